"""Training throughput of a small CNN on synthetic images, per rank and in total.

    python examples/synthetic_benchmark.py
    hvdliterun -np 2 python examples/synthetic_benchmark.py --batch-size 16

Each iteration runs --num-batches-per-iter training steps on random data (generated once, so
the measurement is compute plus gradient communication). After --num-warmup-batches untimed
steps, --num-iters iterations are timed; rank 0 prints images/sec per rank as mean +- 1.96
standard deviations, and the total over all ranks.
"""

import argparse
import timeit

import torch
import torch.nn.functional as F
from torch import nn

import hvdlite as hvd


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    return parser.parse_args(argv)


class SmallCNN(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Linear(128, num_classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def log(text):
    if hvd.rank() == 0:
        print(text, flush=True)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model = SmallCNN(args.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, args.num_classes, (args.batch_size,))

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    params = sum(p.numel() for p in model.parameters())
    log(f"model: SmallCNN ({params:,} parameters), batch size {args.batch_size} per rank, "
        f"{hvd.size()} rank(s), {'fp16' if args.fp16_allreduce else 'no'} gradient compression")
    log(f"running {args.num_warmup_batches} warmup steps...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        log(f"iter #{i}: {rate:.1f} img/sec per rank")
        rates.append(rate)

    rates = torch.tensor(rates)
    mean = rates.mean().item()
    spread = 1.96 * (rates.std().item() if len(rates) > 1 else 0.0)
    # Each rank measured itself; the total is the sum of the ranks' means.
    total = hvd.allreduce(torch.tensor(mean), op=hvd.Sum, name="benchmark.total").item()
    log(f"img/sec per rank: {mean:.1f} +- {spread:.1f}")
    log(f"total img/sec on {hvd.size()} rank(s): {total:.1f}")
    hvd.shutdown()
    return mean, total


if __name__ == "__main__":
    main()
