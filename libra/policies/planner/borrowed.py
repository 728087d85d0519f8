"""Borrowed GPUs as elastic rollout capacity: the rollout-side analogue of the Elastic Hybrid Pool.

A borrowed GPU (a lent slot: its hello names an owner, ``libra.broker.lending``) may hold rollout instances and
never training: the owner takes it back with a deadline whenever it likes. So a plan that counts it must
stay valid with every borrowed GPU gone (its training on owned GPUs, at least one owned GPU rolling out), and
the plan's predicted gain pays the expected cost of losing them.

- :func:`plan_with_borrowed`: the GRP search over owned + borrowed GPUs with training restricted to the
  owned ones (``n_train <= owned - max(1, min_rollout_gpus)``), next to the owned-only plan it falls back to;
  the borrowed plan is taken only when its *expected* step time (below) beats the owned-only plan.
- Expected cost of revocations: ``revocations per step = borrowed × rate_per_gpu_hour × step_s / 3600``;
  each costs ``revocation_cost_s`` of rollout work (the in-flight turns re-run or migrated elsewhere, the
  re-plan), spread over the rollout GPUs left; the expected step time is the plan's objective plus that.
- :func:`revocation_cost_s`: what one revocation costs with the cost model: the slot's in-flight turns
  re-prefill their contexts elsewhere and lose half a turn of decoding on average, plus the re-plan's search.
- :func:`place_borrowed`: which bucket each borrowed GPU's TP-1 instance serves: proportional to the owned
  rollout GPUs of each bucket in every prefix of the lending order, so the plan's split between buckets holds.

Pure: no clocks, no I/O. Borrowed GPUs are pooled with the owned rollout budget in the search (an instance
of TP > 1 may span borrowed GPUs in the model; the runtime's lent slots serve TP 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from libra.policies.cost import RolloutCostModel

from .search import GlobalResourcePlanner
from .types import Plan, PlannerError, Workload, as_workload

__all__ = ["BORROWED_PLACEMENTS", "BorrowedCapacity", "BorrowedPlan", "expected_with_training", "place_borrowed", "plan_with_borrowed",
           "revocation_cost_s"]


@dataclass(frozen=True, slots=True)
class BorrowedCapacity:
    """``gpus`` borrowed now; the owner revokes each at ``revocations_per_gpu_hour`` (the rate its policy
    implies, measured or configured); one revocation costs ``revocation_cost_s`` of rollout work."""

    gpus: int
    revocations_per_gpu_hour: float = 0.0
    revocation_cost_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 0:
            raise PlannerError(f"BorrowedCapacity.gpus must be an integer >= 0, got {self.gpus!r}")
        for name in ("revocations_per_gpu_hour", "revocation_cost_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise PlannerError(f"BorrowedCapacity.{name} must be finite and >= 0, got {v!r}")


@dataclass(frozen=True, slots=True)
class BorrowedPlan:
    """``owned``: the plan on the owned GPUs alone (the fallback); ``plan``: the plan to deploy (``owned``
    itself when borrowing does not pay); ``expected_s``: ``plan``'s expected step time with revocations;
    ``gain``: ``owned.objective / expected_s`` (1.0 when not borrowing)."""

    owned: Plan
    plan: Plan
    expected_s: float
    borrowed_gpus: int

    @property
    def gain(self) -> float:
        return self.owned.objective / self.expected_s if self.expected_s > 0 else 1.0

    @property
    def uses_borrowed(self) -> bool:
        return self.plan is not self.owned


def expected_step_s(plan: Plan, owned_rollout: int, cap: BorrowedCapacity) -> float:
    """``plan``'s objective plus the expected revocation cost per step (module docstring)."""
    t = plan.objective
    if cap.gpus == 0 or not math.isfinite(t):
        return t
    per_step = cap.gpus * cap.revocations_per_gpu_hour * t / 3600.0
    pool = max(1, owned_rollout + cap.gpus - 1)
    return t + per_step * cap.revocation_cost_s / pool


def plan_with_borrowed(planner: GlobalResourcePlanner, workload: Workload | list[tuple[float, float]],
                       cap: BorrowedCapacity) -> BorrowedPlan:
    """The best plan for ``planner.config.n_gpus`` owned GPUs plus ``cap.gpus`` borrowed ones (module
    docstring). Raises :class:`PlannerError` when the owned GPUs alone have no feasible plan."""
    wl = as_workload(workload)
    cfg = planner.config
    owned = planner.search(wl)
    if cap.gpus == 0:
        return BorrowedPlan(owned, owned, owned.objective, 0)
    keep = max(1, cfg.min_rollout_gpus)
    if cfg.n_gpus - keep < max(1, cfg.min_train_gpus):
        return BorrowedPlan(owned, owned, owned.objective, 0)
    big = GlobalResourcePlanner(planner.rollout_model, planner.train_model,
                                replace(cfg, n_gpus=cfg.n_gpus + cap.gpus, min_rollout_gpus=keep + cap.gpus),
                                memoize=planner.memoize, homogeneous_rollout=planner.homogeneous)
    try:
        cand = big.search(wl)
    except PlannerError:
        return BorrowedPlan(owned, owned, owned.objective, 0)
    # valid with every borrowed GPU gone: the same training on owned GPUs, the rest of them rolling out
    alone = planner.plan_fixed(wl, cand.n_train, None, cand.train)
    exp = expected_step_s(cand, cfg.n_gpus - cand.n_train, cap)
    if not math.isfinite(alone.objective) or not exp < owned.objective:
        return BorrowedPlan(owned, owned, owned.objective, 0)
    return BorrowedPlan(owned, cand, exp, cap.gpus)


def expected_with_training(planner: GlobalResourcePlanner, workload: Workload | list[tuple[float, float]],
                           plan: Plan, cap: BorrowedCapacity) -> float:
    """The expected step time of ``plan``'s training layout (deployed on the owned GPUs) when its rollout also
    has ``cap.gpus`` borrowed GPUs, revocations included: what a deployed plan is worth after the borrowed
    capacity changed (``inf`` when that training layout no longer fits)."""
    wl = as_workload(workload)
    cfg = planner.config
    if cap.gpus == 0 or plan.n_train == 0:
        return planner.plan_fixed(wl, plan.n_train, None, plan.train).objective
    big = GlobalResourcePlanner(planner.rollout_model, planner.train_model,
                                replace(cfg, n_gpus=cfg.n_gpus + cap.gpus,
                                        min_rollout_gpus=max(1, cfg.min_rollout_gpus) + cap.gpus),
                                memoize=planner.memoize, homogeneous_rollout=planner.homogeneous)
    pooled = big.plan_fixed(wl, plan.n_train, None, plan.train)
    return expected_step_s(pooled, cfg.n_gpus - plan.n_train, cap)


def revocation_cost_s(cm: RolloutCostModel, in_flight: int, context_tokens: float, turn_gen_tokens: float,
                      replan_s: float = 0.0, tp: int = 1) -> float:
    """Rollout seconds one revocation costs (module docstring): ``in_flight`` turns of ``context_tokens``
    each re-prefill on a TP-``tp`` instance and re-decode half of a ``turn_gen_tokens`` turn, plus
    ``replan_s``."""
    if in_flight < 0 or context_tokens < 0 or turn_gen_tokens < 0 or replan_s < 0:
        raise PlannerError("revocation_cost_s: every argument must be >= 0")
    if in_flight == 0:
        return replan_s
    prefill = float(cm.prefill_time(tp, context_tokens))
    step = float(cm.decode_step(tp, in_flight, in_flight * context_tokens))
    return in_flight * prefill + step * turn_gen_tokens / 2 + replan_s


#: Placement policies of :func:`place_borrowed`.
BORROWED_PLACEMENTS = ("proportional", "smallest")


def place_borrowed(bucket_gpus: Mapping[str, int], n: int, policy: str = "proportional") -> list[str]:
    """The bucket of each of ``n`` borrowed TP-1 instances, in the owner's lending order.

    ``proportional``: proportional to ``bucket_gpus`` (owned rollout GPUs per bucket) in every prefix as far as
    counts allow (each next slot goes to the bucket furthest below its share; ties to the earlier bucket), since
    an owner lends its GPUs in order and the first ones lent are the last ones reclaimed.
    ``smallest``: every one serves the first (smallest-context) bucket: C-MLFQ starts every trajectory there and
    moves the long ones on to the owned multi-GPU instances, so revocable single-GPU capacity holds short-lived,
    short-context work (a revocation costs little) and never sets the step's long tail."""
    if policy not in BORROWED_PLACEMENTS:
        raise PlannerError(f"place_borrowed: unknown policy {policy!r} (known: {', '.join(BORROWED_PLACEMENTS)})")
    if n < 0 or not bucket_gpus or any(v < 0 for v in bucket_gpus.values()) or sum(bucket_gpus.values()) <= 0:
        raise PlannerError(f"place_borrowed: need n >= 0 and positive bucket GPU counts, got {dict(bucket_gpus)}, {n}")
    if policy == "smallest":
        return [next(iter(bucket_gpus))] * n
    total = sum(bucket_gpus.values())
    names = list(bucket_gpus)
    have = dict.fromkeys(names, 0)
    out: list[str] = []
    for k in range(1, n + 1):
        best = max(names, key=lambda b: (bucket_gpus[b] * k / total - have[b], -names.index(b)))
        have[best] += 1
        out.append(best)
    return out
