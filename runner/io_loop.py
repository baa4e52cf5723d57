"""IoLoop: one thread that watches every rank's output pipes and every rank's exit.

Note [One thread watches the ranks]
The launcher held a reader thread per rank's stdout, one per stderr and a waiter per rank:
4,099 threads at 1,024 ranks. Now one thread waits in one selector on every pipe and on a
process file descriptor per child (pidfd_open, Linux 5.3 and later), which becomes readable
when the child exits: a pipe's bytes are handed on in whole lines, in the order they came, and
an exit within the loop's wake-up, as promptly as a waiter thread saw it. Where pidfds are not
available the loop polls its children every EXIT_POLL_SECONDS instead. Callbacks run on the
loop's thread and must not block for long (the output sink's write is the one exception: a
stalled terminal stalls the launcher's view of its ranks, as it stalled the reader threads).
Anything may be watched from any thread; the loop starts with the first watch.
"""
import os
import selectors
import socket
import subprocess
import threading
from typing import Callable, List, Optional

EXIT_POLL_SECONDS = 0.05
_READ_BYTES = 1 << 16
_LONGEST_LINE = 1 << 20  # a line longer than this is handed on in pieces


class _Pipe:
    def __init__(self, owner, on_line: Callable[[bytes], None], on_eof: Callable[[], None]) -> None:
        self.owner = owner  # the pipe object, which keeps (and closes) the descriptor
        self.fd = owner.fileno()
        self.on_line, self.on_eof = on_line, on_eof
        self.partial = bytearray()


class _Child:
    def __init__(self, process: subprocess.Popen, on_exit: Callable[[int], None]) -> None:
        self.process, self.on_exit = process, on_exit


class IoLoop:
    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._added: List[object] = []       # watches to register, under _lock
        self._polled: List[_Child] = []      # children without a pidfd (loop thread only)
        self._open_pipes = 0                 # under _lock
        self._pipes_closed = threading.Condition(self._lock)
        self._thread: Optional[threading.Thread] = None
        self._stopping = False

    # -- any thread
    def watch_pipe(self, pipe, on_line: Callable[[bytes], None], on_eof: Callable[[], None]) -> None:
        """Hands each line of `pipe` (newline included; a last line may lack it) to `on_line`,
        then calls `on_eof` and closes it."""
        watch = _Pipe(pipe, on_line, on_eof)
        os.set_blocking(watch.fd, False)
        with self._lock:
            self._open_pipes += 1
        self._add(watch)

    def watch_exit(self, process: subprocess.Popen, on_exit: Callable[[int], None]) -> None:
        """Calls `on_exit(returncode)` once `process` has exited (and been reaped)."""
        self._add(_Child(process, on_exit))

    def wait_pipes(self, timeout: float) -> bool:
        """Waits until every watched pipe reached end of file; False after `timeout` s if not."""
        with self._pipes_closed:
            return self._pipes_closed.wait_for(lambda: self._open_pipes == 0, timeout=timeout)

    def stop(self) -> None:
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _add(self, watch: object) -> None:
        with self._lock:
            self._added.append(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hvdlite-io", daemon=True)
                self._thread.start()
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"w")
        except (BlockingIOError, OSError):
            pass

    # -- the loop's thread
    def _run(self) -> None:
        try:
            self._serve()
        finally:
            for key in list(self._selector.get_map().values()):
                if isinstance(key.data, _Child):
                    os.close(key.fd)  # a pidfd: the pipes belong to their Popen objects
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _serve(self) -> None:
        while not self._stopping:
            timeout = EXIT_POLL_SECONDS if self._polled else None
            for key, _ in self._selector.select(timeout=timeout):
                watch = key.data
                if watch is None:
                    self._take_added()
                elif isinstance(watch, _Pipe):
                    self._read(watch)
                else:
                    self._exited(watch, key.fileobj)
            if self._polled:
                for child in [c for c in self._polled if c.process.poll() is not None]:
                    self._polled.remove(child)
                    child.on_exit(child.process.returncode)

    def _take_added(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        with self._lock:
            added, self._added = self._added, []
        for watch in added:
            if isinstance(watch, _Pipe):
                self._selector.register(watch.fd, selectors.EVENT_READ, watch)
                continue
            try:
                pidfd = os.pidfd_open(watch.process.pid)
            except (AttributeError, OSError):  # no pidfds here, or the child is already reaped
                self._polled.append(watch)
                continue
            self._selector.register(pidfd, selectors.EVENT_READ, watch)

    def _read(self, pipe: _Pipe) -> None:
        try:
            data = os.read(pipe.fd, _READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            if pipe.partial:
                pipe.on_line(bytes(pipe.partial))
            self._selector.unregister(pipe.fd)
            try:
                pipe.owner.close()
            except OSError:
                pass
            try:
                pipe.on_eof()
            finally:
                with self._lock:
                    self._open_pipes -= 1
                    self._pipes_closed.notify_all()
            return
        pipe.partial += data
        start = 0
        while True:
            end = pipe.partial.find(b"\n", start)
            if end < 0:
                break
            pipe.on_line(bytes(pipe.partial[start:end + 1]))
            start = end + 1
        del pipe.partial[:start]
        if len(pipe.partial) > _LONGEST_LINE:
            pipe.on_line(bytes(pipe.partial))
            pipe.partial.clear()

    def _exited(self, child: _Child, pidfd: int) -> None:
        self._selector.unregister(pidfd)
        os.close(pidfd)
        child.on_exit(child.process.wait())

