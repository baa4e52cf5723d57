"""The launcher's I/O loop (runner/io_loop.py, Note [One thread watches the ranks]): a child's
lines come before its exit, whichever the loop sees first."""
import subprocess
import sys
import threading
import time

from runner.io_loop import IoLoop


def _zombie(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_lines_written_before_an_exit_are_handed_on_before_it():
    """A child that has printed and exited before the loop looks at it: its pipes still hold
    the lines, its process is already gone. The exit must still come after every line (the
    launcher takes a rank's exit as the end of its output)."""
    for _ in range(5):
        events, done = [], threading.Event()
        child = subprocess.Popen([sys.executable, "-c", "import sys; print('out 1'); print('out 2'); "
                                  "print('err', file=sys.stderr)"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not _zombie(child.pid):  # exited, not yet reaped
            assert time.monotonic() < deadline
            time.sleep(0.01)
        loop = IoLoop()
        try:
            loop.watch_pipe(child.stdout, lambda line: events.append(("stdout", line)), lambda: None)
            loop.watch_pipe(child.stderr, lambda line: events.append(("stderr", line)), lambda: None)
            loop.watch_exit(child, lambda code: (events.append(("exit", code)), done.set()))
            assert done.wait(10)
            assert loop.wait_pipes(10)
        finally:
            loop.stop()
        assert events[-1] == ("exit", 0), events
        assert [e for e in events if e[0] == "stdout"] == [("stdout", b"out 1\n"), ("stdout", b"out 2\n")], events
        assert ("stderr", b"err\n") in events, events
