"""systemd readiness notification (``Type=notify``), in-tree on purpose (no dependency).

Contract: :func:`notify` sends one datagram to ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the
abstract namespace) and returns True; without ``NOTIFY_SOCKET`` it does nothing and returns False.
It never raises: a failed notification is logged and the service keeps running (systemd then
times the start out, which is the visible failure). Callers send READY only once they can serve
(the broker after binding, an actor after its first Welcome) and STOPPING when shutdown begins.
"""

from __future__ import annotations

import os
import socket

from libra.logging import get_logger

log = get_logger("libra.transport.sdnotify")


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``) to systemd. Returns whether a message was sent."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":  # abstract socket namespace
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as exc:
        log.warning("sd_notify_failed", state=state.split("\n", 1)[0], error=str(exc))
        return False
    return True


def ready(status: str = "") -> bool:
    """Tell systemd the service is up (``READY=1``, our pid, and an optional status line)."""
    msg = f"READY=1\nMAINPID={os.getpid()}"
    return notify(f"{msg}\nSTATUS={status}" if status else msg)


def stopping() -> bool:
    """Tell systemd a clean shutdown has begun."""
    return notify("STOPPING=1")
