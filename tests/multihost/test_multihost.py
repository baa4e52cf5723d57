"""hvdliterun across hosts that are real to the software: network namespaces with their own
names, addresses, decoy interfaces and real sshd (tests/multihost/hosts.py). Every job runs
under a hard timeout, and every test checks that nothing is left running on any host."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.multihost.hosts import PREFIX

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = [sys.executable, "tests/multihost/collective_job.py"]
LAUNCH = [sys.executable, "-m", "hvdlite.runner.launch"]


def launcher(hosts, *args):
    return LAUNCH + ["--ssh-config-file", hosts.ssh_config] + list(args)


def run_on(hosts, host, argv, env=None, timeout=120):
    return hosts.run(host, argv, timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})


def lines(text, marker):
    return [line for line in text.splitlines() if marker in line]


def assert_nothing_left(hosts, names=("hvta", "hvtb", "hvtc"), within=10.0):
    deadline = time.monotonic() + within
    while True:
        left = {name: hosts.pids(name) for name in names}
        left = {name: pids for name, pids in left.items() if pids}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"processes left running: {left}"


class Background:
    """A launcher running in the background whose output lines are collected as they come."""

    def __init__(self, argv, env=None):
        self.proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def wait_for(self, marker, count, timeout=60):
        deadline = time.monotonic() + timeout
        while sum(marker in line for _, line in self.lines) < count:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"never saw {count} x {marker!r}:\n" + self.text())
            time.sleep(0.05)

    def finish(self, timeout):
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.reader.join(timeout=5)
        return self.proc.returncode

    def text(self):
        return "\n".join(line for _, line in self.lines)


# ---- jobs across hosts ---------------------------------------------------------------------

def test_collectives_and_training_across_two_hosts_launched_from_one_of_them(hosts):
    result = run_on(hosts, "hvta", launcher(hosts, "-H", "hvta:2,hvtb:2") + JOB, env={"JOB_MARK": "forwarded"})
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    checked = lines(out, "CHECKED")
    assert len(checked) == 4, out[-4000:]
    for rank, host in ((0, "hvta"), (1, "hvta"), (2, "hvtb"), (3, "hvtb")):
        # rank-prefixed output from every host, the environment forwarded, the discovered interface
        assert f"[{rank}]<stdout>: CHECKED rank {rank} of 4 on {host} ifname=eth0 mark=forwarded homogeneous=True" \
            in checked
    assert_nothing_left(hosts)


# Note [Control link] (the default: recursive doubling over the control plane's own
# connections, here with 6 and 3 ranks, so with ranks folded in and out), and a Gloo group's
# alltoall (HVDLITE_CONTROL_LINK=0, Note [Control exchange by alltoall])
EXCHANGES = {"link": {}, "gloo": {"HVDLITE_CONTROL_LINK": "0"}}


@pytest.mark.parametrize("exchange", sorted(EXCHANGES))
def test_three_hosts_from_outside_with_a_hostfile(hosts, tmp_path, exchange):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("".join(f"{hosts.address(n)} slots=2\n" for n in ("hvta", "hvtb", "hvtc")))
    result = subprocess.run(launcher(hosts, "--verbose", "--hostfile", str(hostfile)) + JOB, cwd=REPO,
                            capture_output=True, text=True, timeout=120, env={**os.environ, **EXCHANGES[exchange]})
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert sorted(lines(out, "CHECKED")) == [
        f"[{r}]<stdout>: CHECKED rank {r} of 6 on {n} ifname=eth0 mark=None homogeneous=True"
        for r, n in enumerate(("hvta", "hvta", "hvtb", "hvtb", "hvtc", "hvtc"))]
    # six remote ranks, one ssh connection per host (Note [One agent per host] in runner/agent.py)
    assert "hvdliterun: ssh connections for ranks: 3" in out, out[-4000:]
    # discovery tried the decoys and kept the interface every host reaches every host through
    report = lines(out, "hvdliterun: discovery:")
    a, b = hosts.address("hvta"), hosts.address("hvtb")
    assert any(f"{a} (hvta) reaches {b} (hvtb) through eth0 (tried dcy0 " in line for line in report), report
    assert any(f"ranks use eth0, rendezvous at {hosts.outside_address}" in line for line in report), report
    assert_nothing_left(hosts)


def test_uneven_hosts_give_one_homogeneous_answer_and_horovods_cross_ranks(hosts):
    result = run_on(hosts, "hvta", launcher(hosts, "-H", "hvta:2,hvtb:1") + JOB)
    out = result.stdout + result.stderr
    checked = lines(out, "CHECKED")
    assert result.returncode == 0 and len(checked) == 3, out[-3000:]
    assert all(line.endswith("homogeneous=False") for line in checked), checked
    # horovod.torch's cross communicators on uneven hosts: the ranks that share a local rank
    # (Note [Cross ranks]); hvdliterun sets horovodrun's variables to the same values
    assert sorted(lines(out, "PLACE")) == [
        "[0]<stdout>: PLACE rank 0 local 0/2 cross 0/2 env 0,3,0,2,0,2,hvta",
        "[1]<stdout>: PLACE rank 1 local 1/2 cross 0/1 env 1,3,1,2,0,1,hvta",
        "[2]<stdout>: PLACE rank 2 local 0/1 cross 1/2 env 2,3,0,1,1,2,hvtb"], out[-3000:]
    assert_nothing_left(hosts)


def test_without_discovery_the_decoy_interface_breaks_the_job(hosts):
    # The control for the two tests above: the same job without discovery fails, because each
    # host's own name resolves to its decoy address, which Gloo then advertises.
    started = time.monotonic()
    result = run_on(hosts, "hvta", launcher(hosts, "--no-network-discovery", "-H", "hvta:1,hvtb:1") + JOB,
                    env={"HVDLITE_PROCESS_GROUP_TIMEOUT_SECONDS": "10"})
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "CHECKED" not in out, out[-3000:]
    assert "could not connect its process groups to the other ranks" in out, out[-3000:]
    assert time.monotonic() - started < 60
    assert_nothing_left(hosts)


def test_network_interfaces_given_by_hand_replace_discovery(hosts):
    good = run_on(hosts, "hvta", launcher(hosts, "--verbose", "--network-interfaces", "eth0",
                                         "-H", "hvta:1,hvtb:1") + JOB)
    out = good.stdout + good.stderr
    assert good.returncode == 0 and len(lines(out, "CHECKED")) == 2, out[-3000:]
    assert not lines(out, "hvdliterun: discovery:")
    # the decoy by hand: the rendezvous is served there too, so hvtb's rank never arrives
    bad = run_on(hosts, "hvta", launcher(hosts, "--network-interfaces", "dcy0", "--start-timeout", "15",
                                        "-H", "hvta:1,hvtb:1") + JOB,
                 env={"HVDLITE_PROCESS_GROUP_TIMEOUT_SECONDS": "10"})
    assert bad.returncode != 0 and "CHECKED" not in bad.stdout
    assert "rank 1 did not reach the rendezvous within the start timeout" in bad.stderr, bad.stderr[-2000:]
    assert_nothing_left(hosts)


def test_no_interface_common_to_every_host_fails_before_any_rank_starts(hosts):
    ns = f"{PREFIX}-hvtc"
    rename = lambda old, new: [subprocess.run(["ip", "-n", ns, "link", "set", *args], check=True)  # noqa: E731
                               for args in (("dev", old, "down"), ("dev", old, "name", new), ("dev", new, "up"))]
    rename("eth0", "ens5")
    try:
        started = time.monotonic()
        result = run_on(hosts, "hvta", launcher(hosts, "-H", "hvta:1,hvtc:1") + JOB)
        elapsed = time.monotonic() - started
    finally:
        rename("ens5", "eth0")
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "STARTED" not in out, out[-3000:]
    assert "no network interface reaches every host from its neighbours" in out, out
    assert "hvta reaches hvtc through ens5" in out and "hvtc reaches hvta through eth0" in out, out
    assert elapsed < 30
    assert_nothing_left(hosts)


def test_rendezvous_is_reachable_from_other_hosts_and_refuses_a_wrong_secret(hosts):
    from hvdlite.runner.rendezvous import RendezvousServer, new_secret
    server = RendezvousServer(new_secret(), host="0.0.0.0").start()
    try:
        client = ("import sys; from hvdlite._job.wire import RendezvousClient, RendezvousError\n"
                  "addr, port, secret = sys.argv[1], int(sys.argv[2]), sys.argv[3]\n"
                  "try:\n"
                  "    c = RendezvousClient(addr, port, secret, connect_timeout=5)\n"
                  "    c.call(b'SET', [b'k', b'from ' + sys.argv[4].encode()]); print('ACCEPTED')\n"
                  "except RendezvousError as e:\n"
                  "    print('REFUSED', e)\n")
        for secret, want in ((server.secret, "ACCEPTED"), ("0" * 64, "REFUSED")):
            result = run_on(hosts, "hvtb", [sys.executable, "-c", client, hosts.outside_address,
                                           str(server.port), secret, "hvtb"], timeout=30)
            assert result.stdout.startswith(want), (result.stdout, result.stderr)
        assert server.refused_connections >= 1
    finally:
        server.stop()


# ---- faults across hosts -------------------------------------------------------------------

def test_host_whose_sshd_is_down_is_named_and_nothing_is_left(hosts):
    hosts.stop_sshd("hvtc")
    try:
        started = time.monotonic()
        result = run_on(hosts, "hvta", launcher(hosts, "-H", "hvta:1,hvtc:1") + JOB, timeout=60)
        elapsed = time.monotonic() - started
    finally:
        hosts.start_sshd("hvtc")
        hosts.wait_ssh("hvtc")
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "STARTED" not in out, out[-3000:]
    assert "network discovery failed on host hvtc" in out and "Connection refused" in out, out[-3000:]
    print(f"sshd down: the launcher failed after {elapsed:.2f} s")
    assert elapsed < 30
    assert_nothing_left(hosts)


def _long_job(hosts, env, from_host=None):
    addrs = ",".join(f"{hosts.address(n)}:1" for n in ("hvta", "hvtb", "hvtc"))
    env = {"JOB_STEPS": "100000", "JOB_STEP_PAUSE": "0.02", **env}
    if from_host is None:
        return Background(launcher(hosts, "-H", addrs) + JOB, env=env)
    return Background(hosts.command(from_host, launcher(hosts, "-H", "hvta:1,hvtb:1,hvtc:1") + JOB), env=env)


def _check_survivors(job, lost_rank, lost_host, since, limit):
    failed = [(t, line) for t, line in job.lines if "FAILED rank" in line]
    survivors = [r for r in range(3) if r != lost_rank]
    for r in survivors:
        mine = [(t, line) for t, line in failed if f"FAILED rank {r} " in line]
        assert mine, f"rank {r} did not report the failure:\n{job.text()[-5000:]}"
        t, line = mine[0]
        assert "RankFailureError" in line and f"ranks=[{lost_rank}]" in line and lost_host in line, line
        assert t - since < limit, (t - since, line)
    return max(t for t, line in failed if any(f"FAILED rank {r} " in line for r in survivors)) - since


@pytest.mark.parametrize("exchange", sorted(EXCHANGES))
def test_every_process_of_one_host_killed_at_once(hosts, exchange):
    job = _long_job(hosts, EXCHANGES[exchange])
    try:
        job.wait_for("TRAINING rank", 3)
        killed = time.time()
        hosts.kill_all("hvtc")
        code = job.finish(timeout=60)
    finally:
        hosts.start_sshd("hvtc")
        hosts.wait_ssh("hvtc")
    took = _check_survivors(job, 2, "hvtc", killed, 10.0)
    assert code != 0
    summary = lines(job.text(), "hvdliterun: error:")
    assert summary and "hvtc" in summary[-1], job.text()[-3000:]
    print(f"host killed: survivors raised within {took:.2f} s; launcher: {summary[-1]}")
    assert_nothing_left(hosts)


def test_link_of_one_host_cut_mid_training(hosts):
    timeout = 5  # the process-group timeout chosen for this case (HVDLITE_PROCESS_GROUP_TIMEOUT_SECONDS)
    job = _long_job(hosts, {"HVDLITE_PROCESS_GROUP_TIMEOUT_SECONDS": str(timeout)})
    try:
        job.wait_for("TRAINING rank", 3)
        cut = time.time()
        hosts.cut_link("hvtc")
        code = job.finish(timeout=90)
    finally:
        hosts.restore_link("hvtc")
    took = _check_survivors(job, 2, "hvtc", cut, timeout + 10.0)
    assert code != 0
    summary = lines(job.text(), "hvdliterun: error:")
    assert summary and "hvtc" in summary[-1], job.text()[-3000:]
    print(f"link cut: survivors raised within {took:.2f} s (process-group timeout {timeout} s); "
          f"launcher: {summary[-1]}")
    assert_nothing_left(hosts, within=30.0)  # the cut host's ranks time out by themselves


@pytest.mark.parametrize("exchange", sorted(EXCHANGES))
def test_a_frozen_rank_on_another_host_is_named_within_the_stall_time(hosts, exchange):
    """SIGSTOP: hvtc's rank is alive, its sockets open, and it never joins another round. The
    others give up on the control exchange after the stall shutdown time, not the 300 s
    process-group timeout, and the census names it (Note [Frozen peers] in groups.py)."""
    stall = 4
    job = _long_job(hosts, {"HVDLITE_STALL_CHECK_TIME_SECONDS": "2", "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": str(stall),
                            **EXCHANGES[exchange]})
    frozen = None
    try:
        job.wait_for("TRAINING rank", 3)
        frozen = next(pid for pid, cmd in hosts.pids("hvtc") if cmd.startswith(sys.executable) and "collective_job.py" in cmd)
        stopped = time.time()
        os.kill(frozen, signal.SIGSTOP)
        code = job.finish(timeout=60)
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
    took = _check_survivors(job, 2, "hvtc", stopped, stall + 8.0)
    assert code != 0
    summary = lines(job.text(), "hvdliterun: error:")
    assert summary and "hvtc" in summary[-1], job.text()[-3000:]
    print(f"frozen rank: survivors raised within {took:.2f} s (stall shutdown {stall} s); launcher: {summary[-1]}")
    assert_nothing_left(hosts)


def test_link_that_flaps_for_less_than_the_timeout_leaves_a_static_job_exact(hosts):
    """hvtc's only link goes down for 3 s and comes back, well inside the 15 s process-group
    timeout: nothing fails, and every step's result is still checked against its closed form
    (collective_job.py). test_link_of_one_host_cut_mid_training is the link that stays down."""
    job = _long_job(hosts, {"HVDLITE_PROCESS_GROUP_TIMEOUT_SECONDS": "15", "JOB_STEPS": "400"})
    try:
        job.wait_for("TRAINING rank", 3)
        hosts.cut_link("hvtc")
        time.sleep(3.0)
    finally:
        hosts.restore_link("hvtc")
    code = job.finish(timeout=90)
    assert code == 0, job.text()[-3000:]
    assert len(lines(job.text(), "CHECKED rank")) == 3, job.text()[-3000:]
    assert not lines(job.text(), "FAILED rank"), job.text()[-3000:]
    assert_nothing_left(hosts)


def test_launcher_killed_stops_every_rank_on_every_host(hosts):
    job = _long_job(hosts, {}, from_host="hvta")  # local ranks on hvta, remote ones on hvtb, hvtc
    job.wait_for("TRAINING rank", 3)
    killed = time.monotonic()
    job.proc.send_signal(signal.SIGKILL)
    job.finish(timeout=10)
    deadline = killed + 10.0
    while time.monotonic() < deadline and any(hosts.pids(n) for n in ("hvta", "hvtb", "hvtc")):
        time.sleep(0.05)
    took = time.monotonic() - killed
    print(f"launcher killed: every rank gone after {took:.2f} s")
    assert_nothing_left(hosts, within=0.1)


def test_hierarchical_allreduce_across_hosts_with_uneven_ranks_per_host(hosts):
    # Note [Hierarchical allreduce]: two ranks on hvta and hvtc share a segment each, hvtb's one
    # rank is alone on its host; the first rank of each host allreduces across hosts.
    job = [sys.executable, "tests/multihost/hierarchical_job.py"]
    path = {"PYTHONPATH": REPO + os.pathsep + os.environ["PYTHONPATH"]}
    result = run_on(hosts, "hvta", launcher(hosts, "--hierarchical-allreduce", "-H", "hvta:2,hvtb:1,hvtc:2") + job,
                    env=path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert sorted(lines(out, "HIERARCHICAL")) == [
        f"[{r}]<stdout>: HIERARCHICAL rank {r} of 5 on {n} hierarchical=True shared_memory=False cpu_groups=1"
        for r, n in enumerate(("hvta", "hvta", "hvtb", "hvtc", "hvtc"))]
    # without the flag the same job runs flat (no segment: the ranks span hosts)
    result = run_on(hosts, "hvta", launcher(hosts, "-H", "hvta:2,hvtb:1,hvtc:2") + job, env=path)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and len(lines(out, "hierarchical=False shared_memory=False cpu_groups=4")) == 5, out[-4000:]
    assert_nothing_left(hosts)


def test_a_stall_across_hosts_gives_one_report_naming_the_missing_rank_and_its_line(hosts):
    """The flight recorder (Note [Dump files] in hvdlite/_runtime/recorder.py): every host's
    ranks send their records to the launcher's store, which merges them into one report."""
    result = run_on(hosts, "hvta", launcher(hosts, "-H", "hvta:1,hvtb:2", sys.executable, "tests/multihost/stuck_job.py"),
                    env={"HVDLITE_STALL_CHECK_TIME_SECONDS": "2", "SLEEP": "6"})
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert len(lines(out, "FINISHED")) == 3, out[-4000:]
    assert "hvdliterun: 3 of 3 ranks wrote a record" in out, out[-4000:]
    assert "submitted by ranks 0, 2; missing rank 1" in out, out[-4000:]
    with open(os.path.join(REPO, "tests", "multihost", "stuck_job.py")) as f:
        line = next(n for n, text in enumerate(f, 1) if "# rank 1 is stuck here" in text)
    assert f"stuck_job.py:{line} in <module>: time.sleep(" in out, out[-4000:]
    assert "(host hvtb," in out, out[-4000:]
    assert_nothing_left(hosts)
