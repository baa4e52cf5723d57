"""The cross-host benchmark: test hosts in network namespaces (tests/multihost/hosts.py) whose
links are shaped with tc, and hvdlite against torch.distributed and DDP across them.

    sudo python bench/multihost.py [--rate 1gbit] [--delay 0.5ms] [--rounds 5] [--json-dir bench/results]

Needs root (namespaces, tc, sshd). Makes two hosts, shapes every link (each direction: rate
and one-way delay with netem; rate only with tbf where the kernel has no netem, as on the
reference machine), launches from the first host with hvdliterun over real ssh (so network
discovery picks the interface), and runs:
  1. bench/cross_host.py: ResNet-50 gradients, flat bound / torch async per tensor / hvdlite
     grouped / hvdlite grouped with fp16 compression;
  2. bench/training.py --models mlp: a DistributedOptimizer training step against DDP;
  3. bench/powersgd.py: the MLP step with Compression.powersgd(rank=4) against DDP with and
     without torch's powerSGD_hook.
--jobs picks some of them (cross_host,training,powersgd).
"""
import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tests.multihost.hosts import TestHosts, unavailable  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--delay", default="0.5ms", help="one-way delay per direction")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--slots", type=int, default=1, help="ranks per host")
    parser.add_argument("--json-dir", default=None)
    parser.add_argument("--jobs", default="cross_host,training,powersgd", help="which jobs, comma-separated")
    parser.add_argument("--hierarchical", action="store_true",
                        help="run every job twice: flat, then with --hierarchical-allreduce "
                             "(Note [Hierarchical allreduce]; use with --slots 2 or more)")
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        raise SystemExit(f"bench/multihost.py: {reason}")
    with TestHosts(["hvta", "hvtb"]) as hosts:
        link = hosts.shape(rate=args.rate, delay=args.delay)
        env = {**os.environ, "BENCH_LINK": link, "OMP_NUM_THREADS": "1"}
        print(f"two test hosts, every link shaped to {link} in each direction, "
              f"{args.slots} rank(s) per host", flush=True)
        launch = [sys.executable, "-m", "hvdlite.runner.launch", "--ssh-config-file", hosts.ssh_config,
                  "-H", f"hvta:{args.slots},hvtb:{args.slots}"]
        jobs = [
            [sys.executable, "bench/cross_host.py", "--rounds", str(args.rounds)],
            [sys.executable, "bench/training.py", "--models", "mlp", "--rounds", str(max(3, args.rounds - 2)),
             "--steps-per-round", "2", "--no-local", "--no-breakdown"],
            [sys.executable, "bench/powersgd.py", "--rounds", str(max(3, args.rounds - 2))],
        ]
        names = ("cross_host", "training", "powersgd")
        chosen = args.jobs.split(",")
        variants = [("", [])] + ([("_hierarchical", ["--hierarchical-allreduce"])] if args.hierarchical else [])
        runs = [(job, name + suffix, flags) for suffix, flags in variants
                for job, name in zip(jobs, names) if name in chosen]
        for job, name, flags in runs:
            if args.json_dir:
                job = job + ["--json", os.path.join(os.path.abspath(args.json_dir), f"multihost_{name}.json")]
            started = time.monotonic()
            print(f"== {name}", flush=True)
            result = hosts.run("hvta", launch[:3] + flags + launch[3:] + job, timeout=1200, cwd=REPO, env=env)
            for line in result.stdout.splitlines():
                if line.startswith("[0]<stdout>: "):
                    print(line[len("[0]<stdout>: "):], flush=True)
            if result.returncode != 0:
                print(result.stdout[-3000:], result.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{name} failed with exit code {result.returncode}")
            print(f"({name}: {time.monotonic() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
