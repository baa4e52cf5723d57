"""This host's network interfaces and their IPv4 addresses (no torch; used by hvd.init() and by
the launcher, which re-exports these from hvdlite.runner.network)."""
import fcntl
import socket
import struct
from typing import Dict, List

from ..exceptions import NetworkError

_SIOCGIFADDR = 0x8915


def interface_names() -> List[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def interface_address(name: str) -> str:
    """The IPv4 address of interface `name` (SIOCGIFADDR)."""
    if not name or len(name) >= 16:
        raise NetworkError(f"bad network interface name {name!r}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()))
        except OSError:
            known = ", ".join(interface_names()) or "none found"
            raise NetworkError(f"network interface {name!r} does not exist or has no IPv4 "
                               f"address (interfaces: {known})") from None
    return socket.inet_ntoa(packed[20:24])


def interface_addresses() -> Dict[str, str]:
    """Interface name -> its IPv4 address, for every interface that has one."""
    found = {}
    for name in interface_names():
        try:
            found[name] = interface_address(name)
        except NetworkError:
            pass
    return found
