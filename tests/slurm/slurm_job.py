"""One rank of a job started by SLURM (srun) or by hvdliterun inside an allocation: hvd.init()
with no MASTER_ADDR, an allreduce and three DistributedOptimizer steps; each rank writes what
it saw to OUT/<tag>.rank<r>.json."""
import json
import os
import sys

import torch

import hvdlite as hvd
from hvdlite._runtime import state as _state

out, tag = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
hvd.init()
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="sum").item()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for step in range(3):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + hvd.rank()))
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
    optimizer.step()
with open(os.path.join(out, f"{tag}.rank{hvd.rank()}.json"), "w") as f:
    json.dump({"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
               "local_size": hvd.local_size(), "sum": total, "source": _state.current().topology.source,
               "weights": model.weight.detach().flatten().tolist()}, f)
hvd.shutdown()
