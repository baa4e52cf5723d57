"""Scale across hosts: K hosts made of network namespaces, one rank on each, hvdlite beside Gloo
in the same job.

    python bench/scale.py [--hosts 2,4,8,16,32] [--runs 3] [--json FILE]     (root)

Each host is a network namespace with its own address on a shared bridge (tests/multihost/
hosts.py, without sshd) and its own host name. This process imports torch and hvdlite once, then
forks every rank, which enters its host's namespace and runs as torchrun would start it (RANK,
WORLD_SIZE, MASTER_ADDR: a TCPStore this process hosts on the bridge). So 32 ranks fit in memory
on a small machine; every rank still runs on this machine's cores, so the times below are those
of K processes sharing them, not of K machines: compare hvdlite and Gloo at the same K, in the
same job, as ratios.

Per K, each rank reports, and the table prints the slowest rank's (times: median over
interleaved blocks, each block timed on every rank and its slowest rank taken):
  - hvd.init(), and torch.distributed's Gloo init_process_group, timed in the same job, each
    from a barrier in the store (so neither counts ranks still being started) and each making
    its own client of the job's store, as both do under torchrun;
  - a 4-byte allreduce, and 1 MiB, hvdlite and Gloo, and the CPU each call costs a rank (all
    of its threads: time.process_time), the figure that does not depend on how many ranks
    share this machine's cores, and for hvdlite the calling thread's own (time.thread_time):
    a blocking 4-byte allreduce's round runs on that thread (Note [A waiting caller runs the
    round] in csrc/round_driver.h), so this is the round's cost without the idle wake-ups of
    the process's other threads (Gloo's loop threads wake every 10 ms, more often per call the
    longer a call takes);
  - a step of 161 one-element tensors (ResNet-50's gradient count, so the round carries 161
    cached requests and their inlined values), hvdlite's allreduce_async_ and synchronize (averages) as
    DistributedOptimizer does, Gloo's 161 async all_reduce; and hvdlite's negotiation time per
    round over those steps (the engine's own counter);
  - fds, threads and resident memory after hvdlite's collectives ran, before the Gloo group
    exists (hvdlite's own), and fds after Gloo's too.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import hvdlite as hvd  # noqa: E402
import hvdlite.basics  # noqa: E402,F401  (imported once here: init() is timed, not the import)
from hvdlite._runtime import state as _state  # noqa: E402
from tests.multihost.forked import run_on_hosts  # noqa: E402
from tests.multihost.hosts import unavailable  # noqa: E402

BLOCKS = 7


def per_rank_counts():
    rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")), "rss": rss}


def blocks(methods, per_block):
    """{name: fn} -> {name: [seconds per call, one per block]}, the blocks of every method
    interleaved, each started from a Gloo barrier; {name + " CPU": [this process's CPU seconds
    per call (every thread's), one per block]}; and {name + " thread CPU": [the calling thread's
    own]}."""
    times = {name: [] for name in methods}
    for kind in (" CPU", " thread CPU"):
        times.update({name + kind: [] for name in methods})
    for b in range(BLOCKS + 1):
        for name, fn in (methods.items() if b % 2 == 0 else reversed(methods.items())):
            dist.barrier()
            start, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(per_block[name]):
                fn()
            if b > 0:  # the first block warms up
                times[name].append((time.perf_counter() - start) / per_block[name])
                times[f"{name} CPU"].append((time.process_time() - cpu) / per_block[name])
                times[f"{name} thread CPU"].append((time.thread_time() - own) / per_block[name])
    return times


def store_barrier(store, key, size):
    """Every rank past this point before any goes on: a count in the store, and the last one in
    opens a gate the others wait for."""
    if store.add(f"{key}/count", 1) == size:
        store.set(f"{key}/gate", "open")
    store.wait([f"{key}/gate"])


def rank_job(rank, size):
    # both inits start from a barrier, so neither is charged for ranks still being forked
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, False)
    store_barrier(store, "bench-start", size)
    start = time.perf_counter()
    hvd.init()
    hvd_init = time.perf_counter() - start
    engine = _state.current().sets[0].engine
    small = torch.ones(1)
    mib = torch.ones(1 << 18)
    step = [torch.full((1,), float(i)) for i in range(161)]

    def hvd_step():
        handles = [hvd.allreduce_async_(t, name=f"grad.{i}", op=hvd.Average) for i, t in enumerate(step)]
        for h in handles:
            hvd.synchronize(h)

    for _ in range(3):  # the collectives' first rounds, before counting what hvdlite holds
        hvd.allreduce(small, name="small")
        hvd.allreduce(mib, name="mib")
        hvd_step()
    mine = per_rank_counts()

    store_barrier(store, "bench-gloo-start", size)
    start = time.perf_counter()
    # its own client of the job's store, as init_process_group("gloo") makes under torchrun and
    # as hvd.init() made above
    gloo_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, False)
    dist.init_process_group("gloo", store=dist.PrefixStore("bench-gloo", gloo_store), rank=rank, world_size=size)
    gloo_init = time.perf_counter() - start

    def gloo_step():
        for w in [dist.all_reduce(t, async_op=True) for t in step]:
            w.wait()

    # Results checked before timing: every rank's value against the sum computed here
    got = hvd.allreduce(torch.full((1,), float(rank)), name="check", op=hvd.Sum)
    assert got.item() == size * (size - 1) / 2, got
    check = [torch.full((1,), float(i + rank)) for i in range(161)]
    handles = [hvd.allreduce_async_(t, name=f"grad.{i}", op=hvd.Average) for i, t in enumerate(check)]
    for i, h in enumerate(handles):
        assert abs(hvd.synchronize(h).item() - (i + (size - 1) / 2)) < 1e-4
    methods = {
        "hvdlite 4 B": lambda: hvd.allreduce(small, name="small"),
        "Gloo 4 B": lambda: dist.all_reduce(small),
        "hvdlite 1 MiB": lambda: hvd.allreduce(mib, name="mib"),
        "Gloo 1 MiB": lambda: dist.all_reduce(mib),
        "hvdlite 161-tensor step": hvd_step,
        "Gloo 161-tensor step": gloo_step,
    }
    per_block = {"hvdlite 4 B": 20, "Gloo 4 B": 20, "hvdlite 1 MiB": 3, "Gloo 1 MiB": 3,
                 "hvdlite 161-tensor step": 2, "Gloo 161-tensor step": 2}
    before = engine.metrics()
    times = blocks({k: v for k, v in methods.items() if "step" in k}, per_block)
    after = engine.metrics()
    rounds = after["negotiations"] - before["negotiations"]
    negotiation = (after["negotiate_sum_s"] - before["negotiate_sum_s"]) / max(rounds, 1)
    times.update(blocks({k: v for k, v in methods.items() if "step" not in k}, per_block))
    # every rank takes each block's slowest rank (for CPU: the rank that spent the most)
    names = sorted(times)
    t = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    slowest = {n: t[i].tolist() for i, n in enumerate(names)}
    tried, decided = engine._cached_rounds  # Note [Cached rounds] in csrc/cached_round.h
    result = {"rank": rank, "cached_rounds": [decided, tried], "hvd_init": hvd_init, "gloo_init": gloo_init, "counts": mine,
              "fds_with_gloo": per_rank_counts()["fds"], "negotiation": negotiation, "times": slowest}
    dist.barrier()
    hvd.shutdown()
    return result


def run(k, timeout, env=None):
    results = run_on_hosts([f"s{i:02d}" for i in range(k)], rank_job, env=env, timeout=timeout)
    times = results[0]["times"]
    out = {name: statistics.median(values) for name, values in times.items()}
    out["hvd_init"] = max(r["hvd_init"] for r in results)
    out["gloo_init"] = max(r["gloo_init"] for r in results)
    out["negotiation"] = max(r["negotiation"] for r in results)
    for key in ("fds", "threads", "rss"):
        out[key] = max(r["counts"][key] for r in results)
    out["fds_with_gloo"] = max(r["fds_with_gloo"] for r in results)
    out["cached_rounds"] = results[0]["cached_rounds"]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,4,8,16,32")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json")
    parser.add_argument("--ab", metavar="VAR",
                        help="run each K twice in a row, with VAR=0 and VAR=1 in every rank (e.g. HVDLITE_CACHED_ROUNDS)")
    args = parser.parse_args()
    why = unavailable()
    if why:
        sys.exit(f"bench/scale.py needs test hosts: {why}")
    torch.set_num_threads(1)
    rows = []
    variants = [{args.ab: "0"}, {args.ab: "1"}] if args.ab else [{}]
    for run_index in range(args.runs):
        for k in (int(x) for x in args.hosts.split(",")):
            for env in variants:
                row = run(k, args.timeout, env)
                row.update({"k": k, "run": run_index, "env": env})
                rows.append(row)
                us = lambda key: row[key] * 1e6  # noqa: E731
                label = " ".join(f"{key}={value}" for key, value in env.items())
                print(f"run {run_index} K={k:>2} {label}: 4 B {us('hvdlite 4 B'):8.0f} / {us('Gloo 4 B'):8.0f} us "
                      f"({row['hvdlite 4 B'] / row['Gloo 4 B']:.2f}x)  "
                      f"1 MiB {row['hvdlite 1 MiB'] * 1e3:7.2f} / {row['Gloo 1 MiB'] * 1e3:7.2f} ms  "
                      f"step {row['hvdlite 161-tensor step'] * 1e3:7.2f} / {row['Gloo 161-tensor step'] * 1e3:7.2f} ms  "
                      f"negotiation {us('negotiation'):7.0f} us  "
                      f"CPU per 4 B call {us('hvdlite 4 B CPU'):6.0f} / {us('Gloo 4 B CPU'):6.0f} us "
                      f"(hvdlite's calling thread, which runs the round: {us('hvdlite 4 B thread CPU'):5.0f} us)  "
                      f"init {row['hvd_init']:.2f} / {row['gloo_init']:.2f} s  "
                      f"fds {row['fds']} ({row['fds_with_gloo']} with Gloo)  threads {row['threads']}  "
                      f"RSS {row['rss'] / 2**20:.0f} MB  "
                      f"cached rounds {row['cached_rounds'][0]} of {row['cached_rounds'][1]} tried", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
