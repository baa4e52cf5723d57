"""DistributedOptimizer on 2 and 3 ranks: training equals one process on the combined batch.

Every rank also trains a reference model without hvdlite on the concatenation of all ranks'
batches (regenerated from seeds), with the same initial weights and the same torch optimizer,
and compares parameters after a few steps. One job per rank count runs every check (spawning
ranks is the slow part); each check's outcome comes back by name and is its own test.
"""

import contextlib
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hvdlite as hvd
from tests import harness
from tests.harness import run_ranks

STEPS = 3


class Net(nn.Module):
    """A small MLP; ``extra`` is used only when asked (data-dependent branch), ``never`` never."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)
        self.extra = nn.Linear(6, 3)
        self.never = nn.Linear(6, 3)

    def forward(self, x, use_extra=False):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out + self.extra(x) if use_extra else out


def batch(step, rank, micro=0, n=4):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def reference_loss(model, step, size):
    """The single-process loss on every rank's batch of ``step``: the mean of their means."""
    return sum(F.mse_loss(model(batch(step, r)[0]), batch(step, r)[1]) for r in range(size)) / size


def assert_params_close(model, ref, atol, what):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        diff = (p.detach() - q.detach()).abs().max().item()
        assert diff <= atol, f"{what}: parameter {name} differs from the reference by {diff:.3g}"


def train_and_compare(make_opt, *, passes=1, use_no_sync=False, clip=None, op=hvd.Average,
                      extra_ranks=(), scheduler=False, atol=1e-5, **options):
    """Trains with DistributedOptimizer(**options) and a single-process reference; compares."""
    rank, size = hvd.rank(), hvd.size()
    model, ref = Net(), Net()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(), op=op, **options)
    ref_opt = make_opt(ref.parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # no state yet: must change nothing
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref_opt)] \
        if scheduler else []
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(passes):
            x, y = batch(step, rank, m)
            quiet = opt.no_sync() if use_no_sync and m < passes - 1 else contextlib.nullcontext()
            with quiet:
                F.mse_loss(model(x, rank in extra_ranks), y).backward()
        if clip:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()

        ref_opt.zero_grad()
        total = 0
        for r in range(size):
            for m in range(passes):
                x, y = batch(step, r, m)
                total = total + F.mse_loss(ref(x, r in extra_ranks), y)
        (total / size if op == hvd.Average else total).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        for s in scheds:
            s.step()
    assert_params_close(model, ref, atol, "after training")
    return model, opt, ref_opt


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


# ---- the checks (each runs on every rank) -------------------------------------------------------

def check_sgd_momentum_matches_single_process():
    train_and_compare(sgd)


def check_adam_matches_single_process():
    _, opt, ref_opt = train_and_compare(adam)
    steps = [s["step"].item() for s in opt.state.values()]
    assert steps and all(s == STEPS for s in steps), f"Adam step counts {steps}, expected {STEPS}"


def check_sum_op_and_predivide_match():
    train_and_compare(sgd, op=hvd.Sum)
    train_and_compare(sgd, gradient_predivide_factor=2.0)  # SGD: a wrong scale shows


def check_backward_passes_per_step_equals_accumulation():
    train_and_compare(sgd, passes=2, backward_passes_per_step=2)


def check_no_sync_equals_accumulation():
    train_and_compare(sgd, passes=2, use_no_sync=True)


def check_groups_and_num_groups_match():
    train_and_compare(sgd, num_groups=2)
    model = Net()
    groups = [[model.fc1.weight, model.fc2.weight], [model.fc1.bias, model.extra.bias]]
    # train_and_compare builds its own model: check an explicit grouping on a model it shares
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters(), groups=groups)
    ref = Net()
    ref_opt = sgd(ref.parameters())
    rank, size = hvd.rank(), hvd.size()
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        reference_loss(ref, step, size).backward()
        ref_opt.step()
    assert_params_close(model, ref, 1e-5, "explicit groups")


def check_compression_within_precision():
    for compression, wire, atol in ((hvd.Compression.fp16, torch.float16, 2e-3),
                                    (hvd.Compression.bf16, torch.bfloat16, 2e-2)):
        model, _, _ = train_and_compare(sgd, compression=compression, atol=atol)
        for name, p in model.named_parameters():  # the reduced gradient did travel as `wire`
            assert p.grad.dtype == torch.float32, name
            assert torch.equal(p.grad, p.grad.to(wire).float()), f"{name}: not {wire} on the wire"


def check_clipping_with_synchronize_and_skip_synchronize():
    train_and_compare(sgd, clip=0.05)


def check_unused_branch_does_not_hang_and_matches():
    # 'extra' is used on rank 0 only, 'never' on no rank: both must reduce without a hang.
    model, _, _ = train_and_compare(sgd, extra_ranks=(0,))
    assert torch.count_nonzero(model.never.weight.grad) == 0


def check_lr_scheduler_works_on_the_wrapper():
    with warnings.catch_warnings():
        # e.g. "Detected call of lr_scheduler.step() before optimizer.step()"
        warnings.simplefilter("error", UserWarning)
        _, opt, ref_opt = train_and_compare(sgd, scheduler=True)
    assert isinstance(opt, torch.optim.Optimizer)
    lrs = [g["lr"] for g in opt.param_groups]
    assert lrs == [g["lr"] for g in ref_opt.param_groups] == [0.1 * 0.5 ** STEPS], lrs
    assert opt.state_dict()["param_groups"] == ref_opt.state_dict()["param_groups"]


def check_zero_grad_during_reduction_raises():
    rank = hvd.rank()
    model = Net()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    x, y = batch(0, rank)
    F.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\).*'grad\.fc\d\.(weight|bias)'"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()  # fine once the reductions are done
    # a second backward pass before step() is caught too, naming the parameter
    F.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"computed again.*backward_passes_per_step"):
        F.mse_loss(model(x), y).backward()
    opt.step()


def check_sparse_gradients_both_ways():
    rank, size = hvd.rank(), hvd.size()
    for as_dense in (False, True):
        torch.manual_seed(3)
        emb = nn.Embedding(12, 4, sparse=True)
        ref = nn.Embedding(12, 4)
        ref.load_state_dict(emb.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=as_dense)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)

        def ids(step, r):
            return torch.randint(0, 12, (5,), generator=torch.Generator().manual_seed(step * 7 + r))

        for step in range(STEPS):
            opt.zero_grad()
            emb(ids(step, rank)).pow(2).mean().backward()
            opt.step()
            assert emb.weight.grad.is_sparse  # sparse_as_dense reduces dense, hands back sparse
            ref_opt.zero_grad()
            sum(ref(ids(step, r)).pow(2).mean() for r in range(size)).div(size).backward()
            ref_opt.step()
        diff = (emb.weight - ref.weight).abs().max().item()
        assert diff < 1e-5, f"sparse_as_dense={as_dense}: embedding differs by {diff}"


def check_constructor_validates_names():
    model = Net()
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="'fc1.weight' twice"):
        hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named + named[:1])
    with pytest.raises(ValueError, match="not in it"):
        hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named[1:])
    with pytest.raises(ValueError, match="op must be"):
        hvd.DistributedOptimizer(sgd(model.parameters()), op=hvd.Max)
    # without named_parameters the generated names must still train correctly
    model, ref = Net(), Net()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()))
    ref_opt = sgd(ref.parameters())
    x, y = batch(0, hvd.rank())
    F.mse_loss(model(x), y).backward()
    opt.step()
    reference_loss(ref, 0, hvd.size()).backward()
    ref_opt.step()
    assert_params_close(model, ref, 1e-5, "generated names")


CHECKS = [name for name in dir() if name.startswith("check_")]


def _run_checks():
    torch.set_default_dtype(torch.float32)
    return harness.run_checks_in_ranks(sys.modules[__name__], CHECKS)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def outcomes(request):
    return run_ranks(request.param, __name__, "_run_checks", timeout=90)


@pytest.mark.parametrize("check", CHECKS)
def test_optimizer(outcomes, check):
    failures = [o[check] for o in outcomes if o[check]]
    assert not failures, "\n".join(failures)
