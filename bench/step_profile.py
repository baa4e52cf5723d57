"""Where a training step's time goes: hvdlite and DDP against the same step without communication.

    hvdliterun -np 2 python bench/step_profile.py [--model cnn] [--rounds 12]
        [--json bench/results/step_profile.json]

bench/training.py gives the ratio; this explains it. Same models, data, optimizer and
interleaved rounds (--steps-per-round steps per method per round, after a barrier). Every step
is timed in phases on every rank, and the kernel's per-thread accounting (/proc/self/task/*/
schedstat: time on a CPU, time runnable but waiting for one) is read around every round, so a
method's step splits into:

- main thread on CPU: the model's own work plus the method's Python and C++ work on that
  thread (hooks, enqueueing, copies into DDP's buckets);
- main thread runnable, not running: the compute was preempted, by this method's helper
  threads (hvdlite's engine, Gloo's) or anything else on the machine;
- main thread blocked: waiting for the other ranks, that is for the slowest rank's backward
  plus the exchange still running after it.

For hvdlite the blocked part is split further from the phase times: waiting for the later
rank's backward (the ranks' skew, which synchronous data parallelism pays every step) and the
tail after it (the last reduction, wake-ups). Helper threads' CPU per step is listed by name.
The "excess" column is each part minus the no-communication step's, per rank and averaged
(for the two parts of synchronize, which that step lacks, the part itself). Step times use the
bench's estimator (per round, the slowest rank's time; median over rounds).

The ranks must share a host: phase times are compared across ranks (CLOCK_MONOTONIC). A thread's
CPU counts only if it lives through a whole round (a thread that ends inside one drops out of
that round's sums), which holds for the threads that matter here: the ranks' main threads,
hvdlite's engine and Gloo's loops.
"""

import argparse
import glob
import json
import os
import statistics
import sys
import threading

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import training  # noqa: E402
import hvdlite as hvd  # noqa: E402

DDP, HVD, LOCAL = training.DDP, training.HVD, training.LOCAL


def thread_times():
    """{tid: (name, ns on CPU, ns runnable waiting)} for every thread of this process."""
    out = {}
    for path in glob.glob("/proc/self/task/*/schedstat"):
        tid = int(path.split("/")[4])
        try:
            with open(path) as f:
                run, wait = (int(v) for v in f.read().split()[:2])
            with open(path.replace("schedstat", "comm")) as f:
                name = f.read().strip()
        except OSError:  # the thread ended
            continue
        out[tid] = (name, run, wait)
    return out


def measure(trainers, rounds, steps):
    """Interleaved rounds; per method the phase times of every timed step and the CPU
    accounting of every thread (summed over the timed rounds)."""
    main = threading.get_native_id()
    phases = {name: [] for name in trainers}
    threads = {name: {} for name in trainers}
    for r in range(rounds + 1):  # round 0 warms up
        for name, trainer in trainers.items():
            dist.barrier()
            before = thread_times()
            rows = [trainer.timestamps() for _ in range(steps)]
            after = thread_times()
            if r == 0:
                continue
            phases[name].extend(rows)
            for tid, (tname, run, wait) in after.items():
                _, run0, wait0 = before.get(tid, (tname, 0, 0))
                label = "main" if tid == main else tname
                acc = threads[name].setdefault(label, [0, 0])
                acc[0] += run - run0
                acc[1] += wait - wait0
    return phases, threads


def gather_rows(rows):
    t = torch.tensor(rows, dtype=torch.int64)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def analyse(name, per_rank, threads, steps):
    """Per-step means (ms) of one method on every rank, from all ranks' phase rows."""
    n = per_rank[0].shape[0]
    size = len(per_rank)
    ms = 1e-6
    later_bwd = torch.stack([p[:, 2] for p in per_rank]).max(0).values
    rounds = n // steps
    step_time = statistics.median(
        max((p[(i + 1) * steps - 1, 4] - p[i * steps, 0]).item() for p in per_rank) / steps
        for i in range(rounds)) * ms
    ranks = []
    for rank, p in enumerate(per_rank):
        wall = (p[:, 4] - p[:, 0]).double().mean().item() * ms
        run, wait = (v * ms / n for v in threads[rank]["main"])
        helpers = {k: v[0] * ms / n for k, v in threads[rank].items() if k != "main"}
        ranks.append({
            "wall": wall,
            "forward": (p[:, 1] - p[:, 0]).double().mean().item() * ms,
            "backward": (p[:, 2] - p[:, 1]).double().mean().item() * ms,
            "synchronize": (p[:, 3] - p[:, 2]).double().mean().item() * ms,
            "optimizer": (p[:, 4] - p[:, 3]).double().mean().item() * ms,
            "main_cpu": run, "main_preempted": wait, "main_blocked": max(wall - run - wait, 0.0),
            # hvdlite: of synchronize, waiting for the later rank's backward, then the tail
            "skew_wait": (later_bwd - p[:, 2]).double().mean().item() * ms,
            "tail": (p[:, 3] - later_bwd).double().mean().item() * ms,
            "helpers_cpu": sum(helpers.values()),
            "helpers": dict(sorted(helpers.items(), key=lambda kv: -kv[1])),
        })
    # What waiting for each other would cost these very steps: step i ends on every rank when
    # the slowest rank's step i does (meaningful for the no-communication step, whose ranks
    # never wait: the synchronization any synchronous method must add to it).
    walls = torch.stack([(p[:, 4] - p[:, 0]).double() for p in per_rank])
    lockstep = (walls.max(0).values - walls.mean(0)).mean().item() * ms
    return {"method": name, "step_ms": step_time, "ranks": ranks, "size": size,
            "lockstep_cost": lockstep, "mean_wall": walls.mean().item() * ms,
            "lockstep_wall": walls.max(0).values.mean().item() * ms}


PARTS = [("main_cpu", "main thread on CPU"), ("main_preempted", "main thread preempted"),
         ("main_blocked", "main thread blocked (waiting for ranks)"),
         ("helpers_cpu", "helper threads' CPU (all)")]


def report(results, title):
    floor = next(r for r in results if r["method"] == LOCAL)
    base = next(r for r in results if r["method"] == DDP)
    hvd_ = next(r for r in results if r["method"] == HVD)
    print(f"\nwhere the step goes: {title}  (ms per step; per rank, then the ranks' mean; "
          "excess = minus the no-communication step)")
    for res in results:
        ratio = res["step_ms"] / base["step_ms"]
        print(f"\n  {res['method']}: step {res['step_ms']:.1f} ms "
              f"({ratio:.3f}x DDP, {res['step_ms'] / floor['step_ms']:.3f}x no communication)")
        header = "".join(f"{'rank ' + str(i):>10}" for i in range(res["size"]))
        print(f"    {'':<42}{header}{'mean':>10}{'excess':>10}")
        keys = [("forward", "forward"), ("backward", "backward"), ("synchronize", "synchronize"),
                ("optimizer", "optimizer step"), ("wall", "step (own wall time)")] + PARTS
        if res["method"] == HVD:
            keys += [("skew_wait", "  of synchronize: later rank's backward"),
                     ("tail", "  of synchronize: after it (the tail)")]
        for key, label in keys:
            vals = [r[key] for r in res["ranks"]]
            mean = sum(vals) / len(vals)
            excess = mean
            if key not in ("skew_wait", "tail"):  # those have no counterpart in the floor
                excess -= sum(r[key] for r in floor["ranks"]) / len(floor["ranks"])
            cells = "".join(f"{v:>10.2f}" for v in vals)
            tail = f"{excess:>+10.2f}" if res is not floor else ""
            print(f"    {label:<42}{cells}{mean:>10.2f}{tail}")
        names = {}
        for r in res["ranks"]:
            for k, v in r["helpers"].items():
                names[k] = names.get(k, 0.0) + v / len(res["ranks"])
        top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:5])
        print(f"    helper threads by name (ms CPU per step, ranks' mean): {top}")
    print(f"\n  had the no-communication ranks waited for each other every step (step i ends when the "
          f"slower rank's step i does), each step would have cost {floor['lockstep_cost']:.2f} ms "
          "more: the synchronization every synchronous method pays on top of the floor.")
    best = floor["lockstep_wall"]
    print(f"  so a synchronous method with no overhead of its own would average {best:.1f} ms per step, "
          f"{best / base['mean_wall']:.3f}x DDP's {base['mean_wall']:.1f} ms and "
          f"{best / hvd_['mean_wall']:.3f}x hvdlite's {hvd_['mean_wall']:.1f} ms (own wall times).")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
    parser.add_argument("--rounds", type=int, default=12, help="timed rounds (after 1 warm-up)")
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--json", default=None, help="write the analysis to this file (rank 0)")
    args = parser.parse_args(argv)
    rank, _ = _common.setup()
    if hvd.local_size() != hvd.size():
        raise SystemExit("bench/step_profile.py compares clocks across ranks: run every rank on one host")
    work = training.workload(args.model, args.batch_size, rank)
    torch.manual_seed(0)
    trainers = training.build_trainers(work, work.build().state_dict(), local=True)
    phases, threads = measure(trainers, args.rounds, args.steps_per_round)
    results = []
    for name in trainers:
        per_rank = gather_rows(phases[name])
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, threads[name])
        results.append(analyse(name, per_rank, everyone, args.steps_per_round))
    if rank == 0:
        report(results, f"{work.name}, batch {args.batch_size}/rank, {args.rounds} rounds of "
                        f"{args.steps_per_round} steps")
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    hvd.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
