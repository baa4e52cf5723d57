"""Every elastic test has a hard alarm on top of the harness's own deadlines."""
import pytest

from tests.elastic.harness import HARD_TIMEOUT
from tests.harness import hard_timeout_fixture

_hard_timeout = hard_timeout_fixture(HARD_TIMEOUT + 20)


@pytest.fixture
def elastic_runs():
    """Runs made by the test; any still running at the end are killed with their workers."""
    runs = []
    yield runs
    for run in runs:
        run.stop()
