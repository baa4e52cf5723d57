"""Compression.fp16 and bf16 cast by the engine (Note [Casting on the wire], csrc/executor.h).

Every result is checked twice: bit for bit against the same allreduce cast in Python (the
tensors cast to the wire dtype, reduced uncompressed by the same route in the same job, and
cast back), and against an independent float64 reference of every rank's wire-dtype inputs.
Each job runs on the shared-memory route and on the Gloo channels (HVDLITE_SHARED_MEMORY=0),
where a batch of 16 MiB or more on the wire is copied in and out chunk by chunk (Note
[Pipelined fusion over channels], csrc/cpu_route.h).
"""

import pytest
import torch
import torch.nn.functional as F

import hvdlite as hvd
from hvdlite._runtime import state as _state
from tests.harness import run_ranks
from tests.multirank._reference import rank_input, reduce_reference

MIB = 1 << 20
ROUTES = {"shared memory": {}, "Gloo channels": {"HVDLITE_SHARED_MEMORY": "0"}}
# The channels pipeline batches of 16 MiB and more on the wire; shared memory cuts a batch
# into chunks of at most 4 MB (Note [Shared-memory allreduce]), which an eighth of the sizes
# (2.5 MiB on the wire) still straddles
UNIT = {"shared memory": MIB // 8, "Gloo channels": MIB}
COMPRESSIONS = [(hvd.Compression.fp16, torch.float16), (hvd.Compression.bf16, torch.bfloat16)]
TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 1e-1}


def _cast_in_python(tensors, wire, **kwargs):
    """The old way: cast to the wire dtype, reduce uncompressed, cast back."""
    sent = [t.to(wire) if t.is_floating_point() else t for t in tensors]
    return [o.to(t.dtype) for o, t in zip(hvd.grouped_allreduce(sent, **kwargs), tensors)]


def _check(got, by_rank, wire, op, what, pre=1.0, post=1.0, python=None):
    """got[i] against the Python cast (bit for bit) and against the float64 reference of every
    rank's member i as it travels (cast to `wire` if floating)."""
    rank = hvd.rank()
    assert len(got) == len(by_rank[rank]), what
    for i, (actual, mine) in enumerate(zip(got, by_rank[rank])):
        label = f"{what}, member {i} ({mine.dtype}, {mine.numel()} elements), rank {rank}"
        assert actual.dtype == mine.dtype and actual.shape == mine.shape, label
        if python is not None:
            assert torch.equal(actual, python[i]), f"{label}: differs from the cast in Python"
        sent = [members[i].to(wire) if mine.is_floating_point() else members[i] for members in by_rank]
        want = reduce_reference(sent, op, pre, post)
        tol = TOLERANCE[wire] if mine.is_floating_point() else 0
        ok = torch.allclose(actual.double(), want, atol=tol, rtol=tol) if tol else torch.equal(actual.double(), want)
        assert ok, f"{label}: got {actual.flatten()[:6].tolist()}, expected {want.flatten()[:6].tolist()}"


def _grouped_and_single(unit):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    # members straddle the pipeline's chunks (with unit MIB, about 20 MiB of float16 on the
    # wire), some empty, one small enough to travel inline with its request; float64 and native
    # float16 members travel in the same float16 batch, int32 ones uncast in a batch of their own
    sizes = [1, 0, 3 * unit // 4 + 1, 5, 2 * unit // 4 - 3] * 3 + [7 * unit // 4 + 11]
    dtypes = [torch.float32, torch.float64, torch.float32, torch.int32, torch.float16] * 3 + [torch.float32]
    for seed, (compression, wire) in enumerate(COMPRESSIONS):
        for op, pre, post in [(hvd.Average, 0.5, 3.0), (hvd.Sum, 1.0, 1.0), (hvd.Max, 1.0, 1.0)]:
            by_rank = [[rank_input(seed * 100 + i, r, (n,), d, op) for i, (n, d) in enumerate(zip(sizes, dtypes))]
                       for r in range(size)]
            kwargs = dict(op=op, prescale_factor=pre, postscale_factor=post)
            got = hvd.grouped_allreduce(by_rank[rank], name=f"g.{seed}.{op}", compression=compression, **kwargs)
            python = _cast_in_python(by_rank[rank], wire, name=f"p.{seed}.{op}", **kwargs)
            _check(got, by_rank, wire, op, f"grouped {wire} (op {op})", pre, post, python)
        # single tensors: inline, medium, one large enough to be pipelined, and a transposed
        # one (a cast that is not a flat range). A large wire-dtype tensor is reduced in place,
        # cut otherwise than the staged one, and on 3 ranks the order of a ring's sum follows
        # the cut: bit for bit is then a property of 2 ranks only
        for i, shape in enumerate([(3,), (1000, 3), (9 * unit,)]):
            by_rank = [[rank_input(50 + i, r, shape, torch.float32)] for r in range(size)]
            got = hvd.allreduce(by_rank[rank][0], name=f"s.{seed}.{i}", compression=compression, op=hvd.Sum)
            python = _cast_in_python(by_rank[rank], wire, name=f"ps.{seed}.{i}", op=hvd.Sum)
            _check([got], by_rank, wire, hvd.Sum, f"single {shape} as {wire}",
                   python=python if size == 2 or i < 2 else None)
        by_rank = [[rank_input(60, r, (1500, 2001), torch.float32).t()] for r in range(size)]
        got = hvd.grouped_allreduce(by_rank[rank], name=f"t.{seed}", compression=compression)
        python = _cast_in_python(by_rank[rank], wire, name=f"pt.{seed}")
        _check(got, by_rank, wire, hvd.Average, f"transposed as {wire}", python=python)
    engine = _state.current().sets[0].engine
    if engine.shared_memory and engine._set_single_copy_min(1):
        # Single copy: peers read each rank's memory as it is, so a batch that casts goes through
        # a fusion buffer while a rank passing native float16 reads straight from its tensors
        by_rank = [[rank_input(80 + i, r, (n,), torch.float32) for i, n in enumerate(sizes)] for r in range(size)]
        mine = by_rank[rank] if rank % 2 == 0 else [t.half() for t in by_rank[rank]]
        got = hvd.grouped_allreduce(mine, name="single-copy", compression=hvd.Compression.fp16, op=hvd.Sum)
        _check([g.float() for g in got], by_rank, torch.float16, hvd.Sum, "single copy, fp16 on the wire")
    hvd.shutdown()
    return True


def _optimizer_and_autograd():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    for compression, wire in COMPRESSIONS:
        # DistributedOptimizer: the engine casts each gradient in place; the result must equal
        # the Python cast of the same local gradients (computed on a plain copy of the model)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Tanh(), torch.nn.Linear(200, 4))
        plain = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Tanh(), torch.nn.Linear(200, 4))
        plain.load_state_dict(model.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=compression)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(16, 300, generator=g), torch.randn(16, 4, generator=g)
        F.mse_loss(model(x), y).backward()
        opt.synchronize()
        F.mse_loss(plain(x), y).backward()
        local = [p.grad for p in plain.parameters()]
        python = _cast_in_python(local, wire, name=f"opt.{wire}")
        by_rank = hvd.allgather_object(local)
        got = [p.grad for p in model.parameters()]
        _check(got, by_rank, wire, hvd.Average, f"DistributedOptimizer with {wire}", python=python)
        with opt.skip_synchronize():
            opt.step()
        # autograd: the gradient travels as the wire dtype too, equal to the Python cast's
        base = rank_input(70, rank, (64, 5), torch.float32)
        a = base.clone().requires_grad_()
        (hvd.grouped_allreduce([a], name=f"ag.{wire}", compression=compression)[0] * 3).sum().backward()
        b = base.clone().requires_grad_()
        (hvd.grouped_allreduce([b.to(wire)], name=f"pg.{wire}")[0].float() * 3).sum().backward()
        assert a.grad.dtype == torch.float32 and torch.equal(a.grad, b.grad), f"autograd as {wire}, rank {rank}"
    # a rank that compresses to another dtype than its peers: a clear mismatch on every rank
    try:
        hvd.allreduce(torch.ones(4), name="mixed", compression=COMPRESSIONS[rank % 2][0])
    except hvd.MismatchError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"rank {rank}: no error for a wire dtype mismatch")
    assert "mixed" in message and "dtype mismatch: rank 0 has Half; rank 1 has BFloat16" in message, message
    assert hvd.allreduce(torch.ones(2), name="after", op=hvd.Sum).tolist() == [size, size]
    hvd.shutdown()
    return True


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("size", [2, 3])
def test_engine_cast_equals_python_cast_and_reference(size, route):
    assert all(run_ranks(size, __name__, "_grouped_and_single", UNIT[route], timeout=150, env=ROUTES[route]))


@pytest.mark.parametrize("route", ROUTES)
def test_optimizer_and_autograd_gradients_travel_cast(route):
    assert all(run_ranks(2, __name__, "_optimizer_and_autograd", timeout=90, env=ROUTES[route]))
