"""A chosen part of torch's own backend test suite (tests/conformance/torch_suite.py), run
against hvdlite: every chosen test must pass. The chosen tests are ones Gloo passes in
bench/conformance.py's full run; HVDLITE_CONFORMANCE_GLOO=1 runs them against Gloo here too
(about 20 s more of the suite, and a check of torch's suite against torch's own backend rather than
of hvdlite, so the suite leaves it to that variable and to bench/conformance.py).

The whole suite takes 5 (hvdlite) to 15 (Gloo) minutes here; bench/conformance.py runs it and lists
every difference (the README's section "Using hvdlite under torch.distributed" has the
figures). The chosen tests cover each collective the backend implements, DDP and its comm
hooks, and the error paths, at about 1 s each (every test forks its ranks: torch_suite.py).
"""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("expecttest", reason="torch's test suite needs expecttest (pip install expecttest)")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# From bench/conformance.py's full run, where Gloo passes 90 tests and hvdlite 64.
CHOSEN = [
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_max", "test_all_reduce_product",
    "test_all_reduce_sum_complex", "test_all_reduce_complex_unsupported_ops", "test_broadcast",
    "test_all_gather", "test_all_gather_complex", "test_all_gather_coalesced_simple", "test_gather",
    "test_gather_checks", "test_scatter", "test_scatter_checks", "test_reduce_sum", "test_reduce_max",
    "test_barrier", "test_DistributedDataParallelCPU", "test_ddp_create_graph", "test_static_graph_api_cpu",
    "test_destroy_group", "test_get_backend",
    # point-to-point (Note [Point-to-point messages] in csrc/point_to_point.h)
    "test_send_recv", "test_send_recv_any_source", "test_send_recv_with_tag", "test_isend", "test_irecv",
]


def _run(backend, tmp_path):
    report = tmp_path / f"{backend}.xml"
    env = dict(os.environ, BACKEND=backend, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    command += [f"tests/conformance/torch_suite.py::TestBackend::{name}" for name in CHOSEN]
    subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=600)
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        failed = [c for c in case if c.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = failed[0].tag if failed else "passed"
    return outcomes


_GLOO = pytest.mark.skipif(os.environ.get("HVDLITE_CONFORMANCE_GLOO") != "1",
                           reason="the Gloo reference run is opt-in: HVDLITE_CONFORMANCE_GLOO=1")


@pytest.mark.parametrize("backend", ["hvdlite", pytest.param("gloo", marks=_GLOO)])
def test_torch_suite_chosen_tests_pass(backend, tmp_path):
    outcomes = _run(backend, tmp_path)
    chosen = {name: outcomes.get(name, "not run") for name in CHOSEN}
    assert all(state == "passed" for state in chosen.values()), {n: s for n, s in chosen.items() if s != "passed"}
