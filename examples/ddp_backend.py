"""A plain DistributedDataParallel training script on scikit-learn's digits, run on hvdlite's
engine by one word: the backend name given to init_process_group.

    hvdliterun -np 2 python examples/ddp_backend.py                    # backend "hvdlite"
    torchrun --nproc-per-node 2 examples/ddp_backend.py                # the same under torchrun
    hvdliterun -np 2 python examples/ddp_backend.py --backend gloo     # Gloo, to compare

Everything below is ordinary torch.distributed code (a DistributedSampler, DDP, the
launcher's RANK / WORLD_SIZE / MASTER_ADDR variables); `import hvdlite` registers the backend.
The last line is the test accuracy, counted over all ranks with dist.all_reduce.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hvdlite  # noqa: F401  (registers the torch.distributed backend "hvdlite")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="hvdlite")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by the world size")
    args = parser.parse_args()

    dist.init_process_group(args.backend)  # env://: the launcher's RANK, WORLD_SIZE, MASTER_*
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()

    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(images / 16.0, labels, test_size=0.25,
                                                        random_state=0, stratify=labels)
    train = TensorDataset(torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train))
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)

    start = time.monotonic()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = 0.0
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item()
        if rank == 0 and (epoch + 1) % 10 == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {total / len(loader):.4f}", flush=True)

    model.eval()
    x_test, y_test = torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test)
    part = torch.arange(rank, len(x_test), size)
    with torch.no_grad():
        correct = (model(x_test[part]).argmax(1) == y_test[part]).sum()
    dist.all_reduce(correct)
    if rank == 0:
        print(f"test accuracy: {100.0 * correct.item() / len(x_test):.2f}% ({correct.item()}/{len(x_test)}) "
              f"on {size} rank(s) over {dist.get_backend()} in {time.monotonic() - start:.1f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
