"""allgather and broadcast, every dtype, uneven and edge shapes, checked on every rank."""

import pytest
import torch

import hvdlite as hvd
from tests.harness import run_ranks
from tests.multirank._reference import DTYPES, assert_close, rank_input


def _allgather():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    for d, dtype in enumerate(DTYPES):
        # even first dimensions
        inputs = [rank_input(d, r, (2, 3), dtype) for r in range(size)]
        assert_close(hvd.allgather(inputs[rank], name=f"even.{d}"), torch.cat(inputs), dtype, f"even {dtype}")
        # uneven first dimensions (rank r has r + 1 rows), one rank possibly empty
        inputs = [rank_input(d + 50, r, (r + 1, 2), dtype) for r in range(size)]
        h = hvd.allgather_async(inputs[rank], name=f"uneven.{d}")
        assert_close(hvd.synchronize(h), torch.cat(inputs), dtype, f"uneven {dtype}")
    # a rank with zero rows
    inputs = [rank_input(90, r, (0 if r == 1 else 2, 4), torch.float32) for r in range(size)]
    assert_close(hvd.allgather(inputs[rank], name="zero-rows"), torch.cat(inputs), torch.float32, "zero rows")
    # 0-d tensors count as one row
    out = hvd.allgather(torch.tensor(float(rank)), name="scalar")
    assert out.tolist() == [float(r) for r in range(size)], out
    # all empty
    assert hvd.allgather(torch.empty(0, 5), name="all-empty").shape == (0, 5)
    # non-contiguous input
    inputs = [rank_input(91, r, (3, 4), torch.float64).t() for r in range(size)]
    assert_close(hvd.allgather(inputs[rank], name="nc"), torch.cat(inputs), torch.float64, "non-contiguous")
    hvd.shutdown()
    return True


@pytest.mark.parametrize("size,inline", [(2, "512"), (3, "512"), (2, "0")])
def test_allgather_uneven_and_edge_shapes_match_reference(size, inline):
    assert all(run_ranks(size, __name__, "_allgather", env={"HVDLITE_INLINE_BYTES": inline}))


def _broadcast():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    for d, dtype in enumerate(DTYPES):
        for root in range(size):
            inputs = [rank_input(d * 7 + root, r, (3, 2), dtype) for r in range(size)]
            mine = inputs[rank].clone()
            out = hvd.broadcast(mine, root, name=f"b.{d}.{root}")
            assert_close(out, inputs[root], dtype, f"broadcast {dtype} root {root}")
            assert torch.equal(mine, inputs[rank]), "broadcast modified its input"
            h = hvd.broadcast_async_(mine, root, name=f"b_.{d}.{root}")
            assert hvd.synchronize(h) is mine
            assert_close(mine, inputs[root], dtype, f"broadcast_ {dtype} root {root}")
    # several broadcasts in flight at once are fused; mixed roots are not
    handles = [hvd.broadcast_async(torch.full((4,), float(rank * 10 + i)), i % size, name=f"f{i}")
               for i in range(20)]
    for i, h in enumerate(handles):
        assert (hvd.synchronize(h) == (i % size) * 10 + i).all()
    # non-contiguous in place, 0-d and empty
    t = torch.arange(12.0).reshape(3, 4).t().clone().t() * (rank + 1)
    nc = t.t()
    hvd.broadcast_(nc, 0, name="nc")
    assert torch.equal(nc, (torch.arange(12.0).reshape(3, 4)).t())
    assert hvd.broadcast(torch.tensor(rank + 5), size - 1, name="s").item() == size - 1 + 5
    assert hvd.broadcast(torch.empty(0), 0, name="e").shape == (0,)
    hvd.shutdown()
    return True


@pytest.mark.parametrize("size,inline", [(2, "512"), (3, "512"), (2, "0")])
def test_broadcast_every_root_and_dtype_matches_reference(size, inline):
    assert all(run_ranks(size, __name__, "_broadcast", env={"HVDLITE_INLINE_BYTES": inline}))
