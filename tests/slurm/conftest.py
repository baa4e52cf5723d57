"""The SLURM cluster fixture (tests/slurm/cluster.py). Without root or the packages the tests
skip with the reason; with HVDLITE_REQUIRE_SLURM=1 (.ci/run sets it) they fail instead."""
import os
import signal

import pytest

from tests.slurm import cluster as clusterlib

HARD_TIMEOUT = 240


@pytest.fixture(autouse=True)
def _hard_timeout():
    def on_alarm(signum, frame):
        raise TimeoutError(f"test exceeded {HARD_TIMEOUT} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(HARD_TIMEOUT)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="session")
def slurm():
    reason = clusterlib.unavailable()
    if reason:
        if os.environ.get("HVDLITE_REQUIRE_SLURM") == "1":
            pytest.fail(f"a SLURM cluster is required here (HVDLITE_REQUIRE_SLURM=1): {reason}")
        pytest.skip(reason)
    with clusterlib.Cluster() as cluster:
        yield cluster
