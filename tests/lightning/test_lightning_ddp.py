"""Lightning's own DDPStrategy over the torch.distributed backend "hvdlite"
(`DDPStrategy(process_group_backend="hvdlite")`), started by hvdliterun: its parameters equal
one process on the combined batch."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is not installed (pip install hvdlite[lightning])")

from tests.lightning.fit_job import reference_fit  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(REPO, "tests", "lightning", "fit_job.py")


def launch(command, out, timeout=180):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HVDLITE_", "SLURM_", "OMPI_", "PMI_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PL_DISABLE_FORK="1")
    done = subprocess.run(command, cwd=str(out), env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)}: {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-4000:]}"
    return done


def results(out, tag, size):
    return [torch.load(out / f"{tag}.rank{r}.pt") for r in range(size)]


def test_lightning_ddp_strategy_over_the_hvdlite_backend(tmp_path):
    launch([sys.executable, "-m", "hvdlite.runner.launch", "-np", "2", sys.executable, JOB, str(tmp_path),
            "ddp", "ddp-hvdlite"], tmp_path)
    expected = reference_fit(2)
    for r, got in enumerate(results(tmp_path, "ddp", 2)):
        assert (got["rank"], got["size"]) == (r, 2)
        for a, b in zip(got["params"], expected):
            assert torch.allclose(a, b, atol=1e-6), (r, (a - b).abs().max())
