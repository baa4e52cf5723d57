"""Gradient-sized collectives: hvdlite against plain torch.distributed, in one job.

    hvdliterun -np 2 python bench/collectives.py [--rounds 15] [--json bench/results/collectives.json]

Cases: ResNet-50's 161 gradient shapes (25.6 M floats), 200 tensors of 1024 floats, and a
4-byte allreduce. Methods: the tight bound (torch.cat into a preallocated buffer, one
allreduce, torch._foreach_copy_ back: the fastest plain torch can do; ratios are to it), the
striped bound (the same buffer over HVDLITE_CPU_CHANNELS Gloo groups at once), the older
loop-copy bound (tensor by tensor copies), torch.distributed per tensor (blocking, and async),
hvdlite async per tensor and grouped. Every method's result is checked before anything is
timed. The ResNet-50 case is reported twice from the same rounds: as ratios to the tight bound
(targets 1.0) and to the striped bound (targets 1.10). Targets: 200 x 1024 floats grouped 1.3,
async 1.5; 4-byte allreduce 1.3x torch.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import hvdlite as hvd  # noqa: E402


TIGHT = "tight bound (cat, 1 allreduce, foreach copy)"
STRIPED = "striped bound (cat, channels, foreach copy)"


def methods_for(tensors, rank, size):
    flat = torch.empty(sum(t.numel() for t in tensors))
    views = list(flat.split([t.numel() for t in tensors]))
    shaped = [v.view(t.shape) for v, t in zip(views, tensors)]
    stripes = _stripe_groups(rank, size)

    def tight_bound():
        # the fastest plain torch can do with these tensors: one cat into a preallocated
        # buffer, one allreduce, one foreach copy back
        torch.cat([t.view(-1) for t in tensors], out=flat)
        dist.all_reduce(flat)
        torch._foreach_copy_(tensors, shaped)

    def striped_bound():
        # the same buffer cut into as many stripes as hvdlite has CPU channels, each allreduced
        # on its own Gloo group at once (what hvdlite does for large buffers)
        torch.cat([t.view(-1) for t in tensors], out=flat)
        parts = flat.chunk(len(stripes))
        works = [group.allreduce([part]) for group, part in zip(stripes, parts)]
        for work in works:
            work.wait()
        torch._foreach_copy_(tensors, shaped)

    def flat_bound():
        offset = 0
        for t in tensors:
            flat[offset:offset + t.numel()].copy_(t.view(-1))
            offset += t.numel()
        dist.all_reduce(flat)
        offset = 0
        for t in tensors:
            t.view(-1).copy_(flat[offset:offset + t.numel()])
            offset += t.numel()

    def torch_per_tensor():
        for t in tensors:
            dist.all_reduce(t)

    def torch_async():
        for work in [dist.all_reduce(t, async_op=True) for t in tensors]:
            work.wait()

    def hvd_async():
        handles = [hvd.allreduce_async_(t, name=f"g{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
        for h in handles:
            hvd.synchronize(h)

    def hvd_grouped():
        hvd.grouped_allreduce_(tensors, name="grouped", op=hvd.Sum)

    return {TIGHT: tight_bound,
            STRIPED: striped_bound,
            "loop-copy bound (copy, 1 allreduce, copy)": flat_bound,
            "torch.distributed per tensor": torch_per_tensor,
            "torch.distributed async per tensor": torch_async,
            "hvdlite async per tensor": hvd_async,
            "hvdlite grouped": hvd_grouped}


def _stripe_groups(rank, size):
    """HVDLITE_CPU_CHANNELS (default 4) Gloo groups beside the default one, for the striped bound."""
    channels = int(os.environ.get("HVDLITE_CPU_CHANNELS", "4"))
    return [dist.new_group(backend="gloo") for _ in range(channels)]


def check(methods, shapes, rank, size, tensors):
    """Each method must turn every rank's (rank + 1) * i pattern into the sum over ranks."""
    for name, fn in methods.items():
        for i, t in enumerate(tensors):
            t.fill_(float((rank + 1) * (i % 7 + 1)))
        fn()
        want = sum(range(1, size + 1))
        for i, t in enumerate(tensors):
            if not bool((t == want * (i % 7 + 1)).all()):
                raise SystemExit(f"{name}: wrong result for tensor {i} on rank {rank}")


def run_case(title, shapes, rounds, targets, out, striped_targets=None):
    """Times every method; reports ratios to the tight bound, and with `striped_targets` the same
    times again as ratios to the striped bound."""
    rank, size = hvd.rank(), hvd.size()
    tensors = [torch.zeros(s) for s in shapes]
    methods = methods_for(tensors, rank, size)
    check(methods, shapes, rank, size, tensors)
    times = _common.interleaved(methods, rounds)
    _common.report(title, times, TIGHT, targets, out)
    if striped_targets:
        _common.report(title + ", against the striped bound", times, STRIPED, striped_targets, out)


def tiny_case(rounds, out):
    one = torch.zeros(1)

    def torch_tiny():
        dist.all_reduce(one)

    def hvd_tiny():
        hvd.allreduce_(one, name="tiny", op=hvd.Sum)

    for fn in (torch_tiny, hvd_tiny):
        one.fill_(1.0)
        fn()
        assert one.item() == hvd.size()
    # many calls per timed sample, so the timer's own cost does not dominate
    reps = 200
    methods = {"torch.distributed all_reduce": lambda: [torch_tiny() for _ in range(reps)],
               "hvdlite allreduce_": lambda: [hvd_tiny() for _ in range(reps)]}
    times = _common.interleaved(methods, rounds)
    times = {k: [t / reps for t in v] for k, v in times.items()}
    _common.report("4-byte allreduce (per call)", times, "torch.distributed all_reduce",
                          {"hvdlite allreduce_": 1.3}, out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", default=None, help="write results to this JSON file (rank 0)")
    args = parser.parse_args()
    _common.setup()
    if hvd.rank() == 0 and args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        if os.path.exists(args.json):
            os.remove(args.json)
    run_case("ResNet-50 gradients (161 tensors, 25.6 M floats)", _common.resnet50_shapes(),
             args.rounds, {"hvdlite async per tensor": 1.0, "hvdlite grouped": 1.0}, args.json,
             striped_targets={"hvdlite async per tensor": 1.10, "hvdlite grouped": 1.10})
    run_case("200 x 1024 floats", [(1024,)] * 200, args.rounds * 4,
             {"hvdlite async per tensor": 1.5, "hvdlite grouped": 1.3}, args.json)
    tiny_case(args.rounds, args.json)
    hvd.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
