"""One host against the machine's own limits: the staged memory floor and a shared-memory ping-pong.

    hvdliterun -np 2 python bench/one_host.py [--rounds 15] [--json bench/results/one_host.json]

The staged memory floor is what any allreduce that stages through shared memory must spend:
every rank, all at once, copies its B bytes into a staging area, reduces its 1/N share of all
N contributions (private buffers standing in for the other ranks'), and copies the whole
result out, with torch kernels and no synchronisation. Beside it, in the same job and
interleaved round by round: hvdlite's allreduce on the single-copy path (the default where the
kernel allows it, Note [Single-copy allreduce] in csrc/shm_channel.h), the same allreduce
with the path switched off (the staged path), and Gloo's. Every method's result is checked
before anything is timed. Every timed round starts at a spin barrier on a shared page (see
SharedPage), so no method pays for the ranks leaving the start line apart. Targets: 64 MB
<= 0.75x the floor, 16 MB <= 0.80x, 1 MB <= 1.10x.

The 4-byte case compares one allreduce with one round trip of a ping-pong through a shared
page between the two processes (a pure handoff that no allreduce can beat); target <= 10 us.
"""

import argparse
import mmap
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import hvdlite as hvd  # noqa: E402
from hvdlite import _core  # noqa: E402
from hvdlite._runtime import state  # noqa: E402

FLOOR = "staged memory floor"
SINGLE = "hvdlite (single copy)"
STAGED = "hvdlite (staged path)"
DEFAULT = "hvdlite (staged path, the default below the threshold)"
GLOO = "torch.distributed gloo"
TARGETS = {1: 1.10, 16: 0.80, 64: 0.75}
SINGLE_COPY_MIN = _core.ShmChannel.SINGLE_COPY_MIN_BYTES  # the engine's default threshold


def size_case(mb, rounds, out, rank, size, page):
    numel = mb * (1 << 20) // 4
    x = torch.full((numel,), float(rank + 1))
    staging = torch.empty(numel)
    others = [torch.full((numel,), float(r + 1)) for r in range(size) if r != rank]
    result = torch.empty(numel)
    share = (numel + size - 1) // size
    lo, hi = min(numel, rank * share), min(numel, (rank + 1) * share)
    engine = state.current().engine
    # the default path (single copy from SINGLE_COPY_MIN where allowed) and, where that is
    # single copy, the staged path beside it
    single = engine._set_single_copy_min(SINGLE_COPY_MIN) and numel * 4 >= SINGLE_COPY_MIN

    def floor():
        staging.copy_(x)
        torch.add(staging[lo:hi], others[0][lo:hi], out=result[lo:hi])
        for other in others[1:]:
            result[lo:hi].add_(other[lo:hi])
        x.copy_(result)  # the whole result out

    def hvd_default():
        engine._set_single_copy_min(SINGLE_COPY_MIN)
        hvd.allreduce_(x, op=hvd.Sum, name="bench")

    def hvd_staged():
        engine._set_single_copy_min(0)
        hvd.allreduce_(x, op=hvd.Sum, name="bench")

    def gloo():
        dist.all_reduce(x)

    methods = {FLOOR: floor, SINGLE if single else DEFAULT: hvd_default, GLOO: gloo}
    if single:
        methods[STAGED] = hvd_staged
    want = float(size * (size + 1) // 2)
    for name, fn in methods.items():
        if name == FLOOR:
            continue
        x.fill_(float(rank + 1))
        fn()
        assert torch.all(x == want), f"{name}: wrong result"

    # Sums grow the values by `size` per call: 2^51 at most over these rounds, far from overflow.
    times = _common.interleaved(methods, rounds, start=page.barrier)
    targets = {SINGLE if single else DEFAULT: TARGETS[mb]} if mb in TARGETS else {}
    return _common.report(f"allreduce of {mb} MB (float32) / {FLOOR}", times, FLOOR, targets, out)


class SharedPage:
    """One shared page between the ranks (all on this host).

    `round_trips(n)` (ranks 0 and 1) returns seconds per ping-pong round trip. `barrier()` is
    the start line of every timed round: each rank publishes a sequence number in its own cache
    line and spins until every rank's has caught up, so the ranks leave it within a cache-line
    transfer of each other. (Gloo's barrier released the two ranks a median 70 us apart here,
    p90 170 us: skew that a collective pays and the floor, which waits for nobody, does not.)
    """

    def __init__(self, rank, size):
        import numpy as np
        path = f"/dev/shm/hvdlite-bench-page-{os.environ.get('MASTER_PORT', 'x')}"
        if rank == 0:
            with open(path, "wb") as f:
                f.write(b"\0" * 4096)
        _common.barrier()
        self.file = open(path, "r+b")
        self.map = mmap.mmap(self.file.fileno(), 4096)
        _common.barrier()
        if rank == 0:
            os.unlink(path)
        self.words = np.frombuffer(self.map, dtype=np.int64, count=2)
        # barrier words: one 64-byte line per rank after the ping-pong's line
        self.lines = np.frombuffer(self.map, dtype=np.int64, count=8 * size, offset=64).reshape(size, 8)
        self.rank = rank
        self.seq = 0
        self.barrier_seq = 0

    def barrier(self):
        self.barrier_seq += 1
        seq, lines = self.barrier_seq, self.lines
        lines[self.rank, 0] = seq
        while lines[:, 0].min() < seq:
            pass

    def round_trips(self, n):
        words, start = self.words, time.perf_counter()
        for _ in range(n):
            self.seq += 1
            seq = self.seq
            if self.rank == 0:
                words[0] = seq
                while words[1] != seq:
                    pass
            elif self.rank == 1:
                while words[0] != seq:
                    pass
                words[1] = seq
        return (time.perf_counter() - start) / n


def tiny_case(rounds, out, rank, size, page, per_round=500):
    tiny = torch.ones(1)
    pong = page
    want = torch.full((1,), float(size))
    assert torch.equal(hvd.allreduce(tiny, op=hvd.Sum, name="tiny"), want)

    def hvd_tiny():
        for _ in range(per_round):
            hvd.allreduce(tiny, op=hvd.Sum, name="tiny")

    def ping():
        pong.round_trips(per_round)

    times = _common.interleaved({"shared-memory ping-pong round trip": ping, "hvdlite 4-byte allreduce": hvd_tiny},
                                rounds, start=page.barrier)
    times = {name: [t / per_round for t in values] for name, values in times.items()}
    ratios = _common.report("4-byte allreduce / ping-pong round trip", times, "shared-memory ping-pong round trip",
                            {}, out)
    median_us = _common.median(times["hvdlite 4-byte allreduce"]) * 1e6
    pong_us = _common.median(times["shared-memory ping-pong round trip"]) * 1e6
    if rank == 0:
        print(f"  4-byte allreduce median {median_us:.1f} us (target <= 10 us); ping-pong round trip {pong_us:.2f} us")
    return ratios


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sizes", default="1,16,64", help="MB, comma-separated")
    parser.add_argument("--json", default=None, help="write results to this JSON file (rank 0)")
    args = parser.parse_args()
    rank, size = _common.setup()
    engine = state.current().engine
    if not engine.shared_memory:
        raise SystemExit("one_host.py needs every rank on one host, with shared memory on")
    allowed = engine._set_single_copy_min(SINGLE_COPY_MIN)
    if rank == 0:
        print("single copy: " + ("allowed" if allowed else "not allowed here (staged path only)"))
    page = SharedPage(rank, size)
    for mb in (int(s) for s in args.sizes.split(",")):
        size_case(mb, args.rounds, args.json, rank, size, page)
    if size == 2:
        tiny_case(args.rounds, args.json, rank, size, page)
    hvd.shutdown()


if __name__ == "__main__":
    main()
