"""The broker's periodic Global Resource Planner: observed trajectories in, plans out.

Role: the "global planner (periodic) -> role directives" box of the design. When the broker config has
a ``[broker.planner]`` table, :class:`~libra.broker.state.BrokerState` feeds every finished trajectory
(prompt and tool-payload tokens, generated tokens, generate turns, seconds its tool calls took from
submission to result) to :meth:`PlannerLoop.observe` and, on its timer, asks :meth:`PlannerLoop.decide` for a plan every
``interval_s`` seconds; a plan it returns is applied with ``BrokerState.apply_plan`` (role directives;
nothing stops). The decision itself is the planner's online rule (:class:`~libra.policies.planner.online.
Replanner`: triggers, the gain-over-reconfiguration-cost test; the first plan is applied outright).

Settings (:class:`PlannerSettings`, every key optional but ``allocation``):

- ``allocation``: an allocator of :mod:`libra.policies.planner.allocators` whose plans are role layouts (``grp``,
  ``grp_homogeneous``, ``static_uniform``, ``static_best``, ``greedy``; not ``colocated``, which
  time-shares every GPU inside a step);
- ``hardware`` / ``model``: cost-model profiles (``libra/policies/cost/data``; default ``a800`` /
  ``qwen3-14b``);
- ``interval_s`` (default 300): seconds between planning rounds;
- ``group_size`` (default 16): GRPO group size; ``batch``: trajectories per training step (default: the
  trajectories finished in the last round, rounded down to whole groups, at least one group);
- ``parallelism`` (default ``fixed``): ``earl`` makes the rollout TP follow the average context of the generate
  turns (:mod:`libra.broker.earl`, settings in the ``earl`` table), applied as plans through directives;
- ``revocations_per_gpu_hour`` (default 1.0, the middle of the 0 / 1 / 10 range the simulator's borrowed
  bench runs) and ``revocation_cost_s`` (default: the cost model's price of one revocation with the observed
  trajectories, :func:`~libra.broker.plan_borrowed.default_revocation_cost_s`): how the round prices the
  borrowed capacity, the connected lent slots its owners have not reclaimed (:mod:`libra.broker.plan_borrowed`);
  ``borrowed_placement`` (default ``smallest``; or ``proportional``): which C-MLFQ buckets the lent slots'
  TP-1 instances serve (:func:`~libra.policies.planner.borrowed.place_borrowed`);
- ``params``: ``make_allocator`` knobs: ``PlannerConfig`` fields (e.g. ``granularity = 8``,
  ``min_train_gpus = 8``, ``rollout_tps``) and the allocator's own (``rollout_tp``); ``replanner``:
  :class:`Replanner` keyword arguments (``plan_interval`` counts rounds; default 1: every round may
  re-plan).

The cluster size is the number of connected GPU actors at each round (a plan needs at least two). A
round with too few GPU actors or too little history is a decision with a reason, never an error.

A round is :meth:`PlannerLoop.start` (on the broker's loop: snapshot the pressure, build the re-planner),
:meth:`PlanJob.run` (the search: about 35 ms at 48 GPUs, 0.2 s at 128, 3 s at 512, so the server runs it
on a worker thread) and :meth:`PlannerLoop.finish` (back on the loop: record, apply). Trajectories that
finish while a search runs are held and reach the re-planner afterwards. Pure: no clock, I/O, threads or
logging here. Time comes in as ``now``; the search's duration (reported as ``search_s``, never decided on)
is measured only with the clock its caller hands :meth:`PlanJob.run` (the server: ``time.perf_counter``;
the simulator: none, or the wall clock in its ``search="measured"`` mode). Each decision is kept in
:attr:`PlannerLoop.decisions` and counted in :attr:`PlannerLoop.recorded`; the broker core turns new ones
into log lines.

Who starts a round is the caller's choice, the decision is the same code: the live broker starts one on its
timer (``interval_s``, :meth:`PlannerLoop.due`), numbering rounds 1, 2, ...; the simulator
(``libra.sim.planner``) starts one at every training-step boundary and numbers it by the step
(``start(..., step=k)``), after a profiling pass (:meth:`PlannerLoop.profile`) chose the plan it launches with.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from libra.config import from_mapping
from libra.policies.cost import (
    ProfileError,
    RolloutCostModel,
    TrainingCostModel,
    load_hardware,
    load_model,
)
from libra.policies.planner.allocators import ALLOCATORS, PlannerConfig, make_allocator
from libra.policies.planner.borrowed import BORROWED_PLACEMENTS, BorrowedCapacity
from libra.policies.planner.engine_caps import cap_rollout_tps, pin_rollout_tp
from libra.policies.planner.online import PressureSnapshot, ReplanDecision, Replanner
from libra.policies.planner.types import Plan, PlannerError, Workload

from .plan_borrowed import borrowed_round, default_revocation_cost_s

__all__ = ["BROKER_ALLOCATORS", "PlanJob", "PlannerLoop", "PlannerSettings"]

#: The allocators whose plans are role layouts the broker can apply (not ``colocated``'s time-sharing).
BROKER_ALLOCATORS = tuple(a for a in ALLOCATORS if a != "colocated")

@dataclass(frozen=True, slots=True)
class PlannerSettings:
    """The ``[broker.planner]`` table (see the module docstring)."""

    allocation: str
    hardware: str = "a800"
    model: str = "qwen3-14b"
    interval_s: float = 300.0
    group_size: int = 16
    batch: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    replanner: dict[str, Any] = field(default_factory=dict)
    parallelism: str = "fixed"  # "earl": the rollout TP follows the average context (libra.broker.earl)
    earl: dict[str, Any] = field(default_factory=dict)  # EarlSettings keys
    revocations_per_gpu_hour: float = 1.0  # how often an owner takes a lent GPU back (libra.broker.plan_borrowed)
    revocation_cost_s: float | None = None  # rollout seconds one revocation costs (None: from the cost model)
    borrowed_placement: str = "smallest"  # which buckets lent slots serve (place_borrowed's policy)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlannerSettings:
        """Validate a config table (strict types, no unknown keys). Raises ``ValueError`` naming the bad
        key or value."""
        if "allocation" not in d:
            raise ValueError(f"broker planner: 'allocation' is required (one of {', '.join(BROKER_ALLOCATORS)})")
        s = from_mapping(cls, dict(d), "broker planner")
        if s.allocation not in BROKER_ALLOCATORS:
            if s.allocation == "colocated":
                raise ValueError("broker planner: 'colocated' time-shares every GPU between rollout and training "
                                 "inside each step, which a layout of roles cannot express (it is a baseline of the "
                                 f"simulator and of `python -m libra plan`); use one of {', '.join(BROKER_ALLOCATORS)}")
            raise ValueError(f"broker planner: unknown allocation {s.allocation!r} "
                             f"(known: {', '.join(BROKER_ALLOCATORS)})")
        if not s.interval_s > 0:
            raise ValueError(f"broker planner: interval_s must be > 0, got {s.interval_s!r}")
        for key in ("revocations_per_gpu_hour", "revocation_cost_s"):
            v = getattr(s, key)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"broker planner: {key} must be finite and >= 0, got {v!r}")
        if s.borrowed_placement not in BORROWED_PLACEMENTS:
            raise ValueError(f"broker planner: unknown borrowed_placement {s.borrowed_placement!r} "
                             f"(known: {', '.join(BORROWED_PLACEMENTS)})")
        if s.group_size < 1:
            raise ValueError(f"broker planner: group_size must be >= 1, got {s.group_size!r}")
        if s.parallelism not in ("fixed", "earl"):
            raise ValueError(f"broker planner: unknown parallelism {s.parallelism!r} (known: fixed, earl)")
        if s.earl:
            from .earl import EarlSettings

            EarlSettings.from_dict(s.earl)  # a bad [broker.planner.earl] stops the broker at start
        if s.batch is not None and (s.batch < s.group_size or s.batch % s.group_size):
            raise ValueError(f"broker planner: batch must be a positive multiple of group_size={s.group_size}, "
                             f"got {s.batch!r}")
        return s


class PlannerLoop:
    """Periodic planning state of one broker (see the module docstring).

    Mutation rule: :meth:`observe`, :meth:`start`, :meth:`finish` (and :meth:`decide`, which is both),
    :meth:`rejected` and :meth:`abandoned` change state. Raises ``ValueError`` at construction for
    unknown profiles, allocator knobs or re-planner arguments (so a bad table stops the broker at start,
    not every round).
    """

    def __init__(self, settings: PlannerSettings) -> None:
        self.settings = settings
        try:
            hw, model = load_hardware(settings.hardware), load_model(settings.model)
        except ProfileError as exc:
            raise ValueError(f"broker planner: {exc}") from None
        self._rollout_model = RolloutCostModel(hw, model)
        self._train_model = TrainingCostModel(hw, model)
        try:  # the knobs are checked once here, on a nominal cluster large enough for any minimum
            self._make(1024, settings.batch or settings.group_size)
        except (PlannerError, ValueError, TypeError) as exc:
            raise ValueError(f"broker planner: params or replanner: {exc}") from None
        self.history: deque[tuple[float, float, float, float]] = deque(maxlen=4096)
        self.finished_since = 0  # trajectories observed since the last round
        self.rounds = 0
        self.last_round_t: float | None = None
        self.plan: Plan | None = None
        self.applied = 0
        self.decisions: deque[dict[str, Any]] = deque(maxlen=16)
        self._replanner: Replanner | None = None
        self._key: tuple[int, int] | None = None  # (GPUs, batch) the replanner was built for
        self.recorded = 0  # decisions recorded so far (``decisions`` keeps the newest 16)
        self._job: PlanJob | None = None  # the round whose search is in flight
        self._held: list[tuple[float, float, float, float]] = []  # observed while it is
        self.plan_borrowed: int | None = None  # borrowed GPUs the deployed plan was decided with
        self.capacity_pending = False  # the borrowed capacity changed since the last round (capacity_changed)

    def observe(self, prompt_tokens: int, generated: int, turns: int, tool_seconds: float = 0.0) -> None:
        """Record one finished trajectory: prompt + tool-payload tokens, generated tokens, generate turns
        and the seconds it waited on tools. While a search is in flight the re-planner is not touched
        (its search runs on another thread); the record reaches it when the round finishes."""
        if prompt_tokens + generated <= 0:
            return
        row = (float(max(0, prompt_tokens)), float(max(1, generated)), float(max(1, turns)),
               float(tool_seconds) if tool_seconds > 0 and math.isfinite(tool_seconds) else 0.0)
        self.history.append(row)
        self.finished_since += 1
        if self._job is not None:
            self._held.append(row)
        elif self._replanner is not None:
            _feed(self._replanner, row)

    oom_pending = False  # a training step ran out of memory since the last round (train_out_of_memory)

    def train_out_of_memory(self) -> None:
        """A training step's batch no longer fit the deployed layout: the next round is due at once and
        re-plans (the ``train_oom`` trigger; its search sizes training with the grown lengths)."""
        self.oom_pending = True

    measured_costs: Any = None  # the running job's MeasuredCosts (measured), shown in the summary

    def measured(self, costs: Any) -> None:
        """The running job's measured costs (:class:`~libra.policies.planner.measured.MeasuredCosts`: rollout
        tokens/s per instance, training tokens/s per rank, from its step records). Kept and shown in
        :meth:`summary`; the Elastic Hybrid Pool decides its borrows and releases with them. Not used yet:
        the GRP search still prices plans with the datasheet profile (``hardware`` / ``model``); on GPUs the
        measured rates would replace that profile's per-instance and per-rank throughput."""
        self.measured_costs = costs

    def capacity_changed(self) -> None:
        """The borrowed capacity changed (a lent slot joined, was reclaimed, lent again or left): the next round
        is due at once, and re-prices the deployed plan with the capacity then lent."""
        self.capacity_pending = True

    def borrowed_capacity(self, gpus: int) -> BorrowedCapacity:
        """``gpus`` lent slots priced with the settings (the default revocation cost from the history)."""
        s = self.settings
        cost = s.revocation_cost_s
        if cost is None:
            cost = default_revocation_cost_s(self._rollout_model, self.history) if gpus else 0.0
        return BorrowedCapacity(gpus, s.revocations_per_gpu_hour, cost)

    def due(self, now: float) -> bool:
        """Whether a planning round is due at ``now`` (the first one ``interval_s`` after start; at once after
        :meth:`train_out_of_memory` or :meth:`capacity_changed`; never while a round's search is in flight)."""
        if (self.oom_pending or self.capacity_pending) and self._job is None:
            return True
        if self.last_round_t is None:
            self.last_round_t = now
            return False
        return self._job is None and now - self.last_round_t >= self.settings.interval_s

    @property
    def searching(self) -> bool:
        """Whether a round's search is in flight (between :meth:`start` and :meth:`finish`)."""
        return self._job is not None

    @property
    def held(self) -> int:
        """Trajectories observed while the search is in flight, waiting for it to finish."""
        return len(self._held)

    def start(self, n_gpus: int, now: float, *, queue_pressure: float = 0.0, active_pressure: float = 0.0,
              rejected_total: int = 0, rollout_time: float | None = None,
              train_time: float | None = None, step: int | None = None, train_oom: bool = False,
              borrowed: int = 0) -> PlanJob | None:
        """Begin a planning round on ``n_gpus`` connected GPU actors (``rollout_time`` / ``train_time``:
        the last measured stage seconds of an RL step, when the broker runs a job; they drive the
        re-planner's stage-imbalance trigger; ``train_oom`` (or :meth:`train_out_of_memory` since the last
        round): a training step no longer fit its layout, so the round re-plans whatever the cooldown;
        ``step``: the number the re-planner's interval, warm-up and cooldown count in, default the round's own number;
        ``borrowed``: lent GPUs connected and not reclaimed, counted as elastic rollout capacity). Returns the search to run (in flight until
        :meth:`finish`), or None when the round ended at once (too few GPU actors, a
        configuration the planner refuses: the decision is recorded)."""
        self.last_round_t = now
        self.rounds += 1
        s = self.settings
        batch = s.batch or max(s.group_size, (self.finished_since // s.group_size) * s.group_size)
        self.finished_since = 0
        if n_gpus < 2:
            return self._record(now, "too_few_gpu_actors", n_gpus=n_gpus)
        if (n_gpus, batch) != self._key:
            try:
                self._build(n_gpus, batch)
            except (PlannerError, ValueError) as exc:
                return self._record(now, "planner_config_error", error=str(exc))
        assert self._replanner is not None
        snap = PressureSnapshot(self.rounds if step is None else step, queue_pressure, active_pressure, rejected_total,
                                rollout_time, train_time, train_oom or self.oom_pending)
        self.oom_pending = self.capacity_pending = False
        self._job = PlanJob(self._replanner, snap, self.plan, self.borrowed_capacity(borrowed), self.plan_borrowed)
        return self._job

    def finish(self, job: PlanJob, now: float) -> Plan | None:
        """End the round of ``job`` (after :meth:`PlanJob.run`): record its decision and return the plan to
        apply now, or None. The caller applies it and reports a layout failure with :meth:`rejected`."""
        if job is not self._job:  # not this loop's round (stale): nothing to do
            return None
        self._job = None
        held, self._held = self._held, []
        if job.replanner is self._replanner:
            for row in held:
                _feed(job.replanner, row)
        if job.error is not None:
            return self._record(now, "planner_error", error=job.error)
        dec = job.decision
        assert dec is not None, "PlanJob.run() was not called"
        plan = dec.plan if dec.apply else None
        self._record(now, dec.reason, step=dec.step, trigger=dec.trigger, current_s=dec.current_time,
                     candidate_s=dec.candidate_time, search_s=round(job.seconds, 4),
                     plan=_plan_summary(plan) if plan is not None else None,
                     **({"borrowed": job.borrowed} if job.borrowed is not None else {}))
        if plan is not None:
            self.plan = plan
            self.plan_borrowed = job.cap.gpus
            self.applied += 1
        return plan

    def decide(self, n_gpus: int, now: float, **pressure: Any) -> Plan | None:
        """A whole round inline (:meth:`start`, :meth:`PlanJob.run`, :meth:`finish`)."""
        job = self.start(n_gpus, now, **pressure)
        if job is None:
            return None
        job.run()
        return self.finish(job, now)

    def profile(self, n_gpus: int, workload: Workload, now: float, *, step: int = 0) -> Plan:
        """Deploy the allocator's plan for ``workload`` (a profiling pass before launch: the simulator's
        first profiled steps) as the current plan, without a round: builds the re-planner for ``n_gpus``,
        proposes, and counts ``step`` as its last re-plan (so the cooldown runs from it). The decision is
        recorded as ``profiled_plan``. Raises ``PlannerError`` / ``ValueError`` for a cluster or workload
        the allocator refuses."""
        s = self.settings
        batch = s.batch or s.group_size
        if (n_gpus, batch) != self._key:
            self._build(n_gpus, batch)
        rp = self._replanner
        assert rp is not None
        plan = rp.allocator.propose(workload, None)
        rp.last_replan = step
        self.plan, self.plan_borrowed = plan, 0
        self.applied += 1
        self._record(now, "profiled_plan", step=step, plan=_plan_summary(plan))
        return plan

    @property
    def replanner(self) -> Replanner | None:
        """The re-planner of the current cluster size (None before the first round). The simulator feeds its
        prediction-error and reconfiguration-cost observations to it; the live broker has none to give."""
        return self._replanner

    max_rollout_tp: int | None = None  # the largest rollout TP group the GPU actors' engines can serve
    pinned_rollout_tp: int | None = None  # parallelism = "earl": EARL owns the rollout TP, the planner keeps it
    earl: Any = None  # EARL's selector state (libra.broker.earl.EarlLoop) when parallelism = "earl": in the summary

    def pin_rollout_tp(self, tp: int | None) -> None:
        """Plan every rollout instance at TP ``tp`` (EARL's current choice: the planner then divides GPUs, and
        never undoes a TP switch EARL made); None: the planner chooses. A change rebuilds the re-planner."""
        if tp != self.pinned_rollout_tp:
            self.pinned_rollout_tp = tp
            self._key = None

    def cap_rollout_tp(self, max_tp: int | None) -> None:
        """Plan no rollout TP group larger than ``max_tp`` (the smallest ``max_tp`` the connected GPU actors
        report: an HF engine serves TP 1 only); None: no cap. A change rebuilds the re-planner next round."""
        if max_tp != self.max_rollout_tp:
            self.max_rollout_tp = max_tp
            self._key = None

    def rejected(self, plan: Plan, error: str) -> None:
        """The broker could not lay ``plan`` out (``PlanError``): forget it as the deployed plan."""
        if self.plan is plan:
            self.plan = None
            self.applied -= 1
        self.decisions[-1]["reason"] = "apply_failed"
        self.decisions[-1]["error"] = error

    def abandoned(self, actor_id: str, why: str, now: float) -> None:
        """The deployed plan's application was abandoned (an actor in it left): forget the plan, so the
        next round plans afresh for the actors then connected."""
        self.plan = None
        self._record(now, "plan_abandoned", actor=actor_id, why=why)

    def summary(self) -> dict[str, Any]:
        """For the status reply: settings, rounds, plans applied, the deployed plan, recent decisions."""
        return {"allocation": self.settings.allocation, "hardware": self.settings.hardware,
                "model": self.settings.model, "interval_s": self.settings.interval_s, "rounds": self.rounds,
                "plans_applied": self.applied, "history": len(self.history),
                "plan": _plan_summary(self.plan) if self.plan is not None else None,
                "plan_borrowed_gpus": self.plan_borrowed if self.plan is not None else None,
                "decisions": list(self.decisions), **({"earl": self.earl.summary()} if self.earl is not None else {}),
                "measured_costs": None if self.measured_costs is None else self.measured_costs.summary()}

    # -- internals -------------------------------------------------------------------------------
    def _make(self, n_gpus: int, batch: int) -> Replanner:
        s = self.settings
        cfg = PlannerConfig(n_gpus=n_gpus, global_batch=batch, group_size=s.group_size)
        allocator = make_allocator(s.allocation, rollout_model=self._rollout_model, train_model=self._train_model,
                                   config=cfg, **pin_rollout_tp(cap_rollout_tps(s.params, self.max_rollout_tp),
                                                                self.pinned_rollout_tp))
        return Replanner(allocator, **{"plan_interval": 1, **s.replanner})

    def _build(self, n_gpus: int, batch: int) -> None:
        rp = self._make(n_gpus, batch)
        for row in self.history:
            _feed(rp, row)
        if self._replanner is not None:  # keep the re-plan clock across a rebuild
            rp.last_replan, rp.last_rejected = self._replanner.last_replan, self._replanner.last_rejected
        self._replanner, self._key = rp, (n_gpus, batch)
        if self.plan is not None and self.plan.n_gpus != n_gpus:  # the cluster changed size: plan afresh
            self.plan = None

    def _record(self, now: float, reason: str, **extra: Any) -> None:
        """Keep one round's decision (the core logs it); returns None for the caller's ``return``."""
        entry = {"round": self.rounds, "t": round(now, 3), "reason": reason, **extra}
        self.decisions.append(entry)
        self.recorded += 1
        return None

    def new_decisions(self, since: int) -> list[dict[str, Any]]:
        """The decisions recorded after the first ``since`` (as many of them as :attr:`decisions` still keeps)."""
        n = min(self.recorded - since, len(self.decisions))
        return list(self.decisions)[len(self.decisions) - n:] if n > 0 else []


class PlanJob:
    """One round's search: the re-planner's decision on the round's pressure snapshot. :meth:`run` may
    run on another thread; until :meth:`PlannerLoop.finish` nothing else touches ``replanner``."""

    def __init__(self, replanner: Replanner, snapshot: PressureSnapshot, current: Plan | None,
                 cap: BorrowedCapacity | None = None, deployed_with: int | None = None) -> None:
        self.replanner, self.snapshot, self.current = replanner, snapshot, current
        self.cap = cap or BorrowedCapacity(0)
        self.deployed_with = deployed_with  # borrowed GPUs the deployed plan was decided with
        self.borrowed: dict[str, Any] | None = None  # the borrowed capacity's figures (plan_borrowed)
        self.decision: ReplanDecision | None = None
        self.error: str | None = None
        self.seconds = 0.0

    def run(self, clock: Callable[[], float] | None = None) -> PlanJob:
        """Search (the expensive part: about 35 ms at 48 GPUs, 3 s at 512). Never raises: a planner
        error is kept in :attr:`error`. ``clock`` (the caller's, e.g. ``time.perf_counter``) measures
        :attr:`seconds`; without one it stays 0 (nothing here reads a clock)."""
        t0 = clock() if clock is not None else 0.0
        try:
            self.decision = self.replanner.step(self.snapshot, self.current)
            self.decision, self.borrowed = borrowed_round(self.replanner, self.decision, self.current, self.cap,
                                                          self.deployed_with if self.current is not None else None)
        except (PlannerError, ValueError, ArithmeticError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        self.seconds = clock() - t0 if clock is not None else 0.0
        return self


def _feed(rp: Replanner, row: tuple[float, float, float, float]) -> None:
    rp.observe(row[0], row[1], int(row[2]), row[3])


def _plan_summary(plan: Plan) -> dict[str, Any]:
    t = plan.train
    return {"n_train": plan.n_train, "train": None if t is None else f"tp{t.tp}/pp{t.pp}/dp{t.dp}/mb{t.micro_batch}",
            "rollout_tps": list(plan.rollout_tps), "t_train_s": round(plan.t_train, 3),
            "t_rollout_s": round(plan.t_rollout, 3)}
