"""IoLoop: one thread that watches every rank's output pipes and every rank's exit.

Note [One thread watches the ranks]
The launcher held a reader thread per rank's stdout, one per stderr and a waiter per rank:
4,099 threads at 1,024 ranks. Now one thread waits in one selector on every pipe, and a pipe's
bytes are handed on in whole lines, in the order they came. A child that exits closes its
pipes, so once both of a child's watched pipes have ended the loop opens a process file
descriptor for it (pidfd_open, Linux 5.3 and later), which becomes readable when it has exited:
the exit is seen as promptly as a waiter thread saw it, and a running child costs no descriptor
beyond its pipes (three per rank with its store connection, not four). A child whose pipes
outlive it (a process it started holds them) is still seen, by a sweep that polls every
running child each SWEEP_SECONDS; where pidfds are missing, a child with ended pipes is polled
every EXIT_POLL_SECONDS. Callbacks run on the
loop's thread and must not block for long (the output sink's write is the one exception: a
stalled terminal stalls the launcher's view of its ranks, as it stalled the reader threads).
Anything may be watched from any thread; the loop starts with the first watch.
"""
import os
import selectors
import subprocess
import threading
import time
from typing import Callable, List, Optional, Set

from hvdlite._job.wakeup import Wakeup

EXIT_POLL_SECONDS = 0.05
SWEEP_SECONDS = 1.0
_READ_BYTES = 1 << 16
_LONGEST_LINE = 1 << 20  # a line longer than this is handed on in pieces


class _Child:
    def __init__(self, process: subprocess.Popen, on_exit: Callable[[int], None]) -> None:
        self.process, self.on_exit = process, on_exit
        self.open_pipes = 0   # its watched pipes that have not ended
        self.pipes: List["_Pipe"] = []  # its watched pipes
        self.armed = False    # waited for through a pidfd or fast polling
        self.done = False


class _Pipe:
    def __init__(self, owner, on_line: Optional[Callable[[bytes], None]], on_eof: Callable[[], None],
                 reader=None) -> None:
        self.owner = owner  # the pipe object, which keeps (and closes) the descriptor
        self.fd = owner.fileno()
        self.on_line, self.on_eof = on_line, on_eof
        self.reader = reader  # for watch_frames: cuts the bytes into frames instead of lines
        self.partial = bytearray()
        self.child: Optional[_Child] = None  # whose stdout or stderr this is, if watched


class IoLoop:
    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wakeup = Wakeup()
        self._selector.register(self._wakeup, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._added: List[object] = []       # watches to register, under _lock
        # loop thread only: children still running, and those polled fast (ended pipes, no pidfd)
        self._children: Set[_Child] = set()
        self._polled: Set[_Child] = set()
        self._pipes_by_fd: dict = {}
        self._next_sweep = 0.0
        self._open_pipes = 0                 # under _lock
        self._pipes_closed = threading.Condition(self._lock)
        self._thread: Optional[threading.Thread] = None
        self._stopping = False

    # -- any thread
    def watch_pipe(self, pipe, on_line: Callable[[bytes], None], on_eof: Callable[[], None]) -> None:
        """Hands each line of `pipe` (newline included; a last line may lack it) to `on_line`,
        then calls `on_eof` and closes it."""
        self._watch_pipe(_Pipe(pipe, on_line, on_eof))

    def watch_frames(self, pipe, reader, on_eof: Callable[[], None]) -> None:
        """Feeds `pipe`'s bytes to `reader` (agent.FrameReader, which hands on whole frames),
        then calls `on_eof` and closes it; a malformed stream ends it as end of file would."""
        self._watch_pipe(_Pipe(pipe, None, on_eof, reader))

    def _watch_pipe(self, watch: "_Pipe") -> None:
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
        self._wakeup.wake()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _add(self, watch: object) -> None:
        with self._lock:
            self._added.append(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hvdlite-io", daemon=True)
                self._thread.start()
        self._wakeup.wake()

    # -- the loop's thread
    def _run(self) -> None:
        try:
            self._serve()
        finally:
            for key in list(self._selector.get_map().values()):
                if isinstance(key.data, _Child):
                    os.close(key.fd)  # a pidfd: the pipes belong to their Popen objects
            self._selector.close()
            self._wakeup.close()

    def _serve(self) -> None:
        while not self._stopping:
            timeout = EXIT_POLL_SECONDS if self._polled else SWEEP_SECONDS if self._children else None
            for key, _ in self._selector.select(timeout=timeout):
                watch = key.data
                if watch is None:
                    self._take_added()
                elif isinstance(watch, _Pipe):
                    self._read(watch)
                else:
                    self._selector.unregister(key.fileobj)
                    os.close(key.fileobj)
                    self._finish(watch)
            now = time.monotonic()
            for child in [c for c in self._polled if c.process.poll() is not None]:
                self._finish(child)
            if self._children and now >= self._next_sweep:  # pipes that outlive their child
                self._next_sweep = now + SWEEP_SECONDS
                for child in [c for c in self._children if not c.armed and c.process.poll() is not None]:
                    self._drain(child)
                    self._finish(child)

    def _arm(self, child: _Child) -> None:
        """Both pipes ended: the child is exiting. Wait for it through a pidfd."""
        child.armed = True
        try:
            pidfd = os.pidfd_open(child.process.pid)
        except (AttributeError, OSError):  # no pidfds here, or the child is already reaped
            self._polled.add(child)
            return
        self._selector.register(pidfd, selectors.EVENT_READ, child)

    def _finish(self, child: _Child) -> None:
        if child.done:
            return
        child.done = True
        self._polled.discard(child)
        self._children.discard(child)
        child.on_exit(child.process.wait())

    def _take_added(self) -> None:
        self._wakeup.drain()
        with self._lock:
            added, self._added = self._added, []
        for watch in added:
            if isinstance(watch, _Pipe):
                self._selector.register(watch.fd, selectors.EVENT_READ, watch)
                self._pipes_by_fd[watch.fd] = watch
                continue
            self._children.add(watch)
            for owner in (watch.process.stdout, watch.process.stderr):
                pipe = self._pipes_by_fd.get(owner.fileno()) if owner is not None and not owner.closed else None
                if pipe is not None and pipe.owner is owner:
                    pipe.child = watch
                    watch.pipes.append(pipe)
                    watch.open_pipes += 1
            if watch.open_pipes == 0:
                self._arm(watch)

    def _drain(self, child: _Child) -> None:
        """Hands on what an exited child's pipes hold before its exit is (the sweep can see the
        exit before the loop has read the last lines): every line it wrote comes first. Lines a
        process it started writes later still follow."""
        for pipe in child.pipes:
            while self._pipes_by_fd.get(pipe.fd) is pipe and self._read(pipe):
                pass

    def _read(self, pipe: _Pipe) -> bool:
        """Reads what `pipe` holds once; True when it read bytes and the pipe is still open."""
        try:
            data = os.read(pipe.fd, _READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if data and pipe.reader is not None:
            try:
                pipe.reader.feed(data)
                return True
            except ValueError:
                data = b""  # a malformed stream: ended
        if not data:
            if pipe.partial:
                pipe.on_line(bytes(pipe.partial))
            self._selector.unregister(pipe.fd)
            self._pipes_by_fd.pop(pipe.fd, None)
            try:
                pipe.owner.close()
            except OSError:
                pass
            if pipe.child is not None:
                pipe.child.open_pipes -= 1
                if pipe.child.open_pipes == 0 and not pipe.child.armed:
                    self._arm(pipe.child)
            try:
                pipe.on_eof()
            finally:
                with self._lock:
                    self._open_pipes -= 1
                    self._pipes_closed.notify_all()
            return False
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
        return True
