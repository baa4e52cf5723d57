"""SyncBatchNorm on N ranks, each holding a slice of a batch, against torch.nn.BatchNorm*d run
in this process, in float64, on the whole batch: outputs, input gradients, weight/bias gradients
summed over ranks, running statistics after several steps, and eval mode afterwards."""

import pytest
import torch

import hvdlite as hvd
from tests.harness import run_ranks

TOL = dict(rtol=1e-5, atol=1e-5)


def _case(split, channels=3, spatial=(), affine=True, momentum=0.1, track=True, steps=2, seed=0):
    return dict(split=split, channels=channels, spatial=spatial, affine=affine, momentum=momentum,
                track=track, steps=steps, seed=seed)


def _offsets(split):
    offs = [0]
    for n in split:
        offs.append(offs[-1] + n)
    return offs


def _gen(case, step, salt):
    return torch.Generator().manual_seed(case["seed"] * 1000 + step * 10 + salt)


def _batch(case, step):
    """The whole batch of a step (every rank builds it and keeps its slice): channels with
    means far from zero, so a naive sum-of-squares variance would lose precision."""
    c = case["channels"]
    shape = (sum(case["split"]), c) + tuple(case["spatial"])
    g = _gen(case, step, 1)
    scale = [1, c] + [1] * len(case["spatial"])
    loc = (torch.arange(c, dtype=torch.float32) * 5 - 4).reshape(scale)
    std = (torch.arange(c, dtype=torch.float32) + 0.5).reshape(scale)
    return torch.randn(shape, generator=g) * std + loc


def _loss_weights(case, step):
    shape = (sum(case["split"]), case["channels"]) + tuple(case["spatial"])
    return torch.randn(shape, generator=_gen(case, step, 2))


def _init_params(module, case):
    if case["affine"]:
        g = _gen(case, 99, 3)
        with torch.no_grad():
            module.weight.copy_(torch.rand(case["channels"], generator=g) + 0.5)
            module.bias.copy_(torch.randn(case["channels"], generator=g))


def _steps(module, case, rows, dtype):
    """Runs the case's training steps and one eval step on rows [rows] of each batch."""
    record = {"train": []}
    module.train()
    for step in range(case["steps"]):
        x = _batch(case, step)[rows].to(dtype).requires_grad_()
        out = module(x)
        (out * _loss_weights(case, step)[rows].to(dtype)).sum().backward()
        grads = {"out": out.detach(), "grad_x": x.grad}
        if case["affine"]:
            grads.update(grad_w=module.weight.grad.clone(), grad_b=module.bias.grad.clone())
            module.weight.grad = None
            module.bias.grad = None
        record["train"].append(grads)
    if case["track"]:
        record["running_mean"] = module.running_mean.clone()
        record["running_var"] = module.running_var.clone()
        record["num_batches_tracked"] = int(module.num_batches_tracked)
        module.eval()
        with torch.no_grad():
            record["eval_out"] = module(_batch(case, case["steps"])[rows].to(dtype))
    return record


def _rank_cases(cases):
    hvd.init()
    rank = hvd.rank()
    results = []
    for case in cases:
        offs = _offsets(case["split"])
        module = hvd.SyncBatchNorm(case["channels"], momentum=case["momentum"],
                                   affine=case["affine"], track_running_stats=case["track"])
        _init_params(module, case)
        results.append(_steps(module, case, slice(offs[rank], offs[rank + 1]), torch.float32))
    hvd.shutdown()
    return results


def _reference(case):
    cls = {0: torch.nn.BatchNorm1d, 1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm2d,
           3: torch.nn.BatchNorm3d}[len(case["spatial"])]
    module = cls(case["channels"], momentum=case["momentum"], affine=case["affine"],
                 track_running_stats=case["track"]).double()
    _init_params(module, case)
    return _steps(module, case, slice(None), torch.float64)


def _close(got, want, what):
    got = got.to(torch.float64)
    assert got.shape == want.shape, f"{what}: shape {list(got.shape)} != {list(want.shape)}"
    diff = (got - want).abs().max().item() if got.numel() else 0.0
    assert torch.allclose(got, want, **TOL), f"{what}: max difference {diff:.3g}"


def _check(case, per_rank):
    """per_rank: each rank's record for this case."""
    ref = _reference(case)
    offs = _offsets(case["split"])
    for step, want in enumerate(ref["train"]):
        for rank, record in enumerate(per_rank):
            rows = slice(offs[rank], offs[rank + 1])
            got = record["train"][step]
            where = f"{case} step {step} rank {rank}"
            _close(got["out"], want["out"][rows], f"{where}: output")
            _close(got["grad_x"], want["grad_x"][rows], f"{where}: input gradient")
        if case["affine"]:
            for key in ("grad_w", "grad_b"):
                summed = sum(record["train"][step][key].to(torch.float64) for record in per_rank)
                _close(summed, want[key], f"{case} step {step}: {key} summed over ranks")
    if case["track"]:
        for rank, record in enumerate(per_rank):
            where = f"{case} rank {rank}"
            _close(record["running_mean"], ref["running_mean"], f"{where}: running_mean")
            _close(record["running_var"], ref["running_var"], f"{where}: running_var")
            assert record["num_batches_tracked"] == ref["num_batches_tracked"], where
            rows = slice(offs[rank], offs[rank + 1])
            _close(record["eval_out"], ref["eval_out"][rows], f"{where}: eval output")


CASES = {
    2: [
        _case([3, 3], spatial=(4, 5), seed=1),                         # 2-D, equal slices
        _case([2, 5], channels=4, affine=False, seed=2),               # (N, C), unequal
        _case([4, 1], spatial=(6,), momentum=None, steps=3, seed=3),   # cumulative average
        _case([3, 2], spatial=(3,), track=False, seed=4),              # no running stats
    ],
    3: [
        _case([1, 4, 2], spatial=(7,), seed=5),                        # 1-D, unequal
        _case([2, 0, 3], spatial=(2, 3), momentum=None, seed=6),      # a rank with no samples
        _case([2, 2, 2], channels=2, spatial=(2, 2, 2), seed=7),      # 3-D (N, C, D, H, W)
    ],
}


@pytest.mark.parametrize("size", [2, 3])
def test_sync_batch_norm_slices_match_batch_norm_on_whole_batch(size):
    results = run_ranks(size, __name__, "_rank_cases", CASES[size], timeout=40)
    for i, case in enumerate(CASES[size]):
        _check(case, [per_rank[i] for per_rank in results])


def test_sync_batch_norm_single_rank_is_plain_batch_norm():
    cases = [_case([5], spatial=(3, 2), seed=8), _case([6], affine=False, momentum=None, seed=9)]
    results = run_ranks(1, __name__, "_rank_cases", cases, timeout=40)
    for i, case in enumerate(cases):
        _check(case, [results[0][i]])


def _one_value_per_channel():
    hvd.init()
    module = hvd.SyncBatchNorm(2)
    x = torch.ones(1 if hvd.rank() == 0 else 0, 2)  # one value per channel over all ranks
    try:
        module(x)
        message = None
    except ValueError as e:
        message = str(e)
    # The engine still works afterwards: the failure did not leave a collective half done.
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    hvd.shutdown()
    return message, total


def test_sync_batch_norm_one_value_per_channel_raises_on_every_rank():
    for message, total in run_ranks(2, __name__, "_one_value_per_channel", timeout=30):
        assert message is not None and "more than 1 value per channel" in message, message
        assert total == 2
