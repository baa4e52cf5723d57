"""The agent hvdliterun starts on each remote host (python -m hvdlite.runner.agent).

Note [One agent per host]
Starting each remote rank through its own ssh made a job of 1,024 ranks on 32 hosts open 1,024
ssh connections (and as many sshd sessions and shell wrappers on the hosts). Now the launcher
opens one ssh per host, which runs this agent; everything else travels as frames over that
connection: the launcher sends START (a rank's argv, environment and folder) and SIGNAL (a
signal for one of the host's ranks), and the agent answers STARTED (the rank's pid), FAILED
(it could not start it), OUTPUT (one whole line of a rank's stdout or stderr, as it came) and
EXIT (its exit status). The launcher's own host has an agent too, started as a plain child
over two pipes: a rank started directly cost the launcher two pipes (and, once they ended, a
pidfd) per rank, 3,082 descriptors at 1,024 local ranks; through the agent it costs none
beyond the rank's store connection. The agent watches its ranks with the launcher's own I/O loop
(io_loop.py), so a rank's lines are sent before its exit. Each rank runs in a session of its
own, and dies with the agent (PR_SET_PDEATHSIG, Note [Launcher death] in workers.py).
When the connection ends (the launcher closed it, ssh died with the launcher, the link broke),
the agent reads end of file: it sends SIGTERM to every running rank's process group, SIGKILL
to what is left after the grace period (HVDLITE_AGENT_GRACE seconds), and exits, as the shell
wrapper of Note [Stopping remote ranks] did for one rank. The launcher reports every rank of a
host whose agent's connection ended as lost with ssh's status (errors.SSH_LOST).

A frame is a 4-byte big-endian length, then a kind byte, a 4-byte rank, and the kind's body:
START and SIGNAL carry JSON (a local START says "whole_env": its environment replaces the
agent's instead of adding to it), STARTED a 4-byte pid, OUTPUT a stream byte (1 stdout, 2
stderr) and the line, EXIT a 4-byte signed status, FAILED the reason as text. No torch.
"""
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, Optional

START, SIGNAL, FAILED, STARTED, OUTPUT, EXIT = b"S", b"G", b"F", b"P", b"O", b"X"
STDOUT, STDERR = 1, 2
MAX_FRAME = 1 << 26
_HEAD = struct.Struct(">IcI")  # length (of what follows it), kind, rank
_INT = struct.Struct(">i")


def encode(kind: bytes, rank: int, body: bytes = b"") -> bytes:
    return _HEAD.pack(5 + len(body), kind, rank) + body


def unpack_int(body: bytes) -> int:
    return _INT.unpack(body)[0]


def decode(frame: bytes):
    """(kind, rank, body) of one frame's bytes after its length."""
    kind, rank = frame[:1], struct.unpack_from(">I", frame, 1)[0]
    return kind, rank, frame[5:]


class FrameReader:
    """Cuts a byte stream into frames (the bytes after each length) for `on_frame`."""

    def __init__(self, on_frame: Callable[[bytes], None]) -> None:
        self.on_frame = on_frame
        self.partial = bytearray()

    def feed(self, data: bytes) -> None:
        self.partial += data
        start = 0
        while len(self.partial) - start >= 4:
            (size,) = struct.unpack_from(">I", self.partial, start)
            if size > MAX_FRAME or size < 5:
                raise ValueError(f"agent frame of {size} bytes")
            if len(self.partial) - start - 4 < size:
                break
            self.on_frame(bytes(self.partial[start + 4:start + 4 + size]))
            start += 4 + size
        del self.partial[:start]


class _Agent:
    def __init__(self, grace: float) -> None:
        from .io_loop import IoLoop
        self.grace = grace
        self.loop = IoLoop()
        self.running: Dict[int, subprocess.Popen] = {}
        self.lock = threading.Lock()
        self.out = sys.stdout.buffer

    def send(self, frame: bytes) -> None:
        with self.lock:
            try:
                self.out.write(frame)
                self.out.flush()
            except (OSError, ValueError):
                pass  # the launcher is gone: end of file on stdin stops everything

    def on_frame(self, frame: bytes) -> None:
        kind, rank, body = decode(frame)
        if kind == START:
            self.start(rank, json.loads(body))
        elif kind == SIGNAL:
            self.signal(rank, json.loads(body)["signal"])

    def start(self, rank: int, spec: dict) -> None:
        from .lifetime import stop_with_parent
        try:
            env = spec["env"] if spec.get("whole_env") else {**os.environ, **spec["env"]}
            process = subprocess.Popen(spec["argv"], env=env, cwd=spec["cwd"],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       start_new_session=True, preexec_fn=stop_with_parent)
        except OSError as exc:
            self.send(encode(FAILED, rank, f"{spec['argv'][0]}: {exc.strerror or exc}".encode()))
            return
        with self.lock:
            self.running[rank] = process
        self.send(encode(STARTED, rank, _INT.pack(process.pid)))
        for pipe, stream in ((process.stdout, STDOUT), (process.stderr, STDERR)):
            tag = bytes([stream])
            self.loop.watch_pipe(pipe, lambda line, t=tag: self.send(encode(OUTPUT, rank, t + line)), lambda: None)
        self.loop.watch_exit(process, lambda code, r=rank: self.exited(r, code))

    def exited(self, rank: int, code: int) -> None:
        with self.lock:
            self.running.pop(rank, None)
        self.send(encode(EXIT, rank, _INT.pack(code)))

    def signal(self, rank: int, sig: int) -> None:
        with self.lock:
            process = self.running.get(rank)
        if process is not None:
            try:
                os.killpg(process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop_all(self) -> None:
        """The connection ended: SIGTERM, the grace period, SIGKILL."""
        for sig, wait in ((signal.SIGTERM, self.grace), (signal.SIGKILL, 5.0)):
            with self.lock:
                ranks = list(self.running)
            for rank in ranks:
                self.signal(rank, sig)
            deadline = time.monotonic() + wait
            while ranks and time.monotonic() < deadline:
                with self.lock:
                    ranks = list(self.running)
                time.sleep(0.05)
        self.loop.stop()


def main(stdin=None, grace: Optional[float] = None) -> int:
    agent = _Agent(float(os.environ.get("HVDLITE_AGENT_GRACE", "3")) if grace is None else grace)
    reader = FrameReader(agent.on_frame)
    fd = (stdin or sys.stdin.buffer).fileno()
    try:
        while True:
            data = os.read(fd, 1 << 16)
            if not data:
                break
            reader.feed(data)
    except (OSError, ValueError) as exc:
        print(f"hvdlite agent: {exc}", file=sys.stderr, flush=True)
    agent.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
