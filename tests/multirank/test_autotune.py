"""HVDLITE_AUTOTUNE=1: rank 0 searches fusion threshold and cycle time while training runs.

Speed is not asserted here (bench/ shows it). What must hold: every result stays exact on every
rank while the parameters change under it (all ranks plan each round with rank 0's parameters,
Note [Autotune]), the search really tries thresholds that change the batching, it finishes,
and it reports its choice in the log file and on stderr.
"""

import os
import time

import torch

import hvdlite as hvd
from tests.harness import Job

# about 3.8 MB per step: thresholds of 1, 2 and 4 MiB batch these differently
SHAPES = [(400_000,), (300_000,), (1000,), (50, 40), (250_000,), (3,)]


def _tuned_training(log_path, deadline_seconds):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    step, done = 0, False
    deadline = time.monotonic() + deadline_seconds
    while not done:
        tensors = [torch.full(s, float((rank + 1) * (i + 1) + step)) for i, s in enumerate(SHAPES)]
        handles = [hvd.allreduce_async_(t, name=f"grad.{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
        for h in handles:
            hvd.synchronize(h)
        for i, t in enumerate(tensors):
            want = (i + 1) * size * (size + 1) / 2 + size * step
            assert bool((t == want).all()), f"step {step}, tensor {i}: got {t.view(-1)[0].item()}, want {want}"
        finished = rank == 0 and os.path.exists(log_path) and "# autotune chose" in open(log_path).read()
        timed_out = time.monotonic() > deadline
        flag = hvd.broadcast(torch.tensor([int(finished), int(timed_out)]), root_rank=0, name="tuned")
        done = bool(flag.sum().item())
        step += 1
    hvd.shutdown()
    return step


def test_autotune_searches_reports_and_keeps_every_result_exact(tmp_path):
    log_path = str(tmp_path / "autotune.csv")
    env = {"HVDLITE_AUTOTUNE": "1", "HVDLITE_AUTOTUNE_SAMPLE_SECONDS": "0.08",
           "HVDLITE_AUTOTUNE_LOG": log_path}
    job = Job(2, __name__, "_tuned_training", log_path, 60.0, env=env)
    steps = job.wait(timeout=90)
    assert steps[0] == steps[1] > 10
    with open(log_path) as f:
        lines = f.read().splitlines()
    assert lines[0] == "phase,fusion_threshold_bytes,cycle_time_ms,bytes,seconds,bytes_per_second"
    rows = [line.split(",") for line in lines[1:] if not line.startswith("#")]
    phases = [r[0] for r in rows]
    assert phases[0] == "warmup" and "threshold" in phases and "cycle" in phases
    thresholds = {int(r[1]) for r in rows if r[0] == "threshold"}
    assert {1 << 20, 2 << 20, 4 << 20, 64 << 20} <= thresholds
    assert all(int(r[3]) > 0 and float(r[4]) >= 0.08 for r in rows)
    summary = [line for line in lines if line.startswith("# autotune chose")]
    assert len(summary) == 1
    # rank 0 announces the choice on stderr without HVDLITE_LOG_LEVEL; other ranks do not tune
    assert "INFO: autotune chose fusion threshold" in job.output(0)
    assert "autotune" not in job.output(1)
