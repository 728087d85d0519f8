"""Streaming GRPO batch formation: the admission rule and the batch rule, as pure functions.

One rule shared by the runtime's job state (:class:`libra.broker.job_groups.JobState`) and the simulator's
batch former (:mod:`libra.sim.batching`), so that both run the execution model of docs/papers.md §1.7:

- **Admission is throttled by staleness only.** With ``B`` groups per training batch, ``version``
  training steps published and ``eta`` the maximum head off-policyness, a new group may start while
  ``admitted < (eta + version + 1) * B`` (``admitted`` = accepted + running: every group handed out and
  not dropped, trained ones included) and, when a concurrency cap is given, while ``running <
  max_concurrent``. :func:`admission_room` is the number of groups that may start now:
  ``min(max_concurrent - running, (eta + version + 1) * B - (accepted + running))``.
- **A batch is the first B complete groups, by creation.** Group ids are handed out in creation order;
  :func:`first_complete` returns the ``B`` lowest ids among the complete groups, or ``None`` while fewer
  than ``B`` are complete. A group whose tail is slow simply lands in a later batch; nothing waits for it.

Units are GRPO groups throughout (a group's samples start together and are trained together).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["admission_room", "first_complete"]


def admission_room(version: int, eta: int, batch: int, admitted: int, running: int = 0,
                   max_concurrent: int | None = None) -> int:
    """Groups that may start now (>= 0); see the module docstring. ``admitted`` counts accepted + running."""
    if batch < 1 or eta < 0 or version < 0:
        raise ValueError("batch must be >= 1, eta and version >= 0")
    room = (eta + version + 1) * batch - admitted
    if max_concurrent is not None:
        room = min(room, max_concurrent - running)
    return max(0, room)


def first_complete(complete: Iterable[int], batch: int) -> list[int] | None:
    """The ``batch`` oldest (lowest id = earliest created) complete groups, or None if fewer are complete."""
    ids = sorted(complete)
    return ids[:batch] if len(ids) >= batch else None
