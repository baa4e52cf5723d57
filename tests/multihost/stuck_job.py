"""A job across hosts in which rank 1 sits in time.sleep while the others wait on an allreduce
(tests/multihost/test_multihost.py: the flight recorder's report across hosts)."""
import os
import time

import torch

import hvdlite as hvd

hvd.init()
r = hvd.rank()
for step in range(3):
    assert hvd.allreduce(torch.ones(4), name=f"warm{step}", op=hvd.Sum).tolist() == [float(hvd.size())] * 4
if r == 1:
    time.sleep(float(os.environ.get("SLEEP", "6")))  # rank 1 is stuck here
out = hvd.allreduce(torch.full((10,), float(r)), name="never.matched", op=hvd.Sum)
assert out.tolist() == [float(sum(range(hvd.size())))] * 10, out
print(f"FINISHED rank {r} on {os.uname().nodename}", flush=True)
