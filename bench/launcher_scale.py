"""The launcher and its store at many ranks on this host, beside an older checkout's launcher.

    python bench/launcher_scale.py [--ranks 64 256 1024] [--baseline /path/to/old/checkout]
                                   [--runs 1] [--json FILE]

Each job is `hvdliterun -np K python rank.py` whose ranks import no torch: a rank connects to
the job's store with the job's client, counts itself in (ADD), and waits (GET) for the last
rank to open a gate, so what is measured is the launcher: starting K processes, streaming
their output, watching their exits, and the store answering K clients at once. While every
rank waits at the gate the bench samples the launcher process's threads and open file
descriptors (/proc), then opens the gate. It reports, per K: the wall time from start to the
launcher's exit, the launcher's largest thread and fd counts, and the store requests per rank
are fixed by the rank script (three). With --baseline, the same jobs run the launcher (and
store) of that checkout, interleaved run by run, and the ratios are printed.

What the figures stand for: K processes on one 2-core machine, so the wall time is mostly
process starts; the thread and fd counts are the launcher's own, whatever the machine.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RANK = """
import os, sys, time
from hvdlite._job.wire import RendezvousClient
rank, size = int(os.environ["HVDLITE_RANK"]), int(os.environ["HVDLITE_SIZE"])
client = RendezvousClient(os.environ["HVDLITE_RENDEZVOUS_ADDR"], int(os.environ["HVDLITE_RENDEZVOUS_PORT"]),
                          os.environ["HVDLITE_RENDEZVOUS_SECRET"], rank=rank, connect_timeout=600)
print(f"rank {rank} in", flush=True)
if int(client.call(b"ADD", [b"arrived", b"1"])[0]) == size:
    while not os.path.exists(os.environ["GATE_FILE"]):
        time.sleep(0.05)
    client.call(b"SET", [b"gate", b"open"])
client.call(b"GET", [b"gate", b"600000"], 600000)
"""


def _count(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
        return threads, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return 0, 0


def run_job(root, ranks, workdir):
    """(seconds, most threads, most fds) of one job with the launcher of checkout `root`."""
    script = os.path.join(workdir, "rank.py")
    with open(script, "w") as f:
        f.write(RANK)
    gate = os.path.join(workdir, f"gate.{time.monotonic_ns()}")
    env = {**os.environ, "GATE_FILE": gate, "PYTHONPATH": root}
    start = time.monotonic()
    launcher = subprocess.Popen([sys.executable, "-m", "hvdlite.runner.launch", "-np", str(ranks),
                                 "--start-timeout", "900", sys.executable, script],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=workdir)
    most = (0, 0)
    children_path = f"/proc/{launcher.pid}/task/{launcher.pid}/children"
    try:
        while launcher.poll() is None:
            most = max(most, _count(launcher.pid))
            try:
                children = len(open(children_path).read().split())
            except OSError:
                children = 0
            if children >= ranks:
                time.sleep(1.0)  # every rank started: let them reach the gate
                most = max(most, _count(launcher.pid))
                break
            time.sleep(0.2)
        with open(gate, "w") as f:
            f.write("open")
        out, err = launcher.communicate(timeout=1800)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    seconds = time.monotonic() - start
    through = out.decode(errors="replace").count(" in\n")
    if launcher.returncode != 0 or through != ranks:
        raise SystemExit(f"job of {ranks} ranks failed ({through} through):\n{err.decode(errors='replace')[-3000:]}")
    return seconds, most[0], most[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--baseline", help="root of another checkout whose launcher runs beside this one "
                                           "(git worktree add DIR COMMIT; ln -s ../runner DIR/hvdlite/runner)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    roots = {"hvdlite": REPO}
    if args.baseline:
        roots["baseline"] = os.path.abspath(args.baseline)
        if not os.path.exists(os.path.join(roots["baseline"], "hvdlite", "runner", "__init__.py")):
            raise SystemExit("the baseline's launcher must import as hvdlite.runner from its root: "
                             "ln -s ../runner BASELINE/hvdlite/runner")
    rows = []
    with tempfile.TemporaryDirectory(prefix="hvdlite-launcher-scale-") as workdir:
        for ranks in args.ranks:
            for run in range(args.runs):
                for label, root in roots.items():  # interleaved, run by run
                    seconds, threads, fds = run_job(root, ranks, workdir)
                    rows.append({"ranks": ranks, "run": run, "launcher": label, "seconds": round(seconds, 2),
                                 "threads": threads, "fds": fds})
                    print(f"{ranks:5d} ranks  {label:9s} run {run}: {seconds:7.1f} s  "
                          f"{threads:5d} threads  {fds:5d} fds ({fds / ranks:.2f} per rank)", flush=True)
    if args.baseline:
        print("\nratios (hvdlite / baseline, medians over runs):")
        for ranks in args.ranks:
            def median(label, field):
                values = sorted(r[field] for r in rows if r["ranks"] == ranks and r["launcher"] == label)
                return values[len(values) // 2]
            print(f"{ranks:5d} ranks: time {median('hvdlite', 'seconds') / median('baseline', 'seconds'):.2f}x  "
                  f"threads {median('hvdlite', 'threads')} vs {median('baseline', 'threads')}  "
                  f"fds {median('hvdlite', 'fds')} vs {median('baseline', 'fds')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
