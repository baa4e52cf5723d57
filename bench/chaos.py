"""The long chaos run: an elastic job on three network-namespace hosts x two slots while faults
drawn from a fixed seed hit it (tests/multihost/chaos.py says which and how), then the checks of
tests/multihost/test_chaos.py and the reset figures.

    sudo python bench/chaos.py --faults 40 --seed 1 [--json chaos.json]

Needs root, iproute2 and OpenSSH's sshd (tests/multihost/hosts.py makes the hosts). Prints one
line per fault, then: the faults by kind, the resets the job survived with the time each took
(from the reset's start to the next generation, as the launcher measured it: median and max),
the epochs completed, whether every sample counted exactly once per epoch, and what was left.
"""
import argparse
import collections
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.multihost import hosts as hostlib  # noqa: E402
from tests.multihost.chaos import HOSTS, Chaos  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    reason = hostlib.unavailable()
    if reason:
        sys.exit(f"bench/chaos.py: {reason}")
    started = time.time()
    with hostlib.TestHosts(list(HOSTS)) as hosts:
        chaos = Chaos(hosts, seed=args.seed, faults=args.faults, log=lambda line: print(line, flush=True))
        try:
            code, out = chaos.drive(recover_timeout=180)
        finally:
            chaos.stop()
        exact = None
        if code == 0:
            try:
                chaos.run.check_every_sample_once_per_epoch()
                exact = True
            except AssertionError as exc:
                exact = str(exc)[:500]
        left = chaos.leftovers(within=30.0)
        resets = chaos.resets()
    figures = {
        "seconds": round(time.time() - started, 1), "exit_code": code,
        "faults": dict(collections.Counter(fault for _, fault, _, _ in chaos.injected)),
        "injected": chaos.injected, "resets": len(resets),
        "reset_seconds_median": round(statistics.median(resets), 2) if resets else None,
        "reset_seconds_max": round(max(resets), 2) if resets else None,
        "epochs": chaos.epochs_done() if code == 0 else None,
        "every_sample_once_per_epoch": exact, "left": left,
    }
    print(json.dumps({k: v for k, v in figures.items() if k != "injected"}, indent=1))
    if code != 0:
        print(out[-6000:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    sys.exit(0 if code == 0 and exact is True and not left else 1)


if __name__ == "__main__":
    main()
