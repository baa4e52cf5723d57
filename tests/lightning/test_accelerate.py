"""Hugging Face Accelerate on the torch.distributed backend "hvdlite" under hvdliterun
(tests/lightning/accelerate_job.py): the parameters equal one process on the combined batch."""
import sys

import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install hvdlite[accelerate])")

from tests.lightning.accelerate_job import reference  # noqa: E402
from tests.lightning.test_lightning_ddp import launch, results  # noqa: E402

JOB = __file__.replace("test_accelerate.py", "accelerate_job.py")


def test_an_accelerate_loop_over_the_hvdlite_backend_equals_one_process(tmp_path):
    launch([sys.executable, "-m", "hvdlite.runner.launch", "-np", "2", sys.executable, JOB, str(tmp_path)],
           tmp_path)
    expected = reference(2)
    for r, got in enumerate(results(tmp_path, "accelerate", 2)):
        assert (got["rank"], got["size"], got["backend"]) == (r, 2, "hvdlite")
        for a, b in zip(got["params"], expected):
            assert torch.allclose(a, b, atol=1e-6), (r, (a - b).abs().max())
