"""The actor core's lifecycle (``ActorState.phase``): its phases and the transitions it may make (see
:mod:`libra.actors.state`); an undefined transition raises, because it is a bug."""

from __future__ import annotations

from enum import Enum

__all__ = ["ActorPhase", "InvalidActorTransition"]


class ActorPhase(str, Enum):
    CONNECTING = "connecting"
    READY = "ready"
    DRAINING = "draining"
    SWITCHING = "switching"


_TRANSITIONS: frozenset[tuple[ActorPhase, ActorPhase]] = frozenset({
    (ActorPhase.CONNECTING, ActorPhase.CONNECTING),
    (ActorPhase.CONNECTING, ActorPhase.READY),
    (ActorPhase.READY, ActorPhase.DRAINING),
    (ActorPhase.DRAINING, ActorPhase.DRAINING),
    (ActorPhase.DRAINING, ActorPhase.SWITCHING),
    (ActorPhase.SWITCHING, ActorPhase.READY),
    (ActorPhase.READY, ActorPhase.CONNECTING),
    (ActorPhase.DRAINING, ActorPhase.CONNECTING),
    (ActorPhase.SWITCHING, ActorPhase.CONNECTING),
})


class InvalidActorTransition(RuntimeError):
    pass
