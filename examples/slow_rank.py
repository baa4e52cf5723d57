"""Seeing inside a job: a digits training run in which one rank is slow, or stuck.

    hvdliterun -np 3 python examples/slow_rank.py --slow-rank 2 --sleep 0.05
    hvdliterun -np 3 --metrics-port 9100 python examples/slow_rank.py --stuck-rank 1 --at-step 20

With --slow-rank R, rank R sleeps --sleep seconds before each backward pass, as a rank with a
slower GPU, a noisy neighbour or a slow data loader would; at the end rank 0 prints
``hvd.straggler_report()``, which names it. With --stuck-rank R, rank R stops at step --at-step
(a ``time.sleep`` standing in for a hang in user code) while the others wait in their next
allreduce: ``hvdliterun --dump`` from another shell, or the stall warning after
HVDLITE_STALL_CHECK_TIME_SECONDS, prints a report naming the tensor, the missing rank and the
line where it is. The data is scikit-learn's bundled digits, split between the ranks.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import hvdlite as hvd


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--slow-rank", type=int, default=None)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--stuck-rank", type=int, default=None)
    parser.add_argument("--at-step", type=int, default=20)
    parser.add_argument("--stuck-for", type=float, default=3600.0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    hvd.init()
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)[hvd.rank()::hvd.size()] / 16.0
    y = torch.tensor(digits.target)[hvd.rank()::hvd.size()]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(args.steps):
        batch = slice((step * 32) % len(x), (step * 32) % len(x) + 32)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[batch]), y[batch])
        if hvd.rank() == args.slow_rank:
            time.sleep(args.sleep)
        if hvd.rank() == args.stuck_rank and step == args.at_step:
            time.sleep(args.stuck_for)  # the stuck rank is here
        loss.backward()
        opt.step()
    accuracy = hvd.allreduce((model(x).argmax(1) == y).float().mean(), name="accuracy")
    report = hvd.straggler_report()
    if hvd.rank() == 0:
        print(f"training accuracy {accuracy.item():.3f}")
        for rank, f in report.items():
            print(f"rank {rank}: last in {f['last_fraction']:.0%} of {f['rounds']} rounds, lag median "
                  f"{f['lag_median_s'] * 1e3:.1f} ms, p95 {f['lag_p95_s'] * 1e3:.1f} ms"
                  f"{'  <- straggler' if f['flagged'] else ''}")


if __name__ == "__main__":
    main()
