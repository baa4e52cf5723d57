"""Cached rounds (Note [Cached rounds] in csrc/cached_round.h): where rounds travel by recursive
doubling (here over the control link, HVDLITE_SHARED_MEMORY=0 as between hosts: Note [Control
link] in csrc/control_link.h), a training loop's steady rounds settle by a reduction of a few words instead of
every rank's message. Checked: the steady loop takes them (the engine's counter), its results
equal an independent reference on every rank, small tensors that travel inline still arrive,
ranks that submit in different orders and at different times still agree, and what is not
steady (a new name mid-training, a shape that changed, a group, a join, a mismatch, a stall)
takes the full round and behaves as it does without cached rounds.
"""

import time

import pytest
import torch

import hvdlite as hvd
from hvdlite._runtime import state as _state
from tests.harness import run_ranks
from tests.multirank._reference import assert_close, rank_input, reduce_reference

CACHED = {"HVDLITE_SHARED_MEMORY": "0", "HVDLITE_CPU_CHANNELS": "1"}
SHAPES = [(1,), (16,), (300,), (4096,), (3, 5)]  # the first two travel inline (<= 512 bytes)


def _engine():
    return _state.current().sets[0].engine


def _step(rank, size, step, names, order):
    inputs = {n: [rank_input(step * 100 + i, r, SHAPES[i], torch.float32) for r in range(size)]
              for i, n in enumerate(names)}
    handles = {n: hvd.allreduce_async(inputs[n][rank], name=n, op=hvd.Average) for n in order}
    for n in names:
        want = reduce_reference(inputs[n], hvd.Average)
        assert_close(hvd.synchronize(handles[n]), want, torch.float32, f"{n} at step {step} on rank {rank}")


def _steady_job():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    engine = _engine()
    names = [f"grad.{i}" for i in range(len(SHAPES))]
    _step(rank, size, 0, names, names)  # in full: names and shapes travel once
    tried, decided = engine._cached_rounds
    for step in range(1, 21):
        # ranks submit in different orders, and some arrive late
        order = names if (rank + step) % 2 else list(reversed(names))
        if step % 5 == 0:
            time.sleep(0.02 * rank)
        _step(rank, size, step, names, order)
    tried_after, decided_after = engine._cached_rounds
    steady = decided_after - decided
    # every step's requests were cache hits: its rounds settle by reduction
    assert steady >= 20, (tried, decided, tried_after, decided_after)
    # broadcast and allgather of known names inline and not
    for step in range(3):
        b = hvd.broadcast(torch.full((7,), float(rank + step)), root_rank=size - 1, name="bcast")
        assert torch.equal(b, torch.full((7,), float(size - 1 + step))), (rank, step, b)
        g = hvd.allgather(torch.full((rank + 1, 2), float(rank)), name="gather")
        want = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(size)])
        assert torch.equal(g, want), (rank, step)
    # a new name mid-training, then the steady loop again
    extra = hvd.allreduce(torch.tensor([float(rank)]), name="new.mid.training", op=hvd.Sum)
    assert extra.item() == sum(range(size))
    _step(rank, size, 99, names, names)
    # a group, a shape that changed, then steady again
    group = [torch.full((5,), float(rank + i)) for i in range(3)]
    hvd.grouped_allreduce_(group, op=hvd.Sum, name="group")
    for i, t in enumerate(group):
        assert torch.equal(t, torch.full((5,), float(sum(range(size)) + size * i))), (rank, i)
    changed = hvd.allreduce(torch.ones(9), name="grad.0", op=hvd.Sum)
    assert torch.equal(changed, torch.full((9,), float(size)))
    _step(rank, size, 100, names, names)
    final = engine._cached_rounds[1]
    hvd.shutdown()
    return steady, final


@pytest.mark.parametrize("size", [2, 3, 5])
def test_a_steady_loop_settles_by_reduction_and_every_result_is_right(size):
    results = run_ranks(size, __name__, "_steady_job", env=CACHED, timeout=120)
    steadies = [s for s, _ in results]
    assert min(steadies) >= 20, steadies
    # every rank decided the same rounds by reduction (rounds pair up across ranks)
    assert len({f for _, f in results}) == 1, results


def _join_job():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    steps = 4 + 2 * rank  # the last rank runs the longest
    for step in range(steps):
        t = torch.full((8,), 1.0)
        out = hvd.allreduce(t, name="g", op=hvd.Sum)
        # ranks that have joined count as zeros
        alive = sum(1 for r in range(size) if step < 4 + 2 * r)
        assert torch.equal(out, torch.full((8,), float(alive))), (rank, step, out)
    last = hvd.join()
    hvd.shutdown()
    return last


def test_join_under_cached_rounds():
    results = run_ranks(3, __name__, "_join_job", env=CACHED, timeout=120)
    assert results == [2, 2, 2], results


def _mismatch_job():
    hvd.init()
    rank = hvd.rank()
    for step in range(5):
        hvd.allreduce(torch.ones(4), name="w", op=hvd.Sum)
    shape = (4,) if rank == 0 else (6,)
    try:
        hvd.allreduce(torch.ones(shape), name="w", op=hvd.Sum)
    except hvd.HvdliteError as e:
        message = str(e)
    else:
        message = None
    ok = hvd.allreduce(torch.ones(4), name="w", op=hvd.Sum)  # the job goes on
    hvd.shutdown()
    return message, ok.tolist()


def test_a_shape_that_changes_on_one_rank_is_named_on_every_rank():
    results = run_ranks(2, __name__, "_mismatch_job", env=CACHED, timeout=120)
    for rank, (message, ok) in enumerate(results):
        assert message is not None, rank
        assert "'w'" in message and "shape" in message and "rank 1" in message, message
        assert ok == [2.0] * 4


def _stall_job():
    hvd.init()
    rank = hvd.rank()
    for step in range(5):
        hvd.allreduce(torch.ones(4), name="s", op=hvd.Sum)
    if rank == 1:
        time.sleep(4)  # rank 0 waits for "s" alone: held, then sent in full, then named
    try:
        hvd.allreduce(torch.ones(4), name="s" if rank == 0 else "other", op=hvd.Sum)
    except hvd.HvdliteError as e:
        message = str(e)
    else:
        message = None
    return message


def test_a_request_held_too_long_reaches_the_stall_inspector():
    env = {**CACHED, "HVDLITE_STALL_CHECK_TIME_SECONDS": "1", "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "2"}
    results = run_ranks(2, __name__, "_stall_job", env=env, timeout=120)
    assert results[0] is not None and "rank 1" in results[0] and "'s'" in results[0], results

