"""Independent references: every rank regenerates every rank's input from a seed and reduces
them with plain torch, without hvdlite, so a test can check what it received."""

import torch

import hvdlite as hvd

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
          torch.int32, torch.int64]
OPS = [hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product]


def rank_input(seed, rank, shape, dtype, op=None):
    """The tensor rank `rank` contributes: small values so sums and products stay exact."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        if op == hvd.Product:
            base = 1.0 + (torch.rand(shape, generator=g) - 0.5) * 0.2
        else:
            base = torch.randn(shape, generator=g)
        return base.to(dtype)
    low, high = (0, 4) if dtype == torch.uint8 else (-3, 4)
    if op == hvd.Product:
        low, high = (1, 3) if dtype == torch.uint8 else (-2, 3)
    return torch.randint(low, high, shape, generator=g).to(dtype)


def reduce_reference(inputs, op, prescale=1.0, postscale=1.0):
    """What allreduce must return, computed in float64 from the ranks' inputs (accumulated in
    place, one input at a time: the references of the large tests are a good part of their CPU)."""
    dtype = inputs[0].dtype

    def widened(t):
        wide = t.to(torch.float64, copy=True)
        if prescale != 1.0:
            wide.mul_(prescale)
            if not dtype.is_floating_point:
                wide.trunc_()
        return wide

    out = widened(inputs[0])
    for t in inputs[1:]:
        other = widened(t) if prescale != 1.0 else t
        if op in (hvd.Sum, hvd.Average):
            out.add_(other)
        elif op == hvd.Min:
            torch.minimum(out, other, out=out)
        elif op == hvd.Max:
            torch.maximum(out, other, out=out)
        else:
            out.mul_(other)
    if op == hvd.Average:
        out.div_(len(inputs))  # integers: truncated once, after the postscale below
    if postscale != 1.0:
        out.mul_(postscale)
    if not dtype.is_floating_point:
        out.trunc_()
    return out


def assert_close(actual, expected, dtype, what):
    assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected {dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), \
        f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 1e-5, torch.float64: 1e-10}
    atol = tol.get(dtype, 0)
    if atol:  # float64 compared as float64, the narrower floats as float32 (rounding 6e-8, far below the tolerance)
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        ok = torch.allclose(actual.to(wide), expected.to(wide), atol=atol, rtol=atol)
    else:
        ok = torch.equal(actual.to(torch.float64), expected.to(torch.float64))
    assert ok, f"{what}: got {actual.flatten()[:8].tolist()}, expected {expected.flatten()[:8].tolist()}"


def assert_members_close(got, by_rank, op, dtype, what, prescale=1.0, postscale=1.0):
    """A grouped result: got[i] against the reduction of every rank's member i (by_rank[r][i])."""
    assert len(got) == len(by_rank[0]), f"{what}: {len(got)} members, expected {len(by_rank[0])}"
    for i, actual in enumerate(got):
        want = reduce_reference([members[i] for members in by_rank], op, prescale, postscale)
        assert_close(actual, want, dtype, f"{what}, member {i}")


def linear_training(steps, size, seed_stride=100):
    """What data-parallel training of a Linear(4, 1) must reach, computed on one process: seed 0
    for the weights, SGD with lr 0.1, and each step's loss averaged over `size` ranks' batches
    (rank r's batch at step s: 8x4 normal values from seed seed_stride * s + r, its row sums as
    the target). Returns (weight as a list, bias)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        losses = []
        for rank in range(size):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed_stride * step + rank))
            losses.append(torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)))
        (sum(losses) / size).backward()
        optimizer.step()
    return model.weight.detach().flatten().tolist(), model.bias.item()
