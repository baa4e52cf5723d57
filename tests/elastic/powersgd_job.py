"""An elastic job that trains a small MLP with DistributedOptimizer(compression=
Compression.powersgd(rank=2)), committing every step, so a reset lands in the middle of
PowerSGD's two dependent allreduces or between them.

Every step appends the same progress lines as elastic_job.py (the harness finds workers and
steps by them). At the end every rank writes $ELASTIC_OUT/final.<rank>.pt: its parameters,
the compressor's shared state (reduction counts and Qs, which every rank must hold alike) and
the size of the job that finished.
"""
import os
import sys
import time

import torch

import hvdlite as hvd

STEPS = int(os.environ.get("ELASTIC_STEPS", "40"))
STEP_SECONDS = float(os.environ.get("ELASTIC_STEP_SECONDS", "0.1"))
BATCH = 8


def data():
    """A fixed regression problem (the test builds the same one)."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(256, 16, generator=generator)
    return x, torch.tanh(x @ torch.randn(16, 8, generator=generator))


def model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def main():
    torch.set_num_threads(1)
    hvd.init()
    net = model()
    compression = hvd.Compression.powersgd(rank=2, warmup_steps=2, seed=11)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=net.named_parameters(), compression=compression)
    x, y = data()
    state = hvd.elastic.TorchState(model=net, optimizer=optimizer, step=0)
    out = os.environ["ELASTIC_OUT"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from progress import recorder
    note = recorder(out)

    @hvd.elastic.run
    def train(state):
        note(event="start", rank=hvd.rank(), size=hvd.size(), step=state.step)
        while state.step < STEPS:
            rows = (state.step * hvd.size() * BATCH + hvd.rank() * BATCH + torch.arange(BATCH)) % len(x)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
            optimizer.step()
            state.step += 1
            note(event="step", rank=hvd.rank(), size=hvd.size(), step=state.step)
            state.commit()
            time.sleep(STEP_SECONDS)

    train(state)
    torch.save({"params": [p.detach().clone() for p in net.parameters()], "shared": compression.shared_state(),
                "size": hvd.size(), "rank": hvd.rank()}, os.path.join(out, f"final.{hvd.rank()}.pt"))
    note(event="done", rank=hvd.rank(), size=hvd.size())
    hvd.shutdown()


if __name__ == "__main__":
    main()
