"""Applying a planner's plan to the live broker: GPU actors → roles → directives, and the periodic
planning round (friend functions of :class:`~libra.broker.state.BrokerState`; pure like it). The layout
and ordering rules are in ``pools``, the round's decision in ``planner_loop``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from libra.logging import get_logger

from .events import Command
from .pools import GpuSlot, PlanApplier, PlanError, Role, bucket_specs, layout_roles

if TYPE_CHECKING:
    from .state import BrokerState

log = get_logger(__name__)


def gpu_slots(self: BrokerState) -> list[GpuSlot]:
    """The connected GPU actors as plan slots (labels ``slot_kind == "gpu"``, slot ``gpuN``)."""
    out = []
    for sess in self.actors.values():
        if sess.labels.get("slot_kind") == "gpu" and sess.slot[3:].isdigit():
            out.append(GpuSlot(sess.actor_id, sess.host, int(sess.slot[3:])))
    return out

def apply_plan(self: BrokerState, plan: Any, now: float) -> list[Command]:
    """Move GPU actors to the roles of ``plan`` (a planner ``Plan``) without stopping anything.

    Lays the plan out on the connected GPU actors (raises ``PlanError`` if it does not fit), sets
    the rollout buckets, and sends the first wave of directives; later waves follow as actors
    finish switching, ordered so that a complete training replica stays active throughout.
    """
    current: dict[str, Role] = {}
    for slot in self.gpu_slots():
        cfg = self._actor_by_id(slot.actor_id).directive_config  # type: ignore[union-attr]
        keys = ("tp", "group", "bucket", "rank", "size")
        current[slot.actor_id] = (Role(cfg["role"], **{k: cfg[k] for k in keys if k in cfg})
                                  if cfg.get("role") in ("train", "rollout") else Role("idle"))
    self._plan_generation += 1
    target = layout_roles(plan, self.gpu_slots(), current, self._plan_generation)
    self.plan_applier = PlanApplier(current, target)
    self.rollout.set_buckets(bucket_specs(plan))
    out: list[Command] = []
    for aid, role in self.plan_applier.start():
        out.extend(self.direct(aid, role.kinds, now, "finish", role.config())[1])
    return out


def plan_round(self: BrokerState, now: float) -> list[Command]:
    """On the timer: when a round of the broker's planner (``planner_loop``) is due and no plan is still
    being applied, start it on the connected GPU actors. Inline (``planner_offload`` False) the search
    runs here and its plan is applied at once; offloaded, the shell runs ``planner.job`` and reports
    back with a ``PlannerDone`` event (:func:`plan_done`)."""
    loop = self.planner
    if loop is None or not loop.due(now) or (self.plan_applier is not None and not self.plan_applier.done):
        return []
    gen = [s for s in self.actors.values() if "generate" in s.accepting]
    cap = max(1, sum(s.capacity for s in gen))
    queued = sum(len(q) for (kind, _), q in self.queues.items() if kind == "generate")
    active = sum(len(s.held) for s in gen)
    stage = _last_step_times(self)
    job = loop.start(len(self.gpu_slots()), now, queue_pressure=min(1.0, queued / cap),
                     active_pressure=min(1.0, active / cap), rejected_total=self.stats["busy"],
                     rollout_time=stage[0], train_time=stage[1])
    if job is None or self.planner_offload:
        return []
    return plan_done(self, job.run(), now)


def _last_step_times(self: BrokerState) -> tuple[float | None, float | None]:
    """``(rollout s, training s)`` of the newest RL step recorded by a job this broker runs (None, None
    without one)."""
    newest: dict[str, Any] | None = None
    for host in self.jobs.values():
        recs = getattr(host, "records", None)
        if recs and (newest is None or recs[-1].get("step", 0) >= newest.get("step", 0)):
            newest = recs[-1]
    if newest is None:
        return None, None
    roll, train = newest.get("rollout_time_s"), newest.get("train_time_s")
    ok = [isinstance(x, (int, float)) and x > 0 for x in (roll, train)]
    return (float(roll) if ok[0] else None), (float(train) if ok[1] else None)


def plan_done(self: BrokerState, job: Any, now: float) -> list[Command]:
    """A round's search finished: apply the plan it decided on, if any. A plan that does not fit the
    actors connected now (``PlanError``: some left meanwhile) is recorded as ``apply_failed``."""
    loop = self.planner
    if loop is None:
        return []
    plan = loop.finish(job, now)
    if plan is None:
        return []
    try:
        return self.apply_plan(plan, now)
    except PlanError as exc:
        loop.rejected(plan, str(exc))
        return []


def abandon_plan(self: BrokerState, actor_id: str, why: str, now: float) -> None:
    """An actor of the plan being applied left (``why``): stop sequencing it. Actors already told keep
    switching and bid with their new roles; the rest keep theirs. The broker's planner (if any) forgets
    the plan, so its next round plans afresh for the actors still connected."""
    self.plan_applier = None
    log.warning("plan_abandoned", actor=actor_id, why=why)
    if self.planner is not None:
        self.planner.abandoned(actor_id, why, now)
