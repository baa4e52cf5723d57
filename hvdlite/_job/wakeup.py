"""Wakeup: how another thread wakes a loop that waits in a selector (the store's loop,
server.py, and the launcher's I/O loop, runner/io_loop.py): a socket pair whose reading end the
loop registers. Wakes that come while one is pending cost nothing more."""
import socket


class Wakeup:
    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    def fileno(self) -> int:
        """The end to register for reading."""
        return self._r.fileno()

    def wake(self) -> None:
        """Any thread."""
        try:
            self._w.send(b"w")
        except OSError:
            pass  # a wake-up is already pending (a full buffer), or the loop has closed it

    def drain(self) -> None:
        """The loop, when the reading end is ready: takes every pending wake-up."""
        try:
            while self._r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def close(self) -> None:
        self._r.close()
        self._w.close()
