"""The Global Resource Planner search ("Algorithm 1"): split N GPUs between training and rollout.

Role: minimise ``max(T_train, T_rollout)`` (with a policy lag ``L > 1`` also the pipeline bound
``(T_chain + T_train) / L``, :func:`~libra.policies.planner_types.pipeline_objective`) over ``n_train`` (outer loop), the training layout
(decision tree, ``planner_training.py``) and the rollout TP multiset with its length ranges (exact
DP, ``planner_rollout.py`` / ``planner_buckets.py``; under a length-blind ``PlannerConfig.routing`` the
exact enumeration of ``planner_buckets.BlindTable``). Pure: the inputs are cost models, a :class:`PlannerConfig` and a
:class:`Workload`; the output is a :class:`Plan`.

Search order and memoisation:

- With ``memoize=True`` one rollout DP is solved for the largest rollout budget; it answers every
  smaller budget, so all ``n_train`` candidates share it. With ``memoize=False`` the DP is solved
  again for each candidate (the reference behaviour; same plan, slower).
- Candidates are visited best-first by ``max(T_rollout(N - n), LB_train(n))`` where ``LB_train`` is
  the ideal compute split; the loop stops once that key reaches the best objective found, and the
  training tree skips leaves whose own lower bound reaches it. Both bounds are exact lower bounds, so
  pruning never changes the optimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from libra.policies.cost_model_rollout import RolloutCostModel
from libra.policies.cost_model_training import TrainConfig, TrainingCostModel
from libra.policies.planner_buckets import (
    BlindCosts,
    BlindTable,
    BucketCosts,
    BucketTable,
    blind_instances,
    bucket_instances,
    evaluate_blind,
    evaluate_buckets,
)
from libra.policies.planner_rollout import RolloutSample, RolloutTable, cost_matrices, evaluate_layout, to_instances
from libra.policies.planner_training import TrainChoice, TrainingSearch
from libra.policies.planner_types import (
    Plan,
    PlannerConfig,
    PlannerError,
    RolloutInstance,
    Workload,
    as_workload,
    pipeline_objective,
)

__all__ = ["GlobalResourcePlanner", "SearchResult", "SearchStats"]


@dataclass(slots=True)
class SearchStats:
    """Work done by one search: candidates visited, training leaves simulated, rollout DP solves."""

    candidates: int = 0
    candidates_visited: int = 0
    train_leaves: int = 0
    rollout_dp_solves: int = 0


@dataclass(frozen=True, slots=True)
class SearchResult:
    """A plan and the work it took."""

    plan: Plan
    stats: SearchStats = field(default_factory=SearchStats)


@dataclass(slots=True)
class _Context:
    workload: Workload
    sample: RolloutSample
    costs: Any
    train: TrainingSearch
    chains: dict = field(default_factory=dict)  # reference DP: critical-path matrices per TP


class GlobalResourcePlanner:
    """GRP search over a fixed cluster. ``homogeneous_rollout=True`` allows one rollout TP degree
    per plan (the best one); ``memoize`` shares the rollout DP across the ``n_train`` loop."""

    def __init__(
        self,
        rollout_model: RolloutCostModel,
        train_model: TrainingCostModel,
        config: PlannerConfig,
        *,
        memoize: bool = True,
        homogeneous_rollout: bool = False,
    ) -> None:
        if homogeneous_rollout and config.require_heterogeneous:
            raise PlannerError("homogeneous_rollout contradicts PlannerConfig.require_heterogeneous")
        self.rollout_model = rollout_model
        self.train_model = train_model
        self.config = config
        self.memoize = memoize
        self.homogeneous = homogeneous_rollout
        per_node = rollout_model.hardware.gpus_per_node
        self.rollout_tps = tuple(t for t in config.rollout_tps if t <= per_node)
        if not self.rollout_tps:
            raise PlannerError(f"no rollout TP in {config.rollout_tps} fits a node of {per_node} GPUs")

    # -- preparation ------------------------------------------------------------------------------
    def _context(self, workload: Workload) -> _Context:
        cfg = self.config
        sample = RolloutSample.from_workload(workload, cfg.global_batch, cfg.max_dp_requests)
        chains: dict[int, Any] = {}
        costs: Any
        if cfg.routing != "by_length":
            costs = BlindCosts(self.rollout_model, sample, cfg.overlap_steps, weighted=cfg.routing == "length_blind")
        elif cfg.pooled_buckets:
            costs = BucketCosts(self.rollout_model, sample, cfg.overlap_steps)
        else:
            costs = cost_matrices(self.rollout_model, sample, self.rollout_tps, cfg.overlap_steps, chains)
        train = TrainingSearch(self.train_model, cfg, workload.training_lengths(cfg.global_batch))
        return _Context(workload, sample, costs, train, chains)

    def _chain(self, ctx: _Context, table: Any, g: int) -> float:
        """The longest critical path of ``table``'s layout for ``g`` GPUs (0.0 unless the pipeline
        bound applies, ``overlap_steps > 1``)."""
        if self.config.overlap_steps <= 1:
            return 0.0
        if isinstance(table, BucketTable):
            return ctx.costs.layout_chain(table.buckets(g))
        if isinstance(table, BlindTable):
            return table.chain(g)
        return max((float(ctx.chains[tp][j, i]) for tp, j, i in table.instances(g)), default=0.0)

    def _tables(self, ctx: _Context, budget: int) -> list[Any]:
        if self.config.routing != "by_length":
            sets = [(t,) for t in self.rollout_tps] if self.homogeneous else [self.rollout_tps]
            return [
                BlindTable(ctx.costs, s, budget, require_heterogeneous=self.config.require_heterogeneous,
                           max_instances=self.config.max_instances)
                for s in sets
            ]
        if self.config.pooled_buckets:
            sets = [(t,) for t in self.rollout_tps] if self.homogeneous else [self.rollout_tps]
            return [
                BucketTable(ctx.costs, s, budget, require_heterogeneous=self.config.require_heterogeneous,
                            max_instances=self.config.max_instances)
                for s in sets
            ]
        groups = [{t: ctx.costs[t]} for t in self.rollout_tps] if self.homogeneous else [ctx.costs]
        return [
            RolloutTable(
                g,
                budget,
                require_heterogeneous=self.config.require_heterogeneous,
                max_instances=self.config.max_instances,
            )
            for g in groups
        ]

    @staticmethod
    def _best_of(tables: list[Any], g: int) -> tuple[float, Any]:
        best = min(tables, key=lambda t: t.time(g))
        return best.time(g), best

    # -- the search ---------------------------------------------------------------------------------
    def search(self, workload: Workload | list[tuple[float, float]]) -> Plan:
        """The optimal plan for ``workload``. Raises :class:`PlannerError` if no layout is feasible."""
        return self.search_detailed(workload).plan

    def search_detailed(self, workload: Workload | list[tuple[float, float]]) -> SearchResult:
        """:meth:`search` plus the work statistics."""
        wl = as_workload(workload)
        cfg = self.config
        ctx = self._context(wl)
        stats = SearchStats()
        cands = [n for n in cfg.train_candidates() if ctx.train.has_layout(n)]
        stats.candidates = len(cands)
        if not cands:
            raise PlannerError(
                f"no feasible training layout for any n_train in {cfg.train_candidates()[:8]}... "
                f"(global_batch={cfg.global_batch}, group_size={cfg.group_size})"
            )
        roll: dict[int, tuple[float, Any]] = {}
        if self.memoize:
            tables = self._tables(ctx, cfg.n_gpus - min(cands))
            stats.rollout_dp_solves += len(tables)
            for n in cands:
                roll[n] = self._best_of(tables, cfg.n_gpus - n)
        else:
            for n in cands:
                tables = self._tables(ctx, cfg.n_gpus - n)
                stats.rollout_dp_solves += len(tables)
                roll[n] = self._best_of(tables, cfg.n_gpus - n)
        order = sorted(cands, key=lambda n: (max(roll[n][0], ctx.train.lower_bound(n)), n))
        best_obj, best_n, best_choice = math.inf, -1, None
        for n in order:
            if max(roll[n][0], ctx.train.lower_bound(n)) >= best_obj:
                break
            stats.candidates_visited += 1
            choice = ctx.train.best(n, bound=best_obj)
            if choice is None:
                continue
            obj = pipeline_objective(choice.time, roll[n][0], self._chain(ctx, roll[n][1], cfg.n_gpus - n),
                                     cfg.overlap_steps)
            if obj < best_obj:
                best_obj, best_n, best_choice = obj, n, choice
        stats.train_leaves = ctx.train.leaves_evaluated
        if best_choice is None or not math.isfinite(best_obj):
            longest = float(ctx.sample.lengths.max())
            raise PlannerError(
                f"no feasible plan on {cfg.n_gpus} GPUs: check that the longest request ({longest:.0f} tokens) fits "
                f"an allowed rollout TP {cfg.rollout_tps} and that the model fits the training GPUs"
            )
        t_roll, table = roll[best_n]
        instances = self._instances(ctx, table, cfg.n_gpus - best_n)
        plan = Plan(cfg.n_gpus, best_n, best_choice.config, instances, best_choice.time, t_roll,
                    t_chain=self._chain(ctx, table, cfg.n_gpus - best_n), overlap_steps=cfg.overlap_steps)
        return SearchResult(plan, stats)

    # -- fixed layouts ------------------------------------------------------------------------------
    def best_training(self, workload: Workload | list[tuple[float, float]], n_train: int) -> TrainChoice | None:
        """The training decision tree's best layout for ``n_train`` GPUs (None if infeasible)."""
        return self._context(as_workload(workload)).train.best(n_train)

    def plan_fixed(
        self,
        workload: Workload | list[tuple[float, float]],
        n_train: int,
        rollout_tps: tuple[int, ...] | None = None,
        train: TrainConfig | None = None,
        *,
        allocator: str = "grp",
    ) -> Plan:
        """Score a partly or fully fixed layout on ``workload``.

        ``train`` None: the tree's best layout for ``n_train``; ``rollout_tps`` None: the DP's best
        layout for the remaining GPUs. Infeasible parts get ``inf`` times (the plan is still returned
        so callers can compare). Raises :class:`PlannerError` if the GPUs do not add up.
        """
        wl = as_workload(workload)
        cfg = self.config
        if train is not None and train.n_gpus != n_train:
            raise PlannerError(f"train layout uses {train.n_gpus} GPUs but n_train={n_train}")
        if rollout_tps is not None and n_train + sum(rollout_tps) > cfg.n_gpus:
            raise PlannerError(f"n_train={n_train} + rollout {rollout_tps} exceeds n_gpus={cfg.n_gpus}")
        ctx = self._context(wl)
        if train is None:
            choice = ctx.train.best(n_train) if n_train > 0 else None
            train_cfg, t_train = (choice.config, choice.time) if choice else (None, math.inf)
        else:
            train_cfg, t_train = train, self.train_model.step_time(train, ctx.train.lengths)
        lag = cfg.overlap_steps
        if rollout_tps is None:
            t_roll, table = self._best_of(self._tables(ctx, cfg.n_gpus - n_train), cfg.n_gpus - n_train)
            instances = self._instances(ctx, table, cfg.n_gpus - n_train)
            chain = self._chain(ctx, table, cfg.n_gpus - n_train) if math.isfinite(t_roll) else math.inf
        elif cfg.routing != "by_length":
            t_roll = evaluate_blind(ctx.costs, tuple(rollout_tps))
            instances = blind_instances(ctx.costs, tuple(rollout_tps)) if math.isfinite(t_roll) else ()
            chain = ctx.costs.layout(tuple(rollout_tps))[1] if lag > 1 else 0.0
        elif cfg.pooled_buckets:
            t_roll, buckets = evaluate_buckets(ctx.costs, tuple(rollout_tps))
            instances = bucket_instances(ctx.costs, buckets)
            chain = ctx.costs.layout_chain(buckets) if lag > 1 else 0.0
        else:
            chains = ctx.chains
            costs = ctx.costs
            if not set(rollout_tps) <= set(ctx.costs):
                chains = {}
                costs = cost_matrices(self.rollout_model, ctx.sample, tuple(sorted(set(rollout_tps))), lag, chains)
            t_roll, segments = evaluate_layout(costs, tuple(rollout_tps))
            instances = to_instances(ctx.sample, costs, segments)
            chain = max((float(chains[tp][j, i]) for tp, j, i in segments), default=0.0) if lag > 1 else 0.0
        if not math.isfinite(t_roll):
            chain = 0.0 if lag <= 1 else math.inf
        if rollout_tps is not None:
            instances = _pad_idle(instances, rollout_tps)
        return Plan(cfg.n_gpus, n_train, train_cfg, instances, t_train, t_roll, allocator=allocator,
                    t_chain=chain, overlap_steps=lag)

    @staticmethod
    def _instances(ctx: _Context, table: Any, g: int) -> tuple[RolloutInstance, ...]:
        if isinstance(table, BucketTable):
            return bucket_instances(ctx.costs, table.buckets(g))
        if isinstance(table, BlindTable):
            return blind_instances(ctx.costs, table.layout(g))
        return to_instances(ctx.sample, table.costs, table.instances(g))

    def evaluate(self, plan: Plan, workload: Workload | list[tuple[float, float]]) -> Plan:
        """Re-score ``plan``'s layout (same n_train, training layout and TP multiset) on ``workload``."""
        return self.plan_fixed(workload, plan.n_train, plan.rollout_tps, plan.train, allocator=plan.allocator)


def _pad_idle(instances: tuple[RolloutInstance, ...], tps: tuple[int, ...]) -> tuple[RolloutInstance, ...]:
    """Keep deployed-but-idle instances of a fixed layout in the plan (they still hold GPUs)."""
    left = list(tps)
    for inst in instances:
        left.remove(inst.tp)
    return instances + tuple(RolloutInstance(t, 0.0, 0.0, 0.0, 0.0) for t in sorted(left))
