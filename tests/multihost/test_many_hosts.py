"""The control plane past a handful of hosts: 8 hosts made of network namespaces, one rank on
each (tests/multihost/forked.py), with rounds by recursive doubling over the control link
(Note [Control link] in csrc/control_link.h) and steady rounds settled by reduction (Note
[Cached rounds] in csrc/cached_round.h). Every result is checked against a
reference computed here; the steady loop must take cached rounds (the engine's counter); a
mismatch is named on every rank; join; a tensor one rank never sends is named as a stall; a
rank killed mid-training is named on every other rank.
"""

import os
import time

import pytest
import torch

import hvdlite as hvd
from hvdlite._runtime import state as _state
from tests.multihost.hosts import unavailable
from tests.multirank._reference import assert_close, rank_input, reduce_reference

pytestmark = pytest.mark.slow

HOSTS = [f"m{i}" for i in range(8)]
ENV = {"HVDLITE_CPU_CHANNELS": "1"}
SHAPES = [(1,), (16,), (300,), (4096,)]


@pytest.fixture(autouse=True)
def _need_hosts():
    why = unavailable()
    if why:
        if os.environ.get("HVDLITE_REQUIRE_TEST_HOSTS"):
            pytest.fail(f"test hosts are required here: {why}")
        pytest.skip(why)


def _run(job, env=None, timeout=300):
    from tests.multihost.forked import run_on_hosts
    torch.set_num_threads(1)
    return run_on_hosts(HOSTS, job, env={**ENV, **(env or {})}, timeout=timeout)


def _step(rank, size, step, names):
    inputs = {n: [rank_input(step * 10 + i, r, SHAPES[i], torch.float32) for r in range(size)]
              for i, n in enumerate(names)}
    order = names if (rank + step) % 2 else names[::-1]
    handles = {n: hvd.allreduce_async(inputs[n][rank], name=n, op=hvd.Sum) for n in order}
    for n in names:
        assert_close(hvd.synchronize(handles[n]), reduce_reference(inputs[n], hvd.Sum), torch.float32,
                     f"{n} at step {step} on rank {rank}")


def _collectives_job(rank, size):
    hvd.init()
    engine = _state.current().sets[0].engine
    names = [f"grad.{i}" for i in range(len(SHAPES))]
    _step(rank, size, 0, names)
    decided = engine._cached_rounds[1]
    for step in range(1, 11):
        _step(rank, size, step, names)
    steady = engine._cached_rounds[1] - decided
    # uncached mid-training: a new name, a group, a broadcast, an allgather; then steady again
    extra = hvd.allreduce(torch.tensor([float(rank)]), name="new.name", op=hvd.Sum)
    assert extra.item() == sum(range(size)), extra
    group = [torch.full((3,), float(rank * i)) for i in range(4)]
    hvd.grouped_allreduce_(group, op=hvd.Sum, name="group")
    for i, t in enumerate(group):
        assert torch.equal(t, torch.full((3,), float(i * sum(range(size))))), (rank, i, t)
    b = hvd.broadcast(torch.full((5,), float(rank)), root_rank=3, name="b")
    assert torch.equal(b, torch.full((5,), 3.0)), b
    g = hvd.allgather(torch.full((rank + 1,), float(rank)), name="g")
    assert g.tolist() == [float(r) for r in range(size) for _ in range(r + 1)], g
    _step(rank, size, 11, names)
    # a process set of the even ranks
    evens = hvd.add_process_set(list(range(0, size, 2)))
    if rank % 2 == 0:
        e = hvd.allreduce(torch.tensor([float(rank)]), name="evens", op=hvd.Sum, process_set=evens)
        assert e.item() == sum(range(0, size, 2)), e
    # a shape that differs on one rank: named on every rank, and the job goes on
    try:
        hvd.allreduce(torch.ones(4 if rank != 5 else 6), name="grad.3", op=hvd.Sum)
        mismatch = None
    except hvd.HvdliteError as e:
        mismatch = str(e)
    _step(rank, size, 12, names)
    # join: rank r runs 2 + r steps; joined ranks count as zeros
    for step in range(2 + rank):
        out = hvd.allreduce(torch.ones(3), name="join.g", op=hvd.Sum)
        alive = sum(1 for r in range(size) if step < 2 + r)
        assert torch.equal(out, torch.full((3,), float(alive))), (rank, step, out)
    last = hvd.join()
    hvd.shutdown()
    return {"steady": steady, "mismatch": mismatch, "last_joined": last}


def test_collectives_on_eight_hosts_with_cached_rounds():
    results = _run(_collectives_job)
    for rank, result in enumerate(results):
        assert result["steady"] >= 10, (rank, result)
        assert result["mismatch"] and "'grad.3'" in result["mismatch"] and "rank 5" in result["mismatch"], result
        assert result["last_joined"] == len(HOSTS) - 1, result


def _stall_job(rank, size):
    hvd.init()
    names = [f"grad.{i}" for i in range(len(SHAPES))]
    for step in range(5):
        _step(rank, size, step, names)
    if rank == 6:
        time.sleep(4)  # never sends "late": the others wait, held, then in the pending table
        return None
    try:
        hvd.allreduce(torch.ones(2), name="late", op=hvd.Sum)
    except hvd.StallError as e:
        return str(e)
    return "no error"


def test_a_tensor_one_host_never_sends_is_named_as_a_stall():
    results = _run(_stall_job, env={"HVDLITE_STALL_CHECK_TIME_SECONDS": "1", "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "2"})
    for rank, message in enumerate(results):
        if rank == 6:
            continue
        assert message and "'late'" in message and "missing rank 6" in message, (rank, message)


def _killed_job(rank, size):
    hvd.init()
    names = [f"grad.{i}" for i in range(len(SHAPES))]
    for step in range(6):
        _step(rank, size, step, names)
    if rank == 5:
        os._exit(0)  # gone mid-training, in the steady state, without a word
    start = time.monotonic()
    try:
        for step in range(6, 1000):
            _step(rank, size, step, names)
        error = None
    except hvd.HvdliteError as e:
        error = str(e)
    return {"error": error, "seconds": time.monotonic() - start}


def test_a_rank_killed_on_one_of_eight_hosts_is_named_on_every_other():
    results = _run(_killed_job)
    assert results[5] is None
    for rank, result in enumerate(results):
        if rank == 5:
            continue
        assert result["error"] is not None, (rank, result)
        assert "rank 5" in result["error"], (rank, result["error"])
        assert result["seconds"] < 60, (rank, result)
