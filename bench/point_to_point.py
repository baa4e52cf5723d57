"""Point-to-point on the hvdlite backend against a Gloo group, side by side in one job.

    hvdliterun -np 2 python bench/point_to_point.py [--rounds 7] [--batch-size 64]

The default process group is init_process_group("hvdlite"); a second group uses Gloo. Timed
interleaved round by round, medians over the rounds, ratios hvdlite / Gloo (lower is better):
  - a 4-byte ping-pong (send then recv, one way: half a round trip);
  - a 16 MB send and recv (one way);
  - a Schedule1F1B step of bench/training.py's MLP (1024-4096-4096-1024), cut after its second
    layer (stage 0: two layers, stage 1: the last; 4096 floats per row between them), a batch
    of --batch-size rows in 8 micro-batches, each group's schedule built over the same weights.
The floor: a ping-pong of one word through a shared-memory segment between the two processes
(ShmChannel.ping_pong_floor, spinning on both sides), measured in the same rounds, in one
native loop and with one call from Python per round trip (what any transport called from
Python pays at least).
Targets: 4 bytes at most 3x that floor, 16 MB at 3x Gloo's bandwidth, the 1F1B step at most
0.7x Gloo's. HVDLITE_SHM_POINT_TO_POINT=0 measures the Gloo path of the hvdlite backend
(Note [Point-to-point messages] in csrc/point_to_point.h) instead of the segment's mailboxes.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import hvdlite  # noqa: F401  (registers the backend)
import _common  # bench/_common.py: the MLP of bench/training.py
from hvdlite._runtime.native import _core


def ping_pong(group, tensor, n):
    rank, into = dist.get_rank(), torch.empty_like(tensor)
    start = time.perf_counter()
    for _ in range(n):
        if rank == 0:
            dist.send(tensor, 1, group=group)
            dist.recv(into, 1, group=group)
        else:
            dist.recv(into, 0, group=group)
            dist.send(tensor, 0, group=group)
    return (time.perf_counter() - start) / n / 2


def pipeline(group, batch, rank):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    torch.manual_seed(0)
    layers = list(_common.MLP().net)
    part = nn.Sequential(*(layers[:4] if rank == 0 else layers[4:]))
    stage = PipelineStage(part, rank, 2, torch.device("cpu"), group=group)
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=nn.MSELoss())
    x, y = torch.randn(batch, 1024), torch.randn(batch, 1024)

    def step():
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
    return step


def post_cost(rank, n=200):
    """What one dist.isend call costs its caller (the call only posts: the median over `n`
    calls, each waited for after it was timed): the part of a message's time spent in torch's
    Python and c10d layers and in posting, whatever the transport does after."""
    tensor, into, took = torch.ones(1), torch.empty(1), []
    for _ in range(n):
        if rank == 0:
            start = time.perf_counter()
            work = dist.isend(tensor, 1)
            took.append(time.perf_counter() - start)
            work.wait()
        else:
            dist.recv(into, 0)
    return statistics.median(took) * 1e6 if took else 0.0


def floor_channel(rank):
    """A segment of its own between the two ranks, for the floor (the group's own is private)."""
    import os
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        name = f"/hvdlite.bench.{os.getpid()}"
        assert not _core.ShmChannel.create(name, 2)
        store.set("bench/floor", name)
    name = store.get("bench/floor").decode()
    store.set(f"bench/floor/pid{rank}", str(os.getpid()))
    pids = [int(store.get(f"bench/floor/pid{r}")) for r in range(2)]
    channel = _core.ShmChannel(name, rank, 2, [0, 1], pids, 60.0)
    dist.barrier()
    if rank == 0:
        _core.ShmChannel.unlink(name)
    return channel


def timed(step, n):
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=64, help="rows per step (8 micro-batches)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("hvdlite")
    rank = dist.get_rank()
    assert dist.get_world_size() == 2, "run with hvdliterun -np 2"
    gloo = dist.new_group(backend="gloo")
    groups = {"hvdlite": None, "gloo": gloo}
    small, large = torch.ones(1), torch.ones(4 << 20)
    steps = {name: pipeline(group, args.batch_size, rank) for name, group in groups.items()}
    channel = floor_channel(rank)
    path = _core.point_to_point_path(dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")))
    floor = []
    for name in groups:  # warm up: connections, the schedules' shape exchange
        ping_pong(groups[name], small, 20)
        ping_pong(groups[name], large, 2)
        steps[name]()
    results = {(what, name): [] for what in ("4 B one way (us)", "16 MB one way (ms)", "1F1B step (ms)")
               for name in groups}
    called = []  # the floor as a Python caller reaches it: one native call per round trip
    posting = []
    for _ in range(args.rounds):
        floor.append(channel.ping_pong_floor(20000) * 1e6)
        start = time.perf_counter()
        for _ in range(2000):
            channel.ping_pong_floor(1)
        called.append((time.perf_counter() - start) / 2000 / 2 * 1e6)
        posting.append(post_cost(rank))
        for name, group in groups.items():
            results[("4 B one way (us)", name)].append(ping_pong(group, small, 200) * 1e6)
            results[("16 MB one way (ms)", name)].append(ping_pong(group, large, 5) * 1e3)
            results[("1F1B step (ms)", name)].append(timed(steps[name], 3) * 1e3)
    if rank == 0:
        print(f"hvdlite's point-to-point path: {path}")
        small_floor = statistics.median(floor)
        ours = statistics.median(results[("4 B one way (us)", "hvdlite")])
        print(f"shared-memory floor, one way: {small_floor:.2f} us; hvdlite's 4 B is {ours / small_floor:.1f}x it")
        called_floor = statistics.median(called)
        print(f"the same, one native call from Python per round trip: {called_floor:.2f} us; "
              f"hvdlite's 4 B is {ours / called_floor:.1f}x it")
        print(f"one dist.isend that only posts (hvdlite): {statistics.median(posting):.2f} us")
        print(f"{'':22} {'hvdlite':>10} {'gloo':>10} {'ratio':>7}")
        for what in ("4 B one way (us)", "16 MB one way (ms)", "1F1B step (ms)"):
            ours = statistics.median(results[(what, "hvdlite")])
            theirs = statistics.median(results[(what, "gloo")])
            print(f"{what:22} {ours:10.1f} {theirs:10.1f} {ours / theirs:6.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
