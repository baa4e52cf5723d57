"""A local Ray cluster for the tests of hvdlite.ray, started by the tests themselves.

Without ray installed the tests skip; with HVDLITE_REQUIRE_RAY=1 (.ci/run sets it) they fail
instead, so CI cannot pass without having run them. Every test has a hard alarm.
"""
import os

import pytest

from tests.harness import hard_timeout_fixture

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARD_TIMEOUT = 240
_hard_timeout = hard_timeout_fixture(HARD_TIMEOUT)


@pytest.fixture(scope="session")
def ray_cluster():
    try:
        import ray
    except ImportError:
        if os.environ.get("HVDLITE_REQUIRE_RAY") == "1":
            pytest.fail("ray is required here (HVDLITE_REQUIRE_RAY=1): pip install 'hvdlite[ray]'")
        pytest.skip("ray is not installed (pip install 'hvdlite[ray]')")
    # The workers import the test functions by name and run one torch thread each.
    os.environ["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ["PYTHONPATH"]}})
    yield ray
    ray.shutdown()
