"""Elastic Hybrid Pool: hybrid workers join training as whole data-parallel replicas. Pure.

A hybrid replica (``tp × pp`` workers, a complete unsharded DP replica) goes through::

    hybrid_rollout ─request─► requested ─begin_fetch─► fetching_state ─state_fetched─► zero_sync
        ▲                                                                               │ zero_step (≥ 1)
        └───── cancel / fail (any member) / release ◄── active ◄─activated── activating ◄┘

Core training never waits for a join: while a replica fetches its snapshot and then sends
zero-gradient placeholders (which leave the core all-reduce mathematically unchanged), the core keeps
stepping. Activation happens at a step boundary; from the next step the replica's gradients are summed
into its target core replica before the core's own all-reduce.

Every join has a **generation**: ``request`` bumps it and every later event must carry it, so a late
event from a cancelled or failed join is ignored. Joins are atomic across the replica's members: one
member failing rolls all of them back. Gradient payloads are accepted only when their membership epoch,
step and state version match and the replica is active (``accept_gradient``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class JoinState(str, Enum):
    HYBRID_ROLLOUT = "hybrid_rollout"
    REQUESTED = "requested"
    FETCHING_STATE = "fetching_state"
    ZERO_SYNC = "zero_sync"
    ACTIVATING = "activating"
    ACTIVE = "active"


_NEXT = {
    "begin_fetch": (JoinState.REQUESTED, JoinState.FETCHING_STATE),
    "state_fetched": (JoinState.FETCHING_STATE, JoinState.ZERO_SYNC),
    "activate": (JoinState.ZERO_SYNC, JoinState.ACTIVATING),
    "activated": (JoinState.ACTIVATING, JoinState.ACTIVE),
}


class JoinError(RuntimeError):
    """An event that the join protocol does not allow in the current state (a caller bug)."""


@dataclass
class HybridReplica:
    """One hybrid DP replica (its member actor ids) and its join protocol state."""

    members: tuple[str, ...]
    target_core_replica: int = 0
    state: JoinState = JoinState.HYBRID_ROLLOUT
    generation: int = 0
    membership_epoch: int = 0  # bumped whenever the set of active replicas changes
    state_version: int = -1  # weights version of the fetched snapshot
    zero_steps: int = 0
    joined_step: int = -1
    history: list[str] = field(default_factory=list)

    def _log(self, what: str) -> None:
        if len(self.history) < 64:
            self.history.append(f"g{self.generation}:{what}")

    def request(self) -> int:
        """Start a join; returns its generation. Only from ``hybrid_rollout``."""
        if self.state is not JoinState.HYBRID_ROLLOUT:
            raise JoinError(f"replica {self.members} cannot join from {self.state.value}")
        self.generation += 1
        self.state = JoinState.REQUESTED
        self.zero_steps = 0
        self._log("requested")
        return self.generation

    def _event(self, name: str, generation: int) -> bool:
        if generation != self.generation:
            self._log(f"stale:{name}")
            return False  # a late event of an earlier join
        frm, to = _NEXT[name]
        if self.state is not frm:
            raise JoinError(f"{name} in state {self.state.value} (expected {frm.value})")
        self.state = to
        self._log(to.value)
        return True

    def begin_fetch(self, generation: int) -> bool:
        return self._event("begin_fetch", generation)

    def state_fetched(self, generation: int, version: int) -> bool:
        ok = self._event("state_fetched", generation)
        if ok:
            self.state_version = version
        return ok

    def zero_step(self, generation: int, step: int) -> bool:
        """One core step passed while this replica contributed zero gradients."""
        if generation != self.generation or self.state is not JoinState.ZERO_SYNC:
            return False
        self.zero_steps += 1
        return True

    def activate(self, generation: int) -> bool:
        """Ask for activation at the next step boundary (needs ≥ 1 zero-gradient step)."""
        if generation == self.generation and self.state is JoinState.ZERO_SYNC and self.zero_steps < 1:
            raise JoinError("activation needs at least one zero-gradient step first")
        return self._event("activate", generation)

    def activated(self, generation: int, step: int, version: int) -> bool:
        """The boundary passed: align to the core's ``version`` and contribute from ``step`` on."""
        ok = self._event("activated", generation)
        if ok:
            self.joined_step = step
            self.state_version = version
            self.membership_epoch += 1
        return ok

    def cancel(self, generation: int, why: str = "cancelled") -> bool:
        """Back to rollout (release signal, a member failed, the planner changed its mind)."""
        if generation != self.generation or self.state is JoinState.HYBRID_ROLLOUT:
            return False
        was_active = self.state is JoinState.ACTIVE
        self.state = JoinState.HYBRID_ROLLOUT
        if was_active:
            self.membership_epoch += 1
        self._log(why)
        return True

    def member_failed(self, actor_id: str, generation: int) -> bool:
        """Atomicity: one member failing rolls the whole replica back."""
        if actor_id not in self.members:
            return False
        return self.cancel(generation, f"failed:{actor_id}")

    def accept_gradient(self, *, epoch: int, step: int, version: int, current_step: int,
                        current_version: int) -> bool:
        """Whether a gradient payload from this replica is summed into its target core replica."""
        return (self.state is JoinState.ACTIVE and epoch == self.membership_epoch and step == current_step
                and version == current_version and step >= self.joined_step)

    @property
    def contributes_zeros(self) -> bool:
        return self.state is JoinState.ZERO_SYNC
