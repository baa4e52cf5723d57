"""Rank processes forked from interpreters that have already imported torch.

Starting a rank as a fresh interpreter costs about 1.5 s of CPU in `import torch` alone, and the
suite starts well over a thousand of them. A zygote is a long-lived interpreter that imports
torch, torch.distributed and hvdlite's extension once, starts no thread, and forks a child per
rank; the child takes the rank's environment, output file, working folder and argv, and then
runs the same boot code a fresh interpreter would, and exits as one does (non-daemon threads
joined, atexit handlers run) except that it skips tearing the modules down (os._exit after the
handlers): with torch loaded that teardown took about 0.8 s per rank, more than most jobs' work.

One zygote per rank index, each with its own hash seed, so the ranks of a job still iterate
their sets and dicts in different orders, as separate interpreters do. A variable read while
torch is imported (OMP_*, MKL_*, TORCH_*, LD_*, PYTHON*) cannot be changed in a child, so a job
that sets one starts fresh interpreters instead (tests/harness.py decides);
HVDLITE_TEST_FRESH_RANKS=1 makes every job do so.

ZygoteProcess answers the part of subprocess.Popen the tests use: pid, poll, wait, kill,
send_signal, returncode.
"""
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading

_SERVE = r"""
import os, pickle, select, struct, sys
import torch, torch.distributed, hvdlite._core  # noqa: F401  (what every rank imports first)
import gc
gc.freeze()  # what the imports made is never garbage: no child's collection walks it (or copies its pages)

def frame(fd):
    head = os.read(fd, 4)
    if len(head) < 4:
        return None
    size, = struct.unpack("<I", head)
    data = b""
    while len(data) < size:
        data += os.read(fd, size - len(data))
    return pickle.loads(data)

def send(fd, message):
    data = pickle.dumps(message)
    os.write(fd, struct.pack("<I", len(data)) + data)

def serve():
    requests, replies = os.dup(0), os.dup(1)
    while True:
        while True:  # report every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            send(replies, ("exit", pid, os.waitstatus_to_exitcode(status)))
        if not select.select([requests], [], [], 0.02)[0]:
            continue
        request = frame(requests)
        if request is None:  # the test process closed the pipe: it is gone
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            os.close(requests)
            os.close(replies)
            return request
        send(replies, ("started", request["id"], pid))

request = serve()
out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.dup2(out, 1)
os.dup2(out, 2)
os.close(out)
os.close(null)
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
sys.argv = request["argv"]
del frame, send, serve
try:
    exec(compile(request["code"], "<rank>", "exec"), {"__name__": "__main__"})
    status = 0
except SystemExit as exit:
    status = exit.code
# The exit a fresh interpreter makes, in its order (non-daemon threads joined, then atexit
# handlers, weakref finalizers among them), without tearing torch's modules down: that costs
# about 0.8 s per rank here, more than the rest of a small job.
import atexit, threading
threading._shutdown()
atexit._run_exitfuncs()
if status is not None and not isinstance(status, int):
    print(status, file=sys.stderr)
    status = 1
sys.stdout.flush()
sys.stderr.flush()
os._exit(status or 0)
"""


class Zygote:
    def __init__(self, env, cwd):
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env, cwd=cwd)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._started = {}  # request id -> pid
        self._ended = {}  # pid -> exit code (negative: the signal)
        self._next = 0
        self._dead = False
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def _read(self):
        stream = self._proc.stdout
        while True:
            head = stream.read(4)
            if len(head) < 4:
                break
            message = pickle.loads(stream.read(struct.unpack("<I", head)[0]))
            with self._changed:
                if message[0] == "started":
                    self._started[message[1]] = message[2]
                    self._ended.pop(message[2], None)  # a pid the kernel gave out again
                else:
                    self._ended[message[1]] = message[2]
                self._changed.notify_all()
        with self._changed:
            self._dead = True
            self._changed.notify_all()

    def start(self, code, argv, env, out, cwd, timeout=30.0):
        with self._changed:
            if self._dead:
                raise RuntimeError("the zygote is gone")
            self._next += 1
            ident = self._next
            data = pickle.dumps({"id": ident, "code": code, "argv": argv, "env": env, "out": out, "cwd": cwd})
            self._proc.stdin.write(struct.pack("<I", len(data)) + data)
            self._proc.stdin.flush()
            if not self._changed.wait_for(lambda: ident in self._started or self._dead, timeout):
                raise RuntimeError(f"the zygote did not fork within {timeout:g} s")
            if self._dead:
                raise RuntimeError("the zygote is gone")
            return ZygoteProcess(self, self._started.pop(ident))

    def returncode(self, pid, timeout):
        """The exit code of `pid` once it ended (consumed: asked once per process), else None."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._ended or self._dead, timeout)
            return self._ended.pop(pid, None)


class ZygoteProcess:
    def __init__(self, zygote, pid):
        self._zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid, 0)
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig):
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self):
        self.send_signal(signal.SIGKILL)
