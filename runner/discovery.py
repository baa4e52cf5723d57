"""Network discovery, the driver's side: which interfaces every host reaches every host through,
and which of the launcher's addresses every host reaches (Note [Network discovery] in
task_service.py).

`discover()` runs on the launcher's main thread before any rank starts, only for jobs on more
than one host. It starts one task per host, waits for their probe results in the job's
rendezvous store, and returns the plan: the interface names for Gloo and NCCL and the address
to give ranks for the rendezvous. A host that cannot be reached, a task that fails, or no
interface common to every pair of hosts is a NetworkDiscoveryError naming the hosts and interfaces.
"""
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Sequence

from hvdlite._job.wire import RendezvousClient, RendezvousError
from hvdlite.exceptions import NetworkDiscoveryError

from .config import SshOptions
from .environment import exportable
from .task_service import interfaces
from .workers import ssh_command, stop_with_parent

TASK_MODULE = "hvdlite.runner.task_service"


@dataclass
class NetworkPlan:
    interfaces: List[str]   # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, in preference order
    rendezvous_addr: str    # the launcher's address that every host reached
    seconds: float
    report: List[str]       # what was found, for --verbose

    def rank_env(self) -> Dict[str, str]:
        names = ",".join(self.interfaces)
        return {"GLOO_SOCKET_IFNAME": names, "NCCL_SOCKET_IFNAME": names}


def driver_addresses(prefer: Sequence[str] = ()) -> List[str]:
    """The launcher's own IPv4 addresses worth offering to tasks, `prefer` first."""
    addrs = [a for a in prefer if a]
    for found in interfaces().values():
        addrs += [a for a in found if a not in addrs]
    return addrs


def _start_task(host: str, local: bool, env: Mapping[str, str], cwd: str, ssh: SshOptions,
                grace: float) -> subprocess.Popen:
    command = [sys.executable, "-m", TASK_MODULE]
    if local:
        return subprocess.Popen(command, env={**os.environ, **env}, cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=stop_with_parent)
    # The launcher's environment goes along, as it does to ranks (PATH, PYTHONPATH, ...).
    remote_env = {**exportable({k: v for k, v in os.environ.items() if not k.startswith("HVDLITE_")}), **env}
    return subprocess.Popen(ssh_command(host, command, remote_env, cwd, ssh, grace), stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=stop_with_parent)


def _stop(tasks: List[subprocess.Popen]) -> None:
    for task in tasks:
        if task.stdin:
            try:
                task.stdin.close()
            except OSError:
                pass
        if task.poll() is None:
            task.kill()
        task.wait()


def _failed(task: subprocess.Popen, host: str) -> str:
    err = (task.stderr.read() or b"").decode(errors="replace").strip().splitlines()
    detail = err[-1] if err else f"exit code {task.returncode}"
    return f"network discovery failed on host {host}: {detail}"


def plan(hosts: Sequence[str], probes: Mapping[int, Mapping[str, list]], infos: Mapping[int, dict],
         driver_addrs: Sequence[str]) -> NetworkPlan:
    """The interfaces every host reached every host it probed through (its ring neighbours:
    Note [Network discovery] in task_service.py), and a driver address every host reached.
    Pure: `probes[i][j]` lists [interface, address, reached] of host j as host i probed them;
    `infos[i]` is what host i published."""
    order = []
    for i in range(len(hosts)):
        for name in infos[i]["interfaces"]:
            if name not in order:
                order.append(name)
    report, common = [], set(order)
    named = [host if infos[i]["hostname"] == host else f"{host} ({infos[i]['hostname']})"
             for i, host in enumerate(hosts)]
    for i, host in enumerate(named):
        for j in sorted(int(k) for k in probes[i]):
            other = named[j]
            entries = probes[i][str(j)]
            through = {name for name, _, ok in entries if ok}
            tried = ", ".join(f"{name} {addr}" for name, addr, _ in entries) or "no addresses"
            report.append(f"{host} reaches {other} through "
                          f"{', '.join(sorted(through)) or 'nothing'} (tried {tried})")
            common &= through
    if not common:
        raise NetworkDiscoveryError("network discovery: no network interface reaches every host from its "
                             "neighbours: " + "; ".join(report) +
                             " (give --network-interfaces to choose them yourself)")
    reached_by_all = [a for a in driver_addrs if all(a in infos[i]["driver_reached"] for i in infos)]
    if not reached_by_all:
        raise NetworkDiscoveryError("network discovery: no address of this launcher is reachable from every "
                             "host (offered " + ", ".join(driver_addrs) + ")")
    chosen = [name for name in order if name in common]
    return NetworkPlan(chosen, reached_by_all[0], 0.0, report)


def discover(hosts: Sequence[str], is_local: Mapping[str, bool], port: int, secret: str,
             driver_addrs: Sequence[str], ssh: SshOptions, cwd: str, grace: float, timeout: float,
             log: Callable[[str], None]) -> NetworkPlan:
    started = time.monotonic()
    client = RendezvousClient("127.0.0.1", port, secret, connect_timeout=10.0)
    tasks: List[subprocess.Popen] = []
    try:
        for index, host in enumerate(hosts):
            env = {"HVDLITE_TASK_SECRET": secret, "HVDLITE_TASK_INDEX": str(index),
                   "HVDLITE_TASK_COUNT": str(len(hosts)), "HVDLITE_TASK_DRIVER_PORT": str(port),
                   "HVDLITE_TASK_DRIVER_ADDRS": ",".join(driver_addrs),
                   "HVDLITE_TASK_TIMEOUT": f"{timeout:g}"}
            tasks.append(_start_task(host, is_local[host], env, cwd, ssh, grace))
        probes, infos = {}, {}
        deadline = started + timeout
        while len(probes) < len(hosts):
            for index, task in enumerate(tasks):
                if index in probes:
                    continue
                try:
                    value = client.call(b"GET", [f"discovery/{index}/probes".encode(), b"100"], 100)[0]
                except RendezvousError:
                    if task.poll() is not None:
                        raise NetworkDiscoveryError(_failed(task, hosts[index])) from None
                    continue
                probes[index] = json.loads(value)["results"]
                infos[index] = json.loads(client.call(b"GET", [f"discovery/{index}/info".encode(), b"0"])[0])
            if time.monotonic() > deadline:
                missing = [hosts[i] for i in range(len(hosts)) if i not in probes]
                raise NetworkDiscoveryError(f"network discovery: no answer from {', '.join(missing)} within "
                                     f"{timeout:g} s")
        result = plan(hosts, probes, infos, driver_addrs)
        result.seconds = time.monotonic() - started
        client.call(b"SET", [b"discovery/done", b"1"])
        for line in result.report:
            log(f"discovery: {line}")
        log(f"discovery: ranks use {','.join(result.interfaces)}, rendezvous at {result.rendezvous_addr} "
            f"({result.seconds:.2f} s)")
        deadline = time.monotonic() + 5.0  # the tasks see `done` and exit by themselves
        for task in tasks:
            try:
                task.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return result
    finally:
        _stop(tasks)
        client.close()
