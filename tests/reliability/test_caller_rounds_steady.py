"""A training-like loop (the same names, shapes and ops every step, allreduces up to 3 MB, with
the script's own tensors of 0.25-8 MB coming and going between them): with caller rounds on,
the waiting caller runs every round itself, also those above 4 KiB (Note [A waiting caller
runs the round] in csrc/engine.h: a repeated CPU allreduce over shared memory up to 4 MB), and
that leaves the resident size flat. With them off, the background thread runs the same rounds
(the check that the engine thread's CPU time tells the two apart). Every result is checked
against the sum the test computes itself.

Measured here (1,500 steps, resident growth after the warm-up, per rank): +2.4 to +6.7 MB with
caller rounds, +1.1 to +6.4 MB without; the background thread used 0.00 s and about 1.5 s of
CPU. The bound below is about 3x the largest."""
import os
import time

import pytest

from tests.harness import Job

# floats: 1 KiB (below the 4 KiB limit for any work), 64 KiB, 256 KiB, 1 MB, 1 MB again, 3 MB
SIZES = [256, 16 << 10, 64 << 10, 256 << 10, 1 << 18, 3 << 18]


def _engine_cpu_seconds():
    """User plus system CPU time of this process's hvdlite-engine threads."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "hvdlite-engine":
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (in clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def _resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def steady(steps):
    import torch

    import hvdlite as hvd
    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    grads = [torch.zeros(n) for n in SIZES]
    gen = torch.Generator().manual_seed(rank)
    warm = steps // 5
    for step in range(steps):
        if step == warm:
            rss0, engine0, cpu0 = _resident_mb(), _engine_cpu_seconds(), time.process_time()
        # the script's own tensors: activations of varying size, dropped after the step
        scratch = [torch.empty(int(torch.randint(1 << 16, 1 << 21, (1,), generator=gen))) for _ in range(4)]
        for i, grad in enumerate(grads):
            grad.fill_(float(rank + step % 7))
            hvd.allreduce_(grad, op=hvd.Sum, name=f"grad.{i}")
            want = float(sum(r + step % 7 for r in range(size)))
            assert grad[0].item() == want and grad[-1].item() == want and bool((grad == want).all()), (step, i)
        del scratch
    result = (_resident_mb() - rss0, _engine_cpu_seconds() - engine0, time.process_time() - cpu0)
    hvd.shutdown()
    return result


@pytest.mark.parametrize("caller_rounds", ["1", "0"], ids=["caller_rounds", "engine_thread"])
def test_repeated_allreduces_run_by_the_caller_leave_memory_flat(caller_rounds):
    results = Job(2, "tests.reliability.test_caller_rounds_steady", "steady", 1500,
                  env={"HVDLITE_CALLER_ROUNDS": caller_rounds}).wait(timeout=200)
    for rank, (rss, engine, process) in enumerate(results):
        assert rss < 20.0, (rank, rss)
        if caller_rounds == "1":
            # heartbeats only: every round of the loop ran on the caller
            assert engine < 0.05 * process, (rank, engine, process)
        else:
            assert engine > 0.3 * process, (rank, engine, process)
