"""The SLURM cluster fixture (tests/slurm/cluster.py). Without root or the packages the tests
skip with the reason; with HVDLITE_REQUIRE_SLURM=1 (.ci/run sets it) they fail instead."""
import os

import pytest

from tests.harness import hard_timeout_fixture
from tests.slurm import cluster as clusterlib

HARD_TIMEOUT = 240
_hard_timeout = hard_timeout_fixture(HARD_TIMEOUT)


@pytest.fixture(scope="session")
def slurm():
    reason = clusterlib.unavailable()
    if reason:
        if os.environ.get("HVDLITE_REQUIRE_SLURM") == "1":
            pytest.fail(f"a SLURM cluster is required here (HVDLITE_REQUIRE_SLURM=1): {reason}")
        pytest.skip(reason)
    with clusterlib.Cluster() as cluster:
        yield cluster
