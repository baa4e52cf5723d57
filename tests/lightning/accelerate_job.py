"""A Hugging Face Accelerate training loop on the torch.distributed backend "hvdlite", started
by hvdliterun; writes each rank's final parameters to OUT/accelerate.rank<r>.pt. reference()
is one process on the combined batch.

On CPU, Accelerate replaces any backend but "mpi" with "gloo" (InitProcessGroupKwargs(backend=
"hvdlite") raises "not available"), so the script creates the default process group itself
before the Accelerator, which then uses it as it is."""
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import hvdlite  # noqa: E402,F401  (registers the torch.distributed backend)
from tests.lightning.fit_job import FEATURES, PER_RANK, SAMPLES, dataset, model  # noqa: E402


def reference(size, steps=SAMPLES // PER_RANK):
    """Accelerate hands process r the r-th of every `size` consecutive batches."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    x, y = dataset().tensors
    per_step = PER_RANK * size
    for step in range(steps // size):
        xs, ys = x[step * per_step:(step + 1) * per_step], y[step * per_step:(step + 1) * per_step]
        opt.zero_grad()
        losses = [torch.nn.functional.mse_loss(net(xs[r * PER_RANK:(r + 1) * PER_RANK]),
                                               ys[r * PER_RANK:(r + 1) * PER_RANK]) for r in range(size)]
        (sum(losses) / size).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def main():
    import torch.distributed as dist
    from accelerate import Accelerator
    torch.set_num_threads(1)
    dist.init_process_group("hvdlite", init_method="hvdlite://")
    accelerator = Accelerator(cpu=True)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=PER_RANK, shuffle=False)
    net, opt, loader = accelerator.prepare(net, opt, loader)
    for x, y in loader:
        opt.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(net(x), y))
        opt.step()
    torch.save({"params": [p.detach() for p in accelerator.unwrap_model(net).parameters()],
                "backend": dist.get_backend(), "rank": accelerator.process_index,
                "size": accelerator.num_processes, "features": FEATURES},
               os.path.join(sys.argv[1], f"accelerate.rank{accelerator.process_index}.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
