"""allreduce in all its forms, every dtype and op, checked on every rank against a reference."""

import pytest
import torch

import hvdlite as hvd
from tests.harness import run_ranks
from tests.multirank._reference import DTYPES, OPS, assert_close, rank_input, reduce_reference


def _every_dtype_and_op():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checked = 0
    for d, dtype in enumerate(DTYPES):
        for op in OPS:
            seed = d * 10 + op
            shape = (5, 3)
            inputs = [rank_input(seed, r, shape, dtype, op) for r in range(size)]
            expected = reduce_reference(inputs, op)
            mine = inputs[rank].clone()
            what = f"allreduce {dtype} op {op} on rank {rank}"
            assert_close(hvd.allreduce(mine, op=op, name=f"ar.{seed}"), expected, dtype, what)
            assert torch.equal(mine, inputs[rank]), f"{what}: the input was modified"
            h = hvd.allreduce_async_(mine, op=op, name=f"ar_.{seed}")
            assert_close(hvd.synchronize(h), expected, dtype, what + " (async in place)")
            assert_close(mine, expected, dtype, what + " (in place result)")
            checked += 1
    hvd.shutdown()
    return checked


@pytest.mark.parametrize("size,inline", [(2, "512"), (3, "512"), (2, "0")])
def test_allreduce_every_dtype_and_op_matches_reference(size, inline):
    # 15 elements: inlined in the negotiation round by default, through Gloo with inlining off
    env = {"HVDLITE_INLINE_BYTES": inline}
    assert run_ranks(size, __name__, "_every_dtype_and_op", timeout=120, env=env) == \
        [len(DTYPES) * len(OPS)] * size


def _edge_cases():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    # 0-d
    out = hvd.allreduce(torch.tensor(float(rank + 1)), op=hvd.Sum, name="scalar")
    assert out.shape == () and out.item() == size * (size + 1) / 2, out
    # empty
    out = hvd.allreduce(torch.empty(0, 3), name="empty")
    assert out.shape == (0, 3)
    # non-contiguous input, out of place and in place
    inputs = [rank_input(7, r, (4, 6), torch.float32) for r in range(size)]
    expected = reduce_reference([t.t() for t in inputs], hvd.Sum)
    mine = inputs[rank].clone().t()
    assert not mine.is_contiguous()
    assert_close(hvd.allreduce(mine, op=hvd.Sum, name="nc"), expected, torch.float32, "non-contiguous")
    hvd.allreduce_(mine, op=hvd.Sum, name="nc_")
    assert_close(mine, expected, torch.float32, "non-contiguous in place")
    # scale factors, float and integer
    for dtype in (torch.float32, torch.int32):
        for op in (hvd.Sum, hvd.Average):
            inputs = [rank_input(11, r, (9,), dtype) for r in range(size)]
            expected = reduce_reference(inputs, op, prescale=0.5, postscale=3.0)
            got = hvd.allreduce(inputs[rank], op=op, prescale_factor=0.5, postscale_factor=3.0,
                                name=f"scaled.{dtype}.{op}")
            assert_close(got, expected, dtype, f"scaled {dtype} op {op}")
    # deprecated average= argument
    assert hvd.allreduce(torch.tensor([float(rank)]), average=False, name="avgF").item() == sum(range(size))
    assert hvd.allreduce(torch.tensor([float(rank)]), average=True, name="avgT").item() == sum(range(size)) / size
    # unnamed operations match by call order
    outs = [hvd.allreduce(torch.tensor([float(rank + i)]), op=hvd.Sum) for i in range(3)]
    assert [o.item() for o in outs] == [sum(range(size)) + size * i for i in range(3)]
    # a tensor larger than the fusion threshold (64 KiB in this job) with small ones around it
    big = torch.full((100_000,), float(rank))
    handles = [hvd.allreduce_async(torch.full((10,), float(rank)), name="s0", op=hvd.Sum),
               hvd.allreduce_async(big, name="big", op=hvd.Sum),
               hvd.allreduce_async(torch.full((10,), float(rank)), name="s1", op=hvd.Sum)]
    outs = [hvd.synchronize(h) for h in handles]
    for o in outs:
        assert (o == sum(range(size))).all()
    # poll eventually reports completion
    h = hvd.allreduce_async(torch.ones(3), name="polled")
    while not hvd.poll(h):
        pass
    assert (hvd.synchronize(h) == 1).all()
    hvd.shutdown()
    return True


@pytest.mark.parametrize("size", [2, 3])
def test_allreduce_edge_cases_match_reference(size):
    assert all(run_ranks(size, __name__, "_edge_cases", env={"HVDLITE_FUSION_THRESHOLD": "65536"}))


def _grouped():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    shapes = [(3,), (2, 2), (), (0,), (7, 1)]
    inputs = [[rank_input(20 + i, r, s, torch.float64) for i, s in enumerate(shapes)] for r in range(size)]
    expected = [reduce_reference([inputs[r][i] for r in range(size)], hvd.Average) for i in range(len(shapes))]
    outs = hvd.grouped_allreduce(inputs[rank], name="g")
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert_close(o, e, torch.float64, f"grouped[{i}]")
    mine = [t.clone() for t in inputs[rank]]
    h = hvd.grouped_allreduce_async_(mine)
    res = hvd.synchronize(h)
    for i, (o, m, e) in enumerate(zip(res, mine, expected)):
        assert o is m
        assert_close(m, e, torch.float64, f"grouped in place [{i}]")
    res = hvd.synchronize(hvd.grouped_allreduce_async(inputs[rank], op=hvd.Max))
    for i, o in enumerate(res):
        assert_close(o, reduce_reference([inputs[r][i] for r in range(size)], hvd.Max), torch.float64, "gmax")
    res = hvd.grouped_allreduce_([t.clone() for t in inputs[rank]], op=hvd.Sum)
    for i, o in enumerate(res):
        assert_close(o, reduce_reference([inputs[r][i] for r in range(size)], hvd.Sum), torch.float64, "gsum")
    hvd.shutdown()
    return True


@pytest.mark.parametrize("size", [2, 3])
def test_grouped_allreduce_matches_reference(size):
    assert all(run_ranks(size, __name__, "_grouped"))
