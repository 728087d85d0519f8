"""The Elastic Hybrid Pool of the simulator's ``grp_ehp`` allocation (:mod:`libra.sim.sim_planner`).

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
from dataclasses import replace

from libra.broker.hybrid import HybridReplica, JoinState
from libra.broker.pools import Role
from libra.policies.planner.allocators import EhpSignal, Plan, PressureSnapshot, Replanner, ehp_signal
from libra.policies.planner.search import GlobalResourcePlanner
from libra.sim.sim_planner_params import PlannerSimParams

__all__ = ["ehp_decision", "end_step", "register_joins", "start_step"]


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
