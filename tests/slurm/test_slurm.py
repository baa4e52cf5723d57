"""Jobs through a real SLURM cluster on this machine: `srun -n 2`, and an `sbatch` script that
runs `srun` and `hvdliterun` (hosts and slots from the allocation) inside its allocation. No
MASTER_ADDR or MASTER_PORT is set: hvd.init() takes them from SLURM's variables."""
import json
import os
import sys

import torch

from tests.multirank._reference import linear_training

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(REPO, "tests", "slurm", "slurm_job.py")


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HVDLITE_", "SLURM_")) and k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return env


def _check(out, tag, source):
    expected, _ = linear_training(3, 2)
    for rank in range(2):
        got = json.loads((out / f"{tag}.rank{rank}.json").read_text())
        assert (got["rank"], got["size"], got["local_rank"], got["local_size"]) == (rank, 2, rank, 2), got
        assert got["sum"] == 3.0 and got["source"] == source, got
        assert torch.allclose(torch.tensor(got["weights"]), torch.tensor(expected), atol=1e-6), got


def test_srun_two_tasks(slurm, tmp_path):
    done = slurm.run(["srun", "-n", "2", "--time=2", sys.executable, JOB, str(tmp_path), "srun"],
                     env=_env(), cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr + slurm.logs()
    _check(tmp_path, "srun", "slurm")


def test_sbatch_with_srun_and_hvdliterun_inside_the_allocation(slurm, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/sh
#SBATCH -n 2
#SBATCH --time=3
#SBATCH -o {tmp_path}/batch.out
set -e
srun {sys.executable} {JOB} {tmp_path} srun
{sys.executable} -m hvdlite.runner.launch {sys.executable} {JOB} {tmp_path} hvdliterun
""")
    submitted = slurm.run(["sbatch", "--parsable", str(script)], env=_env(), cwd=str(tmp_path))
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr + slurm.logs()
    state, exit_code = slurm.wait_job(submitted.stdout.strip().split(";")[0])
    output = (tmp_path / "batch.out").read_text() if (tmp_path / "batch.out").exists() else ""
    assert (state, exit_code) == ("COMPLETED", "0:0"), (state, exit_code, output, slurm.logs())
    _check(tmp_path, "srun", "slurm")
    _check(tmp_path, "hvdliterun", "hvdliterun")  # two ranks: the allocation's two task slots


def test_srun_runs_a_lightning_fit_on_the_hvdlite_strategy(slurm, tmp_path):
    # hvdlite.lightning's strategy reads SLURM's variables through hvd.init() (no MASTER_*);
    # Lightning itself refuses `srun -n` and asks for --ntasks-per-node
    import pytest
    pytest.importorskip("lightning", reason="lightning is not installed (pip install hvdlite[lightning])")
    from tests.lightning.fit_job import reference_fit
    job = os.path.join(REPO, "tests", "lightning", "fit_job.py")
    done = slurm.run(["srun", "--ntasks-per-node=2", "-N", "1", "--time=3", sys.executable, job, str(tmp_path), "srun", "hvdlite"],
                     env=_env(), cwd=str(tmp_path), timeout=200)
    assert done.returncode == 0, done.stdout + done.stderr + slurm.logs()
    expected = reference_fit(2)
    for rank in range(2):
        got = torch.load(tmp_path / f"srun.rank{rank}.pt")
        assert (got["rank"], got["size"]) == (rank, 2), got
        for a, b in zip(got["params"], expected):
            assert torch.allclose(a, b, atol=1e-6), (rank, (a - b).abs().max())
