"""Ranks forked into test hosts: one rank on each of K hosts (tests/multihost/hosts.py, without
sshd), forked from a process that imported torch and hvdlite once, each entering its host's
network namespace and host name, started as torchrun would start it (RANK, WORLD_SIZE,
MASTER_ADDR: a TCPStore a forked child hosts on the bridge). So 8-32 ranks fit in memory on a
small machine. Every host's name resolves to its address, as on a cluster: the ranks and the
store see a hosts file listing them (Note [Names of the test hosts]). Used by bench/scale.py
and tests/multihost/test_many_hosts.py.

    results = run_on_hosts(["s00", "s01", ...], job, env={...}, timeout=300)

`job(rank, size)` runs in each rank and returns something JSON can carry; run_on_hosts returns
the results by rank (None for a rank that exited with status 0 and no result), or raises naming the ranks that failed (their tracebacks printed) or timed
out.
"""

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import traceback

import torch.distributed as dist

from tests.multihost.hosts import TestHosts

CLONE_NEWNET, CLONE_NEWUTS, CLONE_NEWNS = 0x40000000, 0x04000000, 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000

# Note [Names of the test hosts]
# The machine's resolver knows nothing of the test hosts, and torch's TCPStore server looks up
# the name of every client that connects, on its one loop thread: its name server (reachable
# from the machine, not from the namespaces) answered most lookups at once and left some
# unanswered, and each unanswered one stalled the store for the resolver's 5-second timeout,
# charged to whichever client connected then (hvd.init() at 32 hosts took 5.2 s against Gloo's
# 0.13 in bench/scale.py; a plain TCPStore client up to 5.0 s). So the processes of a run (the
# store's and every rank) see a hosts file naming every host, in a mount namespace of their
# own, as a cluster's hosts resolve each other; the machine's /etc/hosts is untouched.


def enter_host(ns, name):
    """This process joins host `name`: its network namespace and a host name of its own."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
    finally:
        os.close(fd)
    if libc.unshare(CLONE_NEWUTS) != 0:
        raise OSError(ctypes.get_errno(), "unshare the host name")
    socket.sethostname(name)


def fork(body):
    """Runs body() in a forked child, which exits with 0 when it returns and 1 (its traceback
    printed) when it raises; returns the child's pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            body()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def use_hosts_file(path):
    """This (single-threaded, forked) process sees `path` as /etc/hosts, in a mount namespace
    of its own (Note [Names of the test hosts])."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare the mounts")
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "make the mounts private")
    if libc.mount(path.encode(), b"/etc/hosts", None, MS_BIND, None) != 0:
        raise OSError(ctypes.get_errno(), f"bind {path} over /etc/hosts")


def hosts_file(hosts, path):
    """Every test host's name, and the bridge's outside address, as IPv4 and as the IPv4-mapped
    IPv6 address a dual-stack server sees its clients from (glibc's files lookup does not map
    one to the other)."""
    named = [(hosts.outside_address, "hvdlite-test-outside")] + [(hosts.address(n), n) for n in hosts.names]
    with open(path, "w") as f:
        f.write("127.0.0.1 localhost\n::1 localhost\n")
        f.write("".join(f"{address} {name}\n::ffff:{address} {name}\n" for address, name in named))
    return path


def host_store(path, address):
    """Forks the job's TCPStore (on `address`) into a child that sees `path` as /etc/hosts
    (Note [Names of the test hosts]) and returns (pid, port, stop): closing `stop` ends it."""
    port_read, port_write = os.pipe()
    stop_read, stop_write = os.pipe()
    def serve():
        os.close(port_read)
        os.close(stop_write)
        use_hosts_file(path)
        store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False)
        os.write(port_write, str(store.port).encode())
        os.close(port_write)
        os.read(stop_read, 1)  # until the parent closes its end
    pid = fork(serve)
    os.close(port_write)
    os.close(stop_read)
    port = int(os.read(port_read, 64).decode() or 0)
    os.close(port_read)
    if not port:
        os.waitpid(pid, 0)
        os.close(stop_write)
        raise RuntimeError("the forked TCPStore did not start")
    return pid, port, stop_write


def static_neighbours(hosts):
    """Every host knows every other host's link address: with 32 hosts' ranks on two cores, an
    address resolution could time out under load ("No route to host" in Gloo's connect), which
    measures the machine, not the software."""
    macs = {}
    for name in hosts.names:
        out = subprocess.run(["ip", "-n", hosts.ns[name], "-j", "link", "show", "eth0"], check=True,
                             capture_output=True, text=True).stdout
        macs[name] = json.loads(out)[0]["address"]
    for name in hosts.names:
        lines = "".join(f"neigh replace {hosts.address(o)} lladdr {macs[o]} dev eth0 nud permanent\n"
                        for o in hosts.names if o != name)
        subprocess.run(["ip", "-n", hosts.ns[name], "-batch", "-"], input=lines, check=True, text=True)


def run_on_hosts(names, job, env=None, timeout=300):
    workdir = tempfile.mkdtemp(prefix="hvdlite-forked-")
    try:
        return _run(names, job, env, timeout, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(names, job, env, timeout, workdir):
    size = len(names)
    with TestHosts(names, ssh=False) as hosts:
        static_neighbours(hosts)
        names_file = hosts_file(hosts, os.path.join(workdir, "hosts"))
        # Every rank is forked before the store exists: a store's server thread could hold a
        # lock (malloc's, say) at the moment of a fork, and the child would then hang on it.
        children, pipes = {}, []
        for rank, name in enumerate(names):
            path = os.path.join(workdir, f"r{rank}.json")
            read_end, write_end = os.pipe()

            def rank_main(rank=rank, name=name, path=path, read_end=read_end, write_end=write_end):
                os.close(write_end)
                port = int(os.read(read_end, 64).decode())
                enter_host(hosts.ns[name], name)
                use_hosts_file(names_file)
                os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": "0",
                                   "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank),
                                   "MASTER_ADDR": hosts.outside_address, "MASTER_PORT": str(port),
                                   "TORCHELASTIC_USE_AGENT_STORE": "true", "GLOO_SOCKET_IFNAME": "eth0",
                                   **(env or {})})
                result = job(rank, size)
                with open(path, "w") as f:
                    json.dump(result, f)
            pid = fork(rank_main)
            os.close(read_end)
            pipes.append(write_end)
            children[pid] = (rank, path)
        store_pid, port, stop_store = host_store(names_file, hosts.outside_address)
        for write_end in pipes:
            os.write(write_end, str(port).encode())
            os.close(write_end)
        deadline = time.monotonic() + timeout
        failed = []
        while children and time.monotonic() < deadline:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(0.1)
                continue
            rank, _ = children.pop(pid)
            if status != 0:
                failed.append(rank)
        stuck = sorted(rank for rank, _ in children.values())
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(stop_store)
        os.waitpid(store_pid, 0)
        if failed or stuck:
            raise RuntimeError(f"{size} hosts: ranks {sorted(failed)} failed, ranks {stuck} timed out")
        results = []
        for rank in range(size):  # None: the rank left without a result (os._exit(0))
            path = os.path.join(workdir, f"r{rank}.json")
            if not os.path.exists(path):
                results.append(None)
                continue
            with open(path) as f:
                results.append(json.load(f))
    return results
