"""Actors: ``ActorState`` (pure core), the runtime shell, slot discovery and the per-host supervisor."""

from __future__ import annotations

from .state import ActorIdentity, ActorPhase, ActorState

__all__ = ["ActorIdentity", "ActorPhase", "ActorState"]
