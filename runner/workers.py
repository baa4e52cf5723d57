"""Rank processes: start them (locally, or on a remote host through its agent), watch their
exits, stop them all.

Runs on the launcher's main thread; the launcher's one I/O thread (io_loop.py, Note [One
thread watches the ranks]) sees each exit and reports it through a queue, so the first failure
is seen in the order it happened.

Every rank starts in a new session, hence its own process group: signals sent by the terminal
to the launcher do not hit the ranks directly, and stopping a rank signals its whole group, so
helper processes it started go too.

Every rank is started, signalled and stopped by its host's agent (Note [One agent per host] in
agent.py): a remote host's over the host's one ssh connection, the launcher's own host's over
two pipes to a plain child; an agent stops its ranks itself when its connection ends. The one-off commands the launcher runs over ssh (network discovery's tasks) go through
the wrapper below.

Note [Stopping remote ranks]
Killing a local `ssh` does not signal the remote command (there is no terminal to hang up).
So the remote side runs the command under a small POSIX sh wrapper (REMOTE_WRAPPER): it runs
in the background in its own session (setsid, when the host has it) with stdin from /dev/null,
while a watcher reads the ssh connection's stdin, which the launcher keeps open and never
writes. When the launcher closes it, or ssh dies, or the connection drops, the watcher sees end
of file and sends SIGTERM to the rank's process group, then SIGKILL if the rank is still there
after the grace period (checked every 0.1 s, so nothing of the wrapper outlives the rank by
more than that).
`set -m` would be the obvious way to get a process group, but without a terminal dash refuses
it; and a non-interactive shell gives background jobs /dev/null as stdin, hence fd 3.

Note [Launcher death]
The launcher can die without stopping anything (SIGKILL, the machine's OOM killer). Its
children run in sessions of their own, so nothing would reach them. So every child (a local
rank, the ssh client of a host's agent, a discovery task) asks the kernel for SIGKILL when the
launcher goes (prctl PR_SET_PDEATHSIG, set between fork and exec: lifetime.py). A killed ssh
client closes its connection, and the host's agent then stops its ranks (Note [One agent per
host] in agent.py), as the remote wrapper stops a discovery task (Note [Stopping remote
ranks]).
"""
import errno
import os
import queue
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .agents import HostAgent
from .config import SshOptions
from .lifetime import stop_with_parent  # noqa: F401  (Note [Launcher death]; discovery and elastic import it here)
from .hosts import SlotInfo
from .output import OutputMux

REMOTE_WRAPPER = """exec 3<&0 0</dev/null
if command -v setsid >/dev/null 2>&1; then setsid "$@" 3<&- & else "$@" 3<&- & fi
rank_pid=$!
{{ while read -r _; do :; done
  kill -TERM -$rank_pid || kill -TERM $rank_pid
  ticks=0
  while kill -0 $rank_pid && [ $ticks -lt {ticks} ]; do sleep 0.1; ticks=$((ticks + 1)); done
  kill -KILL -$rank_pid || kill -KILL $rank_pid
}} <&3 >/dev/null 2>&1 &
watcher_pid=$!
exec 3<&-
wait $rank_pid
rc=$?
kill $watcher_pid 2>/dev/null
exit $rc"""


def ssh_command(host: str, command: Sequence[str], env: Mapping[str, str], cwd: str,
                options: SshOptions, grace_period: float) -> List[str]:
    """The local argv that runs `command` on `host` in `cwd` with `env` exported."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    wrapper = REMOTE_WRAPPER.format(ticks=max(1, int(round(grace_period * 10))))
    remote = (f"cd {shlex.quote(cwd)} && exec env {exports} /bin/sh -c {shlex.quote(wrapper)} "
              f"hvdlite-rank {' '.join(shlex.quote(a) for a in command)}")
    return options.client_argv(host) + [remote]


def _check_runnable(program: str, env: Mapping[str, str], cwd: str) -> None:
    """The OSError that starting `program` in `cwd` with `env`'s PATH would raise, raised here:
    the agent starts local ranks, and the launcher still reports a program it cannot run as
    one line before any rank starts, as when it started them itself."""
    if not os.path.isdir(cwd):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cwd)
    if os.sep in program:
        candidates = [os.path.join(cwd, program)]
    else:
        candidates = [os.path.join(cwd, d, program) for d in env.get("PATH", os.defpath).split(os.pathsep)]
    if any(os.path.isfile(c) and os.access(c, os.X_OK) for c in candidates):
        return
    if any(os.path.exists(c) for c in candidates):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)


@dataclass
class Worker:
    slot: SlotInfo
    agent: HostAgent  # the agent that runs it (Note [One agent per host] in agent.py)
    remote: bool
    returncode: Optional[int] = None


class WorkerGroup:
    """The ranks of one job."""

    def __init__(self, mux: OutputMux, grace_period: float) -> None:
        self._mux = mux
        self._grace = grace_period
        self._workers: Dict[int, Worker] = {}
        self._exits: "queue.Queue[Tuple[int, int]]" = queue.Queue()
        self._agents: Dict[str, HostAgent] = {}  # by host (Note [One agent per host] in agent.py)

    # -- starting
    def start_local(self, slot: SlotInfo, command: Sequence[str], env: Mapping[str, str],
                    cwd: str) -> None:
        """Starts the rank through this host's agent (Note [One agent per host] in agent.py);
        raises OSError, before anything starts, for a program that could not run here."""
        _check_runnable(command[0], env, cwd)
        self._start(slot, None, command, env, cwd, None)

    def start_remote(self, slot: SlotInfo, command: Sequence[str], env: Mapping[str, str],
                     cwd: str, options: SshOptions) -> None:
        """Starts the rank through its host's agent, opening the host's one ssh connection
        first if it has none (Note [One agent per host] in agent.py)."""
        self._start(slot, slot.hostname, command, env, cwd, options)

    def _start(self, slot, key, command, env, cwd, options) -> None:
        agent = self._agents.get(key)
        if agent is None or not agent.alive:
            agent = HostAgent(slot.hostname, cwd, options, self._grace, self._mux, self._exits, stop_with_parent)
            self._agents[key] = agent
        agent.start(slot.rank, command, env, cwd)
        self._workers[slot.rank] = Worker(slot, agent, remote=options is not None)

    def ssh_connections(self) -> int:
        """The ssh connections this group has opened (one per remote host it started ranks on)."""
        return sum(not agent.local for agent in self._agents.values())

    def pids(self) -> Dict[int, int]:
        """The local ranks' process ids, as this host's agent reported them."""
        local = self._agents.get(None)
        return dict(local.pids) if local is not None else {}

    # -- watching
    def running(self) -> List[int]:
        return sorted(r for r, w in self._workers.items() if w.returncode is None)

    def worker(self, rank: int) -> Worker:
        return self._workers[rank]

    def workers(self) -> List[Worker]:
        return [self._workers[r] for r in sorted(self._workers)]

    def next_exit(self, timeout: float) -> Optional[Tuple[int, int]]:
        """The next rank to exit as (rank, returncode), or None after `timeout` seconds."""
        try:
            rank, code = self._exits.get(timeout=timeout)
        except queue.Empty:
            return None
        self._workers[rank].returncode = code
        return rank, code

    # -- stopping
    def _signal(self, worker: Worker, sig: int) -> None:
        worker.agent.signal(worker.slot.rank, sig)

    def kill(self, rank: int) -> None:
        """SIGKILL one rank (and its process group); its exit arrives through next_exit."""
        self._signal(self._workers[rank], signal.SIGKILL)

    def send_signal(self, rank: int, sig: int) -> None:
        """Sends `sig` to one rank (through its agent)."""
        self._signal(self._workers[rank], sig)

    def signal_all(self, sig: int) -> None:
        for rank in self.running():
            self._signal(self._workers[rank], sig)

    def close(self) -> None:
        """Ends every agent's connection (their hosts' leftovers stop) and reaps the ssh
        clients; call once no rank should run any more."""
        for agent in self._agents.values():
            agent.close()
        deadline = time.monotonic() + self._grace + 5.0
        for agent in self._agents.values():
            try:
                agent.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                agent.process.kill()
                agent.process.wait()

    def stop(self, sig: int = signal.SIGTERM, interrupted=lambda: False) -> None:
        """Send `sig` to every running rank, SIGKILL what is left after the grace period.

        `interrupted()` returning True (another Ctrl-C) skips the rest of the grace period.
        """
        self.signal_all(sig)
        deadline = time.monotonic() + self._grace
        while self.running() and time.monotonic() < deadline and not interrupted():
            self.next_exit(timeout=0.05)
        if self.running():
            self.signal_all(signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while self.running() and time.monotonic() < deadline:
            self.next_exit(timeout=0.05)
