"""Elastic training on this machine: how long a reset takes, and whether the result holds.

    python bench/elastic_reset.py --runs 3

Each run trains examples/elastic_digits.py under hvdliterun's elastic mode on hosts
127.0.0.1:2 and 127.0.0.2:2, kills one worker of 127.0.0.2 (its host is blacklisted, so the
job goes on with the two ranks of 127.0.0.1), then adds host 127.0.0.3:2 to the discovery
output. It reports
  - death to the first step completed afterwards (by any rank),
  - the host's appearance in the discovery output to its first completed step,
  - the test accuracy, beside that of an uninterrupted run on 4 ranks (2 hosts x 2).
Every step of the example costs --step-seconds more, standing in for a larger model, so that
kills and additions land mid-training.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "elastic_digits.py")


def _steps(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def _wait(what, condition, proc, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended before {what}")
        time.sleep(0.01)
    raise RuntimeError(f"timed out waiting for {what}")


def one_run(step_seconds, epochs, interrupt):
    work = tempfile.mkdtemp(prefix="hvdlite-elastic-bench-")
    hosts, log = os.path.join(work, "hosts.txt"), os.path.join(work, "steps.jsonl")

    def set_hosts(lines):
        with open(hosts + ".tmp", "w") as f:
            f.write("".join(line + "\n" for line in lines))
        os.replace(hosts + ".tmp", hosts)
        return time.time()

    set_hosts(["127.0.0.1:2", "127.0.0.2:2"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVDLITE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    argv = [sys.executable, "-m", "hvdlite.runner.launch", "--host-discovery-script", f"cat {hosts}",
            sys.executable, EXAMPLE, "--epochs", str(epochs), "--step-seconds", str(step_seconds),
            "--step-log", log]
    proc = subprocess.Popen(argv, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    result = {}
    try:
        if interrupt:
            _wait("40 steps on 4 ranks", lambda: len([s for s in _steps(log) if s["size"] == 4]) >= 40, proc)
            victim = next(s["pid"] for s in _steps(log) if s["host"] == "127.0.0.2")
            os.kill(victim, signal.SIGKILL)
            killed = time.time()
            after = _wait("a step after the kill", lambda: [s for s in _steps(log) if s["t"] > killed], proc)
            result["death_to_step"] = min(s["t"] for s in after) - killed
            _wait("40 steps on 2 ranks", lambda: len([s for s in _steps(log) if s["size"] == 2]) >= 40, proc)
            added = set_hosts(["127.0.0.1:2", "127.0.0.2:2", "127.0.0.3:2"])
            joined = _wait("a step on the new host",
                           lambda: [s for s in _steps(log) if s["host"] == "127.0.0.3"], proc)
            result["host_to_step"] = min(s["t"] for s in joined) - added
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise RuntimeError(f"the job failed (rc {proc.returncode}):\n{out[-3000:]}")
    line = next(line for line in out.splitlines() if "test accuracy:" in line)
    result["accuracy"] = float(line.split("test accuracy:")[1].split("%")[0])
    result["final_size"] = int(line.split(" on ")[1].split()[0])
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--step-seconds", type=float, default=0.02)
    args = parser.parse_args()
    rows = []
    for i in range(args.runs):
        elastic = one_run(args.step_seconds, args.epochs, interrupt=True)
        plain = one_run(args.step_seconds, args.epochs, interrupt=False)
        rows.append((elastic, plain))
        print(f"run {i + 1}: death -> first step {elastic['death_to_step']:.2f} s, new host -> its "
              f"first step {elastic['host_to_step']:.2f} s, accuracy {elastic['accuracy']:.2f}% "
              f"(ends on {elastic['final_size']} ranks) vs uninterrupted {plain['accuracy']:.2f}%",
              flush=True)
    med = lambda key: statistics.median(e[key] for e, _ in rows)  # noqa: E731
    print(f"median over {args.runs} runs: death -> first step {med('death_to_step'):.2f} s, "
          f"new host -> first step {med('host_to_step'):.2f} s; largest accuracy gap "
          f"{max(abs(e['accuracy'] - p['accuracy']) for e, p in rows):.2f} points")


if __name__ == "__main__":
    main()
