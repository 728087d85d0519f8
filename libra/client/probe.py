"""A shell-side check for :func:`libra.client.common.unreachable`'s message (the pure client core does no I/O):
whether the broker's TCP port accepts a connection, which tells a silent, overloaded broker from an absent one."""

from __future__ import annotations

import socket

from libra.transport.endpoints import split_endpoints, tcp_host_port


def port_accepts(url: str, timeout: float = 0.5) -> bool | None:
    """Whether a TCP connect to ``url``'s host and port succeeds; ``None`` for a non-TCP or unparsable url.
    An address list (``tcp://A:5555,tcp://B:5555``): whether any of its ports accepts (``None`` if none is TCP)."""
    items = split_endpoints(url)
    if len(items) > 1:
        found = [port_accepts(str(u), timeout) for u in items]
        return True if True in found else (False if False in found else None)
    hp = tcp_host_port(url)
    if hp is None:
        return None
    try:
        with socket.create_connection((hp[0] or "127.0.0.1", hp[1]), timeout=timeout):
            return True
    except OSError:
        return False
