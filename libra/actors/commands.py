"""What the actor core (:class:`~libra.actors.state.ActorState`) asks its shell to do: send a message, (re)connect,
start or cancel work, reconfigure the engine, write a log line. Plain values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from libra.protocol import messages as m

__all__ = ["CancelWork", "Connect", "Note", "Reconfigure", "SendMsg", "StartWork"]


@dataclass(slots=True)  # not frozen: built per message on the hot path (see protocol.messages)
class SendMsg:
    msg: Any


@dataclass(frozen=True, slots=True)
class Connect:
    """Close any current socket and open a fresh one (new identity) to the broker: the one at index
    ``address`` of the actor's broker address list (always 0 with one address)."""

    address: int = 0


@dataclass(slots=True)  # not frozen: built per message on the hot path (see protocol.messages)
class StartWork:
    assign: m.Assign


@dataclass(frozen=True, slots=True)
class CancelWork:
    work_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Reconfigure:
    directive_id: int
    kinds: list[str]
    config: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Note:
    """Something worth a log line (the core does not log itself), at ``level``."""

    event: str
    fields: dict[str, Any] = field(default_factory=dict)
    level: str = "info"
