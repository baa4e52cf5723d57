"""hvdliterun with many torch-free ranks on this host (Note [One thread watches the ranks] in
runner/io_loop.py, Note [One loop serves the store] in hvdlite/_job/server.py): every rank gets
through the store, the launcher's threads do not grow with the ranks, its descriptors are
about one per rank (the rank's store connection), and each rank's output still arrives whole,
prefixed and in order."""
import os
import resource
import subprocess
import sys
import textwrap
import time

import pytest

from launcher_helpers import LAUNCH, rank_lines

RANKS = 256

# A rank that only meets the others through the job's store: count itself in, and wait for the
# last to open the gate.
RANK = textwrap.dedent("""
    import os, sys, time
    from hvdlite._job.wire import RendezvousClient
    rank, size = int(os.environ["HVDLITE_RANK"]), int(os.environ["HVDLITE_SIZE"])
    client = RendezvousClient(os.environ["HVDLITE_RENDEZVOUS_ADDR"],
                              int(os.environ["HVDLITE_RENDEZVOUS_PORT"]),
                              os.environ["HVDLITE_RENDEZVOUS_SECRET"], rank=rank)
    for line in range(3):
        print(f"rank {rank} line {line}", flush=True)
    print(f"rank {rank} to stderr", file=sys.stderr, flush=True)
    if int(client.call(b"ADD", [b"arrived", b"1"])[0]) == size:
        open(os.environ["GATE_FILE"] + ".all", "w").close()  # every rank holds its connection
        while not os.path.exists(os.environ["GATE_FILE"]):  # the test counts the launcher's threads
            time.sleep(0.05)
        client.call(b"SET", [b"gate", b"open"])
    client.call(b"GET", [b"gate", b"120000"], 120000)
    print(f"rank {rank} through", flush=True)
""")


def _count(pid):
    with open(f"/proc/{pid}/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.slow
def test_many_ranks_through_the_store_on_a_launcher_of_few_threads(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    gate = tmp_path / "gate"
    env = {**os.environ, "GATE_FILE": str(gate), "PYTHONPATH": os.pathsep.join(sys.path)}
    # a soft limit below what 256 ranks need: the launcher raises it itself
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (min(512, limits[0]), limits[1]))  # noqa: E731
    launcher = subprocess.Popen(LAUNCH + ["-np", str(RANKS), "--start-timeout", "80", sys.executable, str(script)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path,
                                text=True, preexec_fn=low)
    most = (0, 0)
    deadline = time.monotonic() + 80
    everyone = tmp_path / "gate.all"
    try:
        # every rank started, connected to the store and waiting: the launcher at its largest,
        # while the gate file does not exist yet
        while time.monotonic() < deadline and launcher.poll() is None and not everyone.exists():
            most = max(most, _count(launcher.pid))
            time.sleep(0.2)
        assert everyone.exists(), "the ranks did not all get through the store's ADD"
        most = max(most, _count(launcher.pid))
        children = open(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read().split()
        gate.write_text("open")
        out, err = launcher.communicate(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, err[-3000:]
    threads, fds = most
    # a few fixed threads (main, I/O, store, dump reporter), none per rank; one child, this
    # host's agent, which holds the ranks' pipes (Note [One agent per host] in
    # runner/agent.py), so the launcher's fds are the ranks' store connections and its own
    assert threads <= 8, most
    assert len(children) == 1, children
    assert fds <= 1.2 * RANKS, most
    lines, errors = rank_lines(out), rank_lines(err, "stderr")
    for rank in range(RANKS):
        assert lines.get(rank) == [f"rank {rank} line {i}" for i in range(3)] + [f"rank {rank} through"], \
            (rank, lines.get(rank))
        assert errors.get(rank) == [f"rank {rank} to stderr"], (rank, errors.get(rank))
