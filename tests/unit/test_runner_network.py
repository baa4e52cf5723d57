"""Interface lookup, local-host detection and free ports (runner/network.py)."""
import socket

import pytest

from hvdlite.runner.network import (LocalHostDetector, NetworkError, free_port,
                                    interface_address)


def test_interface_address_of_loopback():
    assert interface_address("lo") == "127.0.0.1"


def test_interface_address_unknown_interface_names_the_known_ones():
    with pytest.raises(NetworkError, match=r"'nosuchif0' does not exist.*\blo\b"):
        interface_address("nosuchif0")


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.0.1.1", socket.gethostname()])
def test_local_host_detector_knows_this_machine(host):
    assert LocalHostDetector().is_local(host)


def test_local_host_detector_other_hosts_are_remote():
    assert not LocalHostDetector().is_local("node-a.invalid")


def test_free_port_avoids_given_ports():
    first = free_port()
    assert free_port(avoid={first}) != first


# ---- network discovery's choice (runner/discovery.py: plan) ---------------------------------

from hvdlite.runner.discovery import NetworkDiscoveryError, plan  # noqa: E402


def _info(hostname, interfaces, reached):
    return {"hostname": hostname, "interfaces": interfaces, "driver_reached": reached}


def test_plan_keeps_interfaces_every_host_reaches_every_host_through():
    infos = {0: _info("a", {"dcy0": ["10.9.1.2"], "eth0": ["10.0.0.11"], "ib0": ["10.1.0.11"]}, ["10.0.0.1"]),
             1: _info("b", {"dcy0": ["10.9.2.2"], "eth0": ["10.0.0.12"], "ib0": ["10.1.0.12"]}, ["10.0.0.1", "10.5.0.1"])}
    probes = {0: {"1": [["dcy0", "10.9.2.2", False], ["eth0", "10.0.0.12", True], ["ib0", "10.1.0.12", True]]},
              1: {"0": [["dcy0", "10.9.1.2", False], ["eth0", "10.0.0.11", True], ["ib0", "10.1.0.11", False]]}}
    result = plan(["a", "b"], probes, infos, ["10.5.0.1", "10.0.0.1"])
    assert result.interfaces == ["eth0"]  # ib0 works one way only
    assert result.rendezvous_addr == "10.0.0.1"  # the only address both reached
    assert result.rank_env() == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert "b reaches a through eth0 (tried dcy0 10.9.1.2, eth0 10.0.0.11, ib0 10.1.0.11)" in result.report


def test_plan_with_no_common_interface_names_hosts_and_interfaces():
    infos = {0: _info("a", {"eth0": ["10.0.0.11"]}, ["10.0.0.1"]),
             1: _info("b", {"ens5": ["10.0.0.12"]}, ["10.0.0.1"])}
    probes = {0: {"1": [["ens5", "10.0.0.12", True]]}, 1: {"0": [["eth0", "10.0.0.11", True]]}}
    with pytest.raises(NetworkDiscoveryError, match=r"no network interface reaches every host from its neighbours: "
                                             r"a reaches b through ens5 .*; b reaches a through eth0"):
        plan(["a", "b"], probes, infos, ["10.0.0.1"])


def test_plan_with_no_launcher_address_every_host_reaches():
    infos = {0: _info("a", {"eth0": ["10.0.0.11"]}, ["10.0.0.1"]),
             1: _info("b", {"eth0": ["10.0.0.12"]}, ["10.7.0.1"])}
    probes = {0: {"1": [["eth0", "10.0.0.12", True]]}, 1: {"0": [["eth0", "10.0.0.11", True]]}}
    with pytest.raises(NetworkDiscoveryError, match="no address of this launcher is reachable from every host"):
        plan(["a", "b"], probes, infos, ["10.0.0.1", "10.7.0.1"])


def test_each_host_probes_its_two_ring_neighbours_whatever_the_job_size():
    from hvdlite.runner.task_service import neighbours
    assert neighbours(0, 2) == [1] and neighbours(1, 2) == [0]
    for count in (3, 8, 1000):
        probed = {i: neighbours(i, count) for i in range(count)}
        assert all(len(p) == 2 and i not in p for i, p in probed.items())
        # every link of the ring is probed both ways
        assert all(i in probed[(i + 1) % count] and (i + 1) % count in probed[i] for i in range(count))


def test_plan_reads_only_the_pairs_that_were_probed():
    infos = {i: {"hostname": h, "interfaces": {"eth0": [f"10.0.0.{i}"]}, "driver_reached": ["10.0.0.9"]}
             for i, h in enumerate("abcd")}
    ring = {i: {str(j): [["eth0", f"10.0.0.{j}", True]] for j in ((i - 1) % 4, (i + 1) % 4)} for i in range(4)}
    result = plan(list("abcd"), ring, infos, ["10.0.0.9"])
    assert result.interfaces == ["eth0"] and len(result.report) == 8
    ring[2]["3"][0][2] = False  # one link fails one way: named in the error
    with pytest.raises(NetworkDiscoveryError, match="c reaches d through nothing"):
        plan(list("abcd"), ring, infos, ["10.0.0.9"])
