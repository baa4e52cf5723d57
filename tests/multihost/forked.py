"""Ranks forked into test hosts: one rank on each of K hosts (tests/multihost/hosts.py, without
sshd), forked from a process that imported torch and hvdlite once, each entering its host's
network namespace and host name, started as torchrun would start it (RANK, WORLD_SIZE,
MASTER_ADDR: a TCPStore this process hosts on the bridge). So 8-32 ranks fit in memory on a
small machine. Used by bench/scale.py and tests/multihost/test_many_hosts.py.

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

CLONE_NEWNET, CLONE_NEWUTS = 0x40000000, 0x04000000


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
        # Every rank is forked before the store exists: a store's server thread could hold a
        # lock (malloc's, say) at the moment of a fork, and the child would then hang on it.
        children, pipes = {}, []
        for rank, name in enumerate(names):
            path = os.path.join(workdir, f"r{rank}.json")
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.close(write_end)
                    port = int(os.read(read_end, 64).decode())
                    enter_host(hosts.ns[name], name)
                    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": "0",
                                       "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank),
                                       "MASTER_ADDR": hosts.outside_address, "MASTER_PORT": str(port),
                                       "TORCHELASTIC_USE_AGENT_STORE": "true", "GLOO_SOCKET_IFNAME": "eth0",
                                       **(env or {})})
                    result = job(rank, size)
                    with open(path, "w") as f:
                        json.dump(result, f)
                    code = 0
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(code)
            os.close(read_end)
            pipes.append(write_end)
            children[pid] = (rank, path)
        store = dist.TCPStore(hosts.outside_address, 0, is_master=True, wait_for_workers=False)
        for write_end in pipes:
            os.write(write_end, str(store.port).encode())
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
        del store
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
