"""hvdliterun end to end with local ranks: environment, prefixes, files, flags."""
import json
import socket
import sys

import pytest

from hvdlite.runner import launch
from launcher_helpers import rank_lines

PRINT_ENV = r"""
import json, os
names = [n for n in os.environ if n.startswith(("HVDLITE_", "HOROVOD_"))] + [
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "MY_CUSTOM_VAR"]
env = {n: os.environ.get(n) for n in names}
env["cwd"] = os.getcwd()
print(json.dumps(env))
"""


def _envs(proc):
    """{rank: environment} in rank order.

    Ranks run concurrently, so their lines reach the launcher's stdout in whatever order they
    were printed; rank_lines() keeps that order, which on a loaded machine is often not 0, 1.
    """
    assert proc.returncode == 0, proc.stderr
    lines = rank_lines(proc.stdout)
    ranks = sorted(r for r in lines if r is not None)
    return {rank: json.loads(lines[rank][0]) for rank in ranks}


@pytest.mark.parametrize("np", [1, 2, 3])
def test_launch_local_ranks_get_contract_environment(hvdliterun, tmp_path, np):
    proc = hvdliterun("-np", np, sys.executable, "-c", PRINT_ENV)
    envs = _envs(proc)
    assert sorted(envs) == list(range(np))
    secrets = {e["HVDLITE_RENDEZVOUS_SECRET"] for e in envs.values()}
    assert len(secrets) == 1 and len(secrets.pop()) == 64
    for rank, env in envs.items():
        assert env["HVDLITE_RANK"] == env["RANK"] == str(rank)
        assert env["HVDLITE_SIZE"] == env["WORLD_SIZE"] == str(np)
        assert env["HVDLITE_LOCAL_RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["HVDLITE_LOCAL_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(np)
        assert env["HVDLITE_CROSS_RANK"] == "0" and env["HVDLITE_CROSS_SIZE"] == "1"
        assert env["HVDLITE_HOSTNAME"] == socket.gethostname()
        # horovodrun's names for the same place, for Horovod scripts that read them
        for name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME"):
            assert env[f"HOROVOD_{name}"] == env[f"HVDLITE_{name}"], name
        assert env["HOROVOD_CONTROLLER"] == env["HOROVOD_CPU_OPERATIONS"] == "gloo"
        assert env["HVDLITE_RENDEZVOUS_ADDR"] == env["MASTER_ADDR"] == "127.0.0.1"
        assert env["HVDLITE_RENDEZVOUS_PORT"] != env["MASTER_PORT"]
        assert int(env["MASTER_PORT"]) > 0 and int(env["HVDLITE_RENDEZVOUS_PORT"]) > 0
        assert env["cwd"] == str(tmp_path)
        # Core knobs are left to the core's defaults unless a flag sets them.
        assert "HVDLITE_FUSION_THRESHOLD" not in env and "HVDLITE_LOG_LEVEL" not in env


def test_launch_localhost_host_list_runs_locally(hvdliterun):
    envs = _envs(hvdliterun("-H", "localhost:2", sys.executable, "-c", PRINT_ENV))
    assert [envs[r]["HVDLITE_HOSTNAME"] for r in (0, 1)] == ["localhost", "localhost"]
    assert [envs[r]["LOCAL_RANK"] for r in (0, 1)] == ["0", "1"]
    assert envs[0]["HVDLITE_RENDEZVOUS_ADDR"] == "127.0.0.1"


def test_launch_hostfile_with_comments(hvdliterun, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# local only\n127.0.0.1 slots=2  # two ranks\n")
    envs = _envs(hvdliterun("--hostfile", hostfile, "-np", 2, sys.executable, "-c", PRINT_ENV))
    assert [e["HVDLITE_HOSTNAME"] for e in envs.values()] == ["127.0.0.1", "127.0.0.1"]


def test_launch_forwards_environment_and_flags(hvdliterun, tmp_path):
    proc = hvdliterun("-np", 2, "--fusion-threshold-mb", 2, "--cycle-time-ms", 2.5,
                      "--timeline-filename", tmp_path / "tl.json", "--verbose",
                      "--stall-check-time-seconds", 7, "--stall-shutdown-time-seconds", 30,
                      sys.executable, "-c", PRINT_ENV,
                      extra_env={"MY_CUSTOM_VAR": "it travels", "HVDLITE_RANK": "99"})
    for env in _envs(proc).values():
        assert env["MY_CUSTOM_VAR"] == "it travels"
        assert env["HVDLITE_FUSION_THRESHOLD"] == str(2 * 1024 * 1024)
        assert env["HVDLITE_CYCLE_TIME"] == "2.5"
        assert env["HVDLITE_TIMELINE"] == str(tmp_path / "tl.json")
        assert env["HVDLITE_LOG_LEVEL"] == "debug"
        assert env["HVDLITE_STALL_CHECK_TIME_SECONDS"] == "7"
        assert env["HVDLITE_STALL_SHUTDOWN_TIME_SECONDS"] == "30"
    assert {e["HVDLITE_RANK"] for e in _envs(proc).values()} == {"0", "1"}
    assert "hvdliterun: rendezvous store on 127.0.0.1:" in proc.stderr  # --verbose log


CHATTY = r"""
import os, sys
rank = os.environ["RANK"]
for i in range(300):
    # Each line is written in two flushed pieces; the launcher must still keep it whole.
    sys.stdout.write(f"out {rank} {i} " + "x" * 50); sys.stdout.flush()
    sys.stdout.write(" end\n"); sys.stdout.flush()
    sys.stderr.write(f"err {rank} {i}\n")
sys.stdout.write("no newline at the end")
"""


def test_launch_prefixes_every_line_and_never_interleaves(hvdliterun):
    proc = hvdliterun("-np", 3, sys.executable, "-c", CHATTY)
    assert proc.returncode == 0, proc.stderr
    out = rank_lines(proc.stdout, "stdout")
    err = rank_lines(proc.stderr, "stderr")
    assert None not in out and None not in err  # every line carries a prefix
    for rank in range(3):
        expected = [f"out {rank} {i} " + "x" * 50 + " end" for i in range(300)]
        assert out[rank] == expected + ["no newline at the end"]
        assert err[rank] == [f"err {rank} {i}" for i in range(300)]


def test_launch_output_filename_writes_per_rank_files(hvdliterun, tmp_path):
    code = "import os, sys; r = os.environ['RANK']; print('hello', r); " \
           "print('oops', r, file=sys.stderr)"
    proc = hvdliterun("-np", 2, "--output-filename", tmp_path / "logs", sys.executable, "-c",
                      code)
    assert proc.returncode == 0, proc.stderr
    for rank in range(2):
        assert (tmp_path / "logs" / f"rank.{rank}" / "stdout").read_text() == f"hello {rank}\n"
        assert (tmp_path / "logs" / f"rank.{rank}" / "stderr").read_text() == f"oops {rank}\n"
    assert "[1]<stdout>: hello 1" in proc.stdout  # still on the terminal too


def test_launch_double_dash_and_options_after_command_belong_to_the_command(hvdliterun):
    proc = hvdliterun("-np", 1, "--", sys.executable, "-c", "import sys; print(sys.argv[1:])",
                      "-np", "7", "--verbose")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[0]<stdout>: ['-np', '7', '--verbose']\n"


def test_launch_check_build_reports_backends(hvdliterun):
    proc = hvdliterun("--check-build")
    assert proc.returncode == 0, proc.stderr
    assert "torch: " in proc.stdout and "Gloo" in proc.stdout and "NCCL" in proc.stdout
    assert "CUDA" in proc.stdout and "hvdlite: " in proc.stdout


def test_launch_help_reads_like_a_manual(capsys):
    with pytest.raises(SystemExit) as info:
        launch.main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for needle in ("examples:", "hvdliterun -np 4 python train.py", "-H node1:4,node2:4",
                   "--hostfile", "HVDLITE_RANK", "MASTER_PORT", "exit status:",
                   "--start-timeout", "--ssh-port", "--network-interface"):
        assert needle in text
