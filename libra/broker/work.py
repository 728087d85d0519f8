"""Work items and their lifecycle table (queued → leased → done | failed, leased → queued on requeue).

A ``Work`` is one accepted request. Its ``lease`` is bumped on every assignment; a result is only
accepted when it carries the current lease, which is what makes delivery exactly-once even when a slow
or reconnected actor answers late. Transitions not in ``_ALLOWED`` raise :class:`InvalidTransition`
(a bug in the core, never a user error).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class WorkState(str, Enum):
    QUEUED = "queued"
    LEASED = "leased"
    DONE = "done"
    FAILED = "failed"


_ALLOWED: frozenset[tuple[WorkState, WorkState]] = frozenset(
    {
        (WorkState.QUEUED, WorkState.LEASED),
        (WorkState.QUEUED, WorkState.FAILED),  # deadline passed / cancelled while waiting
        (WorkState.LEASED, WorkState.DONE),
        (WorkState.LEASED, WorkState.FAILED),
        (WorkState.LEASED, WorkState.QUEUED),  # actor died, lease expired, handed back
    }
)


class InvalidTransition(RuntimeError):
    """A work item was asked to move along an edge the lifecycle does not have."""

    def __init__(self, work: "Work", to: WorkState) -> None:
        super().__init__(f"work {work.work_id}: {work.state.value} -> {to.value} is not allowed; story: {work.story}")


@dataclass(slots=True)
class Work:
    work_id: str
    request_id: str
    client: bytes
    kind: str
    name: str
    args: Any
    trajectory: str | None
    submitted_at: float
    deadline: float
    seq: int
    state: WorkState = WorkState.QUEUED
    lease: int = 0
    attempt: int = 0  # number of assignments so far
    failures: int = 0  # assignments lost to actor death / lease expiry
    actor: bytes | None = None  # session holding the current lease
    holder: str = ""  # actor id given the current (or last) lease: only it may adopt the work back
    lease_expires: float = 0.0
    target: bytes | None = None  # generate: the instance the router chose (sticky prefix cache)
    client_id: str = ""  # the client's stable id (its socket ``client`` may change on reconnect)
    timeout_s: float = 0.0
    route: dict[str, Any] = field(default_factory=dict)
    pin: str = ""  # an actor id: only that actor may take this work ("" = any actor that serves it)
    story: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.name)

    def move(self, to: WorkState, why: str) -> None:
        if (self.state, to) not in _ALLOWED:
            raise InvalidTransition(self, to)
        self.state = to
        if len(self.story) < 32:
            self.story.append(f"{to.value}:{why}")
