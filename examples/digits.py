"""Data-parallel training of a small MLP on scikit-learn's bundled digits data set.

    python examples/digits.py                       # one process
    hvdliterun -np 2 python examples/digits.py      # two ranks
    hvdliterun -np 2 python examples/digits.py --powersgd-rank 2   # low-rank gradients
    python -m hvdlite.runner.launch -np 2 python examples/digits.py   # the same

The 1,797 8x8 images are split into train and test sets by a fixed seed. Every epoch the
training set is shuffled (the same permutation on every rank) and each rank takes its own
disjoint shard of it, so the ranks together see each example once per epoch. The learning
rate is scaled by the number of ranks, as the global batch is that many times larger. Rank 0
shows a progress bar; the last line is the test accuracy, counted over all ranks.
"""

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import hvdlite as hvd


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by the size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--powersgd-rank", type=int, default=0,
                        help="compress the weight gradients to this rank with PowerSGD (0: off)")
    return parser.parse_args(argv)


def load_data(seed):
    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images / 16.0, labels, test_size=0.25, random_state=seed, stratify=labels)

    def tensors(x, y):
        return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)

    return tensors(x_train, y_train), tensors(x_test, y_test)


def shard(n, epoch, seed):
    """This rank's indices for one epoch; every rank gets the same number (no rank waits)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    per_rank = n // hvd.size()
    return order[hvd.rank() * per_rank:(hvd.rank() + 1) * per_rank]


def progress(epoch, epochs, batch, batches, loss, done=False):
    width = 24
    filled = width * batch // batches
    bar = "#" * filled + "." * (width - filled)
    line = f"epoch {epoch + 1:3d}/{epochs} [{bar}] loss {loss:.4f}"
    if sys.stdout.isatty():
        print("\r" + line, end="\n" if done else "", flush=True)
    elif done:  # one line per epoch when the output is a file or a launcher's pipe
        print(line, flush=True)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    (x_train, y_train), (x_test, y_test) = load_data(args.seed)

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    compression = hvd.Compression.powersgd(rank=args.powersgd_rank) if args.powersgd_rank else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    start = time.monotonic()
    for epoch in range(args.epochs):
        model.train()
        mine = shard(len(x_train), epoch, args.seed)
        batches = (len(mine) + args.batch_size - 1) // args.batch_size
        total = 0.0
        for b in range(batches):
            idx = mine[b * args.batch_size:(b + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            total += loss.item()
            if hvd.rank() == 0:
                progress(epoch, args.epochs, b + 1, batches, total / (b + 1), done=b + 1 == batches)

    accuracy = evaluate(model, x_test, y_test, start)
    hvd.shutdown()
    return accuracy


def evaluate(model, x_test, y_test, start):
    """Test accuracy counted over all ranks (each scores its share); rank 0 prints it."""
    model.eval()
    part = torch.arange(hvd.rank(), len(x_test), hvd.size())
    with torch.no_grad():
        correct = (model(x_test[part]).argmax(1) == y_test[part]).sum()
    correct = hvd.allreduce(correct, op=hvd.Sum, name="test.correct").item()
    accuracy = 100.0 * correct / len(x_test)
    if hvd.rank() == 0:
        print(f"test accuracy: {accuracy:.2f}% ({correct}/{len(x_test)}) on {hvd.size()} rank(s) "
              f"in {time.monotonic() - start:.1f} s", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
