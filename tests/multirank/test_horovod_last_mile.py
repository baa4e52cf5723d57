"""The horovod.torch behaviours a ported script tripped on last: callable sparse handles,
frozen parameters in broadcast_optimizer_state, join with allgather and broadcast, Horovod's
reducescatter gradient, argument errors that are RuntimeErrors, _parameter_names, sparse
gradients handed back sparse, the step-after-synchronize warning and pickling failures that
reach every rank. Each check runs on real ranks; values are checked against references that
every rank computes on its own from the inputs of all ranks."""
import sys
import threading
import time
import warnings

import pytest
import torch

import hvdlite as hvd
from tests import harness
from tests.harness import run_ranks


def check_sparse_allreduce_handle_is_called_for_the_result():
    rank, size = hvd.rank(), hvd.size()

    def mine(r):  # rank r holds r + 1 at row r and 10 at row `size`
        return torch.sparse_coo_tensor([[r, size]], [float(r + 1), 10.0], (size + 1,))

    want_sum = torch.stack([mine(r).to_dense() for r in range(size)]).sum(0)
    handle = hvd.sparse_allreduce_async(mine(rank), name="sparse.sum", op=hvd.Sum)
    assert callable(handle)
    assert torch.equal(handle().to_dense(), want_sum)
    # synchronize(handle) keeps working, and poll() takes the handle
    handle = hvd.sparse_allreduce_async(mine(rank), name="sparse.avg", op=hvd.Average)
    while not hvd.poll(handle):
        time.sleep(0.001)
    assert torch.allclose(hvd.synchronize(handle).to_dense(), want_sum / size)
    # the same with a process set of the first two ranks (every rank adds it)
    pair = hvd.add_process_set([0, 1])
    if rank < 2:
        handle = hvd.sparse_allreduce_async(mine(rank), name="sparse.pair", op=hvd.Sum, process_set=pair)
        want = mine(0).to_dense() + mine(1).to_dense()
        assert torch.equal(handle().to_dense(), want)
    hvd.remove_process_set(pair)


class _ModelWithFrozenParameter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.index = torch.nn.Parameter(torch.tensor([1, 0], dtype=torch.int32), requires_grad=False)
        self.weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))

    def forward(self, x):
        return torch.index_select(self.weight, 0, self.index.long()) * x


def check_broadcast_optimizer_state_skips_a_frozen_parameter():
    model = _ModelWithFrozenParameter()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # the int32 frozen one included
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.001),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    frozen, trained = opt.param_groups[0]["params"]
    assert frozen.grad is None
    # as horovod.torch leaves them: a zero gradient on the trained parameter, which scripts use
    assert torch.equal(trained.grad, torch.zeros(2))
    assert torch.equal(hvd.broadcast(trained.grad, root_rank=0, name="frozen.grad"), torch.zeros(2))
    # training afterwards moves only the trained parameter, and by the same on every rank
    opt.zero_grad()
    model(torch.tensor([1.0, 1.0]) * (hvd.rank() + 1)).sum().backward()
    opt.step()
    assert frozen.grad is None and torch.equal(frozen, torch.tensor([1, 0], dtype=torch.int32))
    everyone = hvd.allgather(trained.detach().reshape(1, 2), name="frozen.after")
    assert torch.equal(everyone, trained.detach().expand(hvd.size(), 2))


def _rows(size, rows):
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def check_reducescatter_gradient_is_horovods():
    rank, size = hvd.rank(), hvd.size()
    rows = 2 * size + 1
    counts = _rows(size, rows)
    weights = [torch.arange(counts[r] * 3, dtype=torch.float64).reshape(counts[r], 3) + 10 * r
               for r in range(size)]
    gathered = torch.cat(weights)  # every rank's output gradient, in rank order
    for op, factor in ((hvd.Sum, size), (hvd.Average, 1)):
        x = torch.randn(rows, 3, dtype=torch.float64, requires_grad=True)
        (hvd.reducescatter(x, op=op, name=f"rs.grad.{op}") * weights[rank]).sum().backward()
        assert torch.allclose(x.grad, gathered * factor), (op, x.grad, gathered * factor)
    # the scale factors scale the gradient too
    x = torch.randn(rows, 3, dtype=torch.float64, requires_grad=True)
    out = hvd.reducescatter(x, op=hvd.Average, name="rs.grad.scaled", prescale_factor=0.5, postscale_factor=3.0)
    (out * weights[rank]).sum().backward()
    assert torch.allclose(x.grad, gathered * 1.5)


def check_grouped_reducescatter_is_differentiable():
    rank, size = hvd.rank(), hvd.size()
    shapes = [(size * 2, 2), (size + 1, 4)]
    weights = [[torch.full((n, shape[1]), float(1 + r + 7 * i), dtype=torch.float64)
                for r, n in enumerate(_rows(size, shape[0]))] for i, shape in enumerate(shapes)]
    for op, factor in ((hvd.Sum, size), (hvd.Average, 1)):
        xs = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]
        outs = hvd.grouped_reducescatter(xs, op=op, name=f"grs.grad.{op}")
        sum((out * w[rank]).sum() for out, w in zip(outs, weights)).backward()
        for x, w in zip(xs, weights):
            assert torch.allclose(x.grad, torch.cat(w) * factor), (op, x.grad)
        # and the forward is the reducescatter of each member
        want = [hvd.reducescatter(x.detach(), op=op, name=f"grs.ref.{op}.{i}") for i, x in enumerate(xs)]
        assert all(torch.allclose(o.detach(), w) for o, w in zip(outs, want))


def check_argument_errors_are_runtime_and_value_errors():
    size = hvd.size()
    bad_calls = {
        "reducescatter op=Adasum": lambda: hvd.reducescatter(torch.ones(size, 2), op=hvd.Adasum),
        "broadcast root out of range": lambda: hvd.broadcast(torch.ones(2), root_rank=size),
        "allreduce of an unknown op": lambda: hvd.allreduce(torch.ones(2), op=99),
        "alltoall splits that do not add up": lambda: hvd.alltoall(torch.ones(size), splits=[size + 1] + [0] * (size - 1)),
        "grouped allreduce of nothing": lambda: hvd.grouped_allreduce([]),
        "unknown handle": lambda: hvd.synchronize(123456789),
    }
    for what, call in bad_calls.items():
        with pytest.raises(RuntimeError) as caught:  # as a Horovod script catches them
            call()
        assert isinstance(caught.value, (ValueError, TypeError)), what
        assert isinstance(caught.value, hvd.HvdliteError), what
    with pytest.raises(TypeError):  # a list where a tensor goes is still a TypeError too
        hvd.allreduce([1.0, 2.0])
    with pytest.raises(RuntimeError):
        hvd.allreduce([1.0, 2.0])
    # horovod.torch: an unsupported dtype is a ValueError, a second collective of one name in
    # flight a ValueError, Adasum over a set that is not a power of two a NotImplementedError
    for error in (ValueError, TypeError, RuntimeError):
        with pytest.raises(error, match="dtype complex64"):
            hvd.allreduce(torch.ones(2, dtype=torch.complex64))
    first = hvd.allreduce_async(torch.ones(2), name="in.flight")
    with pytest.raises(ValueError, match="already in flight") as caught:
        hvd.allreduce_async(torch.ones(2), name="in.flight")
    assert isinstance(caught.value, RuntimeError)
    hvd.synchronize(first)
    if size & (size - 1):
        with pytest.raises(NotImplementedError, match="power-of-two") as caught:
            hvd.allreduce(torch.ones(2), op=hvd.Adasum)
        assert isinstance(caught.value, ValueError) and isinstance(caught.value, hvd.HvdliteError)


def check_parameter_names_without_named_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    names = opt._parameter_names
    assert set(names) == set(model.parameters()) and len(set(names.values())) == 4
    everyone = hvd.allgather_object(sorted(names.values()), name="parameter.names")
    assert all(n == everyone[0] for n in everyone)
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    assert named._parameter_names == {p: n for n, p in model.named_parameters()}


def check_sparse_as_dense_hands_sparse_gradients_back():
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(5)
    embedding = torch.nn.Embedding(6, 3, sparse=True)
    reference = torch.nn.Embedding(6, 3, sparse=True)
    reference.load_state_dict(embedding.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(embedding.parameters(), lr=0.1),
                                   named_parameters=embedding.named_parameters(), sparse_as_dense=True)
    inputs = [torch.tensor([r % 6, (r + 2) % 6]) for r in range(size)]
    opt.zero_grad()
    embedding(inputs[rank]).sum().backward()
    opt.step()  # SparseAdam refuses dense gradients: this needs the reduced gradient sparse
    assert embedding.weight.grad.is_sparse
    # the reference: one SparseAdam step on the average over ranks of every rank's gradient
    ref_opt = torch.optim.SparseAdam(reference.parameters(), lr=0.1)
    dense = sum(torch.zeros(6, 3).index_add_(0, i, torch.ones(2, 3)) for i in inputs) / size
    reference.weight.grad = dense.to_sparse(1)
    ref_opt.step()
    assert torch.allclose(embedding.weight, reference.weight)


def check_step_after_synchronize_warns_in_horovods_words():
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    messages = [str(w.message) for w in caught]
    assert any("optimizer.step() called without optimizer.skip_synchronize()" in m for m in messages), messages


def check_an_unpicklable_object_fails_every_rank_at_once():
    rank = hvd.rank()
    started = time.monotonic()
    with pytest.raises(hvd.ObjectPicklingError, match="could not pickle the object on rank 0") as caught:
        hvd.broadcast_object(threading.Lock() if rank == 0 else None, root_rank=0, name="bad.bcast")
    assert caught.value.ranks == [0]
    bad = threading.Lock() if rank == 1 else {"rank": rank}
    with pytest.raises(hvd.ObjectPicklingError, match="rank 1: TypeError") as caught:
        hvd.allgather_object(bad, name="bad.gather")
    assert caught.value.ranks == [1] and isinstance(caught.value, RuntimeError)
    assert time.monotonic() - started < 10  # not the stall check's minute
    # the job goes on
    assert hvd.allgather_object(rank, name="good.gather") == list(range(hvd.size()))
    assert hvd.broadcast_object(lambda x: x * 2, root_rank=0, name="lambda")(21) == 42


CHECKS = [name for name in dir(sys.modules[__name__]) if name.startswith("check_")]


def _run_checks():
    return harness.run_checks_in_ranks(sys.modules[__name__], CHECKS)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def outcomes(request):
    return run_ranks(request.param, __name__, "_run_checks", timeout=120)


@pytest.mark.parametrize("check", CHECKS)
def test_horovod_behaviour(outcomes, check):
    failures = [o[check] for o in outcomes if o[check]]
    assert not failures, "\n".join(failures)


# ---- join with allgather and broadcast ---------------------------------------------------------

def _join_then_gather_or_broadcast():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    errors = []
    if rank == 0:
        ret = hvd.join()
    else:
        for call in (lambda: hvd.allgather(torch.ones(2, 3), name="after.join.gather"),
                     lambda: hvd.broadcast(torch.ones(3), root_rank=1, name="after.join.bcast")):
            try:
                call()
                errors.append(None)
            except RuntimeError as exc:  # Horovod's tests catch exactly this
                errors.append((type(exc).__name__, str(exc), exc.ranks))
        # the job is still usable: an allreduce among the ranks with data still works
        s = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, name="after.join.sum").item()
        errors.append(s)
        ret = hvd.join()
    values = hvd.allgather_object(ret, name="join.values")
    after = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="after.all.joined").item()
    hvd.shutdown()
    return ret, values, errors, after


@pytest.mark.parametrize("size", [2, 3])
def test_allgather_and_broadcast_after_a_join_raise_and_the_job_goes_on(size):
    results = run_ranks(size, __name__, "_join_then_gather_or_broadcast", timeout=60)
    rets = {ret for ret, _, _, _ in results}
    assert len(rets) == 1 and rets != {0}, rets  # the last rank to join, the same everywhere
    for rank, (ret, values, errors, after) in enumerate(results):
        assert values == [ret] * size
        assert after == size
        if rank == 0:
            continue
        gather_error, bcast_error, total = errors
        for error, op in ((gather_error, "allgather"), (bcast_error, "broadcast")):
            assert error is not None, f"rank {rank}: {op} after a join did not raise"
            kind, message, ranks = error
            assert kind == "MismatchError" and op in message and "rank 0 has joined" in message, error
            assert ranks == [0]
        assert total == sum(range(1, size))  # rank 0 contributes zero
