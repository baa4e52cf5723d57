"""PowerSGD through DistributedOptimizer (Note [PowerSGD], hvdlite/compression.py), against a
reference written here from the algorithm: every rank's raw gradients are gathered, and the
reference runs the two rounds over them in float64 with its own error buffers and Qs."""

import zlib

import pytest
import torch

import hvdlite as hvd
from hvdlite.elastic import TorchState
from tests.harness import run_ranks

SEED = 7


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),  # weight 8 x 27: compressed at rank 2
        torch.nn.Linear(8 * 4 * 4, 24), torch.nn.ReLU(),                 # 24 x 128: compressed
        torch.nn.Linear(24, 3))                                          # 3 x 24: rate 1.3, sent as it is


def _batch(step, rank, bad=False):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(5, 3, 6, 6, generator=g)
    if bad:
        x[0, 0, 0, 0] = float("inf")
    return x, torch.randint(0, 3, (5,), generator=g)


def _local_grads(model, x, y):
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


class Reference:
    """PowerSGD over every rank's gradients at once, in float64 (the independent reference)."""

    def __init__(self, rank, warmup, size, min_rate=2.0):
        self.rank, self.warmup, self.size, self.min_rate = rank, warmup, size, min_rate
        self.steps, self.error, self.q = {}, {}, {}

    def reduce(self, name, grads):  # grads: one per rank -> the averaged gradient every rank gets
        exact = sum(g.double() for g in grads) / self.size
        shape, n = grads[0].shape, grads[0].shape[0]
        m = grads[0].numel() // n
        r = min(self.rank, n, m)
        done = self.steps.get(name, 0)
        self.steps[name] = done + 1
        if grads[0].dim() < 2 or n * m < self.min_rate * (n + m) * r or done < self.warmup:
            return exact.float()
        ms = [g.double().reshape(n, m) + self.error.get((name, i), 0) for i, g in enumerate(grads)]
        q = self.q.get(name)
        if q is None:
            gen = torch.Generator().manual_seed((SEED * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62))
            q = torch.randn(m, r, generator=gen, dtype=torch.float64)
        p, _ = torch.linalg.qr(sum(mi @ q for mi in ms))
        q_sum = sum(mi.t() @ p for mi in ms)
        mean = p @ q_sum.t() / self.size
        if torch.isfinite(mean).all():
            for i, mi in enumerate(ms):
                self.error[(name, i)] = mi - mean
            self.q[name] = q_sum
        return mean.float().reshape(shape)


def _train(steps, rank_r, warmup=0, passes=1, bad_step=None, op=hvd.Average):
    """Trains with PowerSGD and returns, per step, the largest relative difference between each
    gradient and the reference (and whether non-finite steps stayed non-finite)."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model, shadow = _model(), _model()
    compression = hvd.Compression.powersgd(rank=rank_r, warmup_steps=warmup, seed=SEED)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=compression,
                                   backward_passes_per_step=passes, op=op)
    ref = Reference(rank_r, warmup, size)
    worst, skipped = [], []
    for step in range(steps):
        opt.zero_grad()
        shadow.load_state_dict(model.state_dict())
        accumulated = {}
        for k in range(passes):
            x, y = _batch(step * passes + k, rank, bad=step == bad_step and rank == 1)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            for n, g in _local_grads(shadow, x, y).items():
                accumulated[n] = accumulated.get(n, 0) + g
        opt.synchronize()
        diffs = []
        for name, p in model.named_parameters():
            every = hvd.allgather(accumulated[name].unsqueeze(0), name=f"ref.{step}.{name}").unbind(0)
            want = ref.reduce("grad." + name, list(every)) * (size if op == hvd.Sum else 1)
            if step == bad_step:
                skipped.append(not bool(torch.isfinite(p.grad).all()) or not bool(torch.isfinite(want).all()))
                continue
            diffs.append(float((p.grad - want).abs().max() / want.abs().max().clamp_min(1e-12)))
        worst.append(max(diffs) if diffs else 0.0)
        with opt.skip_synchronize():
            if step != bad_step:
                opt.step()
    counts = dict(compression.state_dict()["steps"])
    hvd.shutdown()
    return worst, skipped, counts


@pytest.mark.parametrize("size", [2, 3])
def test_low_rank_steps_match_the_reference_on_every_rank(size):
    for worst, _, _ in run_ranks(size, __name__, "_train", 6, 2, 1, timeout=120):
        assert all(d < 1e-4 for d in worst), worst


def test_full_rank_equals_the_exact_allreduce():
    results = run_ranks(2, __name__, "_full_rank", timeout=120)
    assert all(d < 1e-5 for d in results), results


def _full_rank():
    hvd.init()
    rank = hvd.rank()
    exact_model, low_model = _model(), _model()
    exact = hvd.DistributedOptimizer(torch.optim.SGD(exact_model.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=exact_model.named_parameters())
    full = hvd.DistributedOptimizer(torch.optim.SGD(low_model.parameters(), lr=0.05, momentum=0.9),
                                    named_parameters=low_model.named_parameters(),
                                    compression=hvd.Compression.powersgd(rank=1000, min_compression_rate=0))
    for step in range(8):
        x, y = _batch(step, rank)
        for model, opt in ((exact_model, exact), (low_model, full)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    worst = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(exact_model.parameters(),
                                                                              low_model.parameters()))
    hvd.shutdown()
    return worst


def test_warmup_sum_and_several_backward_passes_per_step():
    # warm-up: the first two reductions of each parameter are exact; then compressed
    for worst, _, counts in run_ranks(2, __name__, "_train", 5, 2, 2, timeout=120):
        assert all(d < 1e-4 for d in worst), worst
        assert set(counts.values()) == {5}, counts
    # op=Sum and two backward passes per step: compression runs once per reducing step
    for worst, _, counts in run_ranks(2, __name__, "_train", 4, 2, 0, 2, None, hvd.Sum, timeout=120):
        assert all(d < 1e-4 for d in worst), worst
        assert set(counts.values()) == {4}, counts


def test_a_non_finite_step_never_reaches_the_error_buffer():
    # rank 1's input holds an inf at step 2: every rank's gradient is non-finite there, the step
    # is skipped (as AMP's scaler would), and the later steps match a reference that kept the
    # error buffers and Qs of step 1
    for worst, skipped, _ in run_ranks(2, __name__, "_train", 5, 2, 0, 1, 2, timeout=120):
        assert skipped and all(skipped), skipped
        assert all(d < 1e-4 for d in worst), worst


def _checkpoints():
    hvd.init()
    rank = hvd.rank()

    def make():
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(),
                                       compression=hvd.Compression.powersgd(rank=2, seed=SEED))
        return model, opt

    def step(model, opt, k):
        opt.zero_grad()
        x, y = _batch(k, rank)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    model, opt = make()
    for k in range(3):
        step(model, opt, k)
    saved = opt.state_dict()
    assert set(saved["powersgd"]["error"]) == {"grad.0.weight", "grad.3.weight"}, saved["powersgd"]["error"].keys()
    copy_model, copy_opt = make()
    copy_model.load_state_dict(model.state_dict())
    copy_opt.load_state_dict(saved)
    # an elastic state's commit and restore carry the compressor's state too
    state = TorchState(model, opt)
    state.commit()
    step(model, opt, 3)
    state.restore()
    for k in (3, 4):
        step(model, opt, k)
        step(copy_model, copy_opt, k)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), copy_model.parameters()))
    hvd.shutdown()
    return same


def test_state_dict_and_elastic_commit_carry_error_buffers_and_qs():
    assert run_ranks(2, __name__, "_checkpoints", timeout=120) == [True, True]


def test_bad_options_are_refused():
    model = _model()
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        hvd.Compression.powersgd(rank=0)
    with pytest.raises(ValueError, match="works with op=Average or Sum"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum,
                                 compression=hvd.Compression.powersgd())


class _Branches(torch.nn.Module):
    """Two same-shape compressed layers (a swap between them would go unnoticed by shape
    checks) and one whose parameter, and so its gradient, is a transposed (strided) tensor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a = torch.nn.Linear(16, 16, bias=False)
        self.b = torch.nn.Linear(16, 16, bias=False)
        self.c = torch.nn.Parameter(torch.randn(16, 12).t())  # 12 x 16, strides of a transpose

    def forward(self, x, use_a=True):
        h = self.b(x) + (self.a(x) if use_a else 0)
        return h @ self.c.t()


def _unused_and_strided(steps=4):
    """Rank 1 skips branch `a` on even steps: its gradient then joins at synchronize(), after
    the others, so the ranks' hooks fire in different orders."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model, shadow = _Branches(), _Branches()
    assert not model.c.is_contiguous()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.powersgd(rank=2, seed=SEED))
    ref = Reference(2, 0, size)
    worst = []
    for step in range(steps):
        shadow.load_state_dict(model.state_dict())
        use_a = not (rank == 1 and step % 2 == 0)
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(6, 16, generator=g), torch.randn(6, 12, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x, use_a), y).backward()
        shadow.zero_grad()
        torch.nn.functional.mse_loss(shadow(x, use_a), y).backward()
        opt.synchronize()
        for name, p in model.named_parameters():
            local = dict(shadow.named_parameters())[name].grad
            local = torch.zeros_like(p) if local is None else local
            every = hvd.allgather(local.unsqueeze(0), name=f"ref.{step}.{name}").unbind(0)
            want = ref.reduce("grad." + name, list(every))
            worst.append(float((p.grad - want).abs().max() / want.abs().max().clamp_min(1e-12)))
        with opt.skip_synchronize():
            opt.step()
    hvd.shutdown()
    return worst


def test_unused_parameters_and_strided_gradients_match_the_reference():
    for worst in run_ranks(2, __name__, "_unused_and_strided", timeout=120):
        assert all(d < 1e-4 for d in worst), worst


def _broadcast_state():
    hvd.init()
    rank = hvd.rank()
    model = _model()
    compression = hvd.Compression.powersgd(rank=2, warmup_steps=2, seed=SEED)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=compression)
    if rank == 0:  # as if only rank 0 had loaded a checkpoint past the warm-up
        compression.load_state_dict({"steps": {n: 5 for n in opt._names.values()}})
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    counts = dict(compression.state_dict()["steps"])
    x, y = _batch(0, rank)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()  # every rank compresses: no rank sends an ordinary allreduce the others hold back
    hvd.shutdown()
    return counts


def test_broadcast_optimizer_state_carries_the_counts_that_decide_warm_up():
    for counts in run_ranks(2, __name__, "_broadcast_state", timeout=120):
        assert set(counts.values()) == {5}, counts
