"""torch's backend test suite (tests/conformance/torch_suite.py) against hvdlite and against
Gloo on this machine, and what differs.

    python bench/conformance.py [--backends hvdlite,gloo] [-k EXPR] [--start spawn|fork] [--out ...]

Each backend's run is one pytest session over the whole suite (every test spawns its ranks, as
torch's own run does, unless --start fork: tests/conformance/torch_suite.py),
with a JUnit report per backend. The summary counts passed, failed and skipped tests per
backend and lists every test Gloo passes that hvdlite does not, with the first line of its
error. About 20 minutes per backend on 2 cores.
"""

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(backend, expr, out_dir, start):
    report = os.path.join(out_dir, f"{backend}.xml")
    env = dict(os.environ, BACKEND=backend, OMP_NUM_THREADS="1", HVDLITE_TORCH_SUITE_START=start)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/conformance/torch_suite.py",
               f"--junitxml={report}"] + (["-k", expr] if expr else [])
    subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return outcomes(report)


def outcomes(report):
    """{test name: ("passed" | "failed" | "skipped", first line of the message)}."""
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name")
        state, why = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                state, why = "failed", (child.get("message") or child.text or "").strip().splitlines()[:1]
            elif child.tag == "skipped":
                state, why = "skipped", (child.get("message") or "").strip().splitlines()[:1]
        results[name] = (state, why[0] if isinstance(why, list) and why else (why or ""))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="hvdlite,gloo")
    parser.add_argument("-k", dest="expr", default=None)
    parser.add_argument("--start", choices=("spawn", "fork"), default="spawn")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "conformance"))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = {b: run(b, args.expr, args.out, args.start) for b in args.backends.split(",")}
    for backend, res in results.items():
        counts = {s: sum(1 for v in res.values() if v[0] == s) for s in ("passed", "failed", "skipped")}
        print(f"{backend}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    if "hvdlite" in results and "gloo" in results:
        ours, gloo = results["hvdlite"], results["gloo"]
        missing = sorted(n for n, (s, _) in gloo.items() if s == "passed" and ours.get(n, ("absent",))[0] != "passed")
        print(f"\n{len(missing)} tests pass with Gloo and not with hvdlite:")
        for name in missing:
            state, why = ours.get(name, ("absent", ""))
            print(f"  {name}: {state}: {why[:160]}")


if __name__ == "__main__":
    main()
