"""The network interface gloo should use, where nobody said (GLOO_SOCKET_IFNAME unset).

gloo binds each rank's sockets to the address its host name resolves to. On many clusters (Debian's and
Ubuntu's /etc/hosts among them) a node's name resolves to 127.0.1.1: every rank then listens on loopback, and the
first collective across nodes (new_group's barrier) hangs. The interface that routes to the rendezvous address
(MASTER_ADDR) is the one the other nodes reach this one on: the kernel says which source address it would use
(a UDP socket's connect sends nothing), and the interface holding that address is the name gloo takes.
"""

from __future__ import annotations

import fcntl
import socket
import struct

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def source_address(towards: str) -> str | None:
    """This machine's IPv4 address on the route to ``towards`` (a host name or address), None if there is none."""
    try:
        target = socket.gethostbyname(towards)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))  # no packet leaves: connect on UDP only picks the route
            return probe.getsockname()[0]
    except OSError:
        return None


def interface_of(address: str) -> str | None:
    """The name of the interface whose (primary) IPv4 address is ``address``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this one
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def gloo_interface(master_addr: str) -> str | None:
    """The interface for GLOO_SOCKET_IFNAME: the one on the route to the rendezvous host (None: unknown)."""
    address = source_address(master_addr)
    return interface_of(address) if address else None
