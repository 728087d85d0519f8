"""Planner-driven allocations in the simulator: GRP plans, online re-planning and the Elastic Hybrid Pool.

Role: the allocation policy of a :class:`~libra.sim.engine.Simulator` whose ``SimConfig.allocation`` is
one of :data:`PLANNER_ALLOCATIONS`. It drives the broker's own planner loop
(:class:`~libra.broker.plan_decider.PlannerLoop`, built from the same :class:`~libra.broker.plan_decider.PlannerSettings`
a ``[broker.planner]`` table gives a live broker) and the real broker plan application
(:meth:`BrokerState.apply_plan`, directives) on the simulated GPU fleet (:mod:`libra.sim.gpus`, which charges
the transition costs in virtual time). The simulator is the loop's shell here: it feeds every finished
trajectory to :meth:`PlannerLoop.observe`, starts a round at every training-step boundary
(:meth:`PlannerLoop.start` with ``step=k``: a live broker starts them on its ``interval_s`` timer instead), runs
the round's search and hands it back with :meth:`PlannerLoop.finish` when the search charge has passed.

The planner scores layouts for the simulated router (:func:`planner_routing`: ``least_loaded`` and
``round_robin`` ignore buckets, so their plans are scored as length-blind; see ``PlannerConfig.routing``;
the ``planner_routing`` allocation parameter overrides the mapping, e.g. ``"start_small"`` for C-MLFQ).

Allocations (name -> planner allocator):

- ``grp_homogeneous``: GRP with one rollout TP degree per plan (one bucket);
- ``grp``: the full GRP (heterogeneous TP buckets);
- ``grp_ehp``: ``grp`` plus the Elastic Hybrid Pool (below);
- ``static_best``: the GRP plan of the profiled steps, frozen (AReaL-Static-Optimal; profiles 5 steps);
- ``greedy``: the greedy heuristic, moving GPUs toward the slower stage at each re-plan.

Contract of one run:

1. **Initial plan**: the allocator's proposal for the workload statistics of the first ``profile_steps``
   steps of the trace (a profiling pass before launch: ``(prompt + tool payload, generated)`` tokens
   the generate turns of each trajectory, each turn paying the serving overhead, and its tool seconds). The cluster
   starts in that layout (no transition cost).
2. **Online re-planning** at every training-step boundary: a round of the broker's planner loop, whose
   :class:`~libra.policies.planner.online.Replanner` decides over the history the simulator has observed (the
   last ``history_steps`` steps of finished trajectories), with its triggers (interval
   ``plan_interval``, queue pressure, active pressure, rollout/train imbalance, cooldown) and its rule
   (apply iff the layout differs, net gain over ``reconfig_cost_s`` > 0 and gain ratio >=
   ``min_gain_ratio``). The Replanner learns from what it observes (:func:`~libra.sim.planner_feedback.observe_step`; the
   live broker measures neither, so the report lists both feedbacks under ``modelled_only`` when they are on):
   with ``reconfig_feedback`` (default) the measured cost of each deployment, the seconds by which the
   steps it touched exceeded the deployed plan's prediction, replaces ``reconfig_cost_s`` when larger
   (:meth:`Replanner.observe_reconfig`); with ``error_feedback`` (opt-in: measured worse on the
   ablation, see BENCHMARKS.md) every clean step's measured time against its plan's prediction
   (:meth:`Replanner.observe_step`) corrects the predicted times of each layout class (homogeneous /
   heterogeneous rollout TP) over the last ``error_window`` observations, and the Replanner picks
   between the GRP's best plan and its best homogeneous plan by corrected time. Pressures: queued
   generate turns / (instances × ``max_queue_length``), running turns / Σ instance credits; stage
   times: the last finished rollout and training step.
3. **Search charge**: a round whose search decides to deploy a plan stays in flight (as on the live broker's
   worker thread: trajectories finishing meanwhile are held) and its plan reaches the broker ``search_s``
   virtual seconds after the decision (``search="fixed"``, the default: deterministic) or after the
   measured wall time of the search (``search="measured"``: not reproducible). The GPUs keep working under
   the old plan meanwhile. A search that deploys nothing finishes at once.
4. **Application**: ``BrokerState.apply_plan`` lays the plan out on the GPU actors and sends directives
   in waves; the fleet drains, pays the transition (10.8 s into rollout, 3.6 + 4.4 s into training)
   and bids again. Without the EHP a change of the set of training replicas also pauses core training
   once by ``regroup_s`` (the process groups are rebuilt and the state re-aligned; [G]). One
   application at a time: a decision while one is in flight is skipped (``reason="busy"``).
5. **EHP** (``grp_ehp``; the broker runs it too, ``broker/ehp.py``, but its join differs from this model:
   the runtime's core ranks wait for a joiner at its join step, and the report says so): new training replicas join as whole DP replicas through the hybrid join
   protocol (:class:`~libra.broker.hybrid.HybridReplica`: a replica whose GPUs have switched when a step
   starts is that step's zero-gradient member and fetches the snapshot meanwhile, then trains from the next
   step, as ``ElasticPool.plan_step``; :class:`~libra.sim.ehp.JoinLedger` reports what each zero step
   cost) and core training never pauses; after each
   step :func:`~libra.policies.planner.online.ehp_signal` sets the number of hybrid replicas (whole
   ``tp × pp`` replicas borrowed from the rollout pool when training is the bottleneck, released when
   rollout is) and the rollout pool is re-planned by the GRP DP for the GPUs left.

Deterministic for a seed with ``search="fixed"``. Results: :meth:`PlannerAllocation.summarize` (the
engine's :class:`~libra.sim.metrics.SimResult` with the GPU idle fraction over every instance that
ever ran and the real training GPU-seconds) and :meth:`PlannerAllocation.report` (plans, decisions,
switches, charges).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from libra.broker.events import PlaceLent, Rehome
from libra.broker.plan_decider import PlanJob, PlannerLoop
from libra.broker.plan_applier import GpuSlot, Role, bucket_specs, layout_roles
from libra.policies.cost import TrainingCostModel, load_hardware, load_model
from libra.policies.cost.training import TrainConfig
from libra.policies.planner.allocators import Plan, PlannerConfig, PressureSnapshot, Replanner
from libra.policies.routing.interface import BucketSpec
from libra.protocol import messages as m
from libra.sim.cluster import Layout, RolloutInstanceSpec, SimConfigError
from libra.sim.config import SimConfig
from libra.sim.gpus import GpuFleet, TransitionCosts, gpu_id
from libra.sim.host import SimHost
from libra.sim.metrics import SimResult, summarize
from libra.sim.ehp import JoinLedger, ehp_decision, register_joins
from libra.sim.planner_feedback import observe_step, pressure_snapshot
from libra.sim.planner_params import (
    PLANNER_ALLOCATIONS,
    ROUTER_ROUTING,
    PlannerSimParams,
    is_planner_allocation,
    modelled_only,
    planner_routing,
    planner_settings,
)
from libra.traces import TrajectorySpec, tool_seconds_of, workload_of

__all__ = ["PLANNER_ALLOCATIONS", "ROUTER_ROUTING", "PlannerAllocation", "PlannerSimParams", "is_planner_allocation",
           "planner_routing"]

def _group_size(trajs: Sequence[TrajectorySpec]) -> int:
    return min(Counter(t.group for t in trajs).values(), default=1)


def _slots(gpus: int) -> list[GpuSlot]:
    return [GpuSlot(gpu_id(i // 8, i % 8), f"n{i // 8}", i % 8) for i in range(gpus)]


class PlannerAllocation:
    """A planner-driven allocation of one simulated run (see the module docstring)."""

    def __init__(self, trajs: Sequence[TrajectorySpec], cfg: SimConfig) -> None:
        if cfg.allocation not in PLANNER_ALLOCATIONS:
            raise SimConfigError(f"{cfg.allocation!r} is not a planner allocation ({', '.join(PLANNER_ALLOCATIONS)})")
        self.name = cfg.allocation
        allocator_name, self.ehp = PLANNER_ALLOCATIONS[cfg.allocation]
        self.params = p = PlannerSimParams.from_dict(dict(cfg.allocation_params))
        self.gpus = cfg.gpus
        if cfg.gpus < 8 or cfg.gpus % 8:
            raise SimConfigError(f"planner allocations need whole 8-GPU nodes, got --gpus {cfg.gpus}")
        steps = sorted({t.step for t in trajs})
        first = [t for t in trajs if t.step == steps[0]]
        self.batch = len(first)
        group = _group_size(first)
        self.train_model = TrainingCostModel(load_hardware(cfg.hardware), load_model(cfg.model))
        self.loop = PlannerLoop(planner_settings(allocator_name, cfg, p, self.batch, group))
        profile = p.profile_steps if p.profile_steps is not None else (5 if self.name == "static_best" else 1)
        self.profile = [t for t in trajs if t.step in set(steps[:max(1, profile)])]
        self.specs = {t.id: t for t in trajs}
        self.search_seconds: list[float] = []
        t0 = time.perf_counter()
        self.initial = self.plan = self.loop.profile(cfg.gpus, workload_of(self.profile), 0.0, step=0)
        self._charge(time.perf_counter() - t0)
        self.plan_history: list[tuple[float, Plan]] = [(0.0, self.core)]  # (virtual time applied, plan)
        self.roles = layout_roles(self.plan, _slots(cfg.gpus))
        self.layout = self._layout(self.plan, self.roles)
        self.sim: SimHost | None = None
        self.fleet: GpuFleet | None = None
        self.decisions: list[dict[str, Any]] = []
        self.applied: list[dict[str, Any]] = []
        self._pending_apply = False
        self._seen = 0
        self._last_replicas: frozenset[str] | None = None
        self.regroup_pauses = 0
        self.train_waits = 0
        self.oom_regroups = 0  # training steps that outgrew their layout and ran regrouped (GpuFleet.regroups)
        self.joins = JoinLedger()  # EHP: the hybrid replicas' joins and what they cost
        self.hybrids = self.joins.hybrids
        self.n_hybrid = 0
        self.ehp_signals: list[dict[str, Any]] = []
        self.train_layouts: list[TrainConfig] = []
        self.step_errors: list[dict[str, Any]] = []
        self.reconfig_costs: list[dict[str, Any]] = []
        self._dirty: list[float] = []  # excess seconds of the steps a deployment touched, not yet reported
        self._dirty_applied = 0

    # ------------------------------------------------------------------ the broker loop's parts
    @property
    def core(self) -> Plan:
        """The plan the broker's planner loop has deployed (EHP's hybrid replicas are not part of it)."""
        assert self.loop.plan is not None
        return self.loop.plan

    @property
    def replanner(self) -> Replanner:
        """The broker planner loop's re-planner (the simulator feeds it its step and deployment measurements)."""
        rp = self.loop.replanner
        assert rp is not None
        return rp

    @property
    def allocator(self) -> Any:
        """The allocator the broker planner loop built from the settings."""
        return self.replanner.allocator

    @property
    def planner_config(self) -> PlannerConfig:
        """The GRP search's configuration as the broker planner loop built it."""
        return self.allocator.planner.config

    def modelled_only(self) -> list[str]:
        """What this run credits that the live broker's planner does not do (issue #19), one line each."""
        return modelled_only(self.ehp, self.params)

    # ------------------------------------------------------------------ layouts
    def _layout(self, plan: Plan, roles: dict[str, Role]) -> Layout:
        insts = tuple(RolloutInstanceSpec(aid, aid.split("/")[0], r.bucket, r.tp)
                      for aid, r in sorted(roles.items()) if r.kind == "rollout" and r.rank == 0)
        return Layout(self.name, self.gpus, insts, tuple(bucket_specs(plan)), plan.n_train, False,
                      {"plan": f"train {plan.train} rollout {list(plan.rollout_tps)}"})

    def _charge(self, measured: float) -> float:
        s = measured if self.params.search == "measured" else self.params.search_s
        self.search_seconds.append(s)
        return s

    # ------------------------------------------------------------------ engine hooks
    def hello(self, sim: SimHost) -> None:
        """Bind to the simulator and connect the GPU actors in the initial layout."""
        self.sim = sim
        p = self.params
        self.fleet = GpuFleet(sim, self.gpus, TransitionCosts(p.to_rollout_s, p.snapshot_s, p.restore_s),
                              on_switched=self.rehome_orphans)
        sim.instances.clear()
        self.fleet.hello(self.roles)

    def on_directive(self, peer: bytes, d: m.Directive) -> None:
        """A broker directive to a GPU actor."""
        assert self.fleet is not None
        self.fleet.on_directive(peer, d)

    def train_time(self, lengths: Sequence[int]) -> float:
        """Start a training step now on the complete active core (and active hybrid) replicas."""
        assert self.fleet is not None and self.sim is not None
        use = None
        if self.ehp:
            use = self.joins.start(self.fleet.replicas(), self.sim.trained)  # joins move on as the step starts
        micro = self.plan.train.micro_batch if self.plan.train is not None else 1
        shape = (self.plan.train.tp, self.plan.train.pp) if self.plan.train is not None else (0, 0)
        regroups = len(self.fleet.regroups)

        def micro_of(tp: int, pp: int) -> int:
            return micro if (tp, pp) == shape else 1

        t_all = (self.fleet.step_seconds(lengths, self.train_model, micro_of, [*(use or []), *(g for g, _ in self.joins.zero)])
                 if self.joins.zero else 0.0)  # the step with its zero-gradient joiners training at once
        t, cfg, groups = self.fleet.train_step(lengths, self.train_model, micro_of, use)
        if len(self.fleet.regroups) > regroups:  # the batch outgrew the layout: regrouped, and re-plan at once
            t += self.params.regroup_s
            self.fleet.train_gpu_seconds += self.params.regroup_s * len(self.fleet.step.members)
            self.oom_regroups, _ = self.oom_regroups + 1, self.loop.train_out_of_memory()
        self.train_layouts.append(cfg)
        if self.ehp:
            self.joins.record(self.sim.trained, t, t_all, self._last_replicas is not None and groups != self._last_replicas)
        if not self.ehp and self._last_replicas is not None and groups != self._last_replicas:
            t += self.params.regroup_s
            self.fleet.train_gpu_seconds += self.params.regroup_s * len(self.fleet.step.members)
            self.regroup_pauses += 1
        self._last_replicas = groups
        return t

    def can_train(self) -> bool:
        """Whether a training step can start now: some complete training replica is active and, while a plan is
        being applied, the replicas left can hold the longest sequence seen (else wait for the new layout)."""
        assert self.fleet is not None and self.sim is not None
        applier, longest = self.sim.broker.plan_applier, max((int(r[0] + r[1]) for r in self.loop.history), default=1)
        if self.fleet.replicas() and (applier is None or applier.done
                                      or self.fleet.holds([longest] * self.batch, self.train_model)):
            return True
        self.train_waits += 1
        return False

    def on_trained(self, k: int) -> None:
        """Training step ``k`` ended: free waiting GPUs, advance hybrid joins, maybe re-plan."""
        assert self.fleet is not None and self.sim is not None
        self.fleet.step_done()
        self._observe()
        if self.ehp:
            self.joins.end(k)
        busy = (self._pending_apply or self.loop.searching
                or (self.sim.broker.plan_applier is not None and not self.sim.broker.plan_applier.done))
        if self.params.error_feedback or self.params.reconfig_feedback:
            observe_step(self, k, busy)
        snap = pressure_snapshot(self.sim, k + 1, self.params.max_queue_length)
        if busy:
            self.decisions.append({"step": k + 1, "t": self.sim.now, "apply": False, "reason": "busy"})
            return
        job = self.loop.start(len(self.sim.broker.gpu_slots()), self.sim.now, step=snap.step,
                              queue_pressure=snap.queue_pressure, active_pressure=snap.active_pressure,
                              rejected_total=snap.rejected_total, rollout_time=snap.rollout_time,
                              train_time=snap.train_time, borrowed=len(self.sim.broker.lent_slots()))
        if job is None:  # the loop ended the round at once (too few GPU actors, a refused configuration)
            raise SimConfigError(f"broker planner loop: {self.loop.decisions[-1]}")
        job.run(time.perf_counter if self.params.search == "measured" else None)
        dec = job.decision
        if job.error is not None or dec is None:
            raise SimConfigError(f"broker planner loop: {job.error}")
        self.decisions.append({"step": dec.step, "t": round(self.sim.now, 3), "apply": dec.apply, "reason": dec.reason,
                               "trigger": dec.trigger, "current_s": dec.current_time, "candidate_s": dec.candidate_time,
                               **({"borrowed": job.borrowed} if job.borrowed is not None else {})})
        if dec.trigger is not None:
            delay = self._charge(job.seconds)
            if dec.apply and dec.plan is not None:
                self.n_hybrid = 0
                self._pending_apply = True
                self.sim._push(self.sim.now + delay, "call", lambda: self._finish_round(job, dec.reason))
                return
        self.loop.finish(job, self.sim.now)
        self.place_lent()  # a round that deploys nothing places the lent slots under the deployed plan
        if self.ehp:
            self._ehp_step(k + 1, snap)

    def place_lent(self) -> None:
        """Let the broker direct the lent slots (borrowed capacity) to their instances under the deployed plan
        (``BrokerState.handle(PlaceLent())``, what its own round does when it deploys nothing); nothing while a
        round or a plan application is in flight (the application places them)."""
        sim = self.sim
        assert sim is not None
        if self._pending_apply or self.loop.searching or not sim.broker.lent_slots():
            return
        for c in sim.broker.handle(PlaceLent(self.core, self.loop.settings.borrowed_placement), sim.now):
            sim._deliver(c)

    def _finish_round(self, job: PlanJob, reason: str) -> None:
        """The round's search is back (its charge has passed): the loop records it and the plan is applied."""
        assert self.sim is not None
        plan = self.loop.finish(job, self.sim.now)
        if plan is None:  # not expected: the decision said apply
            self._pending_apply = False
            return
        self.apply(plan, reason)

    def plan_at(self, t: float) -> Plan:
        """The plan most recently applied at or before virtual time ``t``."""
        out = self.plan_history[0][1]
        for when, plan in self.plan_history:
            if when <= t:
                out = plan
        return out

    def summarize(self) -> SimResult:
        """The run's metrics (see the module docstring)."""
        sim, fleet = self.sim, self.fleet
        assert sim is not None and fleet is not None
        fleet.check()
        names = {b.name for b in sim.layout.buckets}
        extra = [BucketSpec(i.spec.bucket, i.tp, 1 << 30) for i in sim.instances.values() if i.spec.bucket not in names]
        if extra:  # an application still in flight at the end: keep summarize's bucket table complete
            sim.layout = replace(sim.layout, buckets=(*sim.layout.buckets, *dict.fromkeys(extra)))
        res = summarize(sim)
        busy = fleet.rollout_gpu_seconds() + fleet.train_gpu_seconds
        idle = 1.0 - busy / (self.gpus * res.makespan_s) if res.makespan_s > 0 else 0.0
        return replace(res, allocation=self.name, gpu_idle_fraction=max(0.0, idle),
                       rollout_gpus=self.plan.n_rollout, train_gpus=self.plan.n_train)

    def report(self) -> dict[str, Any]:
        """Plans applied, decisions, switches and the virtual seconds charged (JSON-ready)."""
        fleet = self.fleet
        sw = fleet.switches if fleet is not None else []
        by_kind = Counter(f"{s.old}->{s.new}" for s in sw)
        return {
            "allocation": self.name,
            "initial_plan": _plan_dict(self.initial),
            "plans_applied": len(self.applied),
            "applied": list(self.applied),
            "decisions": Counter(d["reason"] for d in self.decisions),
            "switches": dict(by_kind),
            "transition_s": round(sum(s.cost_s for s in sw), 3),
            "search_s": round(sum(self.search_seconds), 3),
            "searches": len(self.search_seconds),
            "regroup_pauses": self.regroup_pauses,
            "core_swaps": self.joins.core_swaps,
            "train_waits": self.train_waits, "oom_regroups": self.oom_regroups,
            "ehp_signals": Counter(s["reason"] for s in self.ehp_signals),
            "ehp_joins": self.joins.report(self.params.regroup_s),
            "final_plan": _plan_dict(self.plan),
            "step_errors": list(self.step_errors),
            "reconfig_costs": list(self.reconfig_costs),
            "runtime": "broker PlannerLoop (libra/broker/plan_decider.py) + BrokerState.apply_plan",
            "loop_rounds": self.loop.rounds,
            "modelled_only": self.modelled_only(),
        }

    # ------------------------------------------------------------------ internals
    def _observe(self) -> None:
        sim = self.sim
        assert sim is not None
        for rec in sim.records[self._seen:]:  # as BrokerState does at each EndTrajectory
            spec = self.specs[rec.id]
            self.loop.observe(spec.prompt_tokens + spec.total_payload_tokens, max(1, spec.total_gen_tokens),
                              spec.num_turns, tool_seconds_of(spec))
        self._seen = len(sim.records)

    def _schedule(self, plan: Plan, delay: float, reason: str) -> None:
        sim = self.sim
        assert sim is not None
        self._pending_apply = True
        sim._push(sim.now + delay, "call", lambda: self.apply(plan, reason))

    def apply(self, plan: Plan, reason: str = "forced") -> None:
        """Deploy ``plan`` now through ``BrokerState.apply_plan`` (tests may call it directly)."""
        sim, fleet = self.sim, self.fleet
        assert sim is not None and fleet is not None
        self._pending_apply = False
        cmds = sim.broker.apply_plan(plan, sim.now, self.loop.settings.borrowed_placement)
        self.plan = plan
        self.plan_history.append((sim.now, plan))
        assert sim.broker.plan_applier is not None
        owned = {g.actor_id for g in sim.broker.gpu_slots()}
        self.roles = {a: r for a, r in sim.broker.plan_applier.target.items() if a in owned}  # lent slots: elsewhere
        if self.ehp:
            self._register_joins()
        sim.layout = self._layout(plan, self.roles)
        self.applied.append({"t": round(sim.now, 3), "reason": reason, "n_train": plan.n_train,
                             "train": _train_str(plan.train), "rollout_tps": list(plan.rollout_tps),
                             "lent": len(sim.broker.lent_slots()),
                             "directives": sum(isinstance(getattr(c, "msg", None), m.Directive) for c in cmds)})
        for c in cmds:
            sim._deliver(c)
        self.rehome_orphans()

    def rehome_orphans(self) -> None:
        """Map what still refers to a bucket the new plan removed onto the nearest bucket by TP degree.

        ``BrokerState.apply_plan`` replaces the bucket list at once, but rollout instances that keep
        serving until their replacement is up still carry their old bucket, and queued turns stay
        under their old bucket name, which no instance would serve any more (a broker gap this
        simulator works around): both move to the nearest current bucket by TP degree."""
        sim = self.sim
        assert sim is not None
        b = sim.broker
        names = {x.name: x.tp for x in b.rollout.buckets}

        def nearest(bucket: str) -> str:
            tp = int(bucket[2:]) if bucket.startswith("tp") and bucket[2:].isdigit() else 1
            return min(names, key=lambda n: (abs(math.log2(names[n]) - math.log2(tp)), -names[n]))

        if not sim.training:
            sim._maybe_train()  # a training step that waited for a replica may start now
        gone = {sess.bucket for sess in b.actors.values() if "generate" in sess.accepting}
        gone |= {k[1] for k, q in b.queues.items() if k[0] == "generate" and q}
        for c in b.handle(Rehome({x: nearest(x) for x in sorted(gone) if x not in names}), sim.now):
            sim._deliver(c)

    # ------------------------------------------------------------------ EHP
    def _register_joins(self) -> None:
        """Training replicas that are new in this application join through the hybrid protocol."""
        assert self.fleet is not None
        register_joins(self.hybrids, self.roles, set(self.fleet.replicas()))

    def _ehp_step(self, step: int, snap: PressureSnapshot) -> None:
        sig, target = ehp_decision(step, snap, self.core, self.n_hybrid, self.replanner, self.allocator.planner,
                                   self.params)
        if sig is not None:
            self.ehp_signals.append({"step": step, "desired": sig.desired_replicas, "reason": sig.reason})
        if sig is not None and target is not None:
            self.joins.moves.append((step, self.n_hybrid, sig.desired_replicas))
            self.n_hybrid = sig.desired_replicas
            self._schedule(target, 0.0, f"ehp_{sig.reason}")

def _train_str(t: TrainConfig | None) -> str:
    return "none" if t is None else f"tp{t.tp}/pp{t.pp}/dp{t.dp}/mb{t.micro_batch}"


def _plan_dict(plan: Plan | None) -> dict[str, Any] | None:
    if plan is None:
        return None
    return {"n_train": plan.n_train, "train": _train_str(plan.train), "rollout_tps": list(plan.rollout_tps),
            "t_train_s": round(plan.t_train, 3), "t_rollout_s": round(plan.t_rollout, 3)}
