"""Addresses of this machine: interface lookup, "is this host me?", free ports.

Used by the launcher's main thread only; no state.
"""
import socket
from typing import Optional, Set

from hvdlite._job.netif import NetworkError, interface_address, interface_names  # noqa: F401

def local_addresses() -> Set[str]:
    """Every IPv4 address of this machine's interfaces, plus what its host name resolves to."""
    addrs = {"127.0.0.1", "::1"}
    for name in interface_names():
        try:
            addrs.add(interface_address(name))
        except NetworkError:
            pass
    try:
        addrs.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return addrs


def local_names() -> Set[str]:
    names = {"localhost", "localhost.localdomain", "ip6-localhost"}
    hostname = socket.gethostname()
    names.add(hostname)
    names.add(hostname.split(".")[0])
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    return names


class LocalHostDetector:
    """Decides whether a host name from -H/--hostfile means this machine (no ssh needed).

    Names and addresses are looked up once; an unknown name is resolved with DNS and compared
    against this machine's addresses.
    """

    def __init__(self) -> None:
        self._names = local_names()
        self._addrs = local_addresses()

    def is_local(self, host: str) -> bool:
        if host in self._names or host in self._addrs or host.startswith("127."):
            return True
        try:
            resolved = socket.gethostbyname_ex(host)[2]
        except OSError:
            return False
        return any(a in self._addrs or a.startswith("127.") for a in resolved)


def free_port(host: str = "127.0.0.1", avoid: Optional[Set[int]] = None) -> int:
    """A TCP port that was free on `host` a moment ago (another process may still take it)."""
    avoid = avoid or set()
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in avoid:
            return port
    raise OSError("could not find a free port")


def address_towards(host: str) -> Optional[str]:
    """The local address the kernel would use to reach `host`, or None if `host` is unknown.

    A UDP connect sends nothing; it only picks the route.
    """
    try:
        target = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((target, 9))
            return sock.getsockname()[0]
    except OSError:
        return None


def advertised_address() -> str:
    """An address of this machine that other machines can probably reach."""
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if not addr.startswith("127."):
            return addr
    except OSError:
        pass
    for addr in sorted(local_addresses()):
        if ":" not in addr and not addr.startswith("127."):
            return addr
    return "127.0.0.1"
