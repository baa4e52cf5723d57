"""The launcher and its store at many ranks on this host, beside an older checkout's launcher.

    python bench/launcher_scale.py [--ranks 64 256 1024] [--baseline /path/to/old/checkout]
                                   [--hosts H] [--runs 1] [--json FILE]

Each job is `hvdliterun -np K python rank.py` whose ranks import no torch: a rank connects to
the job's store with the job's client, counts itself in (ADD), and waits (GET) for the last
rank to open a gate, so what is measured is the launcher: starting K processes, streaming
their output, watching their exits, and the store answering K clients at once. While every
rank waits at the gate the bench samples the launcher process's threads and open file
descriptors (/proc), then opens the gate. It reports, per K: the wall time from start to the
launcher's exit, the launcher's largest thread and fd counts, and the store requests per rank
are fixed by the rank script (three). With --baseline, the same jobs run the launcher (and
store) of that checkout, interleaved run by run, and the ratios are printed.

With --hosts H, each K also runs spread evenly over H hosts made of network namespaces
(tests/multihost/hosts.py, each with its own sshd), the launcher outside them reaching each by
ssh: the bench counts the launcher's ssh clients as well (one agent per host, Note [One agent
per host] in runner/agent.py).

What the figures stand for: K processes on one 2-core machine, so the wall time is mostly
process starts; the thread and fd counts are the launcher's own, whatever the machine. The
hosts share those cores too: H hosts' ranks are still K processes on one machine, so the hosts
run compares the launcher's paths (ssh, agents, frames) with the local one, not H machines.
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
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


def _ssh_children(pid):
    """The launcher's ssh clients (Note [One agent per host] in runner/agent.py)."""
    count = 0
    try:
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return 0
    for child in children:
        try:
            count += open(f"/proc/{child}/comm").read().strip() == "ssh"
        except OSError:
            pass
    return count


def run_job(root, ranks, workdir, hosts=None):
    """(seconds, most threads, most fds, ssh clients) of one job with the launcher of checkout
    `root`; with `hosts` (a TestHosts), its ranks spread evenly over them, reached by ssh."""
    script = os.path.join(workdir, "rank.py")
    with open(script, "w") as f:
        f.write(RANK)
    gate = os.path.join(workdir, f"gate.{time.monotonic_ns()}")
    env = {**os.environ, "GATE_FILE": gate, "PYTHONPATH": root}
    where = []
    if hosts is not None:
        per = ranks // len(hosts.names)
        where = ["--ssh-config-file", hosts.ssh_config,
                 "-H", ",".join(f"{hosts.address(name)}:{per}" for name in hosts.names)]
    start = time.monotonic()
    launcher = subprocess.Popen([sys.executable, "-m", "hvdlite.runner.launch", "-np", str(ranks),
                                 "--start-timeout", "900"] + where + [sys.executable, script],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=workdir)
    arrived = []
    out_lines = []

    def read():
        for line in launcher.stdout:
            out_lines.append(line)
            if line.endswith(b" in\n"):
                arrived.append(1)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    most, ssh = (0, 0), 0
    try:
        while launcher.poll() is None and len(arrived) < ranks:
            most = max(most, _count(launcher.pid))
            ssh = max(ssh, _ssh_children(launcher.pid))
            time.sleep(0.2)
        time.sleep(0.5)  # every rank through the store's ADD and parked at the gate
        most = max(most, _count(launcher.pid))
        ssh = max(ssh, _ssh_children(launcher.pid))
        with open(gate, "w") as f:
            f.write("open")
        err = launcher.stderr.read()
        launcher.wait(timeout=1800)
        reader.join(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    seconds = time.monotonic() - start
    through = len(arrived)
    if launcher.returncode != 0 or through != ranks:
        raise SystemExit(f"job of {ranks} ranks failed ({through} through):\n{err.decode(errors='replace')[-3000:]}")
    return seconds, most[0], most[1], ssh


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--baseline", help="root of another checkout whose launcher runs beside this one "
                                           "(git worktree add DIR COMMIT; ln -s ../runner DIR/hvdlite/runner)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--hosts", type=int, default=0,
                        help="also run each K spread over this many namespace hosts reached by ssh (as root; "
                             "tests/multihost/hosts.py), interleaved with the one-host run")
    parser.add_argument("--json")
    args = parser.parse_args()
    roots = {"hvdlite": REPO}
    if args.baseline:
        roots["baseline"] = os.path.abspath(args.baseline)
        if not os.path.exists(os.path.join(roots["baseline"], "hvdlite", "runner", "__init__.py")):
            raise SystemExit("the baseline's launcher must import as hvdlite.runner from its root: "
                             "ln -s ../runner BASELINE/hvdlite/runner")
    rows = []
    with contextlib.ExitStack() as stack:
        workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="hvdlite-launcher-scale-"))
        runs = [(label, root, None) for label, root in roots.items()]
        if args.hosts:
            sys.path.insert(0, REPO)
            from tests.multihost.hosts import TestHosts, unavailable
            if unavailable():
                raise SystemExit(f"--hosts: {unavailable()}")
            hosts = stack.enter_context(TestHosts([f"lh{i}" for i in range(args.hosts)]))
            runs.append((f"{args.hosts} hosts", REPO, hosts))
        for ranks in args.ranks:
            for run in range(args.runs):
                for label, root, hosts in runs:  # interleaved, run by run
                    seconds, threads, fds, ssh = run_job(root, ranks, workdir, hosts)
                    rows.append({"ranks": ranks, "run": run, "launcher": label, "seconds": round(seconds, 2),
                                 "threads": threads, "fds": fds, "ssh": ssh})
                    print(f"{ranks:5d} ranks  {label:9s} run {run}: {seconds:7.1f} s  "
                          f"{threads:5d} threads  {fds:5d} fds ({fds / ranks:.2f} per rank)  "
                          f"{ssh} ssh clients", flush=True)
    if args.hosts:
        print(f"\nratios ({args.hosts} hosts / one host, medians over runs):")
        for ranks in args.ranks:
            def median_of(label):
                values = sorted(r["seconds"] for r in rows if r["ranks"] == ranks and r["launcher"] == label)
                return values[len(values) // 2]
            print(f"{ranks:5d} ranks: time {median_of(f'{args.hosts} hosts') / median_of('hvdlite'):.2f}x")
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
