"""Soak: a long run of mixed collectives, every result checked, with memory, file descriptors
and threads sampled as it goes.

    HVDLITE_TIMELINE=/tmp/soak.json HVDLITE_AUTOTUNE=1 hvdliterun -np 2 python bench/soak.py \
        --ops 100000 --csv soak.csv
    python bench/soak.py --plot soak.csv --svg docs/soak.svg

Every operation is drawn from one seeded generator, the same on every rank: allreduces of
varied sizes and dtypes (sum, average, max), grouped allreduces, allgathers of uneven rows,
broadcasts from varied roots, alltoalls with uneven splits, and allreduces on a process set.
Each result is compared with the value computed locally from the same formulas (every rank's
input is a function of its rank and the step). Every --every operations each rank records its
resident memory, open file descriptors, threads, C heap in use (glibc's mallinfo2) and Python's
allocated blocks; rank 0 prints the samples and, at the end, the growth after the warm-up (the
first fifth of the run). Resident memory includes the heap's fragmentation; the heap in use and
the blocks count only what is allocated, so a leak shows in them first. tests/reliability/test_soak_flat.py
runs a short version of the same routine.

Measured on the 2-core reference VM, 2 ranks, timeline and autotune on (rank 0's resident
memory; fds and threads stayed at 57 and 35 from the first sample to the last in every run):
  - 100,000 operations, glibc's default allocator, before the timeline's per-name table was
    bounded: +52.8 MB after the warm-up.
  - The same with MALLOC_MMAP_THRESHOLD_=131072: +16.8 MB, a steady ~190 bytes per operation.
    glibc raises its mmap threshold each time a large mmapped block is freed, after which
    tensors of a megabyte come from the heap and fragment it; a fixed threshold stops that.
    The rest was the timeline's table of row names (one per unique tensor name, never freed).
  - With that table bounded (4096 names, then one shared row) and the fixed threshold, 60,000
    operations: +4.0 MB. It grows while hvdlite's bounded name caches fill (about the first
    30,000 operations here, which name every grouped call anew), then +0.9 MB over the last
    30,000 (docs/soak.svg).
"""

import argparse
import ctypes
import os
import random
import resource
import sys
import time

import torch

import hvdlite as hvd

DTYPES = [torch.float32, torch.float64, torch.int32, torch.bfloat16]
SIZES = [1, 7, 130, 1000, 4096, 50000, 300000]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(field, ctypes.c_size_t) for field in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _heap_in_use():
    """MB the C heap has handed out and not had back (glibc's mallinfo2: every arena plus mmapped
    blocks), or nan without glibc. Unlike resident memory it does not move with fragmentation."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return float("nan")
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def usage():
    """(resident MB, open fds, threads, C heap in use MB, Python's allocated blocks) of this process."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * resource.getpagesize() / 2**20
    return (rss, len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")),
            _heap_in_use(), sys.getallocatedblocks())


def _input(n, dtype, rank, step):
    return ((torch.arange(n, dtype=torch.float64) + rank * 3 + step) % 11).to(dtype)


def _one(rng, step, rank, size, subset):
    """One operation, checked; returns its kind."""
    kind = rng.choices(["allreduce", "grouped", "allgather", "broadcast", "alltoall", "process_set"],
                       weights=[40, 15, 15, 10, 10, 10])[0]
    name = f"{kind}.{step}"
    if kind == "allreduce":
        n, dtype = rng.choice(SIZES), rng.choice(DTYPES)
        op = rng.choice([hvd.Sum, hvd.Max] + ([hvd.Average] if dtype.is_floating_point else []))
        got = hvd.allreduce(_input(n, dtype, rank, step), name=name, op=op)
        inputs = torch.stack([_input(n, torch.float64, r, step) for r in range(size)])
        want = {hvd.Sum: inputs.sum(0), hvd.Max: inputs.max(0).values, hvd.Average: inputs.mean(0)}[op]
        tolerance = 0.1 if dtype == torch.bfloat16 else 1e-6
        assert got.dtype == dtype and torch.allclose(got.double(), want, atol=tolerance * max(1, size), rtol=0.02), name
    elif kind == "grouped":
        count = rng.randint(2, 12)
        shapes = [rng.choice(SIZES[:5]) for _ in range(count)]
        got = hvd.grouped_allreduce([_input(n, torch.float32, rank, step + i) for i, n in enumerate(shapes)],
                                    name=name, op=hvd.Sum)
        for i, (n, g) in enumerate(zip(shapes, got)):
            want = sum(_input(n, torch.float64, r, step + i) for r in range(size))
            assert torch.equal(g.double(), want), name
    elif kind == "allgather":
        rows = [rng.randint(0, 5) for _ in range(size)]
        width = rng.choice([1, 3, 64])
        mine = torch.full((rows[rank], width), float(rank + step % 5))
        got = hvd.allgather(mine, name=name)
        want = torch.cat([torch.full((rows[r], width), float(r + step % 5)) for r in range(size)])
        assert torch.equal(got, want), name
    elif kind == "broadcast":
        root, n = rng.randrange(size), rng.choice(SIZES)
        got = hvd.broadcast(_input(n, torch.float32, rank, step), root, name=name)
        assert torch.equal(got, _input(n, torch.float32, root, step)), name
    elif kind == "alltoall":
        splits = [[rng.randint(0, 4) for _ in range(size)] for _ in range(size)]  # [sender][receiver]
        width = rng.choice([1, 8])

        def rows(sender):
            return torch.cat([torch.full((splits[sender][r], width), float(sender * 10 + r)) for r in range(size)])

        got, received = hvd.alltoall(rows(rank), splits=torch.tensor(splits[rank]), name=name)
        want = torch.cat([torch.full((splits[s][rank], width), float(s * 10 + rank)) for s in range(size)])
        assert torch.equal(got, want) and received.tolist() == [splits[s][rank] for s in range(size)], name
    else:
        n = rng.choice(SIZES[:5])
        members = subset.ranks
        if rank in members:
            got = hvd.allreduce(_input(n, torch.float32, rank, step), name=name, op=hvd.Sum, process_set=subset)
            want = sum(_input(n, torch.float64, r, step) for r in members)
            assert torch.equal(got.double(), want), name
    return kind


def run(ops, every, seed=0, log=None):
    """Runs `ops` checked operations; returns the samples [(op, rss MB, fds, threads)]."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    subset = hvd.add_process_set(list(range(0, size, 2)) if size > 2 else list(range(size)))
    rng = random.Random(seed)
    samples, counts = [(0, *usage())], {}
    started = time.monotonic()
    for step in range(1, ops + 1):
        kind = _one(rng, step, rank, size, subset)
        counts[kind] = counts.get(kind, 0) + 1
        if step % every == 0:
            samples.append((step, *usage()))
            if log and rank == 0:
                log(f"{step} ops, {time.monotonic() - started:.0f} s: rss {samples[-1][1]:.1f} MB, "
                    f"fds {samples[-1][2]}, threads {samples[-1][3]}")
    hvd.barrier()
    hvd.remove_process_set(subset)
    hvd.shutdown()
    return samples, counts


def growth(samples):
    """Growth of each usage() figure from the end of the warm-up (a fifth of the run) to the end."""
    warm = samples[max(1, len(samples) // 5)]
    return tuple(last - first for last, first in zip(samples[-1][1:], warm[1:]))


def svg(rows, title):
    """Three small line charts (resident MB, fds, threads against operations) as an SVG."""
    width, height, pad = 300, 140, 34
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{3 * width}" height="{height + 30}" '
             'font-family="sans-serif" font-size="11">',
             f'<text x="6" y="14" font-size="12">{title}</text>']
    xs = [r[0] for r in rows]
    for i, (label, col) in enumerate((("resident MB", 1), ("open fds", 2), ("threads", 3))):
        ys = [r[col] for r in rows]
        low, high = min(ys), max(ys)
        low, high = (low - 1, high + 1) if high - low < 2 else (low, high)
        x0 = i * width + pad

        def point(x, y):
            return (f"{x0 + (x - xs[0]) / max(1, xs[-1] - xs[0]) * (width - pad - 10):.1f},"
                    f"{20 + (height - 20) - (y - low) / (high - low) * (height - 40):.1f}")

        parts.append(f'<rect x="{x0}" y="20" width="{width - pad - 10}" height="{height - 20}" fill="none" stroke="#999"/>')
        parts.append(f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" '
                     f'points="{" ".join(point(x, y) for x, y in zip(xs, ys))}"/>')
        parts.append(f'<text x="{x0}" y="{height + 14}">{label}: {ys[0]:g} at 0, {ys[-1]:g} at {xs[-1]} ops</text>')
        parts.append(f'<text x="{x0 - 30}" y="28">{high:g}</text><text x="{x0 - 30}" y="{height}">{low:g}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=100000)
    parser.add_argument("--every", type=int, default=2000, help="sample every N operations")
    parser.add_argument("--csv", default=None, help="rank 0 writes its samples here")
    parser.add_argument("--plot", default=None, metavar="CSV", help="instead of running: draw a CSV's samples")
    parser.add_argument("--svg", default=None, help="with --plot: the SVG to write")
    args = parser.parse_args()
    if args.plot:
        with open(args.plot) as f:
            rows = [tuple(float(v) for v in line.split(",")) for line in f.read().splitlines()[1:]]
        with open(args.svg, "w") as f:
            f.write(svg(rows, f"bench/soak.py, rank 0: {int(rows[-1][0])} checked operations"))
        return
    torch.set_num_threads(1)
    started = time.monotonic()
    samples, counts = run(args.ops, args.every, log=lambda line: print(line, flush=True))
    if int(os.environ.get("HVDLITE_RANK", "0")) == 0:
        rss, fds, threads, heap, blocks = growth(samples)
        print(f"{args.ops} operations in {time.monotonic() - started:.0f} s, every result checked: "
              + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        print(f"after warm-up: rss {rss:+.1f} MB, C heap in use {heap:+.2f} MB, Python blocks {blocks:+d}, "
              f"fds {fds:+d}, threads {threads:+d}")
        if args.csv:
            with open(args.csv, "w") as f:
                f.write("ops,rss_mb,fds,threads,heap_mb,py_blocks\n")
                for s in samples:
                    f.write(f"{s[0]},{s[1]:.2f},{s[2]},{s[3]},{s[4]:.3f},{s[5]}\n")


if __name__ == "__main__":
    main()
