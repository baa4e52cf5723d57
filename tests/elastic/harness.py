"""Runs tests/elastic/elastic_job.py under hvdliterun's elastic mode and acts on it.

Hosts are 127.0.0.1, 127.0.0.2, ...: every one reaches this machine, and the launcher tells
them apart by name. The discovery script prints a file the test rewrites. Each worker appends
one JSON line per event to progress.<pid> (see elastic_job.py); the test reads them to find a
host's workers, wait for training to reach a point, kill processes and measure resets.
Everything has a deadline: the launcher runs under a hard timeout and is killed with its
workers if a test fails.
"""
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from hvdlite._runtime.liveness import running as _alive  # a pid that runs and is no zombie

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(REPO, "tests", "elastic", "elastic_job.py")
HARD_TIMEOUT = 100


class ElasticRun:
    def __init__(self, hosts, *flags, samples=384, epochs=2, step_seconds=0.1, env=None,
                 discovery=None, command=None, wrap=None):
        self.dir = tempfile.mkdtemp(prefix="hvdlite-elastic-")
        self.hosts_file = os.path.join(self.dir, "hosts.txt")
        self.set_hosts(hosts)
        script = discovery or f"cat {self.hosts_file}"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("HVDLITE_")}
        environ.update({"ELASTIC_OUT": self.dir, "ELASTIC_SAMPLES": str(samples),
                        "ELASTIC_EPOCHS": str(epochs), "ELASTIC_STEP_SECONDS": str(step_seconds),
                        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                        "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
        environ.update(env or {})
        self.epochs, self.samples = epochs, samples
        argv = [sys.executable, "-m", "hvdlite.runner.launch", "--host-discovery-script", script,
                *flags, *(command or [sys.executable, JOB])]
        self.out_path = os.path.join(self.dir, "launcher.out")
        self._out = open(self.out_path, "wb")
        self.started = time.time()
        # `wrap` runs the launcher elsewhere (on a test host: tests/multihost/hosts.py)
        self.proc = subprocess.Popen(wrap(argv) if wrap else argv, env=environ, cwd=self.dir, stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    # -- acting
    def set_hosts(self, hosts):
        tmp = self.hosts_file + ".tmp"
        with open(tmp, "w") as f:
            f.write("".join(h + "\n" for h in hosts))
        os.replace(tmp, self.hosts_file)  # the script never reads half a file
        return time.time()

    def kill(self, pids):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return time.time()

    # -- reading
    def events(self):
        found = []
        for path in glob.glob(os.path.join(self.dir, "progress.*")):
            with open(path) as f:
                for line in f:
                    if line.endswith("\n"):
                        found.append(json.loads(line))
        return sorted(found, key=lambda e: e["t"])

    def steps(self, **match):
        return [e for e in self.events() if e["event"] == "step"
                and all(e.get(k) == v for k, v in match.items())]

    def pids_on(self, host):
        """Workers on `host` that are still alive."""
        pids = {e["pid"] for e in self.events() if e["host"] == host}
        return sorted(p for p in pids if _alive(p))

    def wait_for(self, what, condition, timeout=40):
        deadline = time.time() + timeout
        while time.time() < deadline:
            value = condition()
            if value:
                return value
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended (rc {self.proc.returncode}) before {what}:\n"
                                     + self.output())
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}:\n" + self.output())

    def wait_steps(self, count, **match):
        return self.wait_for(f"{count} steps {match}", lambda: len(self.steps(**match)) >= count)

    def finish(self, timeout=None):
        """Waits for the launcher; returns (exit code, output)."""
        timeout = timeout or max(10, HARD_TIMEOUT - (time.time() - self.started))
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError("the elastic job did not finish in time:\n" + self.output())
        return code, self.output()

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def output(self):
        self._out.flush()
        with open(self.out_path, errors="replace") as f:
            return "".join(line for line in f if " round: " not in line)

    def counts(self):
        with open(os.path.join(self.dir, "counts.json")) as f:
            return json.load(f)

    def check_every_sample_once_per_epoch(self):
        """The model counted each sample exactly `epochs` times (elastic_job.py's docstring);
        the reference is plain arithmetic, not anything the job computed."""
        counts = self.counts()["counts"]
        assert len(counts) == self.samples
        wrong = {i: c for i, c in enumerate(counts) if c != self.epochs}
        assert not wrong, (f"samples processed other than {self.epochs} times: "
                           f"{dict(list(wrong.items())[:10])} ({len(wrong)} in all)\n" + self.output())

    def first_step_after(self, t):
        later = [e for e in self.steps() if e["t"] > t]
        return min(e["t"] for e in later) if later else None

