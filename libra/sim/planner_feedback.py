"""What a planner allocation measures for the broker's re-planner (:mod:`libra.sim.planner`).

Role: the simulator's side of the feedback the broker's planner loop gets each training-step boundary:
:func:`pressure_snapshot` (the pressures and stage times a round starts with) and :func:`observe_step`
(prediction-error and reconfiguration-cost feedback, the ``error_feedback`` / ``reconfig_feedback`` options of
:class:`~libra.sim.planner_params.PlannerSimParams`). Pure simulation state on the virtual clock.
"""

from __future__ import annotations

import math
from typing import Any

from libra.policies.planner.allocators import PressureSnapshot
from libra.policies.planner.online import layout_class
from libra.sim.host import SimHost

__all__ = ["observe_step", "pressure_snapshot"]


def observe_step(alloc: Any, k: int, busy: bool) -> None:
    """Prediction-error feedback after training step ``k`` of the planner allocation ``alloc`` (a
    :class:`~libra.sim.planner.PlannerAllocation`; see :mod:`libra.sim.planner`, contract point 2).

    A step is *clean* when no plan was applied after its window started: the last ``L`` steps'
    rollouts (``L`` = the policy lag) and the training end before them. ``error_feedback``: a clean
    step reports the mean interval between training-step ends over those ``L`` steps (with ``L > 1``
    steps finish in bursts, so one interval alone alternates short and long) against the plan's
    prediction (:meth:`Replanner.observe_step`). ``reconfig_feedback``: a step that is not clean
    adds its interval minus the deployed plan's corrected prediction to the running excess of the
    deployment(s) it saw; the first clean step after them reports that excess, per deployment, as
    the measured reconfiguration cost (:meth:`Replanner.observe_reconfig`)."""
    sim = alloc.sim
    assert sim is not None
    lag = max(1, sim.lag)
    if k < lag:
        return
    start = min(min(sim.rollout_start[k - lag + 1:k + 1]), sim.train_end[k - lag])
    if math.isnan(start):
        return
    rp = alloc.replanner
    if busy or alloc.plan_history[-1][0] > start:
        if alloc.params.reconfig_feedback and len(rp.history) >= rp.min_history:
            pred = rp.corrected(alloc.allocator.evaluate(alloc.plan, rp.workload()))
            if math.isfinite(pred):
                alloc._dirty.append(sim.train_end[k] - sim.train_end[k - 1] - pred)
        return
    if alloc._dirty:
        n = max(1, len(alloc.applied) - alloc._dirty_applied)
        cost = sum(alloc._dirty) / n
        rp.observe_reconfig(cost)
        alloc.reconfig_costs.append({"step": k, "deployments": n, "cost_s": round(cost, 3)})
        alloc._dirty = []
    alloc._dirty_applied = len(alloc.applied)
    if not alloc.params.error_feedback:
        return
    observed = (sim.train_end[k] - sim.train_end[k - lag]) / lag
    ratio = rp.observe_step(alloc.plan, observed)
    if ratio is not None:
        alloc.step_errors.append({"step": k, "class": layout_class(alloc.plan), "observed_s": round(observed, 3),
                                 "ratio": round(ratio, 4)})


def pressure_snapshot(sim: SimHost, step: int, max_queue_length: int) -> PressureSnapshot:
    """The pressures and stage times the next planner round sees at step ``step`` (queued generate turns /
    (leaders x ``max_queue_length``), running turns / credit, the last rollout and training step)."""
    leaders = [s for s in sim.broker.actors.values() if "generate" in s.accepting and s.directive is None]
    credit = sum(s.capacity for s in leaders) or 1
    running = sum(len(s.held) for s in leaders)
    queued = sum(len(q) for key, q in sim.broker.queues.items() if key[0] == "generate")
    qp = min(1.0, queued / max(1, len(leaders) * max_queue_length))
    k = sim.trained - 1
    roll = [e - s for s, e in zip(sim.rollout_start, sim.rollout_end) if not (math.isnan(s) or math.isnan(e))]
    train = sim.train_end[k] - sim.train_start[k] if k >= 0 else None
    return PressureSnapshot(step, qp, min(1.0, running / credit), 0, roll[-1] if roll else None, train)
