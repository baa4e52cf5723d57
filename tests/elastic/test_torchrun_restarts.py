"""An hvdlite script under torchrun's elastic agent (--nnodes=1:2 --max-restarts): a rank dies,
torchrun restarts every process, and the script resumes from its own checkpoint to the same
parameters as a run that never failed."""
import json
import os
import socket
import subprocess
import sys

import torch

from tests.multirank._reference import linear_training

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(REPO, "tests", "elastic", "torchrun_job.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_script_resumes_from_its_checkpoint_after_torchrun_restarts_all_ranks(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVDLITE_")}
    env.update(TORCHRUN_OUT=str(tmp_path), OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2",
            "--max-restarts=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
            "--rdzv-conf=last_call_timeout=1", "--monitor-interval=0.2", JOB]
    done = subprocess.run(argv, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["attempt"] == 1 and result["start"] == 5 and result["size"] == 2, result
    weight, bias = linear_training(12, 2, seed_stride=1000)
    assert torch.allclose(torch.tensor(result["weight"]), torch.tensor(weight), atol=1e-5), (result, weight)
    assert abs(result["bias"] - bias) < 1e-5
