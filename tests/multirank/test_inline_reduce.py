"""Small allreduces reduced by typed loops straight into the output (Note [Inline reduce in place]
in csrc/inline_payloads.cc): every rank's result must equal, bit for bit, plain torch's
arithmetic in rank order (sums and products that wrap for integers, an average or postscale as
one multiplication in the dtype's own precision, or in float64 truncated for integers), for
values whose rounding depends on that order, in every form a call can take."""

import pytest
import torch

import hvdlite as hvd
from tests.harness import run_ranks

# (dtype, low, high): integer ranges wide enough that sums and products wrap
CASES = [(torch.float32, None, None), (torch.float64, None, None), (torch.int32, -2**30, 2**30),
         (torch.int64, -2**62, 2**62), (torch.int8, -100, 100), (torch.uint8, 0, 256)]
OPS = [hvd.Sum, hvd.Average, hvd.Product]


def _input(seed, rank, shape, dtype, low, high):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    if dtype.is_floating_point:  # values whose sums round differently in another order
        magnitude = 10.0 ** torch.randint(-3, 4, shape, generator=g)
        return (torch.randn(shape, generator=g, dtype=torch.float64) * magnitude).to(dtype)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(dtype)


def _expected(inputs, op, postscale):
    """Plain torch, one rank at a time in rank order, as the engine's loop must do it."""
    acc = inputs[0].clone()
    for t in inputs[1:]:
        acc = acc * t if op == hvd.Product else acc + t
    scale = postscale / len(inputs) if op == hvd.Average else postscale
    if scale == 1.0:
        return acc
    if acc.dtype.is_floating_point:
        return acc * scale  # a Python float scalar: multiplied in the tensor's own precision
    return (acc.to(torch.float64) * scale).to(acc.dtype)  # truncated toward zero


def _every_form():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checked = 0
    for i, ((dtype, low, high), op, postscale, shape) in enumerate(
            (c, op, post, shape) for c in CASES for op in OPS for post in (1.0, 0.5)
            for shape in ((1,), (3, 5), (0,))):
        if postscale != 1.0 and op == hvd.Product and not dtype.is_floating_point:
            continue  # (a scaled integer product is covered by the sums)
        inputs = [_input(i, r, shape, dtype, low, high) for r in range(size)]
        want = _expected(inputs, op, postscale)
        what = f"{dtype} {op} postscale {postscale} shape {shape}"
        out = hvd.allreduce(inputs[rank].clone(), op=op, name=f"new.{i}", postscale_factor=postscale)
        assert out.dtype == dtype and torch.equal(out, want), \
            f"{what}: got {out.flatten()[:4]}, want {want.flatten()[:4]}"
        mine = inputs[rank].clone()
        hvd.allreduce_(mine, op=op, name=f"inplace.{i}", postscale_factor=postscale)
        assert torch.equal(mine, want), f"{what} in place"
        # a non-contiguous output: the operators' path, the same values
        wide = torch.stack([inputs[rank], inputs[rank]], dim=-1)
        view = wide[..., 1]
        hvd.allreduce_(view, op=op, name=f"view.{i}", postscale_factor=postscale)
        assert torch.equal(view, want) and torch.equal(wide[..., 0], inputs[rank]), f"{what} into a view"
        checked += 1
    # several small tensors in one round, one a Max (the operators' path) beside the loops'
    tensors = [_input(9000 + j, rank, (4,), torch.float32, None, None) for j in range(4)]
    handles = [hvd.allreduce_async(t, op=hvd.Max if j == 2 else hvd.Sum, name=f"batch.{j}")
               for j, t in enumerate(tensors)]
    for j, h in enumerate(handles):
        everyone = [_input(9000 + j, r, (4,), torch.float32, None, None) for r in range(size)]
        want = torch.stack(everyone).max(0).values if j == 2 else _expected(everyone, hvd.Sum, 1.0)
        assert torch.equal(hvd.synchronize(h), want), f"batch member {j}"
    hvd.shutdown()
    return checked


@pytest.mark.parametrize("size,caller_rounds", [(2, "0"), (3, "0"), (2, "1")])
def test_inline_allreduce_matches_rank_order_arithmetic_bit_for_bit(size, caller_rounds):
    results = run_ranks(size, __name__, "_every_form", env={"HVDLITE_CALLER_ROUNDS": caller_rounds}, timeout=120)
    assert all(n == results[0] and n > 80 for n in results), results
