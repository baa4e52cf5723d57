"""An hvdlite script under torchrun --max-restarts: state comes from its own checkpoint.

Trains a small linear model on fixed data for STEPS steps with DistributedOptimizer, saving a
checkpoint (rank 0) every step. In torchrun's first attempt, rank 1 dies at step CRASH_AT;
torchrun restarts every process, which load the checkpoint and carry on. At the end rank 0
writes the parameters and the steps each attempt took to $TORCHRUN_OUT/result.json.
"""
import json
import os

import torch

import hvdlite as hvd

STEPS, CRASH_AT = 12, 5
OUT = os.environ["TORCHRUN_OUT"]
CKPT = os.path.join(OUT, "checkpoint.pt")

torch.set_num_threads(1)
hvd.init()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
start = 0
if hvd.rank() == 0 and os.path.exists(CKPT):
    saved = torch.load(CKPT)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    start = saved["step"]
start = hvd.broadcast_object(start, 0)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
for step in range(start, STEPS):
    if attempt == 0 and step == CRASH_AT and hvd.rank() == 1:
        os._exit(7)
    g = torch.Generator().manual_seed(1000 * step + hvd.rank())
    x = torch.randn(8, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1},
                   CKPT + ".tmp")
        os.replace(CKPT + ".tmp", CKPT)
if hvd.rank() == 0:
    with open(os.path.join(OUT, "result.json"), "w") as f:
        json.dump({"weight": model.weight.detach().flatten().tolist(), "bias": model.bias.item(),
                   "attempt": attempt, "start": start, "size": hvd.size()}, f)
hvd.shutdown()
