"""A short soak (bench/soak.py's routine): mixed collectives of every kind, with the timeline and
autotune on, every result checked; after the warm-up, memory, file descriptors and threads stay
flat. bench/soak.py --ops 100000 is the long version (its figures are in the notes)."""
import importlib.util
import os

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


def test_mixed_collectives_leave_memory_fds_and_threads_flat(tmp_path):
    env = {"HVDLITE_TIMELINE": str(tmp_path / "trace.json"), "HVDLITE_AUTOTUNE": "1"}
    results = Job(2, "tests.reliability.test_soak_flat", "soak", 2500, 250, env=env).wait(timeout=200)
    for rank, ((rss, fds, threads), counts, samples) in enumerate(results):
        assert set(counts) == {"allreduce", "grouped", "allgather", "broadcast", "alltoall", "process_set"}, counts
        assert sum(counts.values()) == 2500
        assert fds == 0 and threads == 0, (rank, samples)
        assert rss < 8.0, (rank, rss, samples)
    assert os.path.getsize(tmp_path / "trace.rank0.json") > 0
