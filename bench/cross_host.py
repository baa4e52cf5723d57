"""The rank program of the cross-host benchmark (bench/multihost.py starts it on test hosts).

    hvdliterun -H hvta:1,hvtb:1 python bench/cross_host.py [--rounds 5] [--json FILE]

ResNet-50's gradient shapes allreduced across hosts, in one job: the flat bound (copy, one
torch.distributed allreduce, copy), torch.distributed async per tensor, hvdlite grouped, and
hvdlite grouped with fp16 compression (half the bytes on the wire; its result is checked
against the fp32 sum with fp16's tolerance). Every method's result is checked before timing.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import collectives  # noqa: E402
import hvdlite as hvd  # noqa: E402

FLAT = "tight bound (cat, 1 allreduce, foreach copy)"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rank, size = _common.setup()
    shapes = _common.resnet50_shapes()
    tensors = [torch.zeros(s) for s in shapes]
    all_methods = collectives.methods_for(tensors, rank, size)
    methods = {name: all_methods[name] for name in
               (FLAT, "torch.distributed async per tensor", "hvdlite grouped")}
    collectives.check(methods, shapes, rank, size, tensors)

    def hvd_grouped_fp16():
        out = hvd.grouped_allreduce(tensors, name="fp16", op=hvd.Sum, compression=hvd.Compression.fp16)
        for t, o in zip(tensors, out):
            t.copy_(o)

    for i, t in enumerate(tensors):
        t.fill_(float((rank + 1) * (i % 7 + 1)) / 7)
    hvd_grouped_fp16()
    want = sum(range(1, size + 1))
    for i, t in enumerate(tensors):
        assert torch.allclose(t, torch.full_like(t, want * (i % 7 + 1) / 7), rtol=1e-3), i
    methods["hvdlite grouped, fp16 compression"] = hvd_grouped_fp16
    times = _common.interleaved(methods, args.rounds, warmup=1)
    mode = "hierarchical" if os.environ.get("HVDLITE_HIERARCHICAL_ALLREDUCE") == "1" else "flat"
    _common.report(f"ResNet-50 gradients, {size} ranks on {hvd.cross_size()} hosts, hvdlite {mode} "
                   f"({os.environ.get('BENCH_LINK', 'unshaped')})",
                   times, FLAT, {"hvdlite grouped": 1.10}, args.json)
    hvd.shutdown()


if __name__ == "__main__":
    main()
