"""Inputs to and outputs of the broker's pure core (``BrokerState.handle``).

Events are what the shell observed (a decoded frame from a peer, a frame that failed to decode, a
timer tick, a planner search it ran off the loop). Commands are what the core wants done (send a message to a peer). Both are plain frozen
dataclasses so tests can build and compare them directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from libra.protocol.errors import ProtocolError


@dataclass(frozen=True, slots=True)
class PeerMessage:
    """A decoded message from the peer with routing identity ``peer``."""

    peer: bytes
    msg: Any
    buffers: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class BadFrame:
    """A frame list from ``peer`` that the codec rejected."""

    peer: bytes
    error: ProtocolError


@dataclass(frozen=True, slots=True)
class Tick:
    """Periodic timer: liveness, leases, deadlines, heartbeats."""


@dataclass(frozen=True, slots=True)
class PlannerDone:
    """The search of a broker planning round finished (``job``: a ``planner_loop.PlanJob`` the shell
    ran off the event loop)."""

    job: Any


Event = PeerMessage | BadFrame | Tick | PlannerDone


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``msg`` (plus raw ``buffers``) to ``peer``."""

    peer: bytes
    msg: Any
    buffers: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class Journal:
    """Record for durability: ``op`` is ``accept`` (a request was accepted: ``data`` has its fields) or
    ``done`` (its one reply was produced: ``data`` is the Reply's fields). Ignored without a journal."""

    op: str
    client_id: str
    request_id: str
    data: dict[str, Any]


Command = Send
