"""A training-like loop (the same names, shapes and ops every step, allreduces up to 3 MB, with
the script's own tensors of 0.25-8 MB written and dropped between them): with caller rounds
on, the waiting caller runs every round itself, also those above 4 KiB (Note [A waiting caller
runs the round] in csrc/round_driver.h: a repeated CPU allreduce over shared memory up to 4 MB), and
that leaves the resident size flat. With them off, the background thread runs the same rounds
(the control: the callers' round count and the engine thread's CPU time tell the two apart).
Every result is checked against the sum the test computes itself.

Measured here (1,500 steps; resident growth from the first to the last five samples after the
warm-up, per rank; two runs each): -15.7 to +16.5 MB with caller rounds (7,195-7,200 of the
7,200 calls' rounds run by the caller, the background thread 0.00-0.01 s of CPU), -2.6 to -1.1
MB without (2.7-3.1 s of CPU, 24-33% of the process's). Over 3,000 steps: -6.9 to +0.6 MB with
caller rounds, +1.1 and +7.3 without: the spread is the scratch tensors (up to 32 MB a step),
not a trend. The resident bound, 40 MB, is there for an accumulation like the soak's 40-65 MB
when callers ran rounds for new names."""
import os
import statistics
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
    from hvdlite._runtime import state
    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    engine = state.current().engine
    grads = [torch.zeros(n) for n in SIZES]
    gen = torch.Generator().manual_seed(rank)
    warm = steps // 5
    samples = []  # resident MB after every 50th step from the warm-up on
    for step in range(steps):
        if step == warm:
            engine0, cpu0 = _engine_cpu_seconds(), time.process_time()
            rounds0 = engine._caller_rounds
        # the script's own tensors: activations of varying size, written, dropped after the step
        scratch = [torch.ones(int(torch.randint(1 << 16, 1 << 21, (1,), generator=gen))) for _ in range(4)]
        for i, grad in enumerate(grads):
            grad.fill_(float(rank + step % 7))
            hvd.allreduce_(grad, op=hvd.Sum, name=f"grad.{i}")
            want = float(sum(r + step % 7 for r in range(size)))
            assert grad[0].item() == want and grad[-1].item() == want and bool((grad == want).all()), (step, i)
        del scratch
        if step >= warm and step % 50 == 0:
            samples.append(_resident_mb())
    # the growth from the first to the last five samples (medians: one step's scratch, up to
    # 32 MB, may or may not have gone back to the system when a single sample is taken)
    result = (statistics.median(samples[-5:]) - statistics.median(samples[:5]), _engine_cpu_seconds() - engine0, time.process_time() - cpu0,
              engine._caller_rounds - rounds0, (steps - warm) * len(SIZES))
    hvd.shutdown()
    return result


@pytest.mark.parametrize("caller_rounds", ["1", "0"], ids=["caller_rounds", "engine_thread"])
def test_repeated_allreduces_run_by_the_caller_leave_memory_flat(caller_rounds):
    results = Job(2, "tests.reliability.test_caller_rounds_steady", "steady", 1500,
                  env={"HVDLITE_CALLER_ROUNDS": caller_rounds}).wait(timeout=200)
    for rank, (rss, engine, process, rounds, calls) in enumerate(results):
        assert rss < 40.0, (rank, rss)
        if caller_rounds == "1":
            # every call ran its round on the caller (the background thread may take one at a
            # heartbeat), and the background thread did next to nothing
            assert rounds >= 0.9 * calls and engine < 0.05 * process, (rank, rounds, calls, engine, process)
        else:
            assert rounds == 0 and engine > 0.1 * process, (rank, rounds, engine, process)
