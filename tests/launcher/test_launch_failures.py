"""hvdliterun when things go wrong: failing ranks, signals, start timeout, bad command lines."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from hvdlite.runner import launch
from launcher_helpers import LAUNCH

RANK1_FAILS = r"""
import os, sys, time
if os.environ["RANK"] == "1":
    time.sleep(0.3)
    print(f"rank 1 gives up at {time.time()!r}", file=sys.stderr)
    sys.exit(3)
time.sleep(60)
"""


def test_launch_failing_rank_stops_others_and_is_named(hvdliterun):
    proc = hvdliterun("-np", 3, sys.executable, "-c", RANK1_FAILS, timeout=40)
    # Timed from the failure, not from the launch: starting four interpreters on a loaded
    # machine can take seconds, and that is not what this test is about.
    assert proc.returncode == 3, proc.stderr
    elapsed = time.time() - float(re.search(r"gives up at (\S+)", proc.stderr).group(1))
    assert elapsed < 10, f"the sleeping ranks were not stopped promptly ({elapsed:.1f} s)"
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hvdliterun: error: rank 1 (host ")
    assert "failed first: it exited with code 3 without an exception" in last
    assert "[1]<stderr>: rank 1 gives up" in proc.stderr
    # The ranks stopped afterwards are consequences, not causes.
    assert "rank 0" not in last and "rank 2" not in last


def test_launch_rank_killed_by_signal_is_named(hvdliterun):
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    proc = hvdliterun("-np", 1, sys.executable, "-c", code)
    assert proc.returncode == 1
    assert "rank 0" in proc.stderr and "was killed by SIGKILL" in proc.stderr


def test_launch_missing_program_is_one_clear_line(hvdliterun):
    proc = hvdliterun("-np", 2, "no-such-program-hvdlite")
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "could not start rank 0" in proc.stderr and "no-such-program-hvdlite" in proc.stderr


WRITE_PID_AND_SLEEP = r"""
import os, signal, sys, time
if sys.argv[2] == "stubborn":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
path = os.path.join(sys.argv[1], "pid." + os.environ["RANK"])
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
time.sleep(60)
"""


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("mode,sig", [("polite", signal.SIGINT), ("stubborn", signal.SIGTERM)])
def test_launch_signal_stops_every_rank(tmp_path, mode, sig):
    np = 2
    launcher = subprocess.Popen(
        LAUNCH + ["-np", str(np), "--grace-period", "1", sys.executable, "-c",
                  WRITE_PID_AND_SLEEP, str(tmp_path), mode],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        paths = [tmp_path / f"pid.{r}" for r in range(np)]
        while not all(p.exists() for p in paths):
            assert time.monotonic() < deadline, "ranks did not start"
            assert launcher.poll() is None, launcher.communicate()
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in paths]
        t0 = time.monotonic()
        launcher.send_signal(sig)
        out, err = launcher.communicate(timeout=20)
        elapsed = time.monotonic() - t0
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + sig
    assert f"stopped every rank on {signal.Signals(sig).name}" in err
    assert elapsed < 8
    assert [pid for pid in pids if _alive(pid)] == []


# Importing hvdlite.runner imports neither torch nor the core (Note [Lazy exports]), so a rank
# reaches the rendezvous well within the short start timeouts below.
LOAD_RENDEZVOUS = r"""
from hvdlite.runner.rendezvous import RendezvousClient, RendezvousError
"""

CONNECT_THEN_SLEEP = LOAD_RENDEZVOUS + r"""
import os, time
if os.environ["RANK"] == "0":
    RendezvousClient(os.environ["HVDLITE_RENDEZVOUS_ADDR"],
                     int(os.environ["HVDLITE_RENDEZVOUS_PORT"]),
                     os.environ["HVDLITE_RENDEZVOUS_SECRET"], rank=0)
time.sleep(60)
"""


def test_launch_start_timeout_names_ranks_that_never_arrived(hvdliterun):
    t0 = time.monotonic()
    proc = hvdliterun("-np", 3, "--start-timeout", 2, sys.executable, "-c",
                      CONNECT_THEN_SLEEP, timeout=40)
    assert proc.returncode == 1
    assert time.monotonic() - t0 < 12
    last = proc.stderr.strip().splitlines()[-1]
    assert "ranks 1, 2 did not reach the rendezvous within the start timeout of 2 s" in last


def test_launch_start_timeout_ignores_jobs_that_never_use_the_rendezvous(hvdliterun):
    # Plain torch.distributed code meets through MASTER_ADDR; it must not be stopped.
    proc = hvdliterun("-np", 2, "--start-timeout", 0.5, sys.executable, "-c",
                      "import time; time.sleep(1.5); print('done')")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("done") == 2


WRONG_SECRET = LOAD_RENDEZVOUS + r"""
import os
addr, port = os.environ["HVDLITE_RENDEZVOUS_ADDR"], int(os.environ["HVDLITE_RENDEZVOUS_PORT"])
try:
    RendezvousClient(addr, port, "guessed", rank=0, connect_timeout=2)
    print("joined without the secret")
except RendezvousError:
    print("refused")
RendezvousClient(addr, port, os.environ["HVDLITE_RENDEZVOUS_SECRET"], rank=0)
print("joined with the secret")
"""


def test_launch_rendezvous_refuses_a_client_without_the_job_secret(hvdliterun):
    proc = hvdliterun("-np", 1, sys.executable, "-c", WRONG_SECRET)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[0]<stdout>: refused",
                                        "[0]<stdout>: joined with the secret"]


BAD_COMMAND_LINES = [
    (["-np", "two", "echo"], "expected a whole number, got 'two'"),
    (["-np", "0", "echo"], "must be at least 1"),
    (["-np", "3", "-H", "localhost:2", "echo"], "-np 3 is more than the 2 slots"),
    (["-H", "localhost:two", "echo"], "'two' is not a whole number"),
    (["-H", "a::1", "echo"], "expected HOST or HOST:SLOTS"),
    (["-H", "a:1,a:1", "echo"], "listed twice"),
    (["-np", "2"], "missing COMMAND"),
    (["-np", "2", "--"], "missing COMMAND"),
    (["echo"], "-np N is required"),
    (["-np", "1", "--bogus-flag", "echo"], "unrecognized arguments: --bogus-flag"),
    (["-np", "1", "--hostfile", "/nonexistent/hosts", "echo"], "cannot read --hostfile"),
    (["-np", "1", "-H", "localhost", "--hostfile", "h", "echo"], "not allowed with"),
    (["-np", "1", "--start-timeout", "soon", "echo"], "expected a number"),
    (["-np", "1", "-p", "70000", "-H", "x", "echo"], "not a port number"),
    (["-np", "1", "--network-interface", "nosuchif0", "echo"], "'nosuchif0' does not exist"),
]


@pytest.mark.parametrize("args,needle", BAD_COMMAND_LINES)
def test_launch_bad_command_line_is_one_line_exit_2(capsys, args, needle):
    # In process: parsing fails before anything starts, so a launcher subprocess per case
    # would only add interpreter start-ups.
    assert launch.main(args) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1, err
    assert err.startswith("hvdliterun: error: ")
    assert needle in err
    assert out == ""


@pytest.mark.parametrize("args,needle", [BAD_COMMAND_LINES[0], BAD_COMMAND_LINES[6]])
def test_launch_bad_command_line_from_the_real_cli_has_no_traceback(hvdliterun, args, needle):
    proc = hvdliterun(*args)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("hvdliterun: error: ") and needle in proc.stderr
