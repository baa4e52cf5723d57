"""DDP over the hvdlite backend against DDP over Gloo, and dist.all_reduce on the backend
against hvd.allreduce, side by side in one job.

    hvdliterun -np 2 python bench/ddp_backend.py [--rounds 8] [--steps-per-round 3]
        [--batch-size 64] [--models mlp,cnn] [--json bench/results/ddp_backend.json]

The default process group is init_process_group("hvdlite"); a second group uses Gloo. The same
model (from _common: the 25 M-parameter MLP and SmallCNN), built from the same weights, is
wrapped in DDP twice, once per group, with DDP's default settings, and both train on the same
data. First every rank checks that the two replicas' parameters agree exactly after a few
steps. Then these are timed interleaved round by round (one round = --steps-per-round steps of
each): the two; DDP with a comm hook that communicates nothing (DDP's own copies of every
gradient into its buckets and back, the floor no backend can beat under DDP; it still
broadcasts buffers, as DDP does); and the same step in one process without DDP. The table shows
the medians per step and the ratio to DDP over Gloo (target: <= 0.80). Then the same for FSDP2
(fully_shard on each layer and the model, over a device mesh of the hvdlite group and one of
the Gloo group; target <= 0.80). Last, one 64 MB float32 allreduce: dist.all_reduce on the
hvdlite group (in place, no copy), hvd.allreduce_ (target: within 1.1x of it) and
dist.all_reduce on the Gloo group.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import hvdlite as hvd  # noqa: E402

GLOO = "DDP over Gloo"
OURS = "DDP over hvdlite"
LOCAL = "local step, no communication"
NO_OP = "DDP, a no-op comm hook"
TARGETS = {OURS: 0.80}


def _no_op_hook(state, bucket):
    """A comm hook that communicates nothing: DDP's own cost (copying every gradient into its
    bucket and back), which DDP pays over any backend."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def parse_args(argv=None):
    parser = _common.step_parser(__doc__, rounds=8)
    parser.add_argument("--fsdp-models", default="mlp", help="models for the FSDP2 comparison ('' for none)")
    parser.add_argument("--allreduce-mb", type=float, default=64.0)
    return parser.parse_args(argv)


FSDP_GLOO = "FSDP2 over Gloo"
FSDP_OURS = "FSDP2 over hvdlite"


def fsdp_step(name, args, rank, gloo):
    """FSDP2 over each backend, same weights and data: checked equal, then timed interleaved."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    build, x, y, loss_fn = _common.model_and_batch(name, args.batch_size, rank)
    torch.manual_seed(0)
    base = build()
    replicas = {}
    for method, group in ((FSDP_GLOO, gloo), (FSDP_OURS, dist.group.WORLD)):
        mesh = DeviceMesh.from_group(group, "cpu")
        model = copy.deepcopy(base)
        for layer in model.modules():
            if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        replicas[method] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))

    _race(f"FSDP2 training step, {name}", replicas, (FSDP_GLOO, FSDP_OURS), lambda p: p.to_local(),
          (x, y, loss_fn), args, {FSDP_OURS: 0.80}, rank)


def _race(title, replicas, pair, local, batch, args, targets, rank):
    """Two steps of each of `pair`, whose parameters (`local` of each) must then agree exactly;
    then every replica's step timed interleaved and reported against pair[0]."""
    x, y, loss_fn = batch

    def step(method, n=1):
        model, opt = replicas[method]
        for _ in range(n):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

    for method in pair:
        step(method, 2)
    if not all(torch.equal(local(a), local(b)) for a, b in zip(replicas[pair[0]][0].parameters(),
                                                               replicas[pair[1]][0].parameters())):
        raise SystemExit(f"rank {rank}: {pair[1]} and {pair[0]} disagree ({title})")
    times = _common.interleaved({m: (lambda m=m: step(m, args.steps_per_round)) for m in replicas}, args.rounds)
    times = {m: [t / args.steps_per_round for t in v] for m, v in times.items()}
    _common.report(title, times, pair[0], targets, args.json)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    dist.init_process_group("hvdlite", rank=hvd.rank(), world_size=hvd.size())
    gloo = dist.new_group(backend="gloo")
    rank = hvd.rank()
    for name in filter(None, args.models.split(",")):
        build, x, y, loss_fn = _common.model_and_batch(name, args.batch_size, rank)
        torch.manual_seed(0)
        base = build()
        replicas = {}
        for method, group in ((GLOO, gloo), (OURS, None)):
            model = DistributedDataParallel(copy.deepcopy(base), process_group=group)
            replicas[method] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        no_op = DistributedDataParallel(copy.deepcopy(base), process_group=gloo)
        no_op.register_comm_hook(None, _no_op_hook)
        replicas[NO_OP] = (no_op, torch.optim.SGD(no_op.parameters(), lr=0.01, momentum=0.9))
        local = copy.deepcopy(base)
        replicas[LOCAL] = (local, torch.optim.SGD(local.parameters(), lr=0.01, momentum=0.9))

        _race(f"DDP training step, {name}", replicas, (GLOO, OURS), lambda p: p, (x, y, loss_fn), args,
              TARGETS, rank)

    for name in filter(None, args.fsdp_models.split(",")):
        fsdp_step(name, args, rank, gloo)

    numel = int(args.allreduce_mb * (1 << 20) / 4)
    tensors = {m: torch.ones(numel) for m in ("dist.all_reduce (hvdlite)", "hvd.allreduce_", "dist.all_reduce (gloo)")}
    methods = {
        "dist.all_reduce (hvdlite)": lambda: dist.all_reduce(tensors["dist.all_reduce (hvdlite)"]),
        "hvd.allreduce_": lambda: hvd.allreduce_(tensors["hvd.allreduce_"], op=hvd.Sum, name="bench.64mb"),
        "dist.all_reduce (gloo)": lambda: dist.all_reduce(tensors["dist.all_reduce (gloo)"], group=gloo),
    }
    times = _common.interleaved(methods, args.rounds)
    _common.report(f"allreduce of {args.allreduce_mb:g} MB", times, "hvd.allreduce_",
                   {"dist.all_reduce (hvdlite)": 1.10}, args.json)
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
