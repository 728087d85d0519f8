"""GPU allocation policies: the Global Resource Planner and its baselines behind one interface.

Role: the public face of the planner. An :class:`Allocator` proposes a :class:`Plan` for a workload
(and evaluates a deployed plan on a new workload with the same evaluator); the broker and the
simulator pick one by name with :func:`make_allocator`. The search itself lives in
``planner/search.py`` (outer loop), ``planner/training.py`` (decision tree) and
``planner/rollout_dp.py`` (DP); online re-planning and the EHP signal in ``planner/online.py``.

Allocators (all pure; the stateful ones keep only what the policy needs):

- ``grp``: the full GRP search on every proposal (re-plans);
- ``grp_homogeneous``: GRP with a single rollout TP degree per plan;
- ``static_uniform``: half the GPUs train (the tree's best layout), half serve with one fixed TP;
- ``static_best``: the GRP plan of the first workload it sees, frozen (AReaL-Static-Optimal);
- ``greedy``: starts uniform and moves ``increment`` GPUs toward the slower stage whenever one stage is
  more than ``tolerance`` slower than the other (homogeneous rollout TP);
- ``colocated``: time-sharing (verl's colocated mode): every GPU rolls out as homogeneous TP-``rollout_tp``
  instances, then every GPU trains (the tree's best layout for the largest feasible ``n_train <= N``);
  the plan is marked ``colocated`` and its objective is ``t_rollout + t_train``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from libra.policies.cost import RolloutCostModel, TrainingCostModel, load_hardware, load_model
from libra.policies.planner.online import EhpSignal, PressureSnapshot, ReplanDecision, Replanner, ehp_signal
from libra.policies.planner.search import GlobalResourcePlanner, SearchResult, SearchStats
from libra.policies.planner.types import (
    Allocator,
    Plan,
    PlannerConfig,
    PlannerError,
    RolloutBucket,
    RolloutInstance,
    Workload,
    as_workload,
)

__all__ = [
    "ALLOCATORS",
    "Allocator",
    "Colocated",
    "EhpSignal",
    "GlobalResourcePlanner",
    "Plan",
    "PlannerConfig",
    "PlannerError",
    "PressureSnapshot",
    "ReplanDecision",
    "Replanner",
    "RolloutBucket",
    "RolloutInstance",
    "SearchResult",
    "SearchStats",
    "Workload",
    "ehp_signal",
    "make_allocator",
]


class _Base:
    name = "base"

    def __init__(self, planner: GlobalResourcePlanner) -> None:
        self.planner = planner

    def evaluate(self, plan: Plan, workload: Workload) -> Plan:
        """``plan``'s layout re-scored on ``workload``."""
        return self.planner.evaluate(plan, as_workload(workload))

    def _label(self, plan: Plan) -> Plan:
        return replace(plan, allocator=self.name)


class GrpAllocator(_Base):
    """``grp`` / ``grp_homogeneous``: the full search on every proposal."""

    def __init__(self, planner: GlobalResourcePlanner, name: str = "grp") -> None:
        super().__init__(planner)
        self.name = name
        self._homogeneous: GlobalResourcePlanner | None = None
        if not planner.homogeneous and not planner.config.require_heterogeneous:
            self._homogeneous = GlobalResourcePlanner(planner.rollout_model, planner.train_model, planner.config,
                                                      memoize=planner.memoize, homogeneous_rollout=True)

    def propose(self, workload: Workload, current: Plan | None = None) -> Plan:
        """The GRP-optimal plan for ``workload``."""
        return self._label(self.planner.search(as_workload(workload)))

    def candidates(self, workload: Workload, current: Plan | None = None) -> list[Plan]:
        """:meth:`propose`'s plan first, then (``grp`` only, when that plan is heterogeneous) the best
        plan with one rollout TP degree: the best of each layout class, for a re-planner that
        corrects each class's predictions by its own observed error (``Replanner``)."""
        wl = as_workload(workload)
        best = self.propose(wl, current)
        if self._homogeneous is None or len(set(best.rollout_tps)) < 2:
            return [best]
        return [best, self._label(self._homogeneous.search(wl))]


class StaticUniform(_Base):
    """``static_uniform``: a half/half split with homogeneous TP-``rollout_tp`` rollout."""

    name = "static_uniform"

    def __init__(self, planner: GlobalResourcePlanner, rollout_tp: int = 2) -> None:
        super().__init__(planner)
        self.rollout_tp = rollout_tp

    def propose(self, workload: Workload, current: Plan | None = None) -> Plan:
        """Half the GPUs (the nearest count with a feasible layout, at or below half) train."""
        wl = as_workload(workload)
        n = self.planner.config.n_gpus
        for n_train in range(n // 2, 0, -1):
            if self.planner.best_training(wl, n_train) is not None:
                k = (n - n_train) // self.rollout_tp
                if k >= 1:
                    return self.planner.plan_fixed(wl, n_train, (self.rollout_tp,) * k, allocator=self.name)
        raise PlannerError(f"static_uniform: no feasible half/half split of {n} GPUs with rollout TP {self.rollout_tp}")


class StaticBest(_Base):
    """``static_best``: GRP on the first workload seen, then that layout forever."""

    name = "static_best"

    def __init__(self, planner: GlobalResourcePlanner) -> None:
        super().__init__(planner)
        self.frozen: Plan | None = None

    def propose(self, workload: Workload, current: Plan | None = None) -> Plan:
        """The frozen plan re-scored on ``workload`` (computed on the first call)."""
        wl = as_workload(workload)
        if self.frozen is None:
            self.frozen = self._label(self.planner.search(wl))
            return self.frozen
        return self.planner.evaluate(self.frozen, wl)


class Greedy(_Base):
    """``greedy``: shift ``increment`` GPUs toward the slower stage when it is ``tolerance`` slower."""

    name = "greedy"

    def __init__(
        self, planner: GlobalResourcePlanner, increment: int = 8, tolerance: float = 0.1, rollout_tp: int = 2
    ) -> None:
        super().__init__(planner)
        if increment < 1 or tolerance < 0:
            raise PlannerError(f"greedy: increment must be >= 1 and tolerance >= 0, got {increment}, {tolerance}")
        self.increment = increment
        self.tolerance = tolerance
        self.uniform = StaticUniform(planner, rollout_tp)
        self.rollout_tp = rollout_tp
        self.last: Plan | None = None

    def propose(self, workload: Workload, current: Plan | None = None) -> Plan:
        """One greedy move from ``current`` (or from its own last plan, or the uniform split)."""
        wl = as_workload(workload)
        base = current or self.last
        if base is None:
            self.last = self._label(self.uniform.propose(wl))
            return self.last
        now = self.planner.evaluate(base, wl)
        if now.t_rollout > now.t_train * (1 + self.tolerance):
            direction = -1
        elif now.t_train > now.t_rollout * (1 + self.tolerance):
            direction = 1
        else:
            self.last = self._label(now)
            return self.last
        n = self.planner.config.n_gpus
        n_train = now.n_train + direction * self.increment
        while 1 <= n_train <= n - self.rollout_tp:
            if self.planner.best_training(wl, n_train) is not None:
                k = (n - n_train) // self.rollout_tp
                self.last = self.planner.plan_fixed(wl, n_train, (self.rollout_tp,) * k, allocator=self.name)
                return self.last
            n_train += direction
        self.last = self._label(now)
        return self.last


class Colocated(_Base):
    """``colocated``: all GPUs roll out, then all GPUs train (time-sharing; see the module docstring)."""

    name = "colocated"

    def __init__(self, planner: GlobalResourcePlanner, rollout_tp: int = 2) -> None:
        super().__init__(planner)
        if rollout_tp < 1 or planner.config.n_gpus // rollout_tp < 1:
            raise PlannerError(f"colocated: rollout_tp={rollout_tp} does not fit {planner.config.n_gpus} GPUs")
        self.rollout_tp = rollout_tp

    def _plan(self, wl: Workload, train: Any = None) -> Plan:
        n = self.planner.config.n_gpus
        if train is None:
            for n_train in range(n, 0, -1):
                choice = self.planner.best_training(wl, n_train)
                if choice is not None:
                    train, t_train = choice.config, choice.time
                    break
            else:
                raise PlannerError(f"colocated: no feasible training layout on at most {n} GPUs")
        else:
            t_train = float(self.planner.train_model.step_time(train, wl.training_lengths(self.planner.config.global_batch)))
        roll = self.planner.plan_fixed(wl, 0, (self.rollout_tp,) * (n // self.rollout_tp), allocator=self.name)
        return Plan(n, train.n_gpus, train, roll.rollout, t_train, roll.t_rollout, allocator=self.name, colocated=True)

    def propose(self, workload: Workload, current: Plan | None = None) -> Plan:
        """The time-sharing plan for ``workload``."""
        return self._plan(as_workload(workload))

    def evaluate(self, plan: Plan, workload: Workload) -> Plan:
        """``plan``'s training layout and rollout TP re-scored on ``workload`` (still time-sharing)."""
        return self._plan(as_workload(workload), plan.train)


#: Allocator names known to :func:`make_allocator`.
ALLOCATORS = ("colocated", "greedy", "grp", "grp_homogeneous", "static_best", "static_uniform")

_CONFIG_FIELDS = {f.name for f in fields(PlannerConfig)}
_EXTRA = {
    "grp": set(),
    "grp_homogeneous": set(),
    "static_best": set(),
    "static_uniform": {"rollout_tp"},
    "greedy": {"increment", "tolerance", "rollout_tp"},
    "colocated": {"rollout_tp"},
}


@dataclass(frozen=True, slots=True)
class _Models:
    rollout: RolloutCostModel
    train: TrainingCostModel


def _models(params: dict[str, Any]) -> _Models:
    rollout = params.pop("rollout_model", None)
    train = params.pop("train_model", None)
    hw_name = params.pop("hardware", None)
    model_name = params.pop("model", None)
    if rollout is None or train is None:
        if hw_name is None or model_name is None:
            raise PlannerError("make_allocator needs rollout_model and train_model, or hardware and model names")
        hw = load_hardware(hw_name)
        model = load_model(model_name)
        rollout = rollout or RolloutCostModel(hw, model)
        train = train or TrainingCostModel(hw, model)
    return _Models(rollout, train)


def make_allocator(name: str, **params: Any) -> Allocator:
    """Build the allocator called ``name`` (one of :data:`ALLOCATORS`).

    Parameters: ``config`` (a :class:`PlannerConfig`) or its fields (``n_gpus``, ``global_batch``,
    ...); ``rollout_model`` and ``train_model`` or ``hardware`` and ``model`` profile names;
    ``memoize``; and the allocator's own knobs (``rollout_tp`` for static_uniform/greedy/colocated,
    ``increment`` and ``tolerance`` for greedy). Raises ``ValueError`` for an unknown name or
    parameter, :class:`PlannerError` for bad values.
    """
    if name not in ALLOCATORS:
        raise ValueError(f"unknown allocator: {name!r} (known: {', '.join(ALLOCATORS)})")
    params = dict(params)
    models = _models(params)
    memoize = bool(params.pop("memoize", True))
    config = params.pop("config", None)
    cfg_kwargs = {k: params.pop(k) for k in list(params) if k in _CONFIG_FIELDS}
    extra = {k: params.pop(k) for k in list(params) if k in _EXTRA[name]}
    if params:
        raise ValueError(f"unknown parameter(s) for allocator {name!r}: {', '.join(sorted(params))}")
    if config is None:
        config = PlannerConfig(**cfg_kwargs)
    elif cfg_kwargs:
        config = replace(config, **cfg_kwargs)
    planner = GlobalResourcePlanner(
        models.rollout, models.train, config, memoize=memoize, homogeneous_rollout=name == "grp_homogeneous"
    )
    if name in ("grp", "grp_homogeneous"):
        return GrpAllocator(planner, name)
    if name == "static_uniform":
        return StaticUniform(planner, **extra)
    if name == "static_best":
        return StaticBest(planner)
    if name == "colocated":
        return Colocated(planner, **extra)
    return Greedy(planner, **extra)
