"""Borrowed GPUs in the broker planner's rounds: lent slots as elastic rollout capacity. Pure.

A lent slot (its hello names an owner, ``libra.broker.lending``) is capacity the job does not own: the
planner never lays training on it, the plan applier never directs it to train, the Elastic Hybrid Pool never
borrows it and EARL's TP groups never include it. What it adds is rollout capacity, counted here:

- :func:`borrowed_round`: after the re-planner decided on the owned GPUs (``Replanner.step``), the same
  workload is planned with the connected, not-reclaimed lent slots as borrowed capacity
  (:func:`~libra.policies.planner.borrowed.plan_with_borrowed`: training restricted to the owned GPUs, the
  expected cost of revocations, at ``revocations_per_gpu_hour`` each costing ``revocation_cost_s``, added to
  the step time). When the round deploys a plan and borrowing pays, the deployed plan is the owned layout of
  the borrowed plan's training (:func:`borrowed_layout`); the lent slots then serve TP-1 instances in its
  buckets (:func:`lent_roles`). When the borrowed capacity changed since the deployed plan and the round did not
  re-plan, the deployed plan is re-scored with the capacity now lent and replaced when the gain beats the
  re-planner's reconfiguration estimate (reason ``borrowed_capacity_changed``). Every figure goes into the
  round's decision record (``borrowed``).
- :func:`default_revocation_cost_s`: the cost of one revocation when ``[broker.planner]`` does not set it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from libra.policies.cost import RolloutCostModel
from libra.policies.planner.borrowed import (
    BorrowedCapacity,
    expected_with_training,
    place_borrowed,
    plan_with_borrowed,
    revocation_cost_s,
)
from libra.policies.planner.online import ReplanDecision, Replanner
from libra.policies.planner.types import Plan, PlannerError

from .plan_applier import Role

__all__ = ["DEFAULT_IN_FLIGHT", "borrowed_round", "default_revocation_cost_s", "lent_roles"]

#: Turns in flight on a lent TP-1 instance when it is revoked, for the default revocation cost.
DEFAULT_IN_FLIGHT = 8


def default_revocation_cost_s(cm: RolloutCostModel, history: Iterable[tuple[float, float, float, float]]) -> float:
    """Seconds of rollout work one revocation costs when the settings do not say: ``DEFAULT_IN_FLIGHT`` turns
    re-prefill the observed mean context (prompt plus half the generation) on a TP-1 instance and re-decode
    half of the observed mean turn (:func:`~libra.policies.planner.borrowed.revocation_cost_s`); 0 without
    history."""
    rows = list(history)
    if not rows:
        return 0.0
    ctx = sum(p + g / 2 for p, g, _, _ in rows) / len(rows)
    turn = sum(g / max(1.0, t) for _, g, t, _ in rows) / len(rows)
    return revocation_cost_s(cm, DEFAULT_IN_FLIGHT, ctx, turn)


def _owned_layout(planner: Any, workload: Any, plan: Plan) -> Plan:
    """The owned GPUs' layout of a plan counted with borrowed GPUs: its training, the rest rolling out."""
    return replace(planner.plan_fixed(workload, plan.n_train, None, plan.train), allocator=plan.allocator)


def borrowed_round(rp: Replanner, decision: ReplanDecision, current: Plan | None, cap: BorrowedCapacity,
                   deployed_with: int | None) -> tuple[ReplanDecision, dict[str, Any] | None]:
    """The round's decision with the borrowed capacity counted (module docstring), and its record (None when
    nothing was borrowed before or now, or the round had too little history). ``deployed_with``: the borrowed
    GPUs the deployed plan was decided with (None: no deployed plan)."""
    if (cap.gpus == 0 and not deployed_with) or decision.reason in ("insufficient_history", "warmup"):
        return decision, None
    planner = rp.allocator.planner
    wl = rp.workload()
    try:
        bp = plan_with_borrowed(planner, wl, cap)
        deploy = _owned_layout(planner, wl, bp.plan) if bp.uses_borrowed else bp.owned
    except (PlannerError, ValueError, ArithmeticError) as exc:
        return decision, {"gpus": cap.gpus, "error": f"{type(exc).__name__}: {exc}"}
    rec: dict[str, Any] = {"gpus": cap.gpus, "revocations_per_gpu_hour": cap.revocations_per_gpu_hour,
                           "revocation_cost_s": round(cap.revocation_cost_s, 3),
                           "owned_only_s": round(bp.owned.objective, 3), "expected_s": round(bp.expected_s, 3),
                           "predicted_gain": round(bp.gain, 4), "used": bp.uses_borrowed,
                           "n_train": deploy.n_train}
    if decision.apply and decision.plan is not None:
        return (replace(decision, plan=deploy) if bp.uses_borrowed else decision), rec
    if current is None or deployed_with == cap.gpus or deploy.same_layout(current):
        return decision, rec
    t_now = expected_with_training(planner, wl, current, cap)
    net = (t_now - bp.expected_s) - rp.reconfig_estimate() if math.isfinite(t_now) else math.inf
    rec.update(current_expected_s=round(t_now, 3), net_gain_s=round(net, 3))
    if net > 0:
        return replace(decision, apply=True, reason="borrowed_capacity_changed", plan=deploy,
                       current_time=t_now, candidate_time=bp.expected_s), rec
    return decision, rec


def lent_roles(plan: Plan, lent: list[str], policy: str = "proportional") -> dict[str, Role]:
    """The roles of the ``lent`` slots (actor ids, in the order they were lent) under ``plan``: each one a TP-1
    rollout instance in a C-MLFQ bucket of the plan (bucket names as ``plan_applier.bucket_specs``), spread
    like the owned rollout GPUs or all in the smallest bucket, as ``policy`` says
    (:func:`~libra.policies.planner.borrowed.place_borrowed`). Each keeps the group
    name ``lent.<actor id>``, so a slot that stays in its bucket does not switch."""
    gpus: dict[str, int] = {}
    for b in plan.buckets():
        gpus[f"tp{b.tp}"] = gpus.get(f"tp{b.tp}", 0) + sum(i.tp for i in plan.rollout if i.tp == b.tp)
    if not lent or not gpus or sum(gpus.values()) <= 0:
        return {aid: Role("idle") for aid in lent}
    where = place_borrowed(gpus, len(lent), policy)
    return {aid: Role("rollout", 1, f"lent.{aid}", b, 0, 1) for aid, b in zip(lent, where, strict=True)}
