"""The actor's broker socket: which address of its list to open, and the DEALER socket itself.

An actor may be given several broker addresses (``--broker tcp://A:5555,tcp://B:5555``: a primary and a
standby). Which one the next connection opens is decided by the pure core (``ActorState.address``, carried
in ``Connect.address``); this module only opens the socket there.
"""

from __future__ import annotations

import uuid

import zmq

from libra.transport.endpoints import parse_endpoints, resolve
from libra.transport.security import CurveClient, apply_client

__all__ = ["broker_urls", "open_broker_socket"]


def broker_urls(broker: str | list[str] | tuple[str, ...]) -> list[str]:
    """The actor's broker addresses, in order (``BadAddress`` naming a bad item)."""
    return parse_endpoints(broker)


def open_broker_socket(ctx: zmq.Context, url: str, curve: CurveClient | None,
                       max_frame_bytes: int) -> tuple[zmq.Socket, str]:
    """A fresh DEALER socket (new identity) connected to the broker at ``url``, and the endpoint it connected
    to (the broker's ipc path when it is on this host: looked up at each connect, a broker may have moved)."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IDENTITY, b"a-" + uuid.uuid4().bytes)
    if curve is not None:
        apply_client(s, curve)
    s.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    s.setsockopt(zmq.SNDHWM, 100_000)
    s.setsockopt(zmq.RCVHWM, 100_000)
    endpoint = resolve(url)
    s.connect(endpoint)
    return s, endpoint
