"""Elastic data-parallel training on scikit-learn's digits: ranks may die and hosts may come
and go while it trains.

    echo 127.0.0.1:2 > hosts.txt
    hvdliterun --host-discovery-script "cat hosts.txt" --min-np 1 python examples/elastic_digits.py
    # meanwhile: echo 127.0.0.2:2 >> hosts.txt   (two more ranks join)
    #            kill -9 <a rank's pid>           (the others carry on)

The model and data are examples/digits.py's. The training loop runs inside
``hvd.elastic.run``: on a failure every rank rolls back to the last ``state.commit()``, on a
change of hosts every rank keeps its state, and then the job re-forms, the learning rate is
rescaled for the new size by the reset callback, and rank 0's state is synced to every rank
(new ones included). The ElasticSampler makes sure no training example is lost or repeated
within an epoch. The last line is the test accuracy.
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import hvdlite as hvd

try:
    from digits import evaluate, load_data  # examples/ on the path (run as a script)
except ImportError:
    from examples.digits import evaluate, load_data


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by the size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit-every", type=int, default=5, help="batches between commits")
    parser.add_argument("--step-seconds", type=float, default=0.0,
                        help="extra time per step, standing in for a larger model")
    parser.add_argument("--step-log", help="append one JSON line per step to this file "
                                           "(bench/elastic_reset.py measures resets from it)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    train_set = torch.utils.data.TensorDataset(x_train, y_train)

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    log = open(args.step_log, "a", buffering=1) if args.step_log else None

    def rescale_lr():
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, batch=0)
    state.register_reset_callbacks([rescale_lr])

    @hvd.elastic.run
    def train(state):
        while state.epoch < args.epochs:
            model.train()
            state.sampler.set_epoch(state.epoch)  # a new shuffle; the same epoch keeps its progress
            for state.batch, (x, y) in enumerate(loader, start=state.batch):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                state.sampler.record_batch(state.batch, args.batch_size)
                if log:
                    log.write(json.dumps({"t": time.time(), "rank": hvd.rank(), "size": hvd.size(),
                                          "host": os.environ.get("HVDLITE_HOSTNAME"), "pid": os.getpid(),
                                          "epoch": state.epoch, "batch": state.batch}) + "\n")
                if args.step_seconds:
                    time.sleep(args.step_seconds)
                if state.batch % args.commit_every == 0:
                    state.commit()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch + 1:3d}/{args.epochs} on {hvd.size()} rank(s)", flush=True)
            state.epoch += 1
            state.batch = 0
            state.commit()

    start = time.monotonic()
    train(state)

    accuracy = evaluate(model, x_test, y_test, start)
    hvd.shutdown()
    return accuracy


if __name__ == "__main__":
    main()
