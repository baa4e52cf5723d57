"""Children that die with their parent (Note [Launcher death] in workers.py): the launcher's
ranks, ssh clients and discovery tasks, and an agent's ranks (agent.py)."""
import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def stop_with_parent() -> None:
    """Runs in the child between fork and exec: SIGKILL when the launcher dies (Note
    [Launcher death]). Linux only; elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
