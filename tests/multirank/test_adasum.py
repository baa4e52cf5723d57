"""op=Adasum (hvdlite/adasum.py): against a one-process reference of the same tree, its errors,
and training with the Adasum DistributedOptimizer."""
import pytest
import torch

import hvdlite as hvd
from tests.harness import run_ranks

SHAPES = [(7,), (3, 5), (1,), (64, 3)]
ZERO_SQUARED_NORM = 2.2250738585072014e-308 ** 0.5  # Horovod's: sqrt(DBL_MIN)


def _inputs(size, shape, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(size)]


def reference(vectors):
    """The Adasum tree in one process: level k combines the blocks of 2^k ranks pairwise."""
    def combine(a, b):
        dot, an, bn = (a * b).sum(), (a * a).sum(), (b * b).sum()
        ac = 1 - dot / (2 * an) if an >= ZERO_SQUARED_NORM else 1.0
        bc = 1 - dot / (2 * bn) if bn >= ZERO_SQUARED_NORM else 1.0
        return ac * a + bc * b
    level = list(vectors)
    while len(level) > 1:
        level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def _adasum():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    worst = 0.0
    for i, shape in enumerate(SHAPES):
        xs = _inputs(size, shape, i)
        got = hvd.allreduce(xs[rank], op=hvd.Adasum, name=f"a{i}")
        worst = max(worst, (got - reference(xs)).abs().max().item())
    # grouped, in place, async, float32
    xs = [_inputs(size, s, 10 + i) for i, s in enumerate(SHAPES[:2])]
    mine = [x[rank].float() for x in xs]
    hvd.synchronize(hvd.grouped_allreduce_async_(mine, op=hvd.Adasum, name="grouped"))
    worst32 = max((m.double() - reference(x)).abs().max().item() for m, x in zip(mine, xs))
    with pytest.raises(ValueError, match="Adasum is not supported here"):
        hvd.reducescatter(torch.ones(size, 2), op=hvd.Adasum)
    hvd.shutdown()
    return worst, worst32


@pytest.mark.parametrize("size", [2, 4])
def test_adasum_matches_the_reference_tree_on_every_rank(size):
    for worst, worst32 in run_ranks(size, __name__, "_adasum", timeout=120):
        assert worst < 1e-12 and worst32 < 1e-5, (worst, worst32)


def _not_power_of_two():
    hvd.init()
    with pytest.raises(ValueError, match="power-of-two number of ranks in the set, got 3"):
        hvd.allreduce(torch.ones(3), op=hvd.Adasum)
    hvd.shutdown()
    return True


def test_adasum_on_three_ranks_is_a_clear_error_on_every_rank():
    assert all(run_ranks(3, __name__, "_not_power_of_two"))


def _train_digits(op_name):
    from sklearn.datasets import load_digits
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    train_x, train_y, test_x, test_y = x[:1400], y[:1400], x[1400:], y[1400:]
    shard = slice(rank, None, size)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), op=getattr(hvd, op_name))
    xs, ys = train_x[shard], train_y[shard]
    for epoch in range(25):
        for i in range(0, len(xs), 32):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xs[i:i + 32]), ys[i:i + 32]).backward()
            opt.step()
    accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    hvd.shutdown()
    return accuracy, weights


@pytest.mark.slow
def test_adasum_optimizer_trains_the_digits_example_like_averaging_does():
    (acc0, w0), (acc1, w1) = run_ranks(2, __name__, "_train_digits", "Adasum", timeout=180)
    assert torch.equal(w0, w1)  # every rank ends with the same model
    (avg_acc, _), _ = run_ranks(2, __name__, "_train_digits", "Average", timeout=180)
    print(f"digits, 25 epochs on 2 ranks: Adasum {acc0:.3f}, Average {avg_acc:.3f}")
    assert acc0 > 0.9 and acc0 > avg_acc - 0.02, (acc0, avg_acc)


def _tiny_norms():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for norm in (1e-6, 1e-30):
        # the same vector on every rank: Adasum(v, v) = v / 2 + v / 2 = v, at every level
        same = torch.tensor([3.0, -4.0], dtype=torch.float64) / 5 * norm
        out[("same", norm)] = hvd.allreduce(same, op=hvd.Adasum, name=f"same.{norm}").tolist()
        # orthogonal vectors (one axis per rank): Adasum is their plain sum
        axis = torch.zeros(size, dtype=torch.float64)
        axis[rank] = norm
        out[("orthogonal", norm)] = hvd.allreduce(axis, op=hvd.Adasum, name=f"orth.{norm}").tolist()
        out[("float32", norm)] = hvd.allreduce(same.float(), op=hvd.Adasum, name=f"f32.{norm}").tolist()
    hvd.shutdown()
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_adasum_of_tiny_gradients_is_not_a_plain_sum(size):
    # Norms of 1e-6 and 1e-30 are small but not zero: Horovod combines them like any other
    # (before, a squared norm below 1e-8 counted as zero and the result was size x too large).
    for out in run_ranks(size, __name__, "_tiny_norms", timeout=120):
        for norm in (1e-6, 1e-30):
            want = [0.6 * norm, -0.8 * norm]
            assert out[("same", norm)] == pytest.approx(want, rel=1e-12), (norm, out)
            assert out[("float32", norm)] == pytest.approx(want, rel=1e-6), (norm, out)
            assert out[("orthogonal", norm)] == pytest.approx([norm] * size, rel=1e-12), (norm, out)
