"""Test hosts: Linux network namespaces on this machine that are real hosts to the software.

Each host has its own network namespace, its own host name (a UTS namespace), its own address
on a shared bridge, a real OpenSSH sshd accepting only a key made for this run, and a decoy
interface listed before the real one, on a subnet no other host can reach. The host's own name
resolves to the decoy address first (as a hostname mapped to a host-only address does on many
machines), so software that trusts the host name to pick its address fails, and software that
finds the network by probing works.

    with TestHosts(["hvta", "hvtb"]) as hosts:
        hosts.run("hvta", ["hvdliterun", "-H", "hvta:2,hvtb:2", ...])   # on a host
        hosts.launch_outside([...])                                         # from this machine

The root namespace gets an address on the bridge too (the "outside" launcher), and a blackhole
route for the test supernet, so no test address is ever sent to this machine's real network.
Names: every host resolves every host name (its own /etc/netns/NS/hosts); from the root
namespace use the addresses (hosts.address(name)). ssh uses the harness's own config, key and
known-hosts file (hosts.ssh_config), nothing in the user's ~/.ssh.

Requires root, iproute2, unshare and sshd. `TestHosts.unavailable()` says why not, after trying
to install sshd (apt-get) when root. Teardown kills every process in the namespaces and removes
them, the bridge, the route and the files, also after a failure.
"""

import os
import shutil
import signal
import subprocess
import tempfile
import time

SUPERNET = "10.213"          # 10.213.0.0/16: the test network and every decoy
BRIDGE_NET = f"{SUPERNET}.1"  # hosts at .11, .12, ...; the outside launcher at .1
PREFIX = "hvt"               # namespaces, links and the bridge are named hvt-...


def _sh(*argv, check=True, **kw):
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, **kw)


def _ip(*args, check=True):
    return _sh("ip", *args, check=check)


def unavailable():
    """None if test hosts can be made here, else the reason (tries to install sshd as root)."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces, sshd)"
    for tool in ("ip", "unshare", "ssh-keygen", "ssh"):
        if shutil.which(tool) is None:
            return f"test hosts need {tool}"
    if not os.path.exists("/usr/sbin/sshd"):
        try:
            _sh("apt-get", "install", "-y", "-qq", "openssh-server", timeout=600,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, check=False)
            if not os.path.exists("/usr/sbin/sshd"):
                _sh("apt-get", "update", "-qq", timeout=600, check=False)
                _sh("apt-get", "install", "-y", "-qq", "openssh-server", timeout=600,
                    env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"could not install openssh-server: {exc}"
        if not os.path.exists("/usr/sbin/sshd"):
            return "openssh-server is not installed and apt-get could not install it"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"network namespaces are not available: {result.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def cleanup_stale():
    """Removes namespaces, links and routes left by an earlier run that was killed."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        if ns.startswith(PREFIX + "-"):
            _kill_namespace(ns)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(PREFIX + "-"):
            _ip("link", "del", name, check=False)
    _ip("route", "del", "blackhole", f"{SUPERNET}.0.0/16", check=False)


def _kill_namespace(ns):
    for _ in range(20):
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.05)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


class TestHosts:
    def __init__(self, names, python=None, ssh=True):
        self.names = list(names)
        self.ssh = ssh  # False: no sshd (bench/scale.py enters the namespaces itself)
        self.python = python
        self.dir = None
        self.ns = {name: f"{PREFIX}-{name}" for name in self.names}
        self.sshd = {}
        self.bridge = f"{PREFIX}-br"

    # -- addresses
    def address(self, name):
        return f"{BRIDGE_NET}.{11 + self.names.index(name)}"

    def decoy_address(self, name):
        return f"{SUPERNET}.{101 + self.names.index(name)}.2"

    outside_address = f"{BRIDGE_NET}.1"

    # -- lifecycle
    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        cleanup_stale()
        self.dir = tempfile.mkdtemp(prefix="hvdlite-hosts-")
        os.makedirs("/run/sshd", exist_ok=True)
        self._keys()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.outside_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        # Anything else in the test supernet goes nowhere, never to this machine's gateway.
        _ip("route", "add", "blackhole", f"{SUPERNET}.0.0/16")
        for i, name in enumerate(self.names):
            self._make_host(i, name)
        if not self.ssh:
            return
        for name in self.names:
            self.start_sshd(name)
        for name in self.names:
            self.wait_ssh(name)

    def _keys(self):
        d = self.dir
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{d}/id_ed25519")
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{d}/host_ed25519")
        shutil.copy(f"{d}/id_ed25519.pub", f"{d}/authorized_keys")
        host_key = open(f"{d}/host_ed25519.pub").read().split()[:2]
        with open(f"{d}/known_hosts", "w") as f:
            for name in self.names:
                f.write(f"{name},{self.address(name)} {' '.join(host_key)}\n")
        self.ssh_config = f"{d}/ssh_config"
        with open(self.ssh_config, "w") as f:
            f.write(f"Host *\n  IdentityFile {d}/id_ed25519\n  IdentitiesOnly yes\n"
                    f"  UserKnownHostsFile {d}/known_hosts\n  GlobalKnownHostsFile /dev/null\n"
                    "  StrictHostKeyChecking yes\n  BatchMode yes\n  ConnectTimeout 5\n"
                    "  ServerAliveInterval 2\n  ServerAliveCountMax 3\n  LogLevel ERROR\n"
                    "  User root\n")
        with open(f"{d}/sshd_config", "w") as f:
            f.write(f"Port 22\nListenAddress 0.0.0.0\nHostKey {d}/host_ed25519\n"
                    f"AuthorizedKeysFile {d}/authorized_keys\nPermitRootLogin prohibit-password\n"
                    "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                    "StrictModes no\nPrintMotd no\nClientAliveInterval 2\nClientAliveCountMax 3\n"
                    "MaxStartups 100\nMaxSessions 100\n")

    def _make_host(self, i, name):
        ns = self.ns[name]
        _ip("netns", "add", ns)
        inside = lambda *args: _ip("-n", ns, *args)  # noqa: E731
        inside("link", "set", "lo", "up")
        # The decoy first, so it is listed before the real interface: a veth pair whose both
        # ends stay in this namespace, on a subnet of its own.
        decoy, decoy_peer = f"{PREFIX}-d{i}", f"{PREFIX}-e{i}"
        _ip("link", "add", decoy, "type", "veth", "peer", "name", decoy_peer)
        _ip("link", "set", decoy, "netns", ns)
        _ip("link", "set", decoy_peer, "netns", ns)
        inside("link", "set", decoy, "name", "dcy0")
        inside("link", "set", decoy_peer, "name", "dcy1")
        inside("addr", "add", f"{self.decoy_address(name)}/24", "dev", "dcy0")
        inside("link", "set", "dcy0", "up")
        inside("link", "set", "dcy1", "up")
        # The real interface: a veth into the shared bridge.
        host_end, bridge_end = f"{PREFIX}-h{i}", f"{PREFIX}-b{i}"
        _ip("link", "add", host_end, "type", "veth", "peer", "name", bridge_end)
        _ip("link", "set", host_end, "netns", ns)
        _ip("link", "set", bridge_end, "master", self.bridge)
        _ip("link", "set", bridge_end, "up")
        inside("link", "set", host_end, "name", "eth0")
        inside("addr", "add", f"{self.address(name)}/24", "dev", "eth0")
        inside("link", "set", "eth0", "up")
        os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
        with open(f"/etc/netns/{ns}/hosts", "w") as f:
            f.write("127.0.0.1 localhost\n")
            f.write(f"{self.decoy_address(name)} {name}\n")  # its own name: the decoy first
            for other in self.names:
                f.write(f"{self.address(other)} {other}\n")

    def start_sshd(self, name):
        self.sshd[name] = self.popen(name, ["/usr/sbin/sshd", "-D", "-e", "-f", f"{self.dir}/sshd_config"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop_sshd(self, name):
        proc = self.sshd.pop(name, None)
        if proc is not None:
            proc.kill()
            proc.wait()

    def wait_ssh(self, name, timeout=20):
        deadline = time.monotonic() + timeout
        while True:
            result = _sh("ssh", "-F", self.ssh_config, self.address(name), "hostname", check=False)
            if result.returncode == 0 and result.stdout.strip() == name:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on test host {name} did not answer: {result.stderr.strip()}")
            time.sleep(0.1)

    def stop(self):
        for name in list(self.sshd):
            self.stop_sshd(name)
        for ns in self.ns.values():
            _kill_namespace(ns)
        _ip("link", "del", self.bridge, check=False)
        _ip("route", "del", "blackhole", f"{SUPERNET}.0.0/16", check=False)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- running things
    def command(self, name, argv):
        """argv that runs `argv` on host `name` (its network, its /etc/hosts, its host name)."""
        script = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", self.ns[name], "unshare", "--uts", "sh", "-c", script, name] + list(argv)

    def popen(self, name, argv, **kw):
        return subprocess.Popen(self.command(name, argv), start_new_session=True, **kw)

    def run(self, name, argv, timeout, **kw):
        return subprocess.run(self.command(name, argv), capture_output=True, text=True, timeout=timeout, **kw)

    def pids(self, name):
        """Processes running on host `name`, sshd excluded: (pid, command line)."""
        out = []
        sshd = self.sshd.get(name)
        for pid in _ip("netns", "pids", self.ns[name], check=False).stdout.split():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            if sshd is not None and int(pid) == sshd.pid or cmd.startswith(("/usr/sbin/sshd", "sshd:")):
                continue
            if cmd.startswith(("ip netns exec", "unshare")):
                continue
            out.append((int(pid), cmd))
        return out

    def kill_all(self, name):
        """Every process of the host at once (SIGKILL), sshd included."""
        self.sshd.pop(name, None)
        for pid in _ip("netns", "pids", self.ns[name], check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def cut_link(self, name):
        _ip("-n", self.ns[name], "link", "set", "eth0", "down")

    def restore_link(self, name):
        """Brings a cut link back up (also safe when it is up, or the host is gone)."""
        _ip("-n", self.ns[name], "link", "set", "eth0", "up", check=False)

    def shape(self, rate="1gbit", delay="0.5ms", mtu=None):
        """Shapes every host's link in both directions (a host's egress, and the bridge port's
        egress towards it). Returns what was applied: netem (rate and one-way delay) where the
        kernel has it, else tbf (rate only; the delay is then left out and said so). `mtu`
        (bytes) sets every link's MTU, the bridge's too, first (9000: jumbo frames)."""
        devices = [(["ip", "netns", "exec", self.ns[name]], "eth0") for name in self.names]
        devices += [([], f"{PREFIX}-b{i}") for i in range(len(self.names))]
        if mtu:
            for prefix, dev in devices + [([], self.bridge)]:
                _sh(*prefix, "ip", "link", "set", "dev", dev, "mtu", str(mtu))
        netem = ["netem", "delay", delay, "rate", rate]
        tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
        probe = _sh(*devices[0][0], "tc", "qdisc", "replace", "dev", devices[0][1], "root", *netem, check=False)
        qdisc, applied = (netem, f"{rate}, {delay} one-way delay (netem)") if probe.returncode == 0 else \
            (tbf, f"{rate} (tbf; this kernel has no netem, so no added delay)")
        for prefix, dev in devices:
            _sh(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", *qdisc)
        return applied + (f", MTU {mtu}" if mtu else "")
