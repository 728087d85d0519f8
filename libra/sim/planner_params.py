"""The names and knobs of the simulator's planner-driven allocations (:mod:`libra.sim.planner`):
:data:`PLANNER_ALLOCATIONS` (simulator allocation -> planner allocator, elastic hybrid pool),
:func:`planner_routing` (how the planner models each simulated router) and :class:`PlannerSimParams`
(``SimConfig.allocation_params``), :func:`planner_settings` (those knobs as the ``[broker.planner]`` table
of the broker's own planner loop, which the simulator drives) and :func:`modelled_only` (what a run credits
that the live broker lacks). :mod:`libra.sim.planner` re-exports the first four.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from libra.broker.plan_decider import PlannerSettings
from libra.policies.planner.types import ROUTINGS
from libra.sim import cluster
from libra.sim.cluster import SimConfigError
from libra.sim.config import SimConfig

__all__ = ["PLANNER_ALLOCATIONS", "ROUTER_ROUTING", "PlannerSimParams", "is_planner_allocation", "modelled_only",
           "planner_routing", "planner_settings"]

#: Simulated router -> the planner's ``PlannerConfig.routing`` that models how it realises a plan.
#: ``least_loaded`` (least connections on load / TP) and ``round_robin`` ignore buckets. Every other router
#: (C-MLFQ, ``cmlfq_cost``, oracle-like routers) is scored as keeping a request in the bucket of its length
#: (``"by_length"``). ``"start_small"`` models what ``cmlfq`` does by rule (start in the smallest bucket,
#: move at a tool return); it is available through the ``planner_routing`` allocation parameter but not
#: mapped by default: on the ablation it neither predicted ``cmlfq`` better nor ran it faster
#: (BENCHMARKS.md, "the planner models C-MLFQ's start-small routing").
ROUTER_ROUTING: dict[str, str] = {"least_loaded": "length_blind", "round_robin": "round_robin"}


def planner_routing(router: str, override: str | None = None) -> str:
    """The ``PlannerConfig.routing`` that models how ``router`` realises a plan (``override``: the
    ``PlannerSimParams.planner_routing`` knob, when set)."""
    return override if override is not None else ROUTER_ROUTING.get(router, "by_length")


#: simulator allocation name -> (planner allocator, elastic hybrid pool)
PLANNER_ALLOCATIONS: dict[str, tuple[str, bool]] = {
    "grp_homogeneous": ("grp_homogeneous", False),
    "grp": ("grp", False),
    "grp_ehp": ("grp", True),
    "static_best": ("static_best", False),
    "greedy": ("greedy", False),
}


assert tuple(PLANNER_ALLOCATIONS) == cluster.PLANNER_ALLOCATIONS


def is_planner_allocation(name: str) -> bool:
    """True iff ``name`` is simulated by :class:`PlannerAllocation`."""
    return name in PLANNER_ALLOCATIONS


_BROKER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PlannerSettings)}  # the live broker's


@dataclass(frozen=True, slots=True)
class PlannerSimParams:
    """Knobs of a planner-driven allocation (``SimConfig.allocation_params``; see the module docstring).
    ``profile_steps`` None means 1 (5 for ``static_best``, docs/papers.md §5.1). The search space follows
    the reference's 48-GPU R2E config [C]: whole 8-GPU steps, at least 8 training and 8 rollout GPUs.
    ``planner_routing``: the planner's ``PlannerConfig.routing`` (None: :func:`planner_routing` of the
    router); ``exact_pipeline``: ``PlannerConfig.exact_pipeline`` (off by default here: measured slower
    on the ablation, BENCHMARKS.md "the planner models C-MLFQ's start-small routing"); ``residency``:
    ``PlannerConfig.residency``; ``objective``: ``PlannerConfig.objective`` (``"throughput"``, the
    default, or the earlier ``"pipeline"``); ``max_seq_len``: ``Replanner(max_seq_len=...)``, the serving
    engine's ``max_model_len`` past which the training-layout headroom asks no margin (None: unknown, the
    margin is the observed growth alone; give it only when the trace respects that cap)."""

    plan_interval: int = 5
    cooldown_steps: int = 1
    online: bool = True
    reconfig_cost_s: float = 15.0
    min_gain_ratio: float = 0.05
    profile_steps: int | None = None
    history_steps: int = 2
    search: str = "fixed"
    search_s: float = 2.0
    to_rollout_s: float = 10.8
    snapshot_s: float = 3.6
    restore_s: float = 4.4
    regroup_s: float = 4.4
    max_queue_length: int = 3
    rollout_tps: tuple[int, ...] = (1, 2, 4, 8)
    granularity: int = 8
    min_train_gpus: int = 8
    min_rollout_gpus: int = 8
    ehp_min_rollout_gpus: int = 8
    ehp_borrow_ratio: float = 1.15
    ehp_release_ratio: float = 0.90
    ehp_protect_pressure: float = 0.8
    error_feedback: bool = False
    reconfig_feedback: bool = True
    error_window: int = 4
    planner_routing: str | None = None
    exact_pipeline: bool = False
    residency: bool = True
    objective: str = "throughput"
    max_seq_len: int | None = None
    # [broker.planner]: how the rounds price lent slots (borrowed GPUs) and which buckets they serve (its defaults)
    revocations_per_gpu_hour: float = _BROKER_DEFAULTS["revocations_per_gpu_hour"]
    borrowed_placement: str = _BROKER_DEFAULTS["borrowed_placement"]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlannerSimParams:
        """Build from a dict; raises :class:`SimConfigError` naming an unknown key or a bad value."""
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise SimConfigError(f"unknown allocation parameter(s) {bad} (known: {', '.join(sorted(known))})")
        p = cls(**d)
        if p.search not in ("fixed", "measured"):
            raise SimConfigError(f"allocation parameter search must be 'fixed' or 'measured', got {p.search!r}")
        if p.search_s < 0 or p.history_steps < 1 or p.plan_interval < 1 or p.error_window < 1:
            raise SimConfigError("search_s must be >= 0, history_steps, plan_interval and error_window >= 1")
        if p.planner_routing is not None and p.planner_routing not in ROUTINGS:
            raise SimConfigError(f"allocation parameter planner_routing must be one of {ROUTINGS} or None, "
                                 f"got {p.planner_routing!r}")
        if p.objective not in ("throughput", "pipeline"):
            raise SimConfigError(f"allocation parameter objective must be 'throughput' or 'pipeline', got {p.objective!r}")
        return p


def planner_settings(allocator: str, cfg: SimConfig, p: PlannerSimParams, batch: int, group: int) -> PlannerSettings:
    """The ``[broker.planner]`` table a live broker would need to plan as this simulated run does (validated by
    the broker's own :meth:`PlannerSettings.from_dict`). Raises :class:`SimConfigError` if it refuses it."""
    table = {"allocation": allocator, "hardware": cfg.hardware, "model": cfg.model, "group_size": group,
             "batch": batch, "revocations_per_gpu_hour": p.revocations_per_gpu_hour,
             "borrowed_placement": p.borrowed_placement,
             "params": {"rollout_tps": tuple(p.rollout_tps), "granularity": p.granularity,
                        "min_train_gpus": p.min_train_gpus, "min_rollout_gpus": p.min_rollout_gpus,
                        "overlap_steps": cfg.lag, "routing": planner_routing(cfg.router, p.planner_routing),
                        "exact_pipeline": p.exact_pipeline, "residency": p.residency, "objective": p.objective},
             "replanner": {"plan_interval": p.plan_interval, "cooldown_steps": p.cooldown_steps, "online": p.online,
                           "reconfig_cost_s": p.reconfig_cost_s, "min_gain_ratio": p.min_gain_ratio,
                           "max_history": p.history_steps * batch, "error_window": p.error_window,
                           **({} if p.max_seq_len is None else {"max_seq_len": p.max_seq_len})}}
    try:
        return PlannerSettings.from_dict(table)
    except ValueError as exc:
        raise SimConfigError(str(exc)) from None


def modelled_only(ehp: bool, p: PlannerSimParams) -> list[str]:
    """What a planner-driven run with these settings credits that the live broker's planner does not do
    (issue #19), one line each, printed as ``modelled-only: ...`` and kept in the report."""
    out = []
    if ehp:
        out.append("EHP: the simulator's join is modelled, not the runtime's: here a hybrid replica fetches its "
                   "snapshot in the background and core training never pauses; the broker's grp_ehp "
                   "(broker/ehp.py) joins a replica into one flat DP group: the joiner all-reduces zeros at once and "
                   "loads the state off the core's path, every member forms the step's group on a thread beside its "
                   "passes, and rank 0 copies its state on its path at the join step; the core waits where the "
                   "formation outlasts its own passes (bench ehp_join)")
    if p.reconfig_feedback:
        out.append("reconfiguration-cost feedback: modelled only (the simulator measures each deployment's cost; "
                   "the live broker's planner loop charges the fixed reconfig_cost_s)")
    if p.error_feedback:
        out.append("prediction-error feedback: modelled only (the live broker's planner loop does not measure "
                   "step times against its plan)")
    out.append("initial plan from a profiling pass of the first steps (the live broker plans its first round "
               "from observed trajectories); rounds at training-step boundaries (the live broker: every interval_s)")
    return out
