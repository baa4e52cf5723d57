"""What seeing inside a job costs: the engine with its recording on and off, in one job.

    hvdliterun -np 2 python bench/insight_cost.py [--runs 5] [--json bench/results/insight_cost.json]

Straggler attribution, the flight record and the metrics counters are kept by each engine
(csrc/recorder.h). This bench switches that recording off and on for the whole job, block by
block (every rank at the same barrier, alternating which comes first), and times in each block:
  - 200 tensors of 1024 floats in one grouped allreduce (the negotiation-bound case), and
  - a training step of an MLP (784-512-512-10, batch 64 per rank) with DistributedOptimizer.
Every result is checked first. Reported: the median time with recording over the median
without, per job, over --runs jobs started one after the other.

Why not this build against an older one: started as separate jobs, the same build's medians
moved by +-30% from job to job on the reference VM (10 interleaved pairs of jobs gave ratios
from 0.61 to 1.65), far more than anything recording could cost. What stays on with recording
off is the submission time each request carries (4 bytes on the wire) and the last-rank
arithmetic when a tensor is decided (Note [Submission times] in csrc/message.h).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(blocks, first_on):
    import torch

    import hvdlite as hvd
    from hvdlite._runtime import state
    torch.set_num_threads(1)
    hvd.init()
    engine = state.current().engine
    n = hvd.size()
    tensors = [torch.full((1024,), float(hvd.rank() + i)) for i in range(200)]
    want = [torch.full((1024,), float(n * (n - 1) / 2 + n * i)) for i in range(200)]
    got = hvd.grouped_allreduce(tensors, name="check", op=hvd.Sum)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(64, 784, generator=torch.Generator().manual_seed(hvd.rank()))
    y = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(hvd.rank()))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(5):  # warm-up, recording on
        hvd.grouped_allreduce(tensors, name="grouped", op=hvd.Sum)
        step()
    times = {True: {"grouped": [], "mlp": []}, False: {"grouped": [], "mlp": []}}
    for block in range(2 * blocks):
        on = (block % 2 == 0) == first_on
        hvd.barrier()
        engine.set_recording(on)
        for _ in range(20):
            t0 = time.perf_counter()
            hvd.grouped_allreduce(tensors, name="grouped", op=hvd.Sum)
            times[on]["grouped"].append(time.perf_counter() - t0)
        for _ in range(10):
            t0 = time.perf_counter()
            step()
            times[on]["mlp"].append(time.perf_counter() - t0)
    engine.set_recording(True)
    if hvd.rank() == 0:
        medians = {f"{case}_{'on' if on else 'off'}_s": statistics.median(times[on][case])
                   for on in (True, False) for case in ("grouped", "mlp")}
        print("RESULT " + json.dumps(medians), flush=True)
    hvd.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="jobs, one after the other")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=10, help="blocks per mode in each job")
    parser.add_argument("--worker", nargs=2, type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args.worker[0], bool(args.worker[1]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVDLITE_")}
    env["OMP_NUM_THREADS"] = "1"
    runs = []
    for run in range(args.runs):
        out = subprocess.run([sys.executable, "-m", "hvdlite.runner.launch", "-np", str(args.np), sys.executable,
                              os.path.abspath(__file__), "--worker", str(args.blocks), str(run % 2)],
                             capture_output=True, text=True, env=env, cwd=HERE, timeout=600)
        line = next((l for l in out.stdout.splitlines() if "RESULT " in l), None)
        if line is None:
            raise RuntimeError(f"run {run + 1} reported nothing:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        m = json.loads(line.split("RESULT ", 1)[1])
        m["grouped_ratio"] = m["grouped_on_s"] / m["grouped_off_s"]
        m["mlp_ratio"] = m["mlp_on_s"] / m["mlp_off_s"]
        runs.append(m)
        print(f"run {run + 1}: 200 x 1024 grouped {m['grouped_on_s'] * 1e3:.3f} ms recording, "
              f"{m['grouped_off_s'] * 1e3:.3f} ms not ({m['grouped_ratio']:.3f}); MLP step "
              f"{m['mlp_on_s'] * 1e3:.3f} ms vs {m['mlp_off_s'] * 1e3:.3f} ms ({m['mlp_ratio']:.3f})", flush=True)
    summary = {case: statistics.median(r[f"{case}_ratio"] for r in runs) for case in ("grouped", "mlp")}
    print(f"recording on / off, median over {args.runs} jobs: 200 x 1024 grouped allreduce "
          f"{summary['grouped']:.3f}, MLP training step {summary['mlp']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"np": args.np, "runs": runs, "median_ratios": summary}, f, indent=2)


if __name__ == "__main__":
    main()
