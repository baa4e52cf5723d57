"""Note [Leaving a failed generation] (hvdlite/basics.py): an elastic reset drops the old
engines and groups on a thread of its own and goes on if that is stuck; a plain shutdown
still drops them before it returns."""
import threading
import types

from hvdlite import basics


class _Stuck:
    """Stands for a process group whose destruction waits for an operation that does not end."""

    def __init__(self, release, dropped):
        self.release, self.dropped = release, dropped

    def __del__(self):
        self.release.wait(30)
        self.dropped.set()


def test_a_reset_goes_on_while_a_group_is_stuck_in_its_destruction(monkeypatch, capsys):
    monkeypatch.setattr(basics, "TEARDOWN_WAIT", 0.05)
    release, dropped = threading.Event(), threading.Event()
    state = types.SimpleNamespace(sets={0: _Stuck(release, dropped)}, handles={7: object()})
    basics._drop_in_background(state)
    assert state.sets == {} and state.handles == {}
    assert not dropped.is_set()  # still inside its destruction, on the teardown thread
    assert "process groups are still being destroyed after 0.05 s" in capsys.readouterr().err
    release.set()
    assert dropped.wait(10)


def test_the_teardown_finishes_before_the_call_returns_when_nothing_is_stuck():
    release, dropped = threading.Event(), threading.Event()
    release.set()
    state = types.SimpleNamespace(sets={0: _Stuck(release, dropped)}, handles={})
    basics._drop_in_background(state)
    assert dropped.is_set()
