"""Where trainer ranks on several hosts meet: the network interface this host reaches rank 0's address by.

Gloo and NCCL pick the interface for their own connections by resolving the host name unless told
(``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``); on hosts whose name resolves to a loopback address they
then advertise ``127.0.0.1`` to the other hosts and the group never forms. :func:`pin_interfaces` sets
both to the interface that routes to rank 0's address (rank 0: the one holding it), unless the operator
set them or the group is on loopback.
"""

from __future__ import annotations

import ipaddress
import os
import socket

__all__ = ["interface_for", "pin_interfaces", "route_source"]


def route_source(addr: str) -> str | None:
    """The local IP this host's routing table sends packets to ``addr`` from (no packet is sent)."""
    try:
        family = socket.getaddrinfo(addr, None)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def interface_for(addr: str) -> str | None:
    """The name of the interface that holds the local address routing to ``addr``, or None."""
    import psutil

    src = route_source(addr)
    if src is None:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == src for a in addrs):
            return name
    return None


def pin_interfaces(master_addr: str) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` (where unset) to :func:`interface_for` of
    ``master_addr``; nothing for a loopback address. Returns the interface chosen, or None."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(master_addr)).is_loopback:
            return None
    except (OSError, ValueError):
        return None
    name = interface_for(master_addr)
    if name is None:
        return None
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, name)
    return name
