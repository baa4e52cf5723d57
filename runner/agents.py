"""The launcher's side of Note [One agent per host] (agent.py): one ssh per remote host, and
one plain child for the launcher's own host.

A HostAgent starts `python -m hvdlite.runner.agent` on its host over ssh (or here), sends it the host's
ranks to start and the signals for them, and turns what the agent answers into what a local
rank's pipes and exit would have given the launcher: prefixed lines through the output mux,
and (rank, status) exits on the worker group's queue, with every rank still running reported
as lost (errors.SSH_LOST) when the connection ends. The agent's frames are read by the
launcher's one I/O thread (Note [One thread watches the ranks] in io_loop.py).
"""
import json
import os
import shlex
import subprocess
import sys
import threading
from typing import Callable, Dict, Mapping, Optional, Sequence, Set, Tuple

from .agent import (EXIT, FAILED, OUTPUT, SIGNAL, START, STARTED, STDERR, STDOUT, FrameReader, decode,
                    encode, unpack_int)
from .config import SshOptions
from .environment import exportable
from .errors import SSH_LOST
from .output import OutputMux


def agent_command(host: str, env: Mapping[str, str], cwd: str, options: SshOptions) -> list:
    """The ssh argv that runs the agent on `host` in `cwd` with `env` exported; its stdin and
    stdout are the connection (so no shell wrapper: the agent stops its ranks itself)."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    command = f"{shlex.quote(sys.executable)} -m hvdlite.runner.agent"
    return options.client_argv(host) + [f"cd {shlex.quote(cwd)} && exec env {exports} {command}"]


class HostAgent:
    """`options` None: the agent of the launcher's own host, a plain child (no ssh)."""

    def __init__(self, host: str, cwd: str, options: Optional[SshOptions], grace: float, mux: OutputMux,
                 exits: "queue.Queue[Tuple[int, int]]", preexec: Callable[[], None]) -> None:
        self.host = host
        self.local = options is None
        self._mux, self._exits = mux, exits
        self._lock = threading.Lock()        # the tables below; never held while writing
        self._write_lock = threading.Lock()  # the connection's stdin (writes may block)
        self._running: Set[int] = set()   # started here and not yet exited
        self._sinks: Dict[Tuple[int, int], Tuple[Callable, Callable]] = {}
        self.pids: Dict[int, int] = {}    # by rank, as the agent reported them
        self._ended = False
        if self.local:  # each rank's whole environment travels in its START frame
            argv = [sys.executable, "-m", "hvdlite.runner.agent"]
            self.process = subprocess.Popen(argv, env={**os.environ, "HVDLITE_AGENT_GRACE": f"{grace:g}"},
                                            cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, start_new_session=True, preexec_fn=preexec)
        else:
            # The launcher's environment goes along, as it does to the discovery task (PATH,
            # PYTHONPATH...); the ranks' own variables travel in START frames.
            env = {**exportable({k: v for k, v in os.environ.items() if not k.startswith("HVDLITE_")}),
                   "HVDLITE_AGENT_GRACE": f"{grace:g}"}
            self.process = subprocess.Popen(agent_command(host, env, cwd, options), stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            start_new_session=True, preexec_fn=preexec)
        mux.loop.watch_frames(self.process.stdout, FrameReader(self._frame), self._end)
        mux.loop.watch_pipe(self.process.stderr, self._agent_error, lambda: None)

    @property
    def alive(self) -> bool:
        with self._lock:
            return not self._ended

    def start(self, rank: int, command: Sequence[str], env: Mapping[str, str], cwd: str) -> None:
        with self._lock:
            ended = self._ended
            if not ended:
                self._running.add(rank)
                for stream, name in ((STDOUT, "stdout"), (STDERR, "stderr")):
                    self._sinks[(rank, stream)] = self._mux.rank_sink(rank, name)
        if ended:  # the connection ended since the group looked: lost with it
            self._exits.put((rank, SSH_LOST))
            return
        spec = {"argv": list(command), "env": dict(env), "cwd": cwd, "whole_env": self.local}
        self._send(encode(START, rank, json.dumps(spec).encode()))

    def signal(self, rank: int, sig: int) -> None:
        self._send(encode(SIGNAL, rank, json.dumps({"signal": int(sig)}).encode()))

    def close(self) -> None:
        """Ends the connection: the agent stops what still runs there and exits."""
        try:
            self.process.stdin.close()
        except OSError:
            pass

    def _send(self, frame: bytes) -> None:
        # Not under _lock: the I/O thread, which reads the agent's answers (and so lets it read
        # on), must never wait for a writer blocked on a full connection.
        try:
            with self._write_lock:
                self.process.stdin.write(frame)
                self.process.stdin.flush()
        except (OSError, ValueError):
            pass  # the connection is gone: _end reports the host's ranks

    # -- the I/O thread
    def _frame(self, frame: bytes) -> None:
        kind, rank, body = decode(frame)
        if kind == OUTPUT:
            sink = self._sinks.get((rank, body[0]))
            if sink is not None:
                sink[0](body[1:])
        elif kind == STARTED:
            with self._lock:
                self.pids[rank] = unpack_int(body)
        elif kind == EXIT:
            self._exited(rank, unpack_int(body))
        elif kind == FAILED:
            sink = self._sinks.get((rank, STDERR))
            if sink is not None:
                sink[0](b"hvdliterun: agent on " + self.host.encode() + b": cannot start the rank: " + body + b"\n")
            self._exited(rank, 127)

    def _exited(self, rank: int, code: int) -> None:
        with self._lock:
            if rank not in self._running:
                return
            self._running.discard(rank)
            sinks = [self._sinks.pop((rank, s), None) for s in (STDOUT, STDERR)]
        for sink in sinks:
            if sink is not None:
                sink[1]()
        self._exits.put((rank, code))

    def _end(self) -> None:
        """The connection ended: whatever still ran there is lost with it."""
        with self._lock:
            self._ended = True
            lost = sorted(self._running)
        for rank in lost:
            self._exited(rank, SSH_LOST)

    def _agent_error(self, raw: bytes) -> None:
        where = "agent" if self.local else f"ssh {self.host}"
        self._mux.write_line(f"hvdliterun: {where}: {raw.decode(errors='replace').rstrip()}\n")

