"""What every job of the launcher sets up alike, static (job.py) or elastic (elastic.py): the
rendezvous store and where it listens, the environment every rank starts from, the processes
started on this machine or over ssh, and the teardown that stops what still runs.

Note [One launch session]
Both launchers open a LaunchSession, start their processes through ``start`` and close it in
a ``finally``: running processes are stopped (SIGTERM, or the signal that stopped the
launcher), their output is drained and the store is stopped, in that order, so a rank that
is still writing its last lines is not cut off and nothing listens after the launcher
returns. What differs (static ranks vs elastic workers, the watch loop) stays in each.
"""
import os
import signal
from typing import Callable, Dict, Mapping, Optional, Sequence

from .config import JobConfig
from .dump import DumpReporter, new_job_dir
from .environment import exportable
from .hosts import SlotInfo
from .network import address_towards, advertised_address, interface_address
from .output import OutputMux
from .rendezvous import RendezvousServer, new_secret
from .workers import WorkerGroup


def rendezvous_binding(config: JobConfig, first_remote: Optional[str]):
    """(address to bind, address ranks connect to) for the rendezvous store: the
    --network-interface's address; loopback when every host is this machine (the ranks' Gloo
    devices are bound there too); else every interface, reached through the address that
    routes towards the first remote host."""
    if config.network_interface:
        addr = interface_address(config.network_interface)
        return addr, addr
    if first_remote is None:
        return "127.0.0.1", "127.0.0.1"
    return "0.0.0.0", address_towards(first_remote) or advertised_address()


class LaunchSession:
    """Note [One launch session]."""

    def __init__(self, config: JobConfig, mux: OutputMux, first_remote: Optional[str]) -> None:
        self.config = config
        self.mux = mux
        self.cwd = config.cwd or os.getcwd()
        self.bind, self.addr = rendezvous_binding(config, first_remote)
        self.server = RendezvousServer(new_secret(), host=self.bind, addr=self.addr).start()
        self.group = WorkerGroup(mux, config.grace_period)
        # Note [Job directory] (dump.py): where the ranks' dumps go, and their merged reports
        self.job_dir = new_job_dir()
        self.reporter = DumpReporter(self.server, self.job_dir, mux.write_line).start()

    def base_environment(self, environ: Mapping[str, str], network_env: Mapping[str, str]) -> Dict[str, str]:
        """What every rank's environment starts from: the launcher's, the network plan's
        variables, then --env and the config file's (which win)."""
        env = dict(environ)
        env.update(network_env)
        env.update(self.config.extra_env)
        # a directory the user names is the job's for the merged reports too, or `--dump` there
        # would wait for a report written elsewhere
        self.job_dir = self.reporter.job_dir = env.setdefault("HVDLITE_JOB_DIR", self.job_dir)
        return env

    def start(self, slot: SlotInfo, env: Mapping[str, str], local: bool) -> None:
        """Starts the command for `slot`, here or over ssh; raises OSError when it cannot."""
        if local:
            self.group.start_local(slot, self.config.command, env, self.cwd)
        else:
            self.group.start_remote(slot, self.config.command, exportable(env), self.cwd, self.config.ssh)

    def close(self, stop_signal: Optional[int], interrupted: Callable[[], bool],
              log: Callable[[str], None] = lambda _message: None) -> Sequence[int]:
        """Stops what still runs with `stop_signal` (SIGTERM when None), drains the output and
        stops the store; returns the ids of the processes it had to stop."""
        running = self.group.running()
        if running:
            sig = stop_signal or signal.SIGTERM
            log(f"stopping ranks {running} with {signal.Signals(sig).name}")
            self.group.stop(sig, interrupted)
        self.group.close()
        self.mux.drain(timeout=5.0)
        self.mux.close()
        self.reporter.stop()
        self.server.stop()
        _tidy(self.job_dir)
        return running


def _tidy(job_dir: str) -> None:
    """Note [Job directory]: the registrations go with the job; dumps stay for the user."""
    import shutil
    shutil.rmtree(os.path.join(job_dir, "ranks"), ignore_errors=True)
    try:
        os.rmdir(job_dir)  # only if nothing else is in it
    except OSError:
        pass
