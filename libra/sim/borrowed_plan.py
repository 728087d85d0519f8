"""The GRP planner's owned layouts for ``bench borrowed``: owned-only, and with borrowed GPUs counted.

Role: the owned GPUs' layout of a borrowed-GPU comparison when the planner decides it, instead of the
simulator's fixed ``hetero`` layout. Both layouts come from the same planner the runtime uses: the broker's
:class:`~libra.broker.plan_decider.PlannerLoop` built from the ``[broker.planner]`` settings the simulator's
``grp`` allocation gives it (:class:`~libra.sim.planner.PlannerAllocation`), on the workload of the trace's
profiled first step (as that allocation's initial plan):

- :func:`planner_owned`: the loop's profiled plan on the owned GPUs alone (the run without borrowing); its
  predicted step over the run (:meth:`OwnedPlanner.predicted_step_s`) is the mean of the planner's time of the
  deployed layout on every step's workload (the first step's alone is ~4x short on the drifting R2E trace);
- :func:`planner_borrowed`: :func:`~libra.policies.planner.borrowed.plan_with_borrowed` with the lent
  capacity the owner's schedule gives on average (:class:`BorrowedCapacity`: GPUs, its take-backs per lent
  GPU-hour, one take-back's cost by the broker's default :func:`~libra.broker.plan_borrowed.default_revocation_cost_s`);
  the owned GPUs deploy the owned layout of its training (``plan_fixed`` with that training, the rest rolling
  out; the broker's round does the same) and the lent slots serve TP-1 instances in that plan's buckets by the
  broker's :func:`~libra.broker.plan_borrowed.lent_roles`.

Static: each plan is computed once before the run (the broker's rounds would re-plan as lent slots come and
go; the bench says so in a ``modelled-only`` line). Deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from libra.broker.plan_applier import GpuSlot, bucket_specs, layout_roles
from libra.broker.plan_borrowed import default_revocation_cost_s, lent_roles
from libra.policies.cost import RolloutCostModel
from libra.policies.planner.borrowed import BorrowedCapacity, BorrowedPlan, plan_with_borrowed
from libra.policies.planner.types import Plan
from libra.sim.cluster import Layout, RolloutInstanceSpec, SimConfigError
from libra.sim.config import SimConfig
from libra.sim.gpus import gpu_id
from libra.sim.planner import PlannerAllocation
from libra.traces import TrajectorySpec, tool_seconds_of, workload_of

__all__ = ["OwnedPlanner", "PlannedBorrowing", "plan_layout"]


def plan_layout(name: str, plan: Plan, gpus: int) -> Layout:
    """The static simulator layout of ``plan`` on ``gpus`` owned GPUs (roles as the broker's plan applier lays
    them out: rollout instances per group leader, buckets ``tp<N>``, the training GPUs)."""
    slots = [GpuSlot(gpu_id(i // 8, i % 8), f"n{i // 8}", i % 8) for i in range(gpus)]
    roles = layout_roles(plan, slots)
    insts = tuple(RolloutInstanceSpec(aid, aid.split("/")[0], r.bucket, r.tp)
                  for aid, r in sorted(roles.items()) if r.kind == "rollout" and r.rank == 0)
    if not insts:
        raise SimConfigError(f"planner layout {name!r}: the plan has no rollout instance")
    return Layout(name, gpus, insts, tuple(bucket_specs(plan)), plan.n_train, False,
                  {"plan": f"train {plan.train} rollout {list(plan.rollout_tps)}"})


@dataclass(frozen=True, slots=True)
class PlannedBorrowing:
    """The owned layout and the lent slots' buckets of one borrowing run, and the planner's figures."""

    layout: Layout
    buckets: list[str]  # bucket of serving GPU i's TP-1 instance (lending order)
    decision: BorrowedPlan
    capacity: BorrowedCapacity

    def record(self) -> dict[str, Any]:
        d, c = self.decision, self.capacity
        return {"capacity_gpus": c.gpus, "revocations_per_gpu_hour": round(c.revocations_per_gpu_hour, 3),
                "revocation_cost_s": round(c.revocation_cost_s, 2), "used": d.uses_borrowed,
                "owned_only_s": round(d.owned.objective, 1), "expected_s": round(d.expected_s, 1),
                "predicted_gain": round(d.gain, 3), "n_train": self.layout.train_gpus,
                "rollout_tps": sorted((i.tp for i in self.layout.instances), reverse=True)}


def _by_step(trajs: Sequence[TrajectorySpec]) -> list[list[TrajectorySpec]]:
    out: dict[int, list[TrajectorySpec]] = {}
    for t in trajs:
        out.setdefault(t.step, []).append(t)
    return [out[k] for k in sorted(out)]


class OwnedPlanner:
    """The runtime's planner for ``cfg.gpus`` owned GPUs and the trace ``trajs`` (module docstring)."""

    def __init__(self, trajs: Sequence[TrajectorySpec], cfg: SimConfig) -> None:
        self.alloc = PlannerAllocation(trajs, replace(cfg, allocation="grp"))
        self.gpus = cfg.gpus
        self.workload = workload_of(self.alloc.profile)
        self.history = [(t.prompt_tokens + t.total_payload_tokens, max(1, t.total_gen_tokens), t.num_turns,
                         tool_seconds_of(t)) for t in self.alloc.profile]
        self.owned_plan: Plan = self.alloc.initial
        self.layout = plan_layout("grp", self.owned_plan, cfg.gpus)
        self.steps = _by_step(trajs)

    def predicted_step_s(self, plan: Plan | None = None) -> float:
        """The mean predicted step of the static ``plan`` (default: the owned plan) over every step of the run:
        the planner's time of the deployed layout, bucket thresholds as planned (``evaluate_deployed``), on each
        step's own workload. ``plan.objective`` is the profiled first step's alone: the R2E-like lengths grow
        ~4x over a run, so that figure says nothing of a layout held for all of it."""
        p = plan if plan is not None else self.owned_plan
        times = [self.planner.evaluate_deployed(p, workload_of(step)).objective for step in self.steps]
        return sum(times) / len(times)

    @property
    def planner(self) -> Any:
        return self.alloc.allocator.planner

    def capacity(self, gpus: int, take_backs_per_gpu_hour: float, cm: RolloutCostModel) -> BorrowedCapacity:
        return BorrowedCapacity(max(0, gpus), max(0.0, take_backs_per_gpu_hour),
                                default_revocation_cost_s(cm, self.history))

    def borrowed(self, cap: BorrowedCapacity, serving_gpus: int, placement: str) -> PlannedBorrowing:
        """``plan_with_borrowed`` at ``cap``; the owned layout it deploys and the buckets of all
        ``serving_gpus`` lent slots under it (``placement``: ``lent_roles``'s policy)."""
        bp = plan_with_borrowed(self.planner, self.workload, cap)
        deploy = (self.planner.plan_fixed(self.workload, bp.plan.n_train, None, bp.plan.train)
                  if bp.uses_borrowed else bp.owned)
        ids = [f"lent{g:02d}" for g in range(serving_gpus)]
        roles = lent_roles(deploy, ids, placement)
        if any(r.kind != "rollout" for r in roles.values()):
            raise SimConfigError("planner layout: the deployed plan has no bucket for the lent slots")
        layout = plan_layout("grp+borrowed", deploy, self.gpus)
        return PlannedBorrowing(layout, [roles[a].bucket for a in ids], bp, cap)
