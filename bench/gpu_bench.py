"""GPU path: the fused allreduce of ResNet-50's gradient shapes against one raw NCCL allreduce
of the same bytes, on the GPUs of this machine.

    hvdliterun -np 1 python bench/gpu_bench.py      # one GPU: NCCL still runs the full path
    hvdliterun -np 8 python bench/gpu_bench.py      # one rank per GPU

Checks the result first, then reports medians and the fused / raw ratio.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import hvdlite as hvd  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench.py needs CUDA")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.cuda.set_device(hvd.local_rank())
    dev = torch.device("cuda", hvd.local_rank())
    dist.init_process_group("nccl", rank=rank, world_size=size, device_id=dev)
    tensors = [torch.full(s, float(rank + 1), device=dev) for s in _common.resnet50_shapes()]
    flat = torch.empty(sum(t.numel() for t in tensors), device=dev)
    want = float(sum(range(1, size + 1)))

    def fused():
        handles = [hvd.allreduce_async_(t, name=f"g{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
        for h in handles:
            hvd.synchronize(h)

    def raw():
        dist.all_reduce(flat)

    flat.fill_(rank + 1)
    raw()
    fused()
    torch.cuda.synchronize()
    assert all(bool((t == want).all()) for t in tensors) and bool((flat == want).all())
    times = {"raw NCCL allreduce of the same bytes": [], "hvdlite fused async per tensor": []}
    for _ in range(args.rounds):
        for name, fn in (("raw NCCL allreduce of the same bytes", raw), ("hvdlite fused async per tensor", fused)):
            for t in tensors:
                t.fill_(1.0)
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        base = statistics.median(times["raw NCCL allreduce of the same bytes"])
        print(f"ResNet-50 gradients on {size} GPU(s), median of {args.rounds} rounds")
        for name, values in times.items():
            print(f"  {name:<40}{statistics.median(values) * 1e3:10.3f} ms  {statistics.median(values) / base:6.2f}x")
    hvd.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
