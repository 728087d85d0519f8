"""Online re-planning and the Elastic Hybrid Pool signal (docs/papers.md §1.3.4).

Role: decide *when* to run the allocator and *whether* to deploy its proposal, and how many hybrid
training replicas the EHP should hold. Pure: steps and observations come in as arguments; there are
no clocks, threads or sockets.

:class:`Replanner` keeps a sliding window of completed requests (``max_history`` = 4096) and, each
step, checks in order: enough history (``min_history`` = 8) and warm-up (``warmup_steps`` = 1); a training
step that did not fit its layout (``PressureSnapshot.train_oom``: re-plan now, before any cooldown); the
cooldown (``step - last_replan < cooldown_steps``); the interval (``step % plan_interval == 0``); then,
if ``online``, queue pressure >= 0.75, active rollout pressure >= 0.85, >= 8 newly rejected
rollouts, or rollout/train time >= 1.25. On a trigger it evaluates the deployed plan and the
allocator's candidate with the same evaluator and applies the candidate iff the layout differs, the
net gain ``(T_cur - T_cand) - reconfig_cost_s`` is positive and ``(T_cur - T_cand) / T_cur >=
min_gain_ratio``. Every decision carries a reason. Memory headroom: each step the search's training layouts
must fit the longest sequence times :attr:`Replanner.headroom`, the largest growth of the longest sequence
seen over the last rounds (at most 2x, and never past ``max_seq_len``, the serving engine's length cap, when
given), so a layout is not chosen with no room for the next growth.

Prediction-error feedback: the runtime reports each measured step time with the plan that was
deployed for the whole step (:meth:`Replanner.observe_step`). The Replanner keeps, per layout class
(:func:`layout_class`: ``homogeneous`` or ``heterogeneous`` rollout TP), the last ``error_window``
``(observed, predicted)`` pairs (predicted: the allocator's evaluation of that plan on the history
window), and every time in the apply rule is the predicted objective times its plan's class ratio
``sum(observed) / sum(predicted)`` (a ratio of sums: one slow step weighs by its seconds, and
alternating short and long steps of a pipelined run average out); 1.0 for a class with no
observation, and then the rule is exactly the one above. Why classes and not plan signatures: the
candidates are new layouts, so a per-signature ratio would almost never apply to them, while the
measured error is a property of the class (a heterogeneous layout needs the router to keep each
request in the bucket of its length, a homogeneous one does not). If the allocator offers
``candidates(workload, current)`` (the GRP: its best plan and its best homogeneous plan) and some
class has observations, the candidate is the one with the lowest corrected time (the first on a
tie), else ``propose``'s plan.

The reconfiguration cost is a prediction too: the runtime may report what a deployment measurably
cost (:meth:`Replanner.observe_reconfig`: the seconds the steps around it took beyond their corrected
predictions), and the apply rule then charges ``max(reconfig_cost_s, mean of the last error_window
observations)`` instead of ``reconfig_cost_s``.

:func:`ehp_signal` is the borrow/release hysteresis rule for hybrid replicas.
"""

from __future__ import annotations

import math

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from libra.policies.planner.training import fits
from libra.policies.planner.types import Allocator, Plan, PlannerError, Workload

__all__ = ["EhpSignal", "PressureSnapshot", "ReplanDecision", "Replanner", "ehp_signal", "layout_class"]


def layout_class(plan: Plan) -> str:
    """``"heterogeneous"`` if ``plan`` deploys >= 2 distinct rollout TP degrees, else ``"homogeneous"``."""
    return "heterogeneous" if len(set(plan.rollout_tps)) >= 2 else "homogeneous"


@dataclass(frozen=True, slots=True)
class PressureSnapshot:
    """What the runtime measured at ``step``: queue and active-rollout pressure (0..1), the running
    total of rejected rollouts, and the last measured stage times (None if unknown)."""

    step: int
    queue_pressure: float = 0.0
    active_pressure: float = 0.0
    rejected_total: int = 0
    rollout_time: float | None = None
    train_time: float | None = None
    train_oom: bool = False  # the last training step did not fit its layout: re-plan now (no cooldown)


@dataclass(frozen=True, slots=True)
class ReplanDecision:
    """The outcome of one :meth:`Replanner.step`.

    ``apply`` says whether to deploy ``plan``; ``reason`` is a static snake_case word; ``trigger``
    names what started the evaluation (None if none did). Times are predicted seconds per iteration,
    multiplied by their class's observed/predicted ratio (``current_correction``,
    ``candidate_correction``; 1.0 without feedback).
    """

    step: int
    apply: bool
    reason: str
    trigger: str | None = None
    plan: Plan | None = None
    current_time: float | None = None
    candidate_time: float | None = None
    raw_gain: float = 0.0
    net_gain: float = 0.0
    current_correction: float = 1.0
    candidate_correction: float = 1.0
    reconfig_s: float = 0.0


class Replanner:
    """Periodic and pressure-triggered re-planning around an allocator (see the module docstring).

    Mutation rule: only :meth:`observe`, :meth:`observe_many`, :meth:`observe_step`,
    :meth:`observe_reconfig` and :meth:`step` change state (the history window, the prediction-error
    and reconfiguration-cost windows, the last re-plan step and the rejected-rollout baseline).
    """

    def __init__(
        self,
        allocator: Allocator,
        *,
        plan_interval: int = 10,
        cooldown_steps: int = 1,
        online: bool = True,
        queue_pressure_threshold: float = 0.75,
        active_pressure_threshold: float = 0.85,
        rejected_delta_threshold: int = 8,
        imbalance_ratio: float = 1.25,
        reconfig_cost_s: float = 15.0,
        min_gain_ratio: float = 0.05,
        max_history: int = 4096,
        min_history: int = 8,
        warmup_steps: int = 1,
        error_window: int = 4,
        max_seq_len: float | None = None,
    ) -> None:
        if max_seq_len is not None and not (math.isfinite(max_seq_len) and max_seq_len > 0):
            raise PlannerError(f"Replanner: max_seq_len must be a positive number or None, got {max_seq_len!r}")
        if error_window < 1:
            raise PlannerError(f"Replanner: error_window must be >= 1, got {error_window}")
        if plan_interval < 1 or cooldown_steps < 0 or max_history < 1 or min_history < 1:
            raise PlannerError(
                "Replanner: plan_interval, max_history, min_history must be >= 1 and cooldown_steps >= 0 "
                f"(got {plan_interval}, {max_history}, {min_history}, {cooldown_steps})"
            )
        if reconfig_cost_s < 0 or min_gain_ratio < 0:
            raise PlannerError(
                f"Replanner: reconfig_cost_s and min_gain_ratio must be >= 0 (got {reconfig_cost_s}, {min_gain_ratio})"
            )
        self.allocator = allocator
        self.plan_interval = plan_interval
        self.cooldown_steps = cooldown_steps
        self.online = online
        self.queue_pressure_threshold = queue_pressure_threshold
        self.active_pressure_threshold = active_pressure_threshold
        self.rejected_delta_threshold = rejected_delta_threshold
        self.imbalance_ratio = imbalance_ratio
        self.reconfig_cost_s = reconfig_cost_s
        self.min_gain_ratio = min_gain_ratio
        self.min_history = min_history
        self.warmup_steps = warmup_steps
        self.history: deque[tuple[float, ...]] = deque(maxlen=max_history)
        self.last_replan: int | None = None
        self.last_rejected = 0
        self.error_window = error_window
        self.max_seq_len = max_seq_len  # the serving engine's max_model_len: no sequence grows past it
        self.errors: dict[str, deque[tuple[float, float]]] = {}
        self.reconfigs: deque[float] = deque(maxlen=error_window)
        self.longest: deque[float] = deque(maxlen=4)  # the longest sequence of each round's new requests
        self._longest_new = 0.0

    #: the largest training headroom :attr:`headroom` asks for (the growth of one round, at most doubling)
    max_headroom = 2.0

    @property
    def headroom(self) -> float:
        """The margin training layouts are chosen with (``TrainingSearch`` headroom): the largest growth of the
        longest sequence *seen* over the last rounds (each round's longest new request against the longest of
        the rounds before it), in ``[1, max_headroom]``; 1 before two rounds have seen requests. The next round
        may grow as much, so the layout must fit the longest sequence seen times this. Against the running
        longest, not the previous round's: a round in which only a few short requests finished is no growth
        when the next round is back at the usual longest (measured on the ablation: per-round maxima 40,484 ->
        3,607 -> 35,213 tokens read as 2x growth and forced a worse layout). With ``max_seq_len`` (the rollout
        engine's ``max_model_len``) the margin stops there: the longest sequence in the window times the
        headroom is at most ``max_seq_len`` (no sequence can grow past the serving cap)."""
        seq = list(self.longest)
        growth = max((b / max(seq[:i]) for i, b in enumerate(seq) if i and max(seq[:i]) > 0), default=1.0)
        if self.max_seq_len is not None and self.history:  # no margin past the serving engine's length cap
            growth = min(growth, self.max_seq_len / max(r[0] + r[1] for r in self.history))
        return min(self.max_headroom, max(1.0, growth))

    def observe(self, prompt_len: float, output_len: float, turns: int | None = None,
                tool_seconds: float | None = None) -> None:
        """Record one completed request's lengths (and, for a multi-turn request, its serving calls
        and the seconds it waited on tools; give each of ``turns`` / ``tool_seconds`` always or never,
        ``tool_seconds`` only with ``turns``). Raises :class:`PlannerError` if invalid."""
        if not (prompt_len >= 0 and output_len >= 0 and prompt_len + output_len > 0):
            raise PlannerError(f"observe: invalid lengths prompt_len={prompt_len!r} output_len={output_len!r}")
        self._longest_new = max(self._longest_new, float(prompt_len) + float(output_len))
        if turns is None:
            if tool_seconds is not None:
                raise PlannerError("observe: tool_seconds needs turns")
            self.history.append((float(prompt_len), float(output_len)))
            return
        if turns < 1:
            raise PlannerError(f"observe: turns must be >= 1, got {turns!r}")
        if tool_seconds is None:
            self.history.append((float(prompt_len), float(output_len), float(turns)))
            return
        if not (tool_seconds >= 0 and math.isfinite(tool_seconds)):
            raise PlannerError(f"observe: tool_seconds must be finite and >= 0, got {tool_seconds!r}")
        self.history.append((float(prompt_len), float(output_len), float(turns), float(tool_seconds)))

    def observe_many(self, pairs: Iterable[tuple[float, float]]) -> None:
        """Record several completed requests."""
        for p, g in pairs:
            self.observe(p, g)

    def workload(self) -> Workload:
        """The history window as a :class:`Workload`."""
        return Workload.from_pairs(self.history)

    # -- prediction-error feedback --------------------------------------------------------------
    def observe_step(self, plan: Plan, observed_s: float, predicted_s: float | None = None) -> float | None:
        """Record one measured step time of ``plan`` (deployed for the whole step). ``predicted_s``
        None: the allocator's evaluation of ``plan`` on the history window. Returns the ratio
        recorded, or None when nothing was (too little history, or a non-positive / non-finite time)."""
        if predicted_s is None:
            if len(self.history) < self.min_history:
                return None
            predicted_s = self.allocator.evaluate(plan, self.workload()).objective
        if not (math.isfinite(observed_s) and math.isfinite(predicted_s) and observed_s > 0 and predicted_s > 0):
            return None
        self.errors.setdefault(layout_class(plan), deque(maxlen=self.error_window)).append(
            (float(observed_s), float(predicted_s)))
        return observed_s / predicted_s

    def observe_reconfig(self, cost_s: float) -> None:
        """Record the measured cost of one deployment (seconds lost; negative values count as 0).
        Raises :class:`PlannerError` if not finite."""
        if not math.isfinite(cost_s):
            raise PlannerError(f"observe_reconfig: cost must be finite, got {cost_s!r}")
        self.reconfigs.append(max(0.0, float(cost_s)))

    def reconfig_estimate(self) -> float:
        """The cost the apply rule charges: ``max(reconfig_cost_s, mean of the observed costs)``."""
        if not self.reconfigs:
            return self.reconfig_cost_s
        return max(self.reconfig_cost_s, sum(self.reconfigs) / len(self.reconfigs))

    def correction(self, plan: Plan) -> float:
        """``sum(observed) / sum(predicted)`` over the window of ``plan``'s layout class (1.0 with none
        recorded)."""
        window = self.errors.get(layout_class(plan))
        if not window:
            return 1.0
        return sum(o for o, _ in window) / sum(p for _, p in window)

    def corrected(self, plan: Plan) -> float:
        """``plan.objective`` times its class's :meth:`correction`."""
        return plan.objective * self.correction(plan)

    def _candidate(self, workload: Workload, current: Plan) -> Plan:
        offer = getattr(self.allocator, "candidates", None)
        if offer is None or not self.errors:  # no feedback yet: every correction is 1.0
            return self.allocator.propose(workload, current)
        plans = list(offer(workload, current))
        return min(plans, key=self.corrected)

    def _with_headroom(self, propose: Any) -> Plan:
        """``propose()`` with the search's training layouts sized for the longest sequence times :attr:`headroom`
        (``GlobalResourcePlanner.train_headroom``); without the margin when no plan fits with it."""
        planner = getattr(self.allocator, "planner", None)
        if planner is None or self.headroom <= 1.0:
            return propose()
        planner.train_headroom = self.headroom
        try:
            return propose()
        except PlannerError:
            planner.train_headroom = 1.0
            return propose()
        finally:
            planner.train_headroom = 1.0

    def _fits(self, plan: Plan, workload: Workload) -> bool:
        """Whether ``plan``'s training layout holds the window's batch with :attr:`headroom` (True without
        a training layout or a GRP planner to ask)."""
        planner = getattr(self.allocator, "planner", None)
        if plan.train is None or planner is None:
            return True
        lengths = workload.training_lengths(planner.config.global_batch)
        return fits(planner.train_model, plan.train, lengths, self.headroom)

    def _trigger(self, snap: PressureSnapshot) -> tuple[str | None, str]:
        if snap.train_oom:
            return "train_oom", "train_oom"
        if self.last_replan is not None and snap.step - self.last_replan < self.cooldown_steps:
            return None, "cooldown"
        if snap.step % self.plan_interval == 0:
            return "interval", "interval"
        if not self.online:
            return None, "no_trigger"
        if snap.queue_pressure >= self.queue_pressure_threshold:
            return "queue_pressure", "queue_pressure"
        if snap.active_pressure >= self.active_pressure_threshold:
            return "active_pressure", "active_pressure"
        if snap.rejected_total - self.last_rejected >= self.rejected_delta_threshold:
            return "rejected_rollouts", "rejected_rollouts"
        if (
            snap.rollout_time is not None
            and snap.train_time
            and snap.rollout_time / snap.train_time >= self.imbalance_ratio
        ):
            return "stage_imbalance", "stage_imbalance"
        return None, "no_trigger"

    def step(self, snapshot: PressureSnapshot, current: Plan | None) -> ReplanDecision:
        """Decide for ``snapshot.step`` whether to (re)plan and whether to deploy the candidate.

        With no deployed plan (``current`` None) and enough history, the candidate is applied
        unconditionally (``reason="initial_plan"``).
        """
        step = snapshot.step
        if self._longest_new > 0:
            self.longest.append(self._longest_new)
            self._longest_new = 0.0
        if len(self.history) < self.min_history:
            return ReplanDecision(step, False, "insufficient_history")
        if step < self.warmup_steps:
            return ReplanDecision(step, False, "warmup")
        workload = self.workload()
        if current is None:
            plan = self._with_headroom(lambda: self.allocator.propose(workload, None))
            self.last_replan, self.last_rejected = step, snapshot.rejected_total
            return ReplanDecision(step, True, "initial_plan", "initial", plan, None, plan.objective)
        # the deployed training layout no longer fits (it ran out of memory, or leaves no headroom for the
        # observed growth): re-plan now and deploy the candidate whatever the predicted gain
        outgrown = snapshot.train_oom or not self._fits(current, workload)
        trigger, reason = self._trigger(snapshot)
        if trigger is None and outgrown:
            trigger = reason = "headroom"
        if trigger is None:
            return ReplanDecision(step, False, reason)
        self.last_replan, self.last_rejected = step, snapshot.rejected_total
        now = self.allocator.evaluate(current, workload)
        cand = self._with_headroom(lambda: self._candidate(workload, current))
        c_now, c_cand = self.correction(now), self.correction(cand)
        t_now, t_cand = now.objective * c_now, cand.objective * c_cand
        raw = t_now - t_cand
        reconfig = self.reconfig_estimate()
        net = raw - reconfig
        if cand.same_layout(current):
            reason = "same_layout"
        elif outgrown and self._fits(cand, workload):
            reason = "applied"
        elif not net > 0:
            reason = "gain_below_reconfig_cost"
        elif not (t_now > 0 and raw / t_now >= self.min_gain_ratio):
            reason = "gain_ratio_below_min"
        else:
            reason = "applied"
        return ReplanDecision(
            step, reason == "applied", reason, trigger, cand, t_now, t_cand, raw_gain=raw, net_gain=net,
            current_correction=c_now, candidate_correction=c_cand, reconfig_s=reconfig,
        )


@dataclass(frozen=True, slots=True)
class EhpSignal:
    """How many hybrid training replicas the Elastic Hybrid Pool should hold until ``expires_step``."""

    desired_replicas: int
    capacity: int
    reason: str
    expires_step: int


def ehp_signal(
    *,
    step: int,
    train_time: float,
    rollout_time: float,
    queue_pressure: float,
    active_pressure: float,
    rollout_gpus: int,
    min_rollout_gpus: int,
    replica_gpus: int,
    current_replicas: int,
    candidate_extra_replicas: int = 0,
    borrow_ratio: float = 1.15,
    release_ratio: float = 0.90,
    protect_pressure: float = 0.8,
    ttl_steps: int = 20,
) -> EhpSignal:
    """The EHP borrow/release rule (docs/papers.md §1.3.4), checked in order:

    capacity ``(rollout_gpus - min_rollout_gpus) // replica_gpus`` of 0 -> 0 (``no_capacity``);
    ``max(queue, active) pressure >= protect_pressure`` -> 0 (``protect_rollout``); a candidate plan
    wanting extra replicas -> ``min(capacity, extra)`` (``planner_request``); ``train/rollout >=
    borrow_ratio`` -> capacity (``training_bottleneck``); ``<= release_ratio`` -> 0
    (``rollout_bottleneck``); otherwise hold ``min(current, capacity)`` (``hysteresis_hold``).
    ``current_replicas`` counts joining replicas too, so a release can cancel an in-flight join.
    The signal expires ``ttl_steps`` after ``step``. Raises :class:`PlannerError` on bad sizes.
    """
    if replica_gpus < 1 or rollout_gpus < 0 or min_rollout_gpus < 0 or current_replicas < 0:
        raise PlannerError(
            f"ehp_signal: replica_gpus must be >= 1 and GPU/replica counts >= 0 "
            f"(got replica_gpus={replica_gpus}, rollout_gpus={rollout_gpus}, current_replicas={current_replicas})"
        )
    capacity = max(0, (rollout_gpus - min_rollout_gpus) // replica_gpus)
    expires = step + ttl_steps
    pressure = max(queue_pressure, active_pressure)
    if capacity == 0:
        return EhpSignal(0, 0, "no_capacity", expires)
    if pressure >= protect_pressure:
        return EhpSignal(0, capacity, "protect_rollout", expires)
    if candidate_extra_replicas > 0:
        return EhpSignal(min(capacity, candidate_extra_replicas), capacity, "planner_request", expires)
    ratio = train_time / rollout_time if rollout_time > 0 else float("inf")
    if ratio >= borrow_ratio:
        return EhpSignal(capacity, capacity, "training_bottleneck", expires)
    if ratio <= release_ratio:
        return EhpSignal(0, capacity, "rollout_bottleneck", expires)
    return EhpSignal(min(current_replicas, capacity), capacity, "hysteresis_hold", expires)
