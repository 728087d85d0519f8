"""The Elastic Hybrid Pool of the simulator's ``grp_ehp`` allocation (:mod:`libra.sim.planner`).

New training replicas join as whole DP replicas through the hybrid join protocol
(:class:`~libra.broker.hybrid.HybridReplica`): :func:`register_joins` starts a join for every training
group that a plan application adds (and cancels the joins of groups it drops), :func:`start_step` and
:func:`end_step` move the joins on at each training step's start and end as the broker's pool does
(``ElasticPool.plan_step`` / ``step_done``: a replica whose GPUs have switched when a step starts is that
step's zero-gradient member and fetches the state meanwhile; it trains from the next step on), and
:func:`ehp_decision` turns the step's pressures into the number of hybrid replicas the pool should hold
(:func:`~libra.policies.planner.online.ehp_signal`) and the plan that realises it. Pure apart from the
join state machines they are handed.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from libra.broker.hybrid import HybridReplica, JoinState
from libra.broker.plan_applier import Role
from libra.policies.planner.allocators import EhpSignal, Plan, PressureSnapshot, Replanner, ehp_signal
from libra.policies.planner.search import GlobalResourcePlanner
from libra.sim.planner_params import PlannerSimParams

__all__ = ["JoinLedger", "ehp_decision", "end_step", "register_joins", "start_step"]


def register_joins(hybrids: dict[str, HybridReplica], roles: Mapping[str, Role], live: Collection[str]) -> None:
    """Training groups in ``roles`` that are neither ``live`` replicas nor joining start a hybrid join (fetch
    the snapshot in the background); joins of groups no longer in ``roles`` are cancelled and dropped."""
    groups: dict[str, list[str]] = {}
    for aid, r in roles.items():
        if r.kind == "train":
            groups.setdefault(r.group, []).append(aid)
    for g, members in groups.items():
        if g not in live and g not in hybrids:
            rep = HybridReplica(tuple(sorted(members)))
            gen = rep.request()
            rep.begin_fetch(gen)
            hybrids[g] = rep
    for g in list(hybrids):
        if g not in groups:
            rep = hybrids.pop(g)
            rep.cancel(rep.generation, "released")


def start_step(hybrids: Mapping[str, HybridReplica], live: Iterable[str], k: int) -> list[tuple[str, int]]:
    """At the start of training step ``k``, as the broker's ``ElasticPool.plan_step`` does at that boundary:
    a zero-synced replica with >= 1 zero-gradient step activates and trains from step ``k`` on, and a
    fetching replica whose GPUs are ``live`` (switched to training) is a zero-gradient member of step ``k``
    (it fetches the state during the step). Returns those zero members as ``(group, generation)``, for
    :func:`end_step`."""
    live = set(live)
    zero = []
    for g, rep in hybrids.items():
        gen = rep.generation
        if rep.state is JoinState.ZERO_SYNC and rep.zero_steps >= 1:
            rep.activate(gen)
            rep.activated(gen, k, k - 1)
        elif rep.state is JoinState.FETCHING_STATE and g in live:
            zero.append((g, gen))
        elif rep.state is JoinState.ZERO_SYNC:
            zero.append((g, gen))
    return zero


def end_step(hybrids: Mapping[str, HybridReplica], zero: Iterable[tuple[str, int]], k: int) -> None:
    """Training step ``k`` ended (``ElasticPool.step_done``): its zero members hold the fetched state and count
    one zero-gradient step. A join cancelled meanwhile (dropped, or a newer generation) is skipped."""
    for g, gen in zero:
        rep = hybrids.get(g)
        if rep is None or rep.generation != gen:
            continue
        if rep.state is JoinState.FETCHING_STATE:
            rep.state_fetched(gen, k)
        rep.zero_step(gen, k)


def ehp_decision(step: int, snap: PressureSnapshot, core: Plan, n_hybrid: int, replanner: Replanner,
                 planner: GlobalResourcePlanner, params: PlannerSimParams) -> tuple[EhpSignal | None, Plan | None]:
    """The pool's signal for ``step`` and the plan to deploy for it.

    ``(None, None)`` when there is nothing to decide yet (no training plan, no finished rollout and training
    step, or too little history); ``(signal, None)`` when the signal keeps ``n_hybrid`` replicas or the
    plan with the signalled replicas is infeasible; else ``(signal, plan)``: ``core`` with
    ``signal.desired_replicas`` more whole ``tp x pp`` training replicas, the rollout pool re-planned by the
    GRP DP for the GPUs left."""
    plan = core
    if (plan.train is None or snap.rollout_time is None or snap.train_time is None
            or len(replanner.history) < replanner.min_history):
        return None, None
    replica = plan.train.tp * plan.train.pp
    sig = ehp_signal(step=step, train_time=snap.train_time, rollout_time=snap.rollout_time,
                     queue_pressure=snap.queue_pressure, active_pressure=snap.active_pressure,
                     rollout_gpus=plan.n_rollout, min_rollout_gpus=params.ehp_min_rollout_gpus,
                     replica_gpus=replica, current_replicas=n_hybrid,
                     borrow_ratio=params.ehp_borrow_ratio, release_ratio=params.ehp_release_ratio,
                     protect_pressure=params.ehp_protect_pressure)
    if sig.desired_replicas == n_hybrid:
        return sig, None
    n = sig.desired_replicas
    train = replace(plan.train, dp=plan.train.dp + n)
    target = planner.plan_fixed(replanner.workload(), plan.n_train + n * replica, None, train,
                                allocator=plan.allocator)
    if not math.isfinite(target.objective):
        return sig, None
    return sig, target


@dataclass
class JoinLedger:
    """The joins of one ``grp_ehp`` run and what they cost: the hybrid replicas, the running step's zero-gradient
    members, each step that had some (their GPUs, the step's seconds on the training replicas and the seconds
    it would have taken with the joiners training at once), the EHP's borrow/release moves and the regroup
    pauses the joins avoided (a non-elastic allocation pauses ``regroup_s`` whenever its replica set changes)."""

    hybrids: dict[str, HybridReplica] = field(default_factory=dict)
    zero: list[tuple[str, int]] = field(default_factory=list)
    zero_steps: list[dict[str, Any]] = field(default_factory=list)
    moves: list[tuple[int, int, int]] = field(default_factory=list)  # (step, replicas before, after)
    regroups_avoided: int = 0
    core_swaps: int = 0

    def start(self, live: Collection[str], k: int) -> list[str]:
        """Training step ``k`` starts on the ``live`` replica groups: joins move on (:func:`start_step`); returns
        the groups that train (the core and the active joiners; every live group when the whole core was
        replaced: the joined replicas are the core now, a cluster swap)."""
        self.zero = start_step(self.hybrids, live, k)
        use = [g for g in live if g not in self.hybrids or self.hybrids[g].state is JoinState.ACTIVE]
        if not use:
            for g in live:
                self.hybrids.pop(g, None)
            self.core_swaps += 1
            use, self.zero = list(live), []
        return use

    @property
    def zero_gpus(self) -> int:
        """GPUs holding zero gradients in the running step."""
        return sum(len(self.hybrids[g].members) for g, _ in self.zero if g in self.hybrids)

    def record(self, k: int, step_s: float, all_active_s: float, regrouped: bool) -> None:
        """Step ``k`` took ``step_s`` (``all_active_s`` with its zero members training too); ``regrouped``: its
        replica set differs from the last step's (a pause the joins avoided)."""
        if self.zero:
            self.zero_steps.append({"step": k, "zero_gpus": self.zero_gpus, "step_s": round(step_s, 3),
                                    "all_active_s": round(all_active_s, 3)})
        self.regroups_avoided += regrouped

    def end(self, k: int) -> None:
        """Training step ``k`` ended (:func:`end_step`)."""
        end_step(self.hybrids, self.zero, k)
        self.zero = []

    def report(self, regroup_s: float) -> dict[str, Any]:
        """JSON-ready: borrows, releases, zero-gradient steps and their GPU-steps, ``extra_core_s`` (the seconds
        those steps took beyond what they would have with the joiners active) and the regroup seconds avoided."""
        extra = sum(z["step_s"] - z["all_active_s"] for z in self.zero_steps)
        return {"borrows": sum(b > a for _, a, b in self.moves), "releases": sum(b < a for _, a, b in self.moves),
                "zero_steps": len(self.zero_steps), "zero_gpu_steps": sum(z["zero_gpus"] for z in self.zero_steps),
                "extra_core_s": round(extra, 3), "regroups_avoided": self.regroups_avoided,
                "regroup_s_avoided": round(self.regroups_avoided * regroup_s, 3), "steps": list(self.zero_steps)}
