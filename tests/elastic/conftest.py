"""Every elastic test has a hard alarm on top of the harness's own deadlines."""
import signal

import pytest

from tests.elastic.harness import HARD_TIMEOUT


@pytest.fixture(autouse=True)
def _hard_timeout():
    def on_alarm(signum, frame):
        raise TimeoutError(f"test exceeded {HARD_TIMEOUT + 20} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(HARD_TIMEOUT + 20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def elastic_runs():
    """Runs made by the test; any still running at the end are killed with their workers."""
    runs = []
    yield runs
    for run in runs:
        run.stop()
