"""The launcher's summary names the rank whose failure started it, and its error (Note [Root
cause] in runner/errors.py, Note [Failure reports] in hvdlite/_runtime/failure.py); the peers' errors
say why; hvdlite.runner.run and torchrun say the same. Summary lines are checked word for word."""
import os
import re
import socket
import subprocess
import sys

import pytest

from hvdlite.runner import JobFailedError, run

HOST = socket.gethostname()

# Line 8 raises on rank 1 (the example, with pids printed for the check). In "kill" mode
# every rank first passes a barrier, so rank 1 dies after its peers' init(), not during it.
EXAMPLE = """import os, sys, torch
import hvdlite as hvd
print(f"PID {os.getpid()}", flush=True)
hvd.init()
mode = os.environ.get("FAIL_MODE", "raise"); mode == "kill" and hvd.barrier()
if hvd.rank() == 1:
    if mode == "raise":
        raise RuntimeError("bad data in rank 1")
    if mode == "exit":
        sys.exit(3)
    if mode == "kill":
        os.kill(os.getpid(), 9)
hvd.allreduce(torch.ones(2 if mode != "mismatch" else 2 + hvd.rank()), name="x")
"""

INIT_FAILS = """import os
import hvdlite as hvd
print(f"PID {os.getpid()}", flush=True)
if os.environ["RANK"] == "1":
    os.environ["HVDLITE_LOCAL_RANK"] = "7"
hvd.init()
"""


def _run(hvdliterun, tmp_path, np, source, mode="raise"):
    script = tmp_path / "ex.py"
    script.write_text(source)
    proc = hvdliterun("-np", np, sys.executable, script, extra_env={"FAIL_MODE": mode}, timeout=60)
    pids = {int(r): int(p) for r, p in re.findall(r"\[(\d+)\]<stdout>: PID (\d+)", proc.stdout)}
    summary = [line for line in proc.stderr.splitlines() if line.startswith("hvdliterun:")]
    return proc, pids, summary


def _others(np):
    others = [r for r in range(np) if r != 1]
    return ("rank " if len(others) == 1 else "ranks ") + ", ".join(map(str, others))


@pytest.mark.parametrize("np", [2, 3])
def test_uncaught_exception_is_the_root_cause_and_the_others_say_why(hvdliterun, tmp_path, np):
    proc, pids, summary = _run(hvdliterun, tmp_path, np, EXAMPLE)
    assert proc.returncode == 1, proc.stderr
    assert summary == [
        f"hvdliterun: error: rank 1 (host {HOST}, pid {pids[1]}) failed first: RuntimeError: bad data "
        "in rank 1 (ex.py, line 8); it exited with code 1",
        f"hvdliterun: then {_others(np)} failed because of it (ShutdownError: allreduce of 'x': hvdlite was "
        "shut down by rank 1, which is exiting after RuntimeError: bad data in rank 1)",
    ], proc.stderr


@pytest.mark.parametrize("np", [2, 3])
def test_exit_without_an_exception_is_the_root_cause(hvdliterun, tmp_path, np):
    proc, pids, summary = _run(hvdliterun, tmp_path, np, EXAMPLE, mode="exit")
    assert proc.returncode == 3, proc.stderr
    assert summary == [
        f"hvdliterun: error: rank 1 (host {HOST}, pid {pids[1]}) failed first: it exited with code 3 "
        "without an exception",
        f"hvdliterun: then {_others(np)} failed because of it (ShutdownError: allreduce of 'x': hvdlite was "
        "shut down (requested by rank 1))",
    ], proc.stderr


@pytest.mark.parametrize("np", [2, 3])
def test_rank_killed_by_a_signal_is_the_root_cause(hvdliterun, tmp_path, np):
    proc, pids, summary = _run(hvdliterun, tmp_path, np, EXAMPLE, mode="kill")
    assert proc.returncode == 1, proc.stderr
    assert summary[0] == (f"hvdliterun: error: rank 1 (host {HOST}, pid {pids[1]}) failed first: it was "
                          "killed by SIGKILL"), proc.stderr
    assert summary[1].startswith(f"hvdliterun: then {_others(np)} failed because of it (RankFailureError: "
                                 "allreduce of 'x': hvdlite lost contact with its peers"), proc.stderr
    assert f"lost rank 1 (pid {pids[1]} on {HOST}): it has exited" in proc.stderr


@pytest.mark.parametrize("np", [2, 3])
def test_the_same_error_on_every_rank_is_reported_once_for_all(hvdliterun, tmp_path, np):
    proc, pids, summary = _run(hvdliterun, tmp_path, np, EXAMPLE, mode="mismatch")
    assert proc.returncode == 1, proc.stderr
    ranks = ", ".join(map(str, range(np)))
    values = "; ".join(f"rank {r} has [{2 + r}]" for r in range(np))
    assert summary == [f"hvdliterun: error: ranks {ranks} failed at once: MismatchError: allreduce of 'x': "
                       f"shape mismatch: {values} (ex.py, line 13)"], proc.stderr


def test_a_rank_failing_inside_init_is_the_root_cause(hvdliterun, tmp_path):
    proc, pids, summary = _run(hvdliterun, tmp_path, 2, INIT_FAILS)
    assert proc.returncode == 1, proc.stderr
    assert summary == [
        f"hvdliterun: error: rank 1 (host {HOST}, pid {pids[1]}) failed first: LaunchEnvironmentError: "
        "hvdlite.init(): local rank 7 is outside a local size of 2 (from hvdliterun) (ex.py, line 6); it exited "
        "with code 1",
    ], proc.stderr


def raise_on_rank_1():
    import torch

    import hvdlite as hvd
    hvd.init()
    if hvd.rank() == 1:
        raise RuntimeError("bad data in rank 1")
    hvd.allreduce(torch.ones(2), name="x")


@pytest.mark.parametrize("np", [2, 3])
def test_runner_run_raises_naming_the_root_cause(np, capfd):
    with pytest.raises(JobFailedError) as info:
        run(raise_on_rank_1, np=np)
    assert info.value.rank == 1
    first, second = str(info.value).splitlines()[:2]
    assert re.fullmatch(rf"hvdlite\.runner\.run: rank 1 \(host {re.escape(HOST)}, pid \d+\) failed first: "
                        r"RuntimeError: bad data in rank 1 \(test_root_cause\.py, line \d+\); it exited with code 1",
                        first), first
    assert second == (f"then {_others(np)} failed because of it (ShutdownError: allreduce of 'x': hvdlite was "
                      "shut down by rank 1, which is exiting after RuntimeError: bad data in rank 1)")


def fail_on_rank_1(mode):
    import os
    import sys

    import torch

    import hvdlite as hvd
    hvd.init()
    if hvd.rank() == 1 and mode == "exit":
        sys.exit(3)
    if hvd.rank() == 1 and mode == "kill":
        os.kill(os.getpid(), 9)
    hvd.allreduce(torch.ones(2 if mode != "mismatch" else 2 + hvd.rank()), name="x")


@pytest.mark.slow
@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("mode", ["exit", "kill", "mismatch"])
def test_runner_run_names_the_root_cause_of_each_kind(np, mode, capfd):
    with pytest.raises(JobFailedError) as info:
        run(fail_on_rank_1, args=(mode,), np=np)
    first = str(info.value).splitlines()[0]
    if mode == "mismatch":
        ranks = ", ".join(map(str, range(np)))
        assert first.startswith(f"hvdlite.runner.run: ranks {ranks} failed at once: MismatchError: allreduce of 'x': "
                                "shape mismatch: rank 0 has [2]; rank 1 has [3]"), first
        assert info.value.rank == 0
        return
    assert info.value.rank == 1
    if mode == "exit":  # inside run(), sys.exit is an exception the function raised
        assert re.fullmatch(rf"hvdlite\.runner\.run: rank 1 \(host {re.escape(HOST)}, pid \d+\) failed first: "
                            r"SystemExit: 3 \(test_root_cause\.py, line \d+\); it exited with code 1", first), first
    else:
        assert re.fullmatch(rf"hvdlite\.runner\.run: rank 1 \(host {re.escape(HOST)}, pid \d+\) failed first: "
                            r"it was killed by SIGKILL", first), first


def test_torchrun_error_file_names_the_root_cause(tmp_path):
    script = tmp_path / "ex.py"
    script.write_text(EXAMPLE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVDLITE_")}
    env.update({"FAIL_MODE": "raise", "OMP_NUM_THREADS": "1"})
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=80, env=env, cwd=tmp_path)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    root = out[out.index("Root Cause"):]
    assert re.search(r"rank\s*:\s*1\b", root), root
    assert 'ex.py", line 8' in root and "RuntimeError: bad data in rank 1" in root, root
