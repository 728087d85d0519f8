"""The Global Resource Planner search ("Algorithm 1"): split N GPUs between training and rollout.

Role: minimise ``max(T_train, T_rollout)`` (``PlannerConfig.objective = "throughput"``, the default,
docs/papers.md §1.7: ``T_rollout`` is the busiest instance's work, or where its longest trajectory
outlasts that work, the work plus that trajectory's drained tail at batch 1, ``planner/chain.py``; the
rollout DP alone is exact; with ``"pipeline"``, the earlier objective, each bucket's cost includes its chain and with a policy
lag ``L > 1`` also the pipeline bound ``(T_chain + T_train) / L``,
:func:`~libra.policies.planner.types.pipeline_objective`, as described below) over ``n_train``
(outer loop), the training layout (decision tree, ``planner/training.py``) and the rollout TP multiset
with its length ranges (exact DP, ``planner/rollout_dp.py`` / ``planner/buckets.py`` /
``planner/start_small.py``; under a length-blind ``PlannerConfig.routing`` the exact enumeration of
``buckets.BlindTable``). Pure: the inputs are cost models, a :class:`PlannerConfig` and a
:class:`Workload`; the output is a :class:`Plan`.

Contract (``PlannerConfig.exact_pipeline``, the default): the returned plan minimises the objective it
reports (``Plan.objective``) over every ``n_train`` and every rollout layout of the configured model,
exactly:

- ``L = 1``: the objective is ``max(T_train, T_rollout)``; the rollout DP minimises ``T_rollout`` and the
  tree ``T_train``, so one DP (per budget) is exact.
- ``L > 1``: the objective is ``max(T_train, max over buckets of max(work, (chain + T_train) / L))``
  (each bucket's ``cost = max(work, chain / L)``, and the layout's chain is the max of its buckets'),
  which depends on ``T_train``. Both terms grow with ``T_train``, so the tree's fastest training layout
  stays optimal for each ``n_train``; the rollout layout is then found by the same DP on costs shifted to
  ``max(cost, (chain + T_train) / L)`` (``costs.shifted(T_train)``), solved for each ``n_train`` the loop
  visits. The unshifted DP value is a lower bound of the shifted one, so the best-first order and the
  pruning below stay exact. With ``exact_pipeline=False`` the rollout DP minimises ``T_rollout`` only
  (the earlier search): exact at ``L = 1``, but at ``L > 1`` it can return a plan predicted slower than
  another layout on the same data.

Search order and memoisation:

- With ``memoize=True`` one unshifted rollout DP is solved for the largest rollout budget; it answers
  every smaller budget, so all ``n_train`` candidates share it. With ``memoize=False`` the DP is solved
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

import numpy as np

from libra.policies.cost.rollout import RolloutCostModel
from libra.policies.cost.training import TrainConfig, TrainingCostModel
from libra.policies.planner.buckets import (
    BLIND_ROUTINGS,
    BlindCosts,
    BlindTable,
    BucketCosts,
    BucketTable,
    blind_instances,
    bucket_instances,
    evaluate_blind,
    evaluate_buckets,
    threshold_buckets,
)
from libra.policies.planner.rollout_dp import RolloutSample, RolloutTable, cost_matrices, evaluate_layout, to_instances
from libra.policies.planner.start_small import (
    StartSmallCosts,
    StartSmallTable,
    evaluate_start_small,
    start_small_instances,
)
from libra.policies.planner.training import TrainChoice, TrainingSearch
from libra.policies.planner.types import (
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

    bucket_table: type[BucketTable] = BucketTable  # the pooled-bucket DP (a subclass in benchmarks' references)
    train_headroom: float = 1.0  # training layouts must fit the longest sequence times this (Replanner.headroom)

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
        sample = RolloutSample.from_workload(workload, cfg.global_batch, cfg.max_dp_requests, residency=cfg.residency)
        chains: dict[int, Any] = {}
        costs: Any
        cb = cfg.objective == "pipeline"  # the throughput objective drops the chain from every bucket cost
        if cfg.routing in BLIND_ROUTINGS:
            costs = BlindCosts(self.rollout_model, sample, cfg.overlap_steps, weighted=cfg.routing == "length_blind",
                               chain_bound=cb)
        elif cfg.routing == "start_small":
            costs = StartSmallCosts(self.rollout_model, sample, cfg.overlap_steps, chain_bound=cb)
        elif cfg.pooled_buckets:
            costs = BucketCosts(self.rollout_model, sample, cfg.overlap_steps, chain_bound=cb)
        else:
            costs = cost_matrices(self.rollout_model, sample, self.rollout_tps, cfg.overlap_steps, chains, cb)
        train = TrainingSearch(self.train_model, cfg, workload.training_lengths(cfg.global_batch), self.train_headroom)
        return _Context(workload, sample, costs, train, chains)

    def _shifted(self, ctx: _Context, t_train: float) -> Any:
        """``ctx.costs`` shifted by the pipeline term for ``t_train`` (see the module docstring); the
        unshifted costs when the bound does not apply (``L = 1`` or an infeasible training)."""
        lag = self.config.overlap_steps
        if (lag <= 1 or not math.isfinite(t_train) or not self.config.exact_pipeline
                or self.config.objective == "throughput"):
            return ctx.costs
        if isinstance(ctx.costs, dict):  # the reference DP's per-TP matrices
            return {tp: np.maximum(c, (ctx.chains[tp] + t_train) / lag) for tp, c in ctx.costs.items()}
        return ctx.costs.shifted(t_train)

    def _tables(self, ctx: _Context, budget: int, costs: Any = None) -> list[Any]:
        costs = ctx.costs if costs is None else costs
        cfg = self.config
        kw = {"require_heterogeneous": cfg.require_heterogeneous, "max_instances": cfg.max_instances}
        if cfg.routing != "by_length" or cfg.pooled_buckets:
            kind = (BlindTable if cfg.routing in BLIND_ROUTINGS
                    else StartSmallTable if cfg.routing == "start_small" else self.bucket_table)
            sets = [(t,) for t in self.rollout_tps] if self.homogeneous else [self.rollout_tps]
            return [kind(costs, s, budget, **kw) for s in sets]
        groups = [{t: costs[t]} for t in self.rollout_tps] if self.homogeneous else [costs]
        return [RolloutTable(g, budget, **kw) for g in groups]

    @staticmethod
    def _best_of(tables: list[Any], g: int) -> tuple[float, Any]:
        best = min(tables, key=lambda t: t.time(g))
        return best.time(g), best

    def _measure(self, ctx: _Context, table: Any, g: int) -> tuple[float, float, tuple[RolloutInstance, ...]]:
        """``(T_rollout, T_chain, instances)`` of ``table``'s layout for ``g`` GPUs, scored with the
        unshifted ``ctx.costs`` (``T_chain`` is 0.0 unless ``overlap_steps > 1``; ``(inf, inf, ())`` if
        infeasible)."""
        costs = ctx.costs
        if isinstance(table, BucketTable):
            bks = table.buckets(g)
            t, chain, inst = costs.layout_time(bks), costs.layout_chain(bks), bucket_instances(costs, bks)
        elif isinstance(table, StartSmallTable):
            bks = table.buckets(g)
            (t, chain), inst = costs.layout(bks), start_small_instances(costs, bks)
        elif isinstance(table, BlindTable):
            layout = table.layout(g)
            if not layout:
                return math.inf, math.inf, ()
            (t, chain), inst = costs.layout(layout), blind_instances(costs, layout)
        else:
            segs = table.instances(g)
            t = max((float(costs[tp][j, i]) for tp, j, i in segs), default=math.inf)
            chain = max((float(ctx.chains[tp][j, i]) for tp, j, i in segs), default=0.0)
            inst = to_instances(ctx.sample, costs, segs)
        if not math.isfinite(t):
            return math.inf, math.inf, ()
        return t, (chain if self.config.overlap_steps > 1 else 0.0), inst

    def _rollout_for(self, ctx: _Context, t_train: float, g: int,
                     unshifted: Any | None = None) -> tuple[float, float, tuple[RolloutInstance, ...]]:
        """The best rollout layout on ``g`` GPUs for the full objective given ``t_train`` (module
        docstring), measured unshifted. ``unshifted``: an already solved unshifted table for ``g``, used
        when the shift does not apply."""
        costs = self._shifted(ctx, t_train)
        if costs is ctx.costs and unshifted is not None:
            return self._measure(ctx, unshifted, g)
        _, table = self._best_of(self._tables(ctx, g, costs), g)
        return self._measure(ctx, table, g)

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
        best_obj, best = math.inf, None
        for n in order:
            if max(roll[n][0], ctx.train.lower_bound(n)) >= best_obj:
                break
            stats.candidates_visited += 1
            choice = ctx.train.best(n, bound=best_obj)
            if choice is None:
                continue
            g = cfg.n_gpus - n
            if self._shifted(ctx, choice.time) is not ctx.costs:
                stats.rollout_dp_solves += 1 if not self.homogeneous else len(self.rollout_tps)
            t_roll, chain, inst = self._rollout_for(ctx, choice.time, g, roll[n][1])
            obj = (max(choice.time, t_roll) if cfg.objective == "throughput"
                   else pipeline_objective(choice.time, t_roll, chain, cfg.overlap_steps))
            if obj < best_obj:
                best_obj, best = obj, (n, choice, t_roll, chain, inst)
        stats.train_leaves = ctx.train.leaves_evaluated
        if best is None or not math.isfinite(best_obj):
            longest = float(ctx.sample.lengths.max())
            raise PlannerError(
                f"no feasible plan on {cfg.n_gpus} GPUs: check that the longest request ({longest:.0f} tokens) fits "
                f"an allowed rollout TP {cfg.rollout_tps} and that the model fits the training GPUs"
            )
        n, choice, t_roll, chain, inst = best
        plan = Plan(cfg.n_gpus, n, choice.config, inst, choice.time, t_roll, t_chain=chain,
                    overlap_steps=cfg.overlap_steps, throughput=cfg.objective == "throughput")
        return SearchResult(plan, stats)

    # -- fixed layouts ------------------------------------------------------------------------------
    def best_training(self, workload: Workload | list[tuple[float, float]], n_train: int) -> TrainChoice | None:
        """The training decision tree's best layout for ``n_train`` GPUs (None if infeasible)."""
        return self._context(as_workload(workload)).train.best(n_train)

    def _training(self, ctx: _Context, n_train: int, train: TrainConfig | None) -> tuple[TrainConfig | None, float]:
        """``(layout, step time)`` of training on ``n_train`` GPUs: ``train`` as given, or the tree's best
        layout for ``n_train`` (``(None, inf)`` when there is none)."""
        if train is not None:
            return train, self.train_model.step_time(train, ctx.train.lengths)
        choice = ctx.train.best(n_train) if n_train > 0 else None
        return (choice.config, choice.time) if choice else (None, math.inf)

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
        layout for the remaining GPUs. Either way the rollout split (which requests each bucket or
        instance serves) is the one minimising the plan objective for that training time (with
        ``overlap_steps > 1`` the pipeline-shifted costs; module docstring). Infeasible parts get
        ``inf`` times (the plan is still returned so callers can compare). Raises
        :class:`PlannerError` if the GPUs do not add up.
        """
        wl = as_workload(workload)
        cfg = self.config
        if train is not None and train.n_gpus != n_train:
            raise PlannerError(f"train layout uses {train.n_gpus} GPUs but n_train={n_train}")
        if rollout_tps is not None and n_train + sum(rollout_tps) > cfg.n_gpus:
            raise PlannerError(f"n_train={n_train} + rollout {rollout_tps} exceeds n_gpus={cfg.n_gpus}")
        ctx = self._context(wl)
        train_cfg, t_train = self._training(ctx, n_train, train)
        lag = cfg.overlap_steps
        costs = self._shifted(ctx, t_train)
        if rollout_tps is None:
            t_roll, chain, instances = self._rollout_for(ctx, t_train, cfg.n_gpus - n_train)
        else:
            tps = tuple(rollout_tps)
            if cfg.routing in BLIND_ROUTINGS:
                t_roll = evaluate_blind(ctx.costs, tps)
                instances = blind_instances(ctx.costs, tps) if math.isfinite(t_roll) else ()
                chain = ctx.costs.layout(tps)[1]
            elif cfg.routing == "start_small":
                _, bks = evaluate_start_small(costs, tps)
                (t_roll, chain), instances = ctx.costs.layout(bks), start_small_instances(ctx.costs, bks)
            elif cfg.pooled_buckets:
                _, bks = evaluate_buckets(costs, tps)
                t_roll, chain = ctx.costs.layout_time(bks), ctx.costs.layout_chain(bks)
                instances = bucket_instances(ctx.costs, bks)
            else:
                chains, base = ctx.chains, ctx.costs
                if not set(tps) <= set(base):
                    chains = {}
                    base = cost_matrices(self.rollout_model, ctx.sample, tuple(sorted(set(tps))), lag, chains,
                                         cfg.objective == "pipeline")
                shifted = ({tp: np.maximum(c, (chains[tp] + t_train) / lag) for tp, c in base.items()}
                           if lag > 1 and math.isfinite(t_train) and cfg.objective == "pipeline" else base)
                _, segments = evaluate_layout(shifted, tps)
                t_roll = max((float(base[tp][j, i]) for tp, j, i in segments), default=math.inf)
                instances = to_instances(ctx.sample, base, segments)
                chain = max((float(chains[tp][j, i]) for tp, j, i in segments), default=0.0)
            if lag <= 1:
                chain = 0.0
        if not math.isfinite(t_roll):
            chain = 0.0 if lag <= 1 else math.inf
        if rollout_tps is not None:
            instances = _pad_idle(instances, rollout_tps)
        return Plan(cfg.n_gpus, n_train, train_cfg, instances, t_train, t_roll, allocator=allocator,
                    t_chain=chain, overlap_steps=lag, throughput=cfg.objective == "throughput")

    def evaluate(self, plan: Plan, workload: Workload | list[tuple[float, float]]) -> Plan:
        """Re-score ``plan``'s layout (same n_train, training layout and TP multiset) on ``workload``."""
        return self.plan_fixed(workload, plan.n_train, plan.rollout_tps, plan.train, allocator=plan.allocator)

    def evaluate_deployed(self, plan: Plan, workload: Workload | list[tuple[float, float]]) -> Plan:
        """``plan`` re-scored on ``workload`` *as deployed*: its buckets keep the length thresholds it was
        planned with (:meth:`Plan.buckets`, which the broker's bucket specs carry), and each request of
        ``workload`` goes to the bucket its length falls in (:func:`~.buckets.threshold_buckets`).
        :meth:`evaluate` instead re-chooses the split for ``workload``, which a deployed layout does not do
        until a round re-plans it: when the lengths grow past the thresholds, the last bucket serves nearly
        everything. For the ``by_length`` pooled-bucket model; the other models have no length thresholds
        (blind routings) or their own rule (``start_small``, the instance-level DP) and score as
        :meth:`evaluate`."""
        cfg = self.config
        if cfg.routing != "by_length" or not cfg.pooled_buckets or plan.colocated:
            return self.evaluate(plan, workload)
        ctx = self._context(as_workload(workload))
        _, t_train = self._training(ctx, plan.n_train, plan.train)
        bks = threshold_buckets(ctx.costs, [(b.tp, b.n_instances, b.max_tokens) for b in plan.buckets()])
        t_roll, chain = ctx.costs.layout_time(bks), ctx.costs.layout_chain(bks)
        inst = _pad_idle(bucket_instances(ctx.costs, bks), plan.rollout_tps) if math.isfinite(t_roll) else ()
        lag = cfg.overlap_steps
        return Plan(cfg.n_gpus, plan.n_train, plan.train, inst, t_train, t_roll, allocator=plan.allocator,
                    t_chain=chain if lag > 1 and math.isfinite(t_roll) else 0.0, overlap_steps=lag,
                    throughput=cfg.objective == "throughput")


def _pad_idle(instances: tuple[RolloutInstance, ...], tps: tuple[int, ...]) -> tuple[RolloutInstance, ...]:
    """Keep deployed-but-idle instances of a fixed layout in the plan (they still hold GPUs)."""
    left = list(tps)
    for inst in instances:
        left.remove(inst.tp)
    return instances + tuple(RolloutInstance(t, 0.0, 0.0, 0.0, 0.0) for t in sorted(left))
