"""A job for the multi-host tests: collectives and a training step, checked on every rank
against references computed here from every rank's known inputs. Prints one CHECKED line."""
import os
import socket
import sys
import time

import torch

import hvdlite as hvd


def main():
    steps = int(os.environ.get("JOB_STEPS", "3"))
    pause = float(os.environ.get("JOB_STEP_PAUSE", "0"))
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    print(f"STARTED rank {rank} on {socket.gethostname()}", flush=True)
    # the place by the one rule, and what a Horovod script reads from the environment
    horovod_env = ",".join(os.environ.get(f"HOROVOD_{k}", "-") for k in (
        "RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME"))
    print(f"PLACE rank {rank} local {hvd.local_rank()}/{hvd.local_size()} cross {hvd.cross_rank()}/"
          f"{hvd.cross_size()} env {horovod_env}", flush=True)
    torch.manual_seed(0)
    # allreduce (sum and average), broadcast, allgather with different rows per rank
    x = torch.arange(6, dtype=torch.float32) + rank
    want = sum(torch.arange(6, dtype=torch.float32) + r for r in range(size))
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum, name="sum"), want)
    assert torch.allclose(hvd.allreduce(x, name="avg"), want / size)
    b = hvd.broadcast(torch.full((3,), float(rank)), root_rank=size - 1, name="bcast")
    assert torch.equal(b, torch.full((3,), float(size - 1)))
    g = hvd.allgather(torch.full((rank + 1, 2), float(rank)), name="gather")
    assert torch.equal(g, torch.cat([torch.full((r + 1, 2), float(r)) for r in range(size)]))
    big = torch.full((5 << 20,), float(rank + 1))  # 20 MiB: striped over the CPU channels
    assert torch.equal(hvd.allreduce(big, op=hvd.Sum, name="big"), torch.full((5 << 20,), float(sum(range(1, size + 1)))))
    # a DistributedOptimizer step: the averaged gradient of a linear model, known in closed form
    model = torch.nn.Linear(4, 1, bias=False)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    try:
        _train(model, opt, rank, size, steps, pause)
    except hvd.HvdliteError as exc:
        print(f"FAILED rank {rank} at {time.time():.3f}: {type(exc).__name__}: {exc} ranks={exc.ranks}",
              flush=True)
        return 1
    print(f"CHECKED rank {rank} of {size} on {socket.gethostname()} ifname={os.environ.get('GLOO_SOCKET_IFNAME')} "
          f"mark={os.environ.get('JOB_MARK')} homogeneous={hvd.is_homogeneous()}", flush=True)
    hvd.shutdown()


def _train(model, opt, rank, size, steps, pause):
    for step in range(steps):
        w0 = model.weight.detach().clone()
        inputs = [torch.full((2, 4), float(r + step + 1)) for r in range(size)]
        opt.zero_grad()
        model(inputs[rank]).sum().backward()
        opt.step()
        grad = sum(inp.sum(0) for inp in inputs) / size  # d/dw of sum(x @ w) is sum of rows
        assert torch.allclose(model.weight.detach(), w0 - 0.1 * grad.unsqueeze(0), atol=1e-5), step
        if step == 0:
            print(f"TRAINING rank {rank}", flush=True)
        if pause:
            time.sleep(pause)


if __name__ == "__main__":
    sys.exit(main())
