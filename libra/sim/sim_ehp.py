"""The Elastic Hybrid Pool of the simulator's ``grp_ehp`` allocation (:mod:`libra.sim.sim_planner`).

New training replicas join as whole DP replicas through the hybrid join protocol
(:class:`~libra.broker.hybrid.HybridReplica`): :func:`register_joins` starts a join for every training
group that a plan application adds (and cancels the joins of groups it drops), :func:`advance_joins`
moves the joins on at a training-step boundary (fetched -> zero-gradient step -> active), and
:func:`ehp_decision` turns the step's pressures into the number of hybrid replicas the pool should hold
(:func:`~libra.policies.planner.online.ehp_signal`) and the plan that realises it. Pure apart from the
join state machines they are handed.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace

from libra.broker.hybrid import HybridReplica, JoinState
from libra.broker.pools import Role
from libra.policies.planner.allocators import EhpSignal, Plan, PressureSnapshot, Replanner, ehp_signal
from libra.policies.planner.search import GlobalResourcePlanner
from libra.sim.sim_planner_params import PlannerSimParams

__all__ = ["advance_joins", "ehp_decision", "register_joins"]


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


def advance_joins(hybrids: Mapping[str, HybridReplica], live: Iterable[str], k: int) -> None:
    """At the boundary after step ``k``: fetched replicas (now ``live``) zero-sync, zero-synced ones activate."""
    live = list(live)
    for g, rep in hybrids.items():
        gen = rep.generation
        if rep.state is JoinState.FETCHING_STATE and g in live:
            rep.state_fetched(gen, k)
        elif rep.state is JoinState.ZERO_SYNC:
            rep.zero_step(gen, k)
            rep.activate(gen)
            rep.activated(gen, k + 1, k + 1)


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
