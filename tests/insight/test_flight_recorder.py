"""The flight recorder (Note [Flight record] in csrc/recorder.h, Note [Dump files] in
hvdlite/_runtime/recorder.py, Note [Job directory] in runner/dump.py): a job whose rank 1 sits
in time.sleep while ranks 0 and 2 wait on an allreduce yields one merged report naming the
tensor, rank 1 as missing and the line of its sleep, through `hvdliterun --dump`, through a
stall warning and through a stall failure; a healthy job dumped twice is not disturbed."""
import json
import os
import subprocess
import sys
import time

import pytest

from tests.harness import Job
from tests.launcher.launcher_helpers import LAUNCH

STUCK = '''
import os, sys, time, torch
import hvdlite as hvd
hvd.init()
r = hvd.rank()
for step in range(3):
    assert hvd.allreduce(torch.full((4,), float(r)), name=f"warm{step}", op=hvd.Sum).tolist() == [3.0] * 4
open(os.path.join(os.environ["READY_DIR"], str(r)), "w").close()
if r == 1:
    time.sleep(float(os.environ["SLEEP"]))  # rank 1 is stuck here
out = hvd.allreduce(torch.full((10,), float(r)), name="never.matched", op=hvd.Sum)
assert out.tolist() == [3.0] * 10, out
print(f"rank {r} finished", flush=True)
'''
SLEEP_LINE = STUCK.lstrip("\n").splitlines().index(
    '    time.sleep(float(os.environ["SLEEP"]))  # rank 1 is stuck here') + 1


def _start(tmp_path, sleep, extra_env=None, source=STUCK, np=3):
    script = tmp_path / "stuck.py"
    script.write_text(source.lstrip("\n"))
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVDLITE_")}
    env.update({"READY_DIR": str(ready), "SLEEP": str(sleep), "HVDLITE_JOB_DIR": str(tmp_path / "job"),
                "OMP_NUM_THREADS": "1", **(extra_env or {})})
    launcher = subprocess.Popen(LAUNCH + ["-np", str(np), sys.executable, str(script)], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return launcher, ready, script


def _wait_ready(launcher, ready, count=3, timeout=60):
    deadline = time.monotonic() + timeout
    while len(os.listdir(ready)) < count:
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "the ranks never got ready"
        time.sleep(0.1)


def _check_report(text, script):
    assert "allreduce 'never.matched'" in text, text
    assert "submitted by ranks 0, 2; missing rank 1" in text, text
    assert f"rank 1 is at {script}:{SLEEP_LINE} in <module>: time.sleep(" in text, text
    assert "3 of 3 ranks wrote a record" in text, text


@pytest.mark.slow
def test_hvdliterun_dump_names_the_missing_rank_and_its_line(tmp_path):
    launcher, ready, script = _start(tmp_path, 30)
    try:
        _wait_ready(launcher, ready)
        time.sleep(0.5)  # ranks 0 and 2 are inside the allreduce by now
        dumped = subprocess.run(LAUNCH + ["--dump", str(tmp_path / "job")], capture_output=True, text=True,
                                timeout=40)
        assert dumped.returncode == 0, dumped.stderr
        _check_report(dumped.stdout, script)
        # every rank's record, with every thread's stack
        directory = [line for line in dumped.stdout.splitlines() if "full record" in line][0].split(": ")[-1].rstrip(")")
        records = {r: json.load(open(os.path.join(directory, f"rank{r}.json"))) for r in range(3)}
        assert all(any(t["main"] for t in rec["threads"]) for rec in records.values())
        assert records[1]["where"]["line"] == SLEEP_LINE
        assert "SIGUSR1" in " ".join(records[0]["reasons"]) or "dump signal" in " ".join(records[1]["reasons"])
    finally:
        launcher.kill()
        out, err = launcher.communicate(timeout=30)
    # the launcher printed the same merged report itself
    assert "hvdliterun: hvdlite flight recorder: dump" in err, err[-3000:]


@pytest.mark.slow
def test_a_stall_warning_dumps_every_rank_and_the_job_goes_on(tmp_path):
    launcher, ready, script = _start(tmp_path, 6, {"HVDLITE_STALL_CHECK_TIME_SECONDS": "2"})
    out, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 0, err[-3000:]
    assert all(f"rank {r} finished" in out for r in range(3)), out
    report = "\n".join(line[len("hvdliterun: "):] for line in err.splitlines() if line.startswith("hvdliterun: "))
    assert "flight recorder: dump" in report and "stall: some ranks have not submitted" in report, err[-3000:]
    _check_report(report, script)


def stalled_rank(job_dir):
    """Under the test harness (no hvdliterun): a stall failure writes the dump files."""
    import torch

    import hvdlite as hvd
    hvd.init()
    if hvd.rank() == 1:
        time.sleep(6)
        return None
    try:
        hvd.allreduce(torch.ones(3), name="stalls.here")
    except hvd.StallError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_a_stall_failure_writes_the_dump_files_without_a_launcher(tmp_path):
    job_dir = tmp_path / "job"
    job = Job(2, "tests.insight.test_flight_recorder", "stalled_rank", str(job_dir),
              env={"HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "2", "HVDLITE_STALL_CHECK_TIME_SECONDS": "0",
                   "HVDLITE_JOB_DIR": str(job_dir)})
    results = job.wait(timeout=60, allow_failure=(1,))
    assert "stalled for" in results[0], results
    dumps = os.listdir(job_dir / "dumps")
    assert dumps, "no dump written"
    from hvdlite._job import dumps as merge
    text = merge.report(merge.read_dir(str(job_dir / "dumps" / dumps[0])), size=2)
    assert "stalled for" in text, text
    assert "rank 1 (host" in text and "test_flight_recorder.py" in text, text


HEALTHY = '''
import os, time, torch
import hvdlite as hvd
hvd.init()
r, n = hvd.rank(), hvd.size()
open(os.path.join(os.environ["READY_DIR"], str(r)), "w").close()
done = os.path.join(os.environ["READY_DIR"], "done")
step = 0
while True:  # until the test has dumped the job; every rank stops at the same step
    got = hvd.allreduce(torch.arange(64, dtype=torch.float64) * (r + 1) + step, name=f"s{step % 7}", op=hvd.Sum)
    want = torch.arange(64, dtype=torch.float64) * (n * (n + 1) / 2) + n * step
    assert torch.equal(got, want), (step, got, want)
    step += 1
    time.sleep(0.002)  # a job at work, not a spin: the two ranks would take both cores from the dumps
    if step % 100 == 0 and hvd.allreduce(torch.tensor(float(os.path.exists(done))), name="done", op=hvd.Max).item():
        break
print(f"rank {r} exact", flush=True)
'''


@pytest.mark.slow
def test_dumping_a_healthy_job_does_not_disturb_it(tmp_path):
    script = tmp_path / "healthy.py"
    script.write_text(HEALTHY.lstrip("\n"))
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVDLITE_")}
    env.update({"READY_DIR": str(ready), "HVDLITE_JOB_DIR": str(tmp_path / "job"), "OMP_NUM_THREADS": "1"})
    launcher = subprocess.Popen(LAUNCH + ["-np", "2", sys.executable, str(script)], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(launcher, ready, count=2)
        for _ in range(2):  # the job runs until the test says it is done (the "done" file)
            dumped = subprocess.run(LAUNCH + ["--dump", str(tmp_path / "job")], capture_output=True, text=True,
                                    timeout=40)
            assert dumped.returncode == 0, dumped.stderr
            assert "2 of 2 ranks wrote a record" in dumped.stdout, dumped.stdout
        (ready / "done").touch()
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, err[-3000:]
    assert "rank 0 exact" in out and "rank 1 exact" in out, out
    # the launcher merged both reports into the job directory the test named (HVDLITE_JOB_DIR)
    assert len(list((tmp_path / "job" / "dumps").glob("*/report.txt"))) == 2


def test_dump_without_a_running_job_says_so(tmp_path):
    dumped = subprocess.run(LAUNCH + ["--dump", str(tmp_path / "nothing")], capture_output=True, text=True, timeout=30)
    assert dumped.returncode == 1
    assert "no live rank" in dumped.stderr, dumped.stderr


def backend_timeout():
    """A process group of the hvdlite backend whose timeout passes: the dump files name it."""
    import datetime

    import torch
    import torch.distributed as dist

    import hvdlite  # noqa: F401  (registers the backend)
    rank, size = int(os.environ["HVDLITE_RANK"]), int(os.environ["HVDLITE_SIZE"])
    for name in ("HVDLITE_RANK", "HVDLITE_SIZE"):  # a plain torch.distributed job
        os.environ.pop(name)
    timeout = datetime.timedelta(seconds=2)
    store = dist.TCPStore("127.0.0.1", int(os.environ["HVDLITE_RENDEZVOUS_PORT"]), size, is_master=False,
                          timeout=timeout)
    dist.init_process_group("hvdlite", store=store, rank=rank, world_size=size, timeout=timeout)
    if rank == 1:
        time.sleep(4)  # past the group's timeout
    try:
        dist.all_reduce(torch.ones(2))
        result = "no error"
    except dist.DistBackendError as exc:
        result = str(exc)
    time.sleep(1)  # the recorder thread writes while this rank waits
    dist.destroy_process_group()
    return result


@pytest.mark.slow
def test_a_process_group_timeout_of_the_backend_writes_a_dump(tmp_path):
    job_dir = tmp_path / "job"
    results = Job(2, "tests.insight.test_flight_recorder", "backend_timeout",
                  env={"HVDLITE_JOB_DIR": str(job_dir)}).wait(timeout=60)
    assert "missing rank 1" in results[0], results
    from hvdlite._job import dumps as merge
    found = [merge.read_dir(str(job_dir / "dumps" / d)) for d in os.listdir(job_dir / "dumps")]
    records = [r for f in found for r in f.values() if any("stalled for" in why for why in r["reasons"])]
    assert records, found
    assert "pg0" in records[0]["engines"], records[0]["engines"].keys()


WAITING_RECV = '''
import os, time, torch
import torch.distributed as dist
import hvdlite
dist.init_process_group("hvdlite")
open(os.path.join(os.environ["READY_DIR"], str(dist.get_rank())), "w").close()
if dist.get_rank() == 1:
    dist.recv(torch.empty(3), 0, tag=6)  # waits while rank 0 sleeps
else:
    time.sleep(30)
'''


@pytest.mark.slow
def test_hvdliterun_dump_shows_who_waits_for_whom_point_to_point(tmp_path):
    launcher, ready, _ = _start(tmp_path, 0, source=WAITING_RECV, np=2)
    try:
        _wait_ready(launcher, ready, count=2)
        time.sleep(1.0)
        dumped = subprocess.run(LAUNCH + ["--dump", str(tmp_path / "job")], capture_output=True, text=True,
                                timeout=40)
        assert dumped.returncode == 0, dumped.stderr
        assert "engine pg0: rank 1: recv from rank 0 with tag 6: waiting for rank 0 to send for" in dumped.stdout, \
            dumped.stdout
    finally:
        launcher.kill()
        launcher.communicate(timeout=30)
