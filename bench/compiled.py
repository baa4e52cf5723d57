"""The training step of a torch.compile'd model: hvdlite's DistributedOptimizer against DDP,
both compiled, in one job.

    hvdliterun -np 2 python bench/compiled.py [--rounds 6] [--steps-per-round 3]
        [--batch-size 64] [--models mlp,cnn] [--json bench/results/compiled.json]

The models of _common (the 25 M-parameter MLP, SmallCNN), built from the same weights, each
compiled with torch.compile (inductor, CPU):

- DDP compiled: torch.compile(DistributedDataParallel(model)) over the Gloo default group,
  default settings; dynamo splits its graph into DDP's buckets;
- hvdlite compiled: torch.compile(model) and hvdlite.DistributedOptimizer, whose compiled
  backward dynamo splits the same way (Note [Compiled backward in buckets] in
  hvdlite/_runtime/compiled_backward.py); target <= 1.00x DDP compiled;
- hvdlite compiled, one graph: the same with torch._dynamo.config.optimize_ddp = False while it
  compiles, so its backward is one node and no reduction starts before it ends;
- local compiled step, no communication: the floor (one graph too).

First DDP and hvdlite train two steps from the same weights on the same data and every rank
checks that their parameters agree (1e-5: inductor's kernels are not the eager ones); then the
methods are timed interleaved round by round, and the table shows medians per step and ratios
to DDP compiled. Last, for each hvdlite variant, the median over a few steps of when (ms after
backward began) the first reduction was submitted and when backward ended: the overlap.
"""

import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import hvdlite as hvd  # noqa: E402

DDP = "DDP compiled"
OURS = "hvdlite compiled"
ONE_GRAPH = "hvdlite compiled, one graph"
LOCAL = "local compiled step, no communication"


def parse_args(argv=None):
    return _common.step_parser(__doc__, rounds=6).parse_args(argv)


class _Own(torch.nn.Module):
    """A model behind a forward of its own: dynamo caches compiled graphs per code object and
    reuses them across instances of one class, so without it the variants compiled without the
    split (one graph, local) would run the graph already split for the others."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)


def overlap(model, opt, x, y, loss_fn, steps=5):
    """Median ms, from backward's start, to the first reduction submitted and to backward's end."""
    marks = []
    handles = [p.register_post_accumulate_grad_hook(
        lambda p: marks.append(time.perf_counter()) if p in opt._pending else None) for p in model.parameters()]
    first, end = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        marks.clear()
        start = time.perf_counter()
        loss.backward()
        end.append((time.perf_counter() - start) * 1e3)
        first.append((min(marks) - start) * 1e3)
        opt.step()
    for handle in handles:
        handle.remove()
    return statistics.median(first), statistics.median(end)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    dist.init_process_group("gloo", init_method="hvdlite://")
    rank = hvd.rank()
    for name in filter(None, args.models.split(",")):
        build, x, y, loss_fn = _common.model_and_batch(name, args.batch_size, rank)
        torch.manual_seed(0)
        base = build()
        replicas = {}
        ddp = DistributedDataParallel(copy.deepcopy(base))
        replicas[DDP] = (torch.compile(ddp), torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9))
        for method in (OURS, ONE_GRAPH):
            model = copy.deepcopy(base)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                           named_parameters=model.named_parameters())
            replicas[method] = (torch.compile(model if method == OURS else _Own(model)), opt)
        local = copy.deepcopy(base)
        replicas[LOCAL] = (torch.compile(_Own(local)), torch.optim.SGD(local.parameters(), lr=0.01, momentum=0.9))

        def step(method, n=1):
            model, opt = replicas[method]
            for _ in range(n):
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()

        for method in replicas:  # compiles each; the one-graph and local ones without the split
            torch._dynamo.config.optimize_ddp = method not in (ONE_GRAPH, LOCAL)
            step(method, 2)
        torch._dynamo.config.optimize_ddp = True
        for method in (OURS, ONE_GRAPH):
            for a, b in zip(replicas[DDP][0].parameters(), replicas[method][0].parameters()):
                if not torch.allclose(a, b, rtol=0, atol=1e-5):
                    raise SystemExit(f"rank {rank}: {method} and {DDP} disagree on {name} by "
                                     f"{(a - b).abs().max().item():.3g}")
        times = _common.interleaved({m: (lambda m=m: step(m, args.steps_per_round)) for m in replicas}, args.rounds)
        times = {m: [t / args.steps_per_round for t in v] for m, v in times.items()}
        _common.report(f"compiled training step, {name}", times, DDP, {OURS: 1.00}, args.json)
        for method in (OURS, ONE_GRAPH):
            first, end = overlap(*replicas[method], x, y, loss_fn)
            if rank == 0:
                print(f"  {method}: first reduction submitted {first:.1f} ms into a {end:.1f} ms backward")
    hvd.shutdown()


if __name__ == "__main__":
    main()
