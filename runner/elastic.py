"""hvdliterun's elastic mode: workers come and go with the hosts a discovery script reports.

Note [Elastic driver]
The launcher runs the discovery script every DISCOVERY_INTERVAL seconds (on a helper thread)
and keeps one worker process per slot of every usable host, up to --max-np. Workers have
stable ids, not ranks; each generation's ranks are handed out through the rendezvous store
(Note [Elastic rendezvous] in hvdlite/_runtime/elastic_worker.py). The main thread loops:
  - a worker that exits non-zero (or is killed, or loses its ssh connection) failed: its
    host is blacklisted (Blacklist in elastic_plan.py) and the generation must end;
  - a worker that exits 0 without having been told to leave has finished training: from then
    on the job only waits for the others to finish;
  - hosts that left the discovery output, or new free slots, end the generation too; workers
    for new slots are started first and the others are told only once the new ones are ready
    to join (Note [Hosts updated]), so the running ranks pause for one rendezvous, not for a
    process start;
  - ending a generation means setting its notice key, which makes every rank stop at the same
    operation (a rank that lost a peer stops by itself);
  - when every rank of the generation has asked for a place, the next generation is formed
    (plan_generation: survivors first, in their old order), with "restore" set if any worker
    failed since the last one; workers on removed or blacklisted hosts, or beyond --max-np, are
    told to exit (with status 0, not counted as failures). New workers that have not asked yet
    (still starting) join the generation after; a rank that has not asked --elastic-timeout
    seconds after its generation ended (it hangs instead of failing) is killed and counts as
    failed.
Each worker is in one WorkerState: STARTING until its first request for a place, ASKING
while it waits for the answer, RUNNING with a rank of the current generation (back to ASKING
when it leaves the generation), LEAVING once told to exit or while being stopped, EXITED when
its process has ended. The store is reached through RendezvousServer.set/get only, and the
store, the environment and the processes are set up as for a static job (Note [One launch
session] in session.py).
The job stops with a message when --reset-limit resets have happened, when fewer than
--min-np workers could be gathered for --elastic-timeout seconds, when every host the
discovery script reports is blacklisted for good, when no worker of the last generation is
left to hand its state on (Note [No survivor]), or when the discovery script fails on its first
run. It succeeds when the workers finish with status 0.

Note [No survivor]
The committed state lives in the workers' memory, and a new generation receives it from its
rank 0, a survivor. A survivor that asked for a place is kept even on a host blacklisted since
(_keep_survivors), when no other survivor is left. When every worker of a generation is gone
(failed, or its host removed) and only new workers remain, nobody holds the state: forming a
generation of newcomers would silently restart training from scratch. The launcher stops the job instead, naming what was
lost, unless a rank 0 has reported a durable copy of its last commit (keys.ELASTIC_DURABLE,
written by TorchState.keep_durable_copy): then the new generation restores that copy, and the
launcher says so.
"""
import enum
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set

from hvdlite._job import keys
from hvdlite._job.rendezvous import LauncherStore
from hvdlite.exceptions import HostDiscoveryError

from .config import JobConfig
from .discovery import NetworkPlan
from .elastic_plan import Blacklist, DiscoveryOutputError, parse_discovery_output, plan_generation
from .errors import JobResult, RankExit, describe_exit
from .hosts import Host, SlotInfo
from .network import LocalHostDetector, address_towards, advertised_address
from .output import OutputMux
from .session import LaunchSession
from .workers import stop_with_parent

DUMP_GRACE = 3.5  # seconds a late worker asked for a dump has to write it (Note [Late workers])

DISCOVERY_INTERVAL = 1.0
DISCOVERY_TIMEOUT = 30.0



def run_discovery_script(script: str, slots_per_host: int, cwd: str) -> List[Host]:
    """Runs the script once (through /bin/sh, so arguments work) and parses what it printed."""
    try:
        done = subprocess.run(["/bin/sh", "-c", script], cwd=cwd, capture_output=True, text=True,
                              timeout=DISCOVERY_TIMEOUT, preexec_fn=stop_with_parent)
    except subprocess.TimeoutExpired:
        raise HostDiscoveryError(f"it did not finish within {DISCOVERY_TIMEOUT:g} s") from None
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or [""]
        raise HostDiscoveryError(f"it {describe_exit(done.returncode)}" + (f": {tail[0]}" if tail[0] else ""))
    try:
        return parse_discovery_output(done.stdout, slots_per_host)
    except DiscoveryOutputError as exc:
        raise HostDiscoveryError(f"its output is not a host list ({exc})") from None


class _Discovery:
    """The discovery script on a helper thread; `latest()` is the newest good answer."""

    def __init__(self, script: str, slots_per_host: int, cwd: str, first: List[Host],
                 log: Callable[[str], None]) -> None:
        self._args = (script, slots_per_host, cwd)
        self._hosts = first
        self._log = log
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hvdlite-elastic-discovery", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        failing = False
        while not self._stop.wait(DISCOVERY_INTERVAL):
            try:
                hosts = run_discovery_script(*self._args)
            except HostDiscoveryError as exc:
                if not failing:
                    self._log(f"the host discovery script failed ({exc}); keeping the last host list")
                failing = True
                continue
            failing = False
            with self._lock:
                self._hosts = hosts

    def latest(self) -> List[Host]:
        with self._lock:
            return list(self._hosts)

    def stop(self) -> None:
        self._stop.set()


class WorkerState(enum.Enum):
    """Where a worker is in its conversation with the launcher (Note [Elastic driver])."""
    STARTING = "starting"  # started; has not asked for a place yet
    ASKING = "asking"      # asked for a place (`request`) and waits for the answer
    RUNNING = "running"    # a rank of the current generation
    LEAVING = "leaving"    # told to exit, or being stopped: its exit is no failure
    EXITED = "exited"      # its process ended (or never started)


@dataclass
class _Worker:
    wid: int
    host: str
    slot: int                       # index among its host's slots
    started: float
    state: WorkerState = WorkerState.STARTING
    # Its rank in the generation it last ran in, kept while it asks for its next place (the
    # survivors of a generation are placed first, in their old order); None for a newcomer.
    rank: Optional[int] = None
    request: Optional[dict] = None  # with ASKING: what it said when it asked
    seq: int = 0                    # the number of its next request

    def answered(self, reply: dict) -> None:
        """The launcher answered its request: it runs with a place, or leaves."""
        self.seq += 1
        self.request = None
        if reply.get("action") == "run":
            self.state, self.rank = WorkerState.RUNNING, reply["rank"]
        else:
            self.state, self.rank = WorkerState.LEAVING, None


class _Driver:
    """Note [Elastic driver]. Built once the discovery script's first answer is known; run()
    then loops until the job ends."""

    def __init__(self, config: JobConfig, mux: OutputMux, environ: Dict[str, str],
                 result: JobResult, first: List[Host]) -> None:
        self.config, self.elastic, self.mux, self.result = config, config.elastic, mux, result
        self.detector = LocalHostDetector()
        remote = [h.name for h in first if not self.detector.is_local(h.name)]
        self.first_remote = remote[0] if remote else None
        self.session = LaunchSession(config, mux, self.first_remote)  # Note [One launch session]
        self.server, self.group = self.session.server, self.session.group
        network_env = (NetworkPlan(config.network_interfaces, self.session.bind, 0.0, []).rank_env()
                       if config.network_interfaces else {})
        self.base_env = self.session.base_environment(environ, network_env)
        self.base_env.update(config.knobs.core_env())
        self.workers: Dict[int, _Worker] = {}
        self.blacklist = Blacklist(self.elastic.cooldown_range)
        self.generation = -1
        self.generation_hosts: List[str] = []  # the hosts of the current generation
        self.resets = 0
        self.failed_since_formed = False
        self.finishing = False
        self.ended_generation = False      # the current generation's notice was sent
        self.reset_began = time.monotonic()
        self.dump_asked: Dict[int, float] = {}  # late workers asked for a dump, when (Note [Late workers])
        # a worker without the recorder has no SIGUSR1 handler: the signal would end it
        self.dumps_allowed = self.base_env.get("HVDLITE_FLIGHT_RECORDER") != "0"
        self.short_since: Optional[float] = None
        self.newcomers: Set[int] = set()   # started for new slots, not yet in a generation
        self.failures: List[RankExit] = []
        self.done = False
        self.events: List[str] = []        # what happened, for the verbose log and tests
        self.discovery = _Discovery(self.elastic.discovery_script, self.elastic.slots_per_host,
                                    self.session.cwd, first, self.log)
        self.log(f"discovered {', '.join(f'{h.name}:{h.slots}' for h in first) or 'no hosts'}; "
                 f"store on {self.session.bind}:{self.server.port}")

    def _in(self, *states: WorkerState) -> List[_Worker]:
        """The running workers in one of `states`."""
        return [w for w in self._live() if w.state in states]

    # -- logging
    def log(self, message: str) -> None:
        self.events.append(message)
        if self.config.verbose:
            self.mux.write_line(f"hvdliterun: elastic: {message}\n")

    def announce(self, message: str) -> None:
        self.events.append(message)
        self.mux.write_line(f"hvdliterun: elastic: {message}\n")

    # -- starting workers
    def _rendezvous_addr(self, host: str, local: bool) -> str:
        """What a worker on `host` connects to: the session's address (rendezvous_binding in
        session.py) for this machine, for a job whose first host list names only this machine
        (it stays on loopback) and with --network-interface; else the address that routes
        towards `host`, which may have joined after the store was opened."""
        if local or self.first_remote is None or self.config.network_interface:
            return self.session.addr
        return address_towards(host) or advertised_address()

    def _start_worker(self, host: str, slot: int) -> None:
        wid = max(self.workers, default=-1) + 1
        local = self.detector.is_local(host)
        env = dict(self.base_env)
        env.update({
            "HVDLITE_ELASTIC": "1", "HVDLITE_ELASTIC_WORKER": str(wid),
            "HVDLITE_ELASTIC_TIMEOUT": f"{self.elastic.timeout:g}", "HVDLITE_HOSTNAME": host,
            "HOROVOD_ELASTIC": "1", "HOROVOD_HOSTNAME": host,  # as horovodrun's elastic workers
            **LauncherStore(self._rendezvous_addr(host, local), self.server.port,
                            self.server.secret).to_env(),
        })
        for name in ("HVDLITE_RANK", "HVDLITE_SIZE", "HOROVOD_RANK", "HOROVOD_SIZE", "RANK", "WORLD_SIZE",
                     "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        info = SlotInfo(hostname=host, rank=wid, size=0, local_rank=slot, local_size=0,
                        cross_rank=0, cross_size=0)
        worker = _Worker(wid, host, slot, started=time.monotonic())
        self.workers[wid] = worker
        self.log(f"starting worker {wid} on {host} (slot {slot})")
        try:
            self.session.start(info, env, local)
        except OSError as exc:
            worker.state = WorkerState.EXITED
            self.blacklist.add(host, time.monotonic())
            self.announce(f"could not start a worker on {host}: {exc.strerror or exc}; blacklisted it")

    def _live(self) -> List[_Worker]:
        running = set(self.group.running())
        return [w for w in self.workers.values() if w.wid in running]

    def _wanted_slots(self, now: float) -> Dict[str, int]:
        hosts = self.discovery.latest()
        return {h.name: h.slots for h in hosts if not self.blacklist.blocked(h.name, now)}

    def _fill_slots(self, now: float) -> List[int]:
        """Starts workers for free slots of usable hosts, up to --max-np; returns their ids."""
        if self.finishing:
            return []
        wanted = self._wanted_slots(now)
        live = [w for w in self._live() if w.state is not WorkerState.LEAVING]
        started = []
        for host, slots in wanted.items():
            used = {w.slot for w in live if w.host == host}
            for slot in range(slots):
                if self.elastic.max_np is not None and len(live) + len(started) >= self.elastic.max_np:
                    return started
                if slot not in used:
                    self._start_worker(host, slot)
                    started.append(max(self.workers))
        return started

    # -- requests for a place (Note [Elastic rendezvous])
    def _poll_requests(self) -> None:
        for w in self._in(WorkerState.STARTING, WorkerState.RUNNING):
            raw = self.server.get(keys.elastic_ready(w.wid, w.seq))
            if raw is None:
                continue
            was_running = w.state is WorkerState.RUNNING
            w.state, w.request = WorkerState.ASKING, json.loads(raw)
            if was_running and w.request.get("reason") == "failure":
                self.failed_since_formed = True
            if was_running and not self.finishing:
                self._end_generation(f"worker {w.wid} (rank {w.rank}) left generation "
                                     f"{self.generation} ({w.request.get('reason')})")

    def _answer(self, w: _Worker, reply: dict) -> None:
        self.server.set(keys.elastic_assign(w.wid, w.seq), json.dumps(reply).encode())
        w.answered(reply)

    def _end_generation(self, why: str) -> None:
        """Asks every rank of the current generation to stop (Note [Hosts updated])."""
        if self.generation < 0 or self.ended_generation:
            return
        self.ended_generation = True
        self.reset_began = time.monotonic()
        self.log(f"ending generation {self.generation}: {why}")
        self.server.set(keys.elastic_notice(self.generation), b"hosts")

    def _ask_late_for_dumps(self, late: List[_Worker], now: float) -> None:
        """Note [Late workers]
        A worker that has not left an ended generation halfway through --elastic-timeout is
        probably stuck, and will be killed when the timeout ends, which erases where it was.
        So it is asked for a flight-recorder dump then (SIGUSR1 through its agent; Note [Dump
        files] in hvdlite/_runtime/recorder.py): the launcher prints the report, with the line
        its main thread is at and what its engine is doing, before the kill. A worker that
        leaves in the second half has lost nothing but the dump's few milliseconds. The kill
        waits until DUMP_GRACE has passed since the request (a signalled rank first waits up to
        2.5 s for a job-wide dump round), so with a short --elastic-timeout it comes a little
        after the timeout."""
        if not (self.ended_generation and self.dumps_allowed and now - self.reset_began > self.elastic.timeout / 2):
            return
        for w in late:
            if w.wid in self.dump_asked:
                continue
            self.dump_asked[w.wid] = now
            self.announce(f"worker {w.wid} (rank {w.rank}, host {w.host}) has not left generation "
                          f"{self.generation} after {now - self.reset_began:.1f} s; asking it for a "
                          "flight-recorder dump")
            self.group.send_signal(w.wid, signal.SIGUSR1)

    def _abort(self, why: str) -> None:
        for w in self._in(WorkerState.ASKING):
            self._answer(w, {"action": "abort", "why": why})
        self.result.launch_error = why
        self.done = True

    def _try_form(self, now: float) -> None:
        """Forms the next generation once every live worker has asked for a place."""
        if self.finishing:
            for w in self._in(WorkerState.ASKING):
                self._answer(w, {"action": "exit", "why": "the job is finishing: other workers "
                                                      "completed their training"})
            return
        eligible = self._in(WorkerState.STARTING, WorkerState.ASKING, WorkerState.RUNNING)
        if self.generation < 0:
            if any(w.state is not WorkerState.ASKING for w in eligible):  # the first waits for all
                return
        else:
            late = [w for w in eligible if w.state is WorkerState.RUNNING]
            if late:
                self._ask_late_for_dumps(late, now)
                if self.ended_generation and now - self.reset_began > self.elastic.timeout:
                    # Note [Late workers]: a dump asked for gets DUMP_GRACE to be written
                    late = [w for w in late if now - self.dump_asked.get(w.wid, now - DUMP_GRACE) >= DUMP_GRACE]
                    for w in late:  # a rank that hangs instead of leaving: it counts as failed
                        self.announce(f"worker {w.wid} (rank {w.rank}, host {w.host}) did not leave "
                                      f"generation {self.generation} within --elastic-timeout "
                                      f"{self.elastic.timeout:g} s; killing it")
                        self.group.kill(w.wid)
                return
            # New workers still starting join the generation after this one.
            eligible = [w for w in eligible if w.state is WorkerState.ASKING]
        wanted = self._wanted_slots(now)
        stay = [w for w in eligible if w.slot < wanted.get(w.host, 0)]
        if self.generation >= 0 and not any(w.rank is not None for w in stay):
            stay = self._keep_survivors(eligible, stay)
        if len(stay) < self.elastic.min_np:
            if self.short_since is None:
                self.short_since = now
                self.announce(f"{len(stay)} worker(s) ready, --min-np is {self.elastic.min_np}; "
                              f"waiting up to {self.elastic.timeout:g} s for more hosts")
            elif now - self.short_since > self.elastic.timeout:
                self._abort(f"elastic: only {len(stay)} of the --min-np {self.elastic.min_np} "
                            f"slots were available for --elastic-timeout {self.elastic.timeout:g} s; "
                            "stopped the job")
            return
        self.short_since = None
        if self.generation >= 0:
            self.resets += 1
            if self.elastic.reset_limit is not None and self.resets > self.elastic.reset_limit:
                self._abort(f"elastic: the job reset {self.elastic.reset_limit} times "
                            "(--reset-limit); stopped it instead of resetting again")
                return
        survivors = sorted((w for w in stay if w.rank is not None), key=lambda w: w.rank)
        newcomers = sorted((w for w in stay if w.rank is None), key=lambda w: w.wid)
        durable = None
        if self.generation >= 0 and not survivors:  # Note [No survivor]
            durable = self._durable_copy()
            if durable is None:
                self._abort(f"elastic: no worker of generation {self.generation} is left (it ran on "
                            f"{', '.join(self.generation_hosts)}), and only they held the committed "
                            f"state: the {len(newcomers)} new worker(s) cannot be given it, so the job "
                            "stopped instead of restarting training from scratch (a state that keeps a "
                            "durable copy, state.keep_durable_copy(path), is restored from it instead)")
                return
        places, left_out = plan_generation([(w.wid, w.host) for w in survivors],
                                           [(w.wid, w.host) for w in newcomers], self.elastic.max_np)
        old = self.generation
        self.generation += 1
        restore = self.failed_since_formed
        for w in eligible:
            if w.wid not in places:
                why = ("the job has --max-np workers" if w.wid in left_out
                       else f"host {w.host} is no longer in the job")
                self._answer(w, {"action": "exit", "why": why})
        for w in survivors + newcomers:
            if w.wid in places:
                place = places[w.wid]
                self._answer(w, {"action": "run", "generation": self.generation, "restore": restore,
                                 "durable": durable, **place.__dict__})
        self.newcomers.difference_update(places)
        if old >= 0 and not self.ended_generation:
            self.server.set(keys.elastic_notice(old), b"end")
        self.ended_generation = False
        self.failed_since_formed = False
        took = "" if old < 0 else f" {time.monotonic() - self.reset_began:.2f} s after the reset began"
        ranks = ", ".join(f"{w.host}:{places[w.wid].rank}" for w in survivors + newcomers if w.wid in places)
        self.generation_hosts = sorted({w.host for w in survivors + newcomers if w.wid in places})
        if durable is not None:
            how = (f", no worker of generation {old} is left: restoring the durable copy of commit "
                   f"{durable['commit']} ({durable['path']})")
        else:
            how = ", rolled back to the last commit" if restore else ""
        self.announce(f"generation {self.generation}: {len(places)} ranks ({ranks}){how}{took}")

    def _keep_survivors(self, eligible: List[_Worker], stay: List[_Worker]) -> List[_Worker]:
        """Note [No survivor]: when every worker that holds the committed state is on a host
        blacklisted since (another worker there failed or was killed for hanging), but asked
        for a place (`eligible` holds only those, once a generation ran) and so works, it stays: the job goes on rather than stopping. Hosts the
        discovery script no longer reports are left out as always."""
        listed = {h.name: h.slots for h in self.discovery.latest()}
        keep = [w for w in eligible if w.rank is not None and w.slot < listed.get(w.host, 0)]
        if keep:
            self.announce(f"keeping {len(keep)} worker(s) of generation {self.generation} on blacklisted "
                          f"host(s) {', '.join(sorted({w.host for w in keep}))}: they hold the committed "
                          "state and no other worker does")
        return keep + stay  # `stay` holds no survivor, so none is in both

    def _durable_copy(self) -> Optional[dict]:
        """The last durable copy a rank 0 reported (Note [No survivor]), or None."""
        raw = self.server.get(keys.ELASTIC_DURABLE)
        return None if raw is None else json.loads(raw)

    def _hopeless(self, now: float) -> Optional[str]:
        """Why no worker can ever run again: every host the discovery script reports is
        blacklisted for good (no cooldown range). None while some host is usable, may come
        back, or the script reports no host at all (hosts may still be added)."""
        hosts = [h.name for h in self.discovery.latest()]
        if not hosts or any(self.blacklist.until.get(h) != float("inf") for h in hosts):
            return None
        return (f"elastic: every host the discovery script reports ({', '.join(hosts)}) is "
                "blacklisted for good after its workers failed, and without "
                "--blacklist-cooldown-range none comes back: stopped the job")

    # -- exits
    def _handle_exit(self, wid: int, code: int, now: float) -> None:
        w = self.workers[wid]
        left, w.state = w.state is WorkerState.LEAVING, WorkerState.EXITED
        if left:
            self.log(f"worker {wid} on {w.host} left ({describe_exit(code)})")
            return
        if code == 0:
            if not self.finishing:
                self.log(f"worker {wid} finished; waiting for the others")
            self.finishing = True
            return
        cooldown = self.blacklist.add(w.host, now)
        exit_ = RankExit(w.rank if w.rank is not None else -1, w.host, code,
                         not self.detector.is_local(w.host))
        self.failures.append(exit_)
        until = "for good" if cooldown == float("inf") else f"for {cooldown:.0f} s"
        self.announce(f"worker {wid} (rank {w.rank}, host {w.host}) {describe_exit(code)}; "
                      f"host {w.host} is blacklisted {until}")
        w.rank = None
        if self.finishing:
            self.result.root_cause = exit_
            self.done = True
            return
        self.failed_since_formed = True
        self._end_generation(f"worker {wid} failed")

    # -- host changes
    def _follow_hosts(self, now: float) -> None:
        if self.finishing:
            return
        wanted = self._wanted_slots(now)
        gone = [w for w in self._in(WorkerState.ASKING, WorkerState.RUNNING)
                if w.rank is not None and w.slot >= wanted.get(w.host, 0)]
        if gone:
            self._end_generation(f"host {gone[0].host} left the job")
        self.newcomers.update(self._fill_slots(now))
        running = set(self.group.running())
        waiting = [wid for wid in self.newcomers
                   if wid in running and self.workers[wid].state is WorkerState.STARTING]
        if self.newcomers and not waiting:
            joining = [wid for wid in self.newcomers if wid in running]
            if self.generation >= 0 and joining:
                self._end_generation("new workers are ready to join: "
                                     + ", ".join(sorted({self.workers[w].host for w in self.newcomers})))
            self.newcomers.clear()

    # -- the loop
    def run(self, signals) -> None:
        self._fill_slots(time.monotonic())
        while not self.done:
            if signals.received:
                self.result.stopped_by_signal = signals.received[0]
                return
            event = self.group.next_exit(timeout=0.05)
            now = time.monotonic()
            while event is not None:
                self._handle_exit(*event, now)
                event = self.group.next_exit(timeout=0)
            if self.done:
                return
            if not self.group.running() and self.finishing:
                return
            self._poll_requests()
            hopeless = self._hopeless(now)
            if hopeless is not None and not self.finishing:
                self._abort(hopeless)
                return
            self._follow_hosts(now)
            self._try_form(now)
            if not self.group.running() and not self.done:
                self._no_workers(now)

    def _no_workers(self, now: float) -> None:
        if self.short_since is None:
            self.short_since = now
        elif now - self.short_since > self.elastic.timeout:
            self._abort(f"elastic: no worker has been running for --elastic-timeout "
                        f"{self.elastic.timeout:g} s (--min-np {self.elastic.min_np}); stopped the job")


def run_elastic(config: JobConfig, mux: OutputMux, environ: Dict[str, str], signals,
                result: JobResult) -> JobResult:
    """Runs an elastic job (Note [Elastic driver]) to its end; called by job.run_job."""
    elastic = config.elastic
    cwd = config.cwd or os.getcwd()
    try:
        first = run_discovery_script(elastic.discovery_script, elastic.slots_per_host, cwd)
    except HostDiscoveryError as exc:
        result.launch_error = (f"the host discovery script {elastic.discovery_script!r} failed on "
                               f"its first run: {exc}")
        return result
    driver = _Driver(config, mux, environ, result, first)
    try:
        driver.run(signals)
    finally:
        driver.discovery.stop()
        for w in driver._live():
            w.state = WorkerState.LEAVING
        result.stopped = list(driver.session.close(result.stopped_by_signal,
                                                   lambda: len(signals.received) > 1))
    result.exits = [RankExit(w.slot.rank, w.slot.hostname, w.returncode, w.remote)
                    for w in driver.group.workers() if w.returncode is not None]
    result.elastic_events = driver.events
    result.elastic_failures = driver.failures
    return result
