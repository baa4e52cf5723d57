"""Shared pieces of the benchmarks: model shapes, timing, result tables.

Every benchmark runs under `hvdliterun -np N`, initializes hvdlite *and* a plain
torch.distributed Gloo group (from the MASTER_ADDR/MASTER_PORT the launcher exports), checks
each method's result first, then times the methods interleaved round by round, so a noisy
neighbour slows all of them alike. Reported: the median of each method, and ratios.
"""

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import hvdlite as hvd


def setup():
    torch.set_num_threads(1)
    hvd.init()
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=hvd.rank(), world_size=hvd.size())
    return hvd.rank(), hvd.size()


def resnet50_shapes():
    """The 161 parameter (= gradient) shapes of torchvision's ResNet-50, in definition order."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            out = width * 4
            shapes += [(width, in_ch, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (out, width, 1, 1), (out,), (out,)]
            if block == 0:
                shapes += [(out, in_ch, 1, 1), (out,), (out,)]
            in_ch = out
    shapes += [(1000, 2048), (1000,)]
    return shapes


class MLP(torch.nn.Module):
    """1024-4096-4096-1024: 25 M parameters."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
            torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
            torch.nn.Linear(4096, 1024))

    def forward(self, x):
        return self.net(x)


class SmallCNN(torch.nn.Module):
    """8 convolutions with BatchNorm: about 1.2 M parameters, for 32x32 inputs."""

    def __init__(self):
        super().__init__()
        layers, ch = [], 3
        for out in (32, 32, 64, 64, 128, 128, 256, 256):
            layers += [torch.nn.Conv2d(ch, out, 3, padding=1, bias=False), torch.nn.BatchNorm2d(out),
                       torch.nn.ReLU()]
            if out != ch and out in (64, 128, 256):
                layers.append(torch.nn.MaxPool2d(2))
            ch = out
        self.features = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(256, 10)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def step_parser(doc, rounds):
    """The options of a training-step benchmark: --rounds, --steps-per-round, --batch-size,
    --models, --json."""
    import argparse
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--json", default=None)
    return parser


def model_and_batch(name, batch, rank):
    """("mlp" or "cnn") -> (model class, input, target, loss function): this rank's batch."""
    import torch.nn.functional as F
    gen = torch.Generator().manual_seed(1000 + rank)
    if name == "mlp":
        return MLP, torch.randn(batch, 1024, generator=gen), torch.randn(batch, 1024, generator=gen), F.mse_loss
    return (SmallCNN, torch.randn(batch, 3, 32, 32, generator=gen),
            torch.randint(0, 10, (batch,), generator=gen), F.cross_entropy)


def timed(fn, start_line=None):
    """Seconds for fn(), started after `start_line` (default: the Gloo barrier).

    What fn returns is dropped after the clock stops: freeing a result (102 MB of new tensors
    unmapped, for an out-of-place grouped allreduce of ResNet-50's gradients) is the caller's
    cost when it lets go of them, not the call's."""
    (start_line or barrier)()
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def barrier():
    dist.barrier()


def interleaved(methods, rounds, warmup=2, start=None):
    """{name: fn} -> {name: [seconds per round]}, each round running every method once.

    `start`: the barrier each timed call starts from (default: the Gloo barrier)."""
    for _ in range(warmup):
        for fn in methods.values():
            timed(fn, start)
    times = {name: [] for name in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            times[name].append(timed(fn, start))
    # every rank reports the slowest rank's time for each round
    for name in times:
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[name] = t.tolist()
    return times


def median(values):
    return statistics.median(values)


def report(title, times, baseline, targets, out_path):
    """Prints a table of medians and ratios to `baseline`; writes JSON. Returns the ratios."""
    base = median(times[baseline])
    rows, ratios = [], {}
    for name, values in times.items():
        med = median(values)
        ratios[name] = med / base
        target = targets.get(name)
        verdict = "" if target is None else ("meets" if ratios[name] <= target else "MISSES") + f" <= {target}x"
        rows.append((name, med * 1e3, ratios[name], verdict))
    if hvd.rank() == 0:
        print(f"\n{title}  (median of {len(times[baseline])} interleaved rounds, {hvd.size()} ranks)")
        print(f"  {'method':<34}{'median ms':>12}  {'x ' + baseline:>{max(24, len(baseline) + 2)}}  target")
        for name, ms, ratio, verdict in rows:
            print(f"  {name:<34}{ms:>12.3f}  {ratio:>{max(24, len(baseline) + 2)}.3f}  {verdict}")
        if out_path:
            existing = {}
            if os.path.exists(out_path):
                with open(out_path) as f:
                    existing = json.load(f)
            existing[title] = {"baseline": baseline, "ranks": hvd.size(),
                               "median_ms": {n: median(v) * 1e3 for n, v in times.items()},
                               "ratio": ratios, "targets": targets}
            with open(out_path, "w") as f:
                json.dump(existing, f, indent=2)
    return ratios
