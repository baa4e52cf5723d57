"""A short soak (bench/soak.py's routine): mixed collectives of every kind, with the timeline and
autotune on and with neither, every result checked; after the warm-up, memory, file descriptors
and threads stay flat. bench/soak.py --ops 100000 is the long version (its figures are in the
notes).

Memory is judged by what the allocators have handed out, not by resident size. Resident size
moves by up to 14 MB between samples of a 2,500-operation run with nothing leaking (glibc's heap
fragments as tensors of every size come and go), so it only bounds gross leaks here. The C heap
in use grew 0.75 MB from operation 500 to 2,500 and Python's blocks by ~5,200: both are the
bounded name caches filling (every grouped call here has a new name). The bounds below are ~4x
and ~3x that, so a leak of ~1.5 KB or ~5 objects an operation fails the test."""
import importlib.util
import os

import pytest

from tests.harness import REPO, Job


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", os.path.join(REPO, "bench", "soak.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def soak(ops, every):
    import torch
    torch.set_num_threads(1)
    module = _soak_module()
    samples, counts = module.run(ops, every)
    return module.growth(samples), counts, samples


# With the timeline and autotune on, every round is the background thread's; with neither (the
# default), waiting callers run the small rounds themselves (Note [A waiting caller runs the
# round] in csrc/engine.h), whose allocations land in the caller's own heap.
@pytest.mark.parametrize("insight", [True, False], ids=["timeline_autotune", "caller_rounds"])
def test_mixed_collectives_leave_memory_fds_and_threads_flat(tmp_path, insight):
    env = {"HVDLITE_TIMELINE": str(tmp_path / "trace.json"), "HVDLITE_AUTOTUNE": "1"} if insight else {}
    results = Job(2, "tests.reliability.test_soak_flat", "soak", 2500, 250, env=env).wait(timeout=200)
    for rank, ((rss, fds, threads, heap, blocks), counts, samples) in enumerate(results):
        assert set(counts) == {"allreduce", "grouped", "allgather", "broadcast", "alltoall", "process_set"}, counts
        assert sum(counts.values()) == 2500
        assert fds == 0 and threads == 0, (rank, samples)
        assert rss < 48.0, (rank, rss, samples)
        assert heap < 3.0, (rank, heap, samples)  # nan (no glibc) fails too: CI runs on glibc
        assert blocks < 15000, (rank, blocks, samples)
    if insight:
        assert os.path.getsize(tmp_path / "trace.rank0.json") > 0
