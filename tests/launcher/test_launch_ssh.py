"""The ssh command lines of remote ranks, recorded by a stand-in.

A fake `ssh` first on PATH records its arguments and runs the remote command locally in a new
session, as sshd would (without a terminal, detached from the launcher's process group). What
is checked: the ssh options, the host, the exported environment, the working directory, and
that stopping the job stops the "remote" ranks. Jobs across real hosts (network namespaces
with real sshd) are in tests/multihost.
"""
import json
import os
import re
import shutil
import stat
import sys
import time

import pytest

from launcher_helpers import rank_lines

pytestmark = pytest.mark.skipif(shutil.which("setsid") is None,
                                reason="the fake ssh needs setsid(1)")

FAKE_SSH = r"""#!/bin/sh
log="$FAKE_SSH_LOG/ssh.$$"
for a in "$@"; do printf '%s\0' "$a"; done > "$log"
while [ $# -gt 0 ]; do
  case "$1" in
    -p|-i|-o|-l) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
shift  # the host
exec setsid -w /bin/sh -c "$*"
"""


@pytest.fixture
def fake_ssh(tmp_path):
    bindir = tmp_path / "bin"
    logdir = tmp_path / "ssh-log"
    bindir.mkdir()
    logdir.mkdir()
    ssh = bindir / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(ssh.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
           "FAKE_SSH_LOG": str(logdir)}

    def calls():
        return [p.read_bytes().split(b"\0")[:-1] for p in sorted(logdir.iterdir())]

    return env, calls


PRINT_ENV = r"""
import json, os
keys = ["RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "HVDLITE_HOSTNAME", "HVDLITE_CROSS_RANK",
        "HVDLITE_CROSS_SIZE", "HVDLITE_RENDEZVOUS_SECRET", "HVDLITE_RENDEZVOUS_PORT",
        "MASTER_ADDR", "REMOTE_TEST_VAR"]
env = {k: os.environ.get(k) for k in keys}
env["cwd"] = os.getcwd()
print(json.dumps(env))
"""


def test_launch_remote_ranks_via_ssh_get_options_environment_and_cwd(hvdliterun, fake_ssh,
                                                                     tmp_path):
    env, calls = fake_ssh
    key = tmp_path / "id_test"
    key.write_text("not a real key\n")
    env["REMOTE_TEST_VAR"] = "it's got 'quotes' and $dollars"
    proc = hvdliterun("-H", "localhost:1,node-a:2,node-b:1", "-p", 2222, "-i", key,
                      sys.executable, "-c", PRINT_ENV, extra_env=env)
    assert proc.returncode == 0, proc.stderr
    envs = {r: json.loads(lines[0]) for r, lines in rank_lines(proc.stdout).items()}
    assert [envs[r]["HVDLITE_HOSTNAME"] for r in range(4)] == \
        ["localhost", "node-a", "node-a", "node-b"]
    assert [envs[r]["LOCAL_RANK"] for r in range(4)] == ["0", "0", "1", "0"]
    assert [envs[r]["HVDLITE_CROSS_RANK"] for r in range(4)] == ["0", "1", "0", "2"]
    assert [envs[r]["HVDLITE_CROSS_SIZE"] for r in range(4)] == ["3", "3", "1", "3"]
    assert len({e["HVDLITE_RENDEZVOUS_SECRET"] for e in envs.values()}) == 1
    for e in envs.values():
        assert e["REMOTE_TEST_VAR"] == "it's got 'quotes' and $dollars"
        assert e["cwd"] == str(tmp_path)
        assert e["MASTER_ADDR"] != "127.0.0.1"  # remote ranks must be able to reach it

    everything = calls()
    discovery = [args for args in everything if b"hvdlite.runner.task_service" in args[-1]]
    recorded = [args for args in everything if args not in discovery]
    # one ssh per remote host, whatever its ranks (Note [One agent per host]), none for localhost
    assert len(recorded) == 2
    assert sorted(args[-2].decode() for args in recorded) == ["node-a", "node-b"]
    assert all(b"hvdlite.runner.agent" in args[-1] for args in recorded)
    # network discovery ran one task on each remote host first, with the same ssh options
    assert sorted(args[-2].decode() for args in discovery) == ["node-a", "node-b"]
    for args in everything:
        text = [a.decode() for a in args]
        assert text[text.index("-p") + 1] == "2222"
        assert text[text.index("-i") + 1] == str(key)
        assert "BatchMode=yes" in text and "StrictHostKeyChecking=no" in text
        remote = text[-1]
        assert remote.startswith(f"cd {tmp_path} && ")
        assert "REMOTE_TEST_VAR=" in remote  # the environment is forwarded to both
        assert "HVDLITE_RANK=" not in remote  # a rank's own variables travel to its agent
        # Variables that describe the launching machine stay behind.
        assert not re.search(r"(^| )(HOSTNAME|PWD|SHLVL|SSH_[A-Z_]*|DISPLAY)=", remote)


STOP_REMOTE = r"""
import os, sys, time
path = os.path.join(sys.argv[1], "pid." + os.environ["RANK"])
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
if os.environ["RANK"] == "0":
    while not all(os.path.exists(os.path.join(sys.argv[1], f"pid.{r}")) for r in (1, 2)):
        time.sleep(0.05)
    sys.exit(5)
time.sleep(60)
"""


def test_launch_local_failure_stops_remote_ranks(hvdliterun, fake_ssh, tmp_path):
    env, _ = fake_ssh
    t0 = time.monotonic()
    proc = hvdliterun("-H", "localhost:1,node-a:2", "--grace-period", 2, sys.executable,
                      "-c", STOP_REMOTE, tmp_path, extra_env=env, timeout=40)
    assert proc.returncode == 5
    assert re.search(r"rank 0 \(host localhost, pid \d+\) failed first: it exited with code 5", proc.stderr)
    assert time.monotonic() - t0 < 15
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in (1, 2)]
    deadline = time.monotonic() + 5  # the remote side stops its rank asynchronously
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if _alive(p)] == []


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # The rank's session was detached: once it exits, init may not have reaped it yet.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
