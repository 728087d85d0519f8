"""A shell-side check for :func:`libra.client.common.unreachable`'s message (the pure client core does no I/O):
whether the broker's TCP port accepts a connection, which tells a silent, overloaded broker from an absent one."""

from __future__ import annotations

import socket


def port_accepts(url: str, timeout: float = 0.5) -> bool | None:
    """Whether a TCP connect to ``url``'s host and port succeeds; ``None`` for a non-TCP or unparsable url."""
    if not url.startswith("tcp://"):
        return None
    host, _, port = url[len("tcp://"):].rpartition(":")
    try:
        addr = (host.strip("[]") or "127.0.0.1", int(port))
    except ValueError:
        return None
    try:
        with socket.create_connection(addr, timeout=timeout):
            return True
    except OSError:
        return False
