"""A two-node SLURM cluster across the network-namespace test hosts: slurmctld on this machine
(on the bridge), slurmd on hosts hvtb and hvtc, and `srun -N 2 -n 4` whose ranks find their
rendezvous from SLURM's node list alone (the first node, hvtb, whose own name resolves to its
decoy address there and to its real one elsewhere)."""
import json
import os
import sys

import pytest
import torch

from tests.multirank._reference import linear_training
from tests.slurm import cluster as clusterlib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(REPO, "tests", "slurm", "slurm_job.py")


@pytest.fixture
def two_node_slurm(hosts):
    reason = clusterlib.unavailable()
    if reason:
        if os.environ.get("HVDLITE_REQUIRE_SLURM") == "1":
            pytest.fail(f"a SLURM cluster is required here (HVDLITE_REQUIRE_SLURM=1): {reason}")
        pytest.skip(reason)
    nodes = [(name, hosts.address(name)) for name in ("hvtb", "hvtc")]
    with clusterlib.Cluster(cpus=2, nodes=nodes, controller_addr=hosts.outside_address,
                            wrap=hosts.command) as cluster:
        yield cluster


def test_srun_across_two_hosts(two_node_slurm, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HVDLITE_", "SLURM_")) and k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = two_node_slurm.run(["srun", "-N", "2", "-n", "4", "--time=2", sys.executable, JOB,
                               str(tmp_path), "srun"], env=env, cwd=str(tmp_path), timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr + two_node_slurm.logs()
    expected, _ = linear_training(3, 4)
    seen = []
    for rank in range(4):
        got = json.loads((tmp_path / f"srun.rank{rank}.json").read_text())
        seen.append((got["rank"], got["local_rank"], got["local_size"]))
        assert got["size"] == 4 and got["sum"] == 10.0 and got["source"] == "slurm", got
        assert torch.allclose(torch.tensor(got["weights"]), torch.tensor(expected), atol=1e-6), got
    assert seen == [(0, 0, 2), (1, 1, 2), (2, 0, 2), (3, 1, 2)], seen
