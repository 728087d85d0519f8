"""The work-handler contract between actors and engines.

A handler is ``fn(args, ctx) -> output`` where ``output`` is anything msgpack can carry. It raises
:class:`ToolError` (with a stable ``code``) for a failure the caller should see as typed; any other
exception becomes ``tool_failed`` with the exception's text. Engines build handlers
(:mod:`libra.engines.sandbox.handlers`, :mod:`libra.engines.services`); actors run them
(:mod:`libra.actors.tools`, which also documents how users declare tools of their own).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Handler", "ToolError", "WorkContext"]


class ToolError(Exception):
    """A typed tool failure; ``code`` travels to the client (e.g. ``timeout``, ``memory``, ``bad_request``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True)
class WorkContext:
    """What a handler knows of the work it runs: ids, its time budget, and the revocation flag."""

    work_id: str
    trajectory: str | None
    budget_s: float
    cancelled: threading.Event = field(default_factory=threading.Event)
    actor_id: str = ""
    cores: int = 1  # cores the action scheduler granted this action (sandbox tools pin to this many)
    route: dict[str, Any] = field(default_factory=dict)  # Assign.route: core_ids, a GPU service's placement
    sandbox: Any = None  # a user tool declared sandboxed: runs python/bash/pytest in the trajectory's sandbox


Handler = Callable[[Any, WorkContext], Any]
