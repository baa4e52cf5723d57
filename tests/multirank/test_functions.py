"""broadcast_parameters, broadcast_optimizer_state, broadcast_object and allgather_object on 2
and 3 ranks. Values are checked on every rank against what the root holds (shipped with
broadcast_object, itself checked first against values every rank can compute)."""

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hvdlite as hvd
from tests import harness
from tests.harness import run_ranks


def _model(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 2))
    model.register_buffer("mask", torch.tensor([True, False, seed % 2 == 0]))  # bool: by pickle
    return model


def _train_alone(model, opt, steps, seed=0):
    """Plain local training, no hvdlite: how a rank gets state before any broadcast."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(torch.randn(8, 5, generator=g)), torch.randn(8, 2, generator=g)).backward()
        opt.step()


def _flat_state(opt):
    out = {}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for k, v in opt.state.get(p, {}).items():
            out[f"{i}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return out, hyper


def _assert_same_state(mine, roots, what):
    (state, hyper), (root_state, root_hyper) = mine, roots
    assert hyper == root_hyper, f"{what}: hyperparameters {hyper} != root's {root_hyper}"
    assert state.keys() == root_state.keys(), \
        f"{what}: keys {sorted(state)} != {sorted(root_state)}"
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == root_state[k].dtype and torch.equal(v, root_state[k]), f"{what}: {k}"
        else:
            assert v == root_state[k], f"{what}: {k}"


# ---- the checks (each runs on every rank) -------------------------------------------------------

def check_objects_round_trip():
    rank, size = hvd.rank(), hvd.size()
    obj = {"from": rank, "payload": list(range(rank * 50))}
    last = size - 1
    assert hvd.broadcast_object(obj, root_rank=last) == {"from": last,
                                                         "payload": list(range(last * 50))}
    assert hvd.broadcast_object(None if rank else ("x", 1.5)) == ("x", 1.5)
    gathered = hvd.allgather_object(obj, name="objs")
    assert gathered == [{"from": r, "payload": list(range(r * 50))} for r in range(size)], gathered
    assert hvd.allgather_object(rank * "a") == ["a" * r for r in range(size)]  # rank 0: empty str


def check_broadcast_parameters_from_state_dict_and_named_parameters():
    rank = hvd.rank()
    for root, source in ((0, "state_dict"), (hvd.size() - 1, "named_parameters")):
        model = _model(seed=rank)
        model(torch.randn(4, 5))  # moves BatchNorm running stats: buffers differ per rank too
        params = model.state_dict() if source == "state_dict" else model.named_parameters()
        hvd.broadcast_parameters(params, root_rank=root)
        expected = hvd.broadcast_object({k: v.clone() for k, v in model.state_dict().items()}, root)
        for k, v in model.state_dict().items():
            if source == "state_dict" or k in dict(model.named_parameters()):
                assert torch.equal(v, expected[k]), f"{source} from root {root}: {k} differs"
    with pytest.raises(ValueError, match="twice"):
        hvd.broadcast_parameters([("a", torch.zeros(1)), ("a", torch.zeros(1))], root_rank=0)


def check_optimizer_state_when_only_root_has_it():
    rank = hvd.rank()
    for make in (lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.95)),
                 lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)):
        model = _model(seed=0)
        opt = make(model.parameters())
        if rank == 0:
            _train_alone(model, opt, steps=3)  # e.g. resumed from a checkpoint on rank 0 only
        else:  # fresh state, different hyperparameters
            for group in opt.param_groups:
                group["lr"] = 123.0
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        roots = hvd.broadcast_object(_flat_state(opt) if rank == 0 else None, root_rank=0)
        _assert_same_state(_flat_state(opt), roots, type(opt).__name__)
        if isinstance(opt, torch.optim.Adam):
            assert all(s["step"].item() == 3 for s in opt.state.values())

        # Training on goes on identically on every rank, with the step counts continuing.
        dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        model.train()
        _train_alone(model, dopt, steps=2, seed=10 + rank)  # different data per rank
        weights = hvd.allgather_object([p.detach() for p in model.parameters()])
        for other in weights[1:]:
            for a, b in zip(weights[0], other):
                assert torch.equal(a, b), "parameters diverged after broadcast_optimizer_state"
        if isinstance(opt, torch.optim.Adam):
            assert all(s["step"].item() == 5 for s in opt.state.values())


def check_optimizer_state_when_no_rank_has_it_changes_nothing():
    model = _model(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert len(opt.state) == 0, "state was created: the first real step would be shifted"
    assert opt.param_groups[0]["lr"] == 0.01


def check_optimizer_state_overwrites_existing_state_in_place():
    rank = hvd.rank()
    model = _model(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train_alone(model, opt, steps=1 + rank, seed=rank)  # every rank has state, all different
    before = {id(v) for s in opt.state.values() for v in s.values()}
    hvd.broadcast_optimizer_state(opt, root_rank=1)
    roots = hvd.broadcast_object(_flat_state(opt) if rank == 1 else None, root_rank=1)
    _assert_same_state(_flat_state(opt), roots, "existing state")
    assert {id(v) for s in opt.state.values() for v in s.values()} == before, "tensors replaced"


def check_mismatched_optimizers_fail_on_every_rank():
    model = nn.Linear(3, 2 + hvd.rank() % 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="rank 1: its optimizer has param groups"):
        hvd.broadcast_optimizer_state(opt, root_rank=0)


CHECKS = [name for name in dir() if name.startswith("check_")]


def _run_checks():
    return harness.run_checks_in_ranks(sys.modules[__name__], CHECKS)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def outcomes(request):
    return run_ranks(request.param, __name__, "_run_checks", timeout=60)


@pytest.mark.parametrize("check", CHECKS)
def test_functions(outcomes, check):
    failures = [o[check] for o in outcomes if o[check]]
    assert not failures, "\n".join(failures)
