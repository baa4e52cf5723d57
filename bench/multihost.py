"""The cross-host benchmark: test hosts in network namespaces (tests/multihost/hosts.py) whose
links are shaped with tc, and hvdlite against torch.distributed and DDP across them.

    sudo python bench/multihost.py [--hosts 2] [--rate 1gbit] [--delay 0.5ms] [--mtu 9000] [--rounds 5] [--json-dir DIR]

Needs root (namespaces, tc, sshd). Makes --hosts hosts (2 by default), shapes every link (each direction: rate
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


def rate_bits(rate):
    """tc's rate ("1gbit", "500mbit", "100kbit") in bit/s; tc's k, m and g are powers of 1000."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * factor
    raise SystemExit(f"bench/multihost.py: --rate {rate!r}: expected a number and kbit, mbit or gbit")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--delay", default="0.5ms", help="one-way delay per direction")
    parser.add_argument("--mtu", type=int, default=None,
                        help="every link's MTU (default: the veth's 1500; 9000 for jumbo frames, whose "
                             "headers are 0.7%% of a frame against 4.4%% at 1500)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--slots", type=int, default=1, help="ranks per host")
    parser.add_argument("--hosts", type=int, default=2, help="test hosts (2 to 4)")
    parser.add_argument("--json-dir", default=None)
    parser.add_argument("--jobs", default="cross_host,training,powersgd", help="which jobs, comma-separated")
    parser.add_argument("--hierarchical", action="store_true",
                        help="run every job twice: flat, then with --hierarchical-allreduce "
                             "(Note [Hierarchical allreduce]; use with --slots 2 or more)")
    parser.add_argument("--link-profile", action="store_true",
                        help="cross_host: also split each method's time on the link (bench/linkprofile.py)")
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        raise SystemExit(f"bench/multihost.py: {reason}")
    if not 2 <= args.hosts <= 4:
        raise SystemExit("bench/multihost.py: --hosts must be 2, 3 or 4")
    names = ["hvta", "hvtb", "hvtc", "hvtd"][:args.hosts]
    with TestHosts(names) as hosts:
        link = hosts.shape(rate=args.rate, delay=args.delay, mtu=args.mtu)
        env = {**os.environ, "BENCH_LINK": link, "BENCH_RATE_BITS": str(rate_bits(args.rate)), "OMP_NUM_THREADS": "1"}
        print(f"{args.hosts} test hosts, every link shaped to {link} in each direction, "
              f"{args.slots} rank(s) per host", flush=True)
        launch = [sys.executable, "-m", "hvdlite.runner.launch", "--ssh-config-file", hosts.ssh_config,
                  "-H", ",".join(f"{name}:{args.slots}" for name in names)]
        jobs = [
            [sys.executable, "bench/cross_host.py", "--rounds", str(args.rounds)] +
            (["--link-profile"] if args.link_profile else []),
            [sys.executable, "bench/training.py", "--models", "mlp", "--rounds", str(max(3, args.rounds - 2)),
             "--steps-per-round", "2", "--no-local", "--no-breakdown"],
            [sys.executable, "bench/powersgd.py", "--rounds", str(max(3, args.rounds - 2))],
        ]
        jobs_named = ("cross_host", "training", "powersgd")
        chosen = args.jobs.split(",")
        variants = [("", [])] + ([("_hierarchical", ["--hierarchical-allreduce"])] if args.hierarchical else [])
        runs = [(job, name + suffix, flags) for suffix, flags in variants
                for job, name in zip(jobs, jobs_named) if name in chosen]
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
