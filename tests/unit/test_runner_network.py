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
