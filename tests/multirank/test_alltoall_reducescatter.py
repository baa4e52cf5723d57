"""alltoall, reducescatter and the grouped forms, checked on every rank against references."""

import pytest
import torch

import hvdlite as hvd
from tests.harness import run_ranks
from tests.multirank._reference import DTYPES, assert_close, rank_input, reduce_reference


def _splits(sender, size):
    """Uneven, including zeros: sender s sends (s + r) % 3 rows to rank r."""
    return [(sender + r) % 3 for r in range(size)]


def _alltoall():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    for d, dtype in enumerate(DTYPES):
        inputs = [rank_input(d, s, (sum(_splits(s, size)), 2), dtype) for s in range(size)]
        # what rank `rank` must receive: from each sender, the block addressed to it
        blocks = []
        for s in range(size):
            start = sum(_splits(s, size)[:rank])
            blocks.append(inputs[s][start:start + _splits(s, size)[rank]])
        out, received = hvd.alltoall(inputs[rank], splits=_splits(rank, size), name=f"a2a.{d}")
        assert_close(out, torch.cat(blocks), dtype, f"alltoall {dtype}")
        assert received.tolist() == [_splits(s, size)[rank] for s in range(size)]
        assert received.dtype == torch.int32
    # even split without splits
    inputs = [torch.arange(size * 3, dtype=torch.float32).reshape(size * 3, 1) + 100 * s for s in range(size)]
    out = hvd.alltoall(inputs[rank], name="even")
    assert torch.equal(out, torch.cat([inputs[s][rank * 3:(rank + 1) * 3] for s in range(size)]))
    # async with a tensor of splits, a rank sending nothing at all
    mine = torch.ones(0 if rank == 0 else size, 3) * rank
    splits = torch.tensor([0] * size if rank == 0 else [1] * size)
    out, received = hvd.synchronize(hvd.alltoall_async(mine, splits=splits, name="sparse"))
    assert received.tolist() == [0] + [1] * (size - 1)
    assert torch.equal(out, torch.cat([torch.ones(1, 3) * s for s in range(1, size)]))
    # local mistakes raise at the call
    with pytest.raises(ValueError, match="splits sum to 5 but dimension 0 of the tensor is 4"):
        hvd.alltoall(torch.ones(4), splits=[5] + [0] * (size - 1))
    with pytest.raises(ValueError, match=f"splits has 1 entries but the process set has {size} ranks"):
        hvd.alltoall(torch.ones(4), splits=[4])
    with pytest.raises(ValueError, match="must divide evenly"):
        hvd.alltoall(torch.ones(size * 2 + 1))
    with pytest.raises(ValueError, match="at least 1 dimension"):
        hvd.alltoall(torch.tensor(1.0))
    hvd.shutdown()
    return True


@pytest.mark.parametrize("size", [2, 3])
def test_alltoall_uneven_splits_match_reference(size):
    assert all(run_ranks(size, __name__, "_alltoall"))


def _rows(rows, rank, size):
    base, extra = divmod(rows, size)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


def _reducescatter():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    for d, dtype in enumerate(DTYPES):
        for op in (hvd.Average, hvd.Sum):
            for rows in (size * 2, size * 2 + 1, 1):
                inputs = [rank_input(d * 31 + rows + op, r, (rows, 3), dtype) for r in range(size)]
                full = reduce_reference(inputs, op)
                start, count = _rows(rows, rank, size)
                out = hvd.reducescatter(inputs[rank], op=op, name=f"rs.{d}.{op}.{rows}")
                assert_close(out, full[start:start + count].to(dtype), dtype, f"reducescatter {dtype} {op} {rows}")
    # scale factors and async
    inputs = [rank_input(5, r, (size, 2), torch.float64) for r in range(size)]
    expected = reduce_reference(inputs, hvd.Sum, prescale=2.0, postscale=0.25)[rank:rank + 1]
    h = hvd.reducescatter_async(inputs[rank], op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    assert_close(hvd.synchronize(h), expected, torch.float64, "scaled reducescatter")
    # grouped forms
    shapes = [(size, 2), (size * 3 + 1,), (2 * size, 1, 2)]
    inputs = [[rank_input(60 + i, r, s, torch.float32) for i, s in enumerate(shapes)] for r in range(size)]
    outs = hvd.grouped_reducescatter(inputs[rank], op=hvd.Sum, name="grs")
    for i, s in enumerate(shapes):
        full = reduce_reference([inputs[r][i] for r in range(size)], hvd.Sum)
        start, count = _rows(s[0], rank, size)
        assert_close(outs[i], full[start:start + count].float(), torch.float32, f"grouped rs {i}")
    gathered = hvd.grouped_allgather([t[: rank + 1] for t in inputs[rank]], name="gag")
    for i in range(len(shapes)):
        assert_close(gathered[i], torch.cat([inputs[r][i][: r + 1] for r in range(size)]), torch.float32,
                     f"grouped allgather {i}")
    with pytest.raises(ValueError, match="op must be one of Average, Sum"):
        hvd.reducescatter(torch.ones(size), op=hvd.Max)
    with pytest.raises(ValueError, match="at least 1 dimension"):
        hvd.reducescatter(torch.tensor(1.0))
    hvd.shutdown()
    return True


@pytest.mark.parametrize("size", [2, 3])
def test_reducescatter_and_grouped_forms_match_reference(size):
    assert all(run_ranks(size, __name__, "_reducescatter", timeout=90))


def _barrier_and_join(steps):
    import time
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    # barrier: nobody leaves before the slowest arrives
    time.sleep(0.3 * rank)
    before = time.monotonic()
    hvd.barrier()
    waited = time.monotonic() - before
    # join: rank r has steps[r] batches; the others keep averaging over the ranks with data
    results = []
    for step in range(steps[rank]):
        value = torch.full((3,), float(rank + 1 + step))
        results.append(hvd.allreduce(value, name=f"grad.{step}").tolist())
        results.append(hvd.allreduce(torch.tensor([rank + 1, 10 * (rank + 1)]), op=hvd.Min,
                                     name=f"min.{step}").tolist())
    last = hvd.join()
    after = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="after-join").item()
    hvd.shutdown()
    return waited, results, last, after


@pytest.mark.parametrize("steps", [[3, 1], [1, 4, 2]])
@pytest.mark.parametrize("divide_by", ["size", "contributors"])
def test_join_lets_ranks_with_more_data_continue_and_averages_like_horovod(steps, divide_by):
    # Horovod's (and DDP Join's) average divides by every rank of the set, joined ranks counting
    # as zeros; HVDLITE_JOIN_AVERAGE=contributors divides by the ranks that had data.
    size = len(steps)
    env = {} if divide_by == "size" else {"HVDLITE_JOIN_AVERAGE": "contributors"}
    out = run_ranks(size, __name__, "_barrier_and_join", steps, timeout=60, env=env)
    # the rank that slept least waited at the barrier for the one that slept most
    assert out[0][0] > 0.3 * (size - 1) - 0.1
    last_rank = max(range(size), key=lambda r: steps[r])
    for rank in range(size):
        waited, results, last, after = out[rank]
        assert last == last_rank, (rank, last)
        assert after == size
        for step in range(steps[rank]):
            contributors = [r for r in range(size) if steps[r] > step]
            want = torch.full((3,), float(sum(r + 1 + step for r in contributors)))
            want *= 1.0 / (size if divide_by == "size" else len(contributors))  # as horovod.torch scales
            assert results[2 * step] == want.tolist(), (rank, step, results[2 * step])
            assert results[2 * step + 1] == [min(r + 1 for r in contributors),
                                             min(10 * (r + 1) for r in contributors)]
