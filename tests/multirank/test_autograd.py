"""Gradients of the differentiable collectives against a single-process computation.

Every rank rebuilds all ranks' inputs, computes the same function without hvdlite (sums,
concatenations, slices) under autograd, and compares its own input's gradient.
"""

import pytest
import torch

import hvdlite as hvd
from tests.harness import run_ranks


def _inputs(size, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(size)]


def _weights(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _gradients():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks = {}

    # Each check: the job's loss is the sum over ranks r of (output_r * w_r).sum(); hvdlite
    # computes this rank's part, the reference computes the whole sum in one process.
    # allreduce (Average and Sum with scale factors)
    for op, pre, post in ((hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 3.0)):
        xs = [x.requires_grad_(True) for x in _inputs(size, (4, 3), 1)]
        w = [_weights((4, 3), 10 + r) for r in range(size)]
        out = hvd.allreduce(xs[rank], op=op, prescale_factor=pre, postscale_factor=post)
        (out * w[rank]).sum().backward()
        ref_x = [x.detach().clone().requires_grad_(True) for x in xs]
        total = sum(x * pre for x in ref_x) * post
        if op == hvd.Average:
            total = total / size
        sum((total * w[r]).sum() for r in range(size)).backward()
        checks[f"allreduce.{op}"] = torch.allclose(xs[rank].grad, ref_x[rank].grad)

    # grouped allreduce
    xs = [[t.requires_grad_(True) for t in _inputs(size, s, 2 + i)] for i, s in enumerate([(3,), (2, 2)])]
    outs = hvd.grouped_allreduce([xs[0][rank], xs[1][rank]], op=hvd.Sum)
    w = [[_weights(s, 20 + 10 * i + r) for r in range(size)] for i, s in enumerate([(3,), (2, 2)])]
    sum((o * w[i][rank]).sum() for i, o in enumerate(outs)).backward()
    ok = True
    for i in range(2):
        ref = [x.detach().clone().requires_grad_(True) for x in xs[i]]
        sum((sum(ref) * w[i][r]).sum() for r in range(size)).backward()
        ok &= torch.allclose(xs[i][rank].grad, ref[rank].grad)
    checks["grouped_allreduce"] = ok

    # allgather with uneven rows: horovod.torch averages the incoming gradients over ranks, so the
    # gradient is the summed-loss reference's divided by the size
    xs = [torch.randn(r + 1, 2, generator=torch.Generator().manual_seed(30 + r), dtype=torch.float64).requires_grad_(True)
          for r in range(size)]
    w = [_weights((sum(range(1, size + 1)), 2), 40 + r) for r in range(size)]
    out = hvd.allgather(xs[rank])
    (out * w[rank]).sum().backward()
    ref = [x.detach().clone().requires_grad_(True) for x in xs]
    sum((torch.cat(ref) * w[r]).sum() for r in range(size)).backward()
    checks["allgather"] = torch.allclose(xs[rank].grad, ref[rank].grad / size)

    # grouped allgather: the same, per member
    xs2 = [torch.randn(r + 2, generator=torch.Generator().manual_seed(35 + r), dtype=torch.float64).requires_grad_(True)
           for r in range(size)]
    w2 = [_weights((sum(range(2, size + 2)),), 45 + r) for r in range(size)]
    for x in xs:
        x.grad = None
    outs = hvd.grouped_allgather([xs[rank], xs2[rank]])
    ((outs[0] * w[rank]).sum() + (outs[1] * w2[rank]).sum()).backward()
    ref2 = [x.detach().clone().requires_grad_(True) for x in xs2]
    sum((torch.cat(ref2) * w2[r]).sum() for r in range(size)).backward()
    checks["grouped_allgather"] = (torch.allclose(xs[rank].grad, ref[rank].grad / size)
                                   and torch.allclose(xs2[rank].grad, ref2[rank].grad / size))

    # broadcast from the last rank: Horovod's gradient is the average on the root, zero elsewhere
    root = size - 1
    xs = [x.requires_grad_(True) for x in _inputs(size, (5,), 3)]
    w = [_weights((5,), 50 + r) for r in range(size)]
    (hvd.broadcast(xs[rank], root) * w[rank]).sum().backward()
    expected = sum(w) / size if rank == root else torch.zeros(5, dtype=torch.float64)
    checks["broadcast"] = torch.allclose(xs[rank].grad, expected)

    # alltoall with uneven splits: the gradient flows back to the rows that were sent
    splits = [[(s + r) % 2 + 1 for r in range(size)] for s in range(size)]
    xs = [torch.randn(sum(splits[s]), 3, generator=torch.Generator().manual_seed(60 + s), dtype=torch.float64).requires_grad_(True)
          for s in range(size)]
    out, _ = hvd.alltoall(xs[rank], splits=splits[rank])
    w = [_weights((sum(splits[s][r] for s in range(size)), 3), 70 + r) for r in range(size)]
    (out * w[rank]).sum().backward()
    ref = [x.detach().clone().requires_grad_(True) for x in xs]
    loss = 0
    for r in range(size):
        received = torch.cat([ref[s][sum(splits[s][:r]):sum(splits[s][:r + 1])] for s in range(size)])
        loss = loss + (received * w[r]).sum()
    loss.backward()
    checks["alltoall"] = torch.allclose(xs[rank].grad, ref[rank].grad)

    # reducescatter (Average) with uneven rows
    rows = 2 * size + 1
    xs = [x.requires_grad_(True) for x in _inputs(size, (rows, 2), 4)]
    out = hvd.reducescatter(xs[rank])
    base, extra = divmod(rows, size)
    counts = [base + (1 if r < extra else 0) for r in range(size)]
    w = [_weights((counts[r], 2), 80 + r) for r in range(size)]
    (out * w[rank]).sum().backward()
    ref = [x.detach().clone().requires_grad_(True) for x in xs]
    mean = sum(ref) / size
    loss = sum((mean[sum(counts[:r]):sum(counts[:r + 1])] * w[r]).sum() for r in range(size))
    loss.backward()
    # horovod.torch's rule (Note [Reducescatter gradient]): the set's size times the gradient
    # of the sum of every rank's loss
    checks["reducescatter"] = torch.allclose(xs[rank].grad, ref[rank].grad * size)
    hvd.shutdown()
    return checks


@pytest.mark.parametrize("size", [2, 3])
def test_collective_gradients_match_single_process_reference(size):
    for rank, checks in enumerate(run_ranks(size, __name__, "_gradients")):
        failed = [name for name, ok in checks.items() if not ok]
        assert not failed, f"rank {rank}: wrong gradients for {failed}"
