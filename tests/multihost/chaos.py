"""Chaos on the network-namespace test hosts: an elastic job on three hosts x two slots, and a
driver that injects faults at random times drawn from a fixed seed until it has injected the
number asked for, then lets the job finish.

The faults, each aimed at one host of the running generation:
  - kill_rank: SIGKILL of one worker;
  - stop_rank: SIGSTOP of one worker (a hang, not a death: the others must name it and the
    launcher must kill it after --elastic-timeout);
  - kill_host: every process of the host at once, sshd included; sshd comes back a moment
    later (the host rebooted) and the host returns after its blacklist cooldown;
  - remove_host: the host leaves the discovery output and comes back a few seconds later;
  - link_down: the host's only link goes down for a few seconds and comes back.
The next fault waits until the job runs a generation on at least two hosts in which every rank
stepped within the last second (so a survivor always holds the committed state: Note [No
survivor] in runner/elastic.py), and until discovery lists every host again. The job is
tests/elastic/elastic_job.py's counting model, whose final vector says how many times each
sample contributed to the committed model: the reference, exactly `epochs` for every sample,
is plain arithmetic.

tests/multihost/test_chaos.py runs a short schedule in the suite; bench/chaos.py the long one.
"""
import json
import os
import random
import re
import signal
import subprocess
import time

from hvdlite._runtime.groups import segment_name_prefix
from hvdlite._runtime.liveness import running as _alive
from tests.elastic.harness import ElasticRun

HOSTS = ("hvta", "hvtb", "hvtc")
SLOTS = 2
FAULTS = ("kill_rank", "stop_rank", "kill_host", "remove_host", "link_down")
# The job's knobs: a frozen peer is named after the stall shutdown time (Note [Process group
# timeout] in hvdlite/_runtime/groups.py), a hung worker is killed --elastic-timeout after its
# generation ended, a host whose worker failed returns after the blacklist cooldown.
STALL_SHUTDOWN = 4
ELASTIC_TIMEOUT = 8
COOLDOWN = (3, 6)
MAX_EPOCHS = 1000  # the job trains until the driver asks it to stop (ELASTIC_UNTIL)


class _Run(ElasticRun):
    """ElasticRun reading the progress files incrementally (a long run writes many lines)."""

    def __init__(self, *args, **kwargs):
        self._seen, self._offsets = [], {}
        super().__init__(*args, **kwargs)

    def events(self):
        for name in os.listdir(self.dir):
            if not name.startswith("progress."):
                continue
            path = os.path.join(self.dir, name)
            with open(path) as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            complete = data[:data.rfind("\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            self._seen.extend(json.loads(line) for line in complete.splitlines())
        self._seen.sort(key=lambda e: e["t"])
        return self._seen


class Chaos:
    def __init__(self, hosts, seed, faults, samples=240, step_seconds=0.1, gap=(0.5, 2.0), log=print):
        self.hosts, self.rng, self.count, self.gap, self.log = hosts, random.Random(seed), faults, gap, log
        self.address = {name: hosts.address(name) for name in HOSTS}
        self.name_of = {addr: name for name, addr in self.address.items()}
        self.listed = set(HOSTS)
        self.injected = []  # (time, fault, host, detail)
        self.stopped = []   # pids we SIGSTOPped: each must be killed by the launcher
        self.started = time.time()
        # Every kind once (in a seeded order) when the count allows, then seeded draws.
        kinds = self.rng.sample(FAULTS, len(FAULTS)) if faults >= len(FAULTS) else []
        self.kinds = kinds + [self.rng.choice(FAULTS) for _ in range(faults - len(kinds))]
        # The launcher runs outside the hosts (so every host can be hit); it reaches them over
        # the bridge, and the ranks reach each other over eth0 (GLOO_SOCKET_IFNAME, forwarded).
        self.run = _Run(self._discovery(), "--ssh-config-file", hosts.ssh_config,
                        "--min-np", "2", "--elastic-timeout", str(ELASTIC_TIMEOUT),
                        "--blacklist-cooldown-range", *map(str, COOLDOWN), "--verbose",
                        samples=samples, epochs=MAX_EPOCHS, step_seconds=step_seconds,
                        env={"GLOO_SOCKET_IFNAME": "eth0", "HVDLITE_STALL_CHECK_TIME_SECONDS": "2",
                             "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": str(STALL_SHUTDOWN),
                             "ELASTIC_COMMIT_EVERY": "2", "ELASTIC_UNTIL": "until"})
        self.until = os.path.join(self.run.dir, "until")

    def _discovery(self):
        return [f"{self.address[n]}:{SLOTS}" for n in HOSTS if n in self.listed]

    # -- what the job is doing
    def generations(self):
        """[(generation, ranks, {host name: ranks on it}, seconds after the reset began or None)]
        from the launcher's announcements."""
        found = []
        for line in self.run.output().splitlines():
            m = re.search(r"hvdliterun: elastic: generation (\d+): (\d+) ranks \(([^)]*)\)(.*)", line)
            if not m:
                continue
            per_host = {}
            for place in m.group(3).split(", "):
                addr = place.rsplit(":", 1)[0]
                per_host[self.name_of.get(addr, addr)] = per_host.get(self.name_of.get(addr, addr), 0) + 1
            took = re.search(r" ([0-9.]+) s after the reset began", m.group(4))
            found.append((int(m.group(1)), int(m.group(2)), per_host, float(took.group(1)) if took else None))
        return found

    def _healthy(self, since):
        """The newest generation, (number, {host name: ranks on it}), if it runs on at least
        two hosts and every rank of it has made a step after `since`; else None."""
        gens = self.generations()
        if self.listed != set(HOSTS) or not gens:
            return None
        gen, size, per_host, _ = gens[-1]
        if len(per_host) < 2:
            return None
        steps = [e for e in self.run.events() if e["event"] == "step" and e["generation"] == gen
                 and e["t"] > since]
        return (gen, per_host) if len({e["rank"] for e in steps}) == size else None

    def _workers(self, gen):
        """pid -> host name of the live workers of generation `gen`."""
        found = {}
        for e in self.run.events():
            if e["event"] == "start" and e["generation"] == gen and _alive(e["pid"]):
                found[e["pid"]] = self.name_of.get(e["host"], e["host"])
        return found

    # -- faults
    def _inject(self, healthy):
        gen, per_host = healthy
        fault = self.kinds[len(self.injected)]
        host = self.rng.choice(sorted(per_host))
        detail = ""
        if fault in ("kill_rank", "stop_rank"):
            pids = sorted(p for p, h in self._workers(gen).items() if h == host)
            if not pids:
                return False
            pid = self.rng.choice(pids)
            os.kill(pid, signal.SIGKILL if fault == "kill_rank" else signal.SIGSTOP)
            if fault == "stop_rank":
                self.stopped.append(pid)
            detail = f"pid {pid}"
        elif fault == "kill_host":
            self.hosts.kill_all(host)
            time.sleep(1.0)
            self.hosts.start_sshd(host)
            self.hosts.wait_ssh(host)
        elif fault == "remove_host":
            self.listed.discard(host)
            self.run.set_hosts(self._discovery())
            time.sleep(self.rng.uniform(2.0, 4.0))
            self.listed.add(host)
            self.run.set_hosts(self._discovery())
        else:
            seconds = self.rng.uniform(2.0, 3.0)
            self.hosts.cut_link(host)
            time.sleep(seconds)
            self.hosts.restore_link(host)
            detail = f"{seconds:.1f} s"
        self.injected.append((time.time() - self.started, fault, host, detail))
        self.log(f"chaos: {time.time() - self.started:6.1f} s: {fault} on {host} {detail}".rstrip())
        return True

    def drive(self, recover_timeout=120):
        """Injects the faults, then waits for the job; returns (exit code, output)."""
        since = 0.0
        while len(self.injected) < self.count:
            self.run.wait_for("the job to run on two hosts again", lambda: self._healthy(since),
                              timeout=recover_timeout)
            time.sleep(self.rng.uniform(*self.gap))
            if self.run.proc.poll() is not None:
                break
            healthy = self._healthy(since)
            if healthy and healthy == self._healthy(time.time() - 1.0) and self._inject(healthy):
                since = time.time()
        if len(self.injected) == self.count:  # the job ran again after the last fault: stop it
            self.run.wait_for("the job to run on two hosts after the last fault", lambda: self._healthy(since),
                              timeout=recover_timeout)
            with open(self.until, "w"):
                pass
        code, out = self.run.finish(timeout=recover_timeout * 3)
        if code == 0:
            self.run.epochs = self.epochs_done()
        return code, out

    def epochs_done(self):
        """The epochs the job completed (it stops at the end of the epoch in which it is asked)."""
        return self.run.counts()["epochs"]

    def stop(self):
        self.run.stop()
        for pid in self.stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for name in HOSTS:
            self.hosts.restore_link(name)
            if name not in self.hosts.sshd:
                self.hosts.start_sshd(name)
                self.hosts.wait_ssh(name)

    # -- results
    def resets(self):
        """Seconds from each reset's start to its new generation, as the launcher measured."""
        return [took for _, _, _, took in self.generations() if took is not None]

    def leftovers(self, within=0.0):
        """What is left anywhere: processes on the hosts (waiting up to `within` s for them to
        go), the job's /dev/shm segments, TCP ports listened on in the hosts' namespaces other
        than sshd's."""
        deadline = time.monotonic() + within
        while True:
            left = {name: self.hosts.pids(name) for name in HOSTS}
            left = {name: pids for name, pids in left.items() if pids}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        # the job's workers' segments (groups.segment_name_prefix): other workers of a parallel
        # run of the suite hold their own meanwhile
        prefixes = tuple({segment_name_prefix(e["pid"]) for e in self.run.events() if "pid" in e})
        segments = [n for n in os.listdir("/dev/shm") if n.startswith(prefixes)]
        ports = {}
        for name in HOSTS:
            out = subprocess.run(["ip", "netns", "exec", self.hosts.ns[name], "ss", "-Hltnp"],
                                 capture_output=True, text=True).stdout
            extra = [line for line in out.splitlines() if line.strip() and "sshd" not in line]
            if extra:
                ports[name] = extra
        return {k: v for k, v in (("processes", left), ("shm", segments), ("ports", ports)) if v}
