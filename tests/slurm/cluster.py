"""A one-machine SLURM cluster for the tests: munged, slurmctld and slurmd from the
distribution's packages, with a configuration of the test's own (ports chosen at run time,
state and logs in a temporary directory, the node at 127.0.0.1).

`unavailable()` says why the cluster cannot run here (not root, no packages and no apt-get);
when root and apt-get are there, it installs slurm-wlm and munge first.
"""
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged")


def _installed():
    return all(os.path.exists(p) for p in DAEMONS) and shutil.which("srun") and shutil.which("sbatch")


def unavailable():
    if os.geteuid() != 0:
        return "the SLURM test cluster needs root (it runs slurmctld, slurmd and munged)"
    if not _installed():
        if not shutil.which("apt-get"):
            return "slurm-wlm and munge are not installed, and there is no apt-get to install them"
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                return f"could not install slurm-wlm and munge: {' '.join(argv)}: {done.stderr.strip()[-300:]}"
    if not _installed():
        return "slurm-wlm and munge were installed but their programs are missing"
    return None


def _answers(path):
    """True when a daemon listens on the Unix socket `path`."""
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(path)
            return True
        except OSError:
            return False


def _cgroup_mounts():
    """Shell commands that mount the cgroup file systems as this machine mounts them (run
    where /sys was mounted afresh); empty when /sys/fs/cgroup is already there."""
    commands = ["[ -e /sys/fs/cgroup/cgroup.controllers ] || [ -e /sys/fs/cgroup/cpu ] || {"]
    with open("/proc/mounts") as f:
        for line in f:
            device, where, kind, options = line.split()[:4]
            if where.startswith("/sys/fs/cgroup") and kind in ("tmpfs", "cgroup", "cgroup2"):
                commands.append(f"mkdir -p {where} && mount -t {kind} -o {options} {device} {where};")
    return "\n".join(commands + ["}\n"])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """`nodes`: (name, address) of each compute node, default this machine at 127.0.0.1;
    `wrap(name, argv)` runs argv on node `name` (tests/multihost's hosts.command), default
    here. slurmctld runs here, on `controller_addr`."""

    def __init__(self, cpus=4, nodes=None, controller_addr="127.0.0.1", wrap=None):
        self.dir = tempfile.mkdtemp(prefix="hvdlite-slurm-")
        self.node = socket.gethostname()
        self.nodes = nodes or [(self.node, "127.0.0.1")]
        self.controller_addr = controller_addr
        self.wrap = wrap or (lambda name, argv: argv)
        self.cpus = cpus
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self._munged = None
        self._slurmd = []

    def _write_conf(self):
        d = self.dir
        for sub in ["state"] + [f"spool-{name}" for name, _ in self.nodes]:
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        nodes = "\n".join(f"NodeName={name} NodeAddr={addr} CPUs={self.cpus} State=UNKNOWN"
                           for name, addr in self.nodes)
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=hvdlite
SlurmctldHost={self.node}({self.controller_addr})
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
KillWait=5
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def start(self):
        self._write_conf()
        os.makedirs("/run/munge", exist_ok=True)
        if not _answers("/run/munge/munge.socket.2"):
            if os.path.exists("/run/munge/munge.socket.2"):
                os.unlink("/run/munge/munge.socket.2")  # left by a munged that is gone
            self._munged = subprocess.Popen(["/usr/sbin/munged", "--force", "--foreground"],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True)
        deadline = time.monotonic() + 10
        while not _answers("/run/munge/munge.socket.2") and time.monotonic() < deadline:
            time.sleep(0.05)
        subprocess.run(["/usr/sbin/slurmctld", "-f", self.conf], env=self.env, check=True, timeout=30)
        for name, _ in self.nodes:
            # `ip netns exec` mounts a fresh /sys without cgroups, which slurmd insists on: mount
            # them in the node's own mount namespace as this machine has them.
            script = _cgroup_mounts() + 'exec "$@"'
            argv = ["sh", "-c", script, "slurmd", "/usr/sbin/slurmd", "-D", "-N", name, "-f", self.conf]
            self._slurmd.append(subprocess.Popen(
                self.wrap(name, argv), env=self.env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=self.env, capture_output=True,
                                 text=True, timeout=10).stdout.split()
            if len(out) == len(self.nodes) and all(state in ("idle", "mix", "alloc") for state in out):
                return self
            time.sleep(0.2)
        raise RuntimeError(f"the SLURM node did not come up: sinfo says {out!r}\n{self.logs()}")

    def logs(self):
        text = ""
        for name in ["slurmctld.log"] + [f"slurmd-{n}.log" for n, _ in self.nodes]:
            path = os.path.join(self.dir, name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    text += f"--- {name}\n" + "".join(f.readlines()[-30:])
        return text

    def run(self, argv, timeout=120, cwd=None, env=None):
        return subprocess.run(argv, env={**self.env, **(env or {})}, cwd=cwd, capture_output=True,
                              text=True, timeout=timeout)

    def wait_job(self, job_id, timeout=200):
        """(JobState, ExitCode) of batch job `job_id` once it has ended. Polls scontrol every
        0.2 s: `sbatch --wait` polls at growing intervals and took ~30 s longer here."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.run(["scontrol", "-o", "show", "job", str(job_id)], timeout=30).stdout
            fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
            state = fields.get("JobState", "")
            if state and state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"):
                return state, fields.get("ExitCode", "")
            if time.monotonic() > deadline:
                raise AssertionError(f"batch job {job_id} still {state or 'unknown'} after {timeout} s:\n{self.logs()}")
            time.sleep(0.2)

    def stop(self):
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=10)
        for proc in self._slurmd:
            proc.terminate()
        for proc in self._slurmd:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for name in ("slurmctld.pid",):
            path = os.path.join(self.dir, name)
            try:
                with open(path) as f:
                    os.kill(int(f.read().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        if self._munged is not None:
            self._munged.terminate()
            self._munged.wait(timeout=10)
        time.sleep(0.5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()
