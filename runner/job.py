"""One job from start to end: rendezvous, ranks, the watch loop, the verdict.

`run_job(config)` runs on the launcher's main thread and returns a JobResult; it never exits
the process (launch.py and run() decide what to do with the result).

Note [Start timeout]
A rank "arrives" when it authenticates with the rendezvous store (hvd.init() does this). When
the start timeout expires and some ranks have arrived, every running rank that has not is named
and the job is stopped. When no rank at all has arrived by then, the job is taken to be plain
torch.distributed code that rendezvous through MASTER_ADDR/MASTER_PORT instead, and the check is
dropped: otherwise every non-hvdlite job would be killed after the timeout. Ranks that already
exited are never counted as missing; their exit code speaks for them.
"""
import os
import signal
import socket
import threading
import time
from typing import IO, Dict, List, Mapping, Optional

from .config import JobConfig
from .discovery import NetworkDiscoveryError, NetworkPlan, discover, driver_addresses
from .environment import Rendezvous, rank_environment
from .errors import JobResult, RankExit
from .hosts import Host, assign_slots
from .network import LocalHostDetector, free_port
from .output import OutputMux
from .rendezvous import RendezvousServer
from .session import LaunchSession
from .workers import WorkerGroup


class _SignalWatch:
    """Records SIGINT/SIGTERM sent to the launcher while a job runs (main thread only)."""

    def __init__(self) -> None:
        self.received: List[int] = []
        self._previous: Dict[int, object] = {}

    def __enter__(self) -> "_SignalWatch":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        self.received.append(signum)  # the watch loop acts on it; no work in the handler

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run_job(config: JobConfig, stdout: Optional[IO[str]] = None,
            stderr: Optional[IO[str]] = None,
            environ: Optional[Mapping[str, str]] = None) -> JobResult:
    """Run the job in `config` to the end and say how it went."""
    if config.elastic is not None:
        from .elastic import run_elastic
        mux = OutputMux(stdout, stderr, config.output_dir, config.output_timestamps)
        with _SignalWatch() as signals:
            return run_elastic(config, mux, dict(os.environ if environ is None else environ),
                               signals, JobResult())
    hosts = config.hosts or [Host(socket.gethostname(), config.np)]
    slots = assign_slots(hosts, config.np)
    if config.hosts:
        detector = LocalHostDetector()
        is_local = {h.name: detector.is_local(h.name) for h in hosts}
    else:
        is_local = {hosts[0].name: True}
    remote_hosts = [s.hostname for s in slots if not is_local[s.hostname]]

    mux = OutputMux(stdout, stderr, config.output_dir, config.output_timestamps)

    def log(message: str) -> None:
        if config.verbose:
            mux.write_line(f"hvdliterun: {message}\n")

    session = LaunchSession(config, mux, remote_hosts[0] if remote_hosts else None)
    server, addr, cwd = session.server, session.addr, session.cwd
    network_env: Dict[str, str] = {}
    distinct_hosts = list(dict.fromkeys(s.hostname for s in slots))
    result = JobResult(start_timeout=config.start_timeout)
    if config.network_interfaces:
        network_env = NetworkPlan(config.network_interfaces, addr, 0.0, []).rank_env()
    elif len(distinct_hosts) > 1 and config.discovery:
        # Note [Network discovery] (task_service.py): before any rank starts.
        try:
            found = discover(distinct_hosts, is_local, server.port, server.secret,
                             driver_addresses(prefer=[addr]), config.ssh, cwd, config.grace_period,
                             config.discovery_timeout, log)
        except NetworkDiscoveryError as exc:
            server.stop()
            result.launch_error = str(exc)
            return result
        network_env = found.rank_env()
        if not config.network_interface:
            addr = found.rendezvous_addr
    rank0_host = slots[0].hostname
    master_addr = addr if is_local[rank0_host] else rank0_host
    rdzv = Rendezvous(addr=addr, port=server.port, secret=server.secret,
                      master_addr=master_addr,
                      master_port=free_port(session.bind, avoid={server.port}))
    log(f"rendezvous store on {session.bind}:{server.port} (ranks connect to {addr}); "
        f"MASTER_ADDR={rdzv.master_addr} MASTER_PORT={rdzv.master_port}")

    base_env = session.base_environment(os.environ if environ is None else environ, network_env)
    core_env = config.knobs.core_env()
    group = session.group

    with _SignalWatch() as signals:
        try:
            _start_ranks(config, session, slots, is_local, base_env, core_env, rdzv, log)
            _watch(config, group, server, signals, result)
        except _RankStartFailed as exc:
            result.launch_error = str(exc)
        finally:
            result.stopped = list(session.close(result.stopped_by_signal,
                                                lambda: len(signals.received) > 1, log))
    if remote_hosts:
        log(f"ssh connections for ranks: {group.ssh_connections()}")  # Note [One agent per host]
    result.exits = [RankExit(w.slot.rank, w.slot.hostname, w.returncode, w.remote,
                             server.rank_host(w.slot.rank) or "")
                    for w in group.workers() if w.returncode is not None]
    return result


class _RankStartFailed(Exception):
    """A rank could not be started (control flow inside run_job; becomes its launch error)."""


# Note [Letting ranks report]: after the first failure the others usually fail by themselves
# within moments (a lost peer is seen within milliseconds, its census takes up to 2 s), and
# their own errors, which say what they lost, are worth more than a SIGTERM's silence. So the
# launcher waits this long for them to exit before stopping those still running.
FAILURE_SETTLE_SECONDS = 3.0


def _let_ranks_report(group: WorkerGroup) -> None:
    deadline = time.monotonic() + FAILURE_SETTLE_SECONDS
    while group.running() and time.monotonic() < deadline:
        group.next_exit(timeout=0.05)


def _start_ranks(config, session, slots, is_local, base_env, core_env, rdzv, log) -> None:
    for slot in slots:
        env = rank_environment(base_env, slot, rdzv, core_env)
        where = "local" if is_local[slot.hostname] else f"ssh {slot.hostname}"
        log(f"rank {slot.rank} ({where}): {' '.join(config.command)}")
        try:
            session.start(slot, env, is_local[slot.hostname])
        except OSError as exc:
            program = config.command[0] if is_local[slot.hostname] else "ssh"
            raise _RankStartFailed(f"could not start rank {slot.rank} on {slot.hostname}: "
                               f"{program}: {exc.strerror or exc}") from None


def _watch(config: JobConfig, group: WorkerGroup, server: RendezvousServer,
           signals: _SignalWatch, result: JobResult) -> None:
    """Wait until every rank exited, one failed, a signal came or the start timeout hit."""
    start_deadline: Optional[float] = time.monotonic() + config.start_timeout
    while group.running():
        if signals.received:
            result.stopped_by_signal = signals.received[0]
            return
        event = group.next_exit(timeout=0.1)
        if event is not None:
            rank, code = event
            if code != 0:
                worker = group.worker(rank)
                result.root_cause = RankExit(rank, worker.slot.hostname, code, worker.remote,
                                             server.rank_host(rank) or "")
                _let_ranks_report(group)
                result.lost_contact = server.lost_contact(rank)
                # Note [Root cause] (errors.py): what the ranks said about their own failures.
                result.failures = server.failure_records()
                result.pids = group.pids()
                return
        if start_deadline is not None and time.monotonic() >= start_deadline:
            start_deadline = None  # checked once; see Note [Start timeout]
            arrived = server.arrived_ranks()
            missing = [r for r in group.running() if r not in arrived]
            if arrived and missing:
                result.missing_ranks = missing
                return
