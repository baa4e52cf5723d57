"""A Fabric loop on hvdlite's strategy (Fabric(strategy="hvdlite")), started by a launcher;
writes each rank's final parameters to OUT/<tag>.rank<r>.pt. reference() is one process on
the combined batch.

    python tests/lightning/fabric_job.py OUT TAG [--accumulate N] [--clip NORM] [--clip-value V]
    python tests/lightning/fabric_job.py OUT - --case TAG=OPTIONS [--case ...]

With --case, one Fabric runs the loop once per case, each from a fresh model and optimizer.
"""
import argparse
import os
import shlex
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from tests.lightning.fit_job import PER_RANK, SAMPLES, dataset, model, one_process, optimizer  # noqa: E402

EPOCHS = 2


def reference(size, accumulate=1, clip=None, clip_value=None):
    """Fabric's sampler does not shuffle a sequential loader: rank r takes every size-th sample,
    so step k's batches are rank r's samples k*PER_RANK*size + r, + r + size, ..."""
    per_step = PER_RANK * size
    steps = [[list(range(k * per_step + r, (k + 1) * per_step, size)) for r in range(size)]
             for k in range(SAMPLES // per_step)] * EPOCHS
    return one_process(steps, accumulate=accumulate, clip=clip, clip_value=clip_value)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("tag")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--clip-value", type=float, default=None)
    parser.add_argument("--case", action="append", default=[], metavar="TAG=OPTIONS")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from lightning.fabric import Fabric
    import hvdlite.lightning  # noqa: F401  (registers the strategy "hvdlite")
    fabric = Fabric(strategy="hvdlite", accelerator="cpu")
    fabric.launch()
    if not args.case:
        loop(fabric, args)
    for case in args.case:
        tag, _, options = case.partition("=")
        loop(fabric, parser.parse_args([args.out, tag, *shlex.split(options)]))


def loop(fabric, args):
    net = model()
    net, opt = fabric.setup(net, optimizer("sgd", net.parameters()))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset(), batch_size=PER_RANK, shuffle=False))
    for _ in range(EPOCHS):
        for i, (x, y) in enumerate(loader):
            accumulating = (i + 1) % args.accumulate != 0
            with fabric.no_backward_sync(net, enabled=accumulating):
                fabric.backward(torch.nn.functional.mse_loss(net(x), y) / args.accumulate)
            if not accumulating:
                if args.clip is not None:
                    fabric.clip_gradients(net, opt, max_norm=args.clip)
                if args.clip_value is not None:
                    fabric.clip_gradients(net, opt, clip_val=args.clip_value)
                opt.step()
                opt.zero_grad()
    mean = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="mean")
    torch.save({"params": [p.detach() for p in net.parameters()], "rank": fabric.global_rank,
                "size": fabric.world_size, "mean": mean.item()},
               os.path.join(args.out, f"{args.tag}.rank{fabric.global_rank}.pt"))


if __name__ == "__main__":
    main()
