"""The GRP rollout model for length-blind routers: what a plan costs when the router ignores request lengths.

Role: the alternative to the bucket model of :mod:`libra.policies.planner.buckets` for
``PlannerConfig.routing`` in :data:`BLIND_ROUTINGS` (``"length_blind"``: each instance's share is
``tp / W``, least connections on ``load / tp`` as ``least_loaded`` does; ``"round_robin"``: ``1 / I``).
Every instance draws its share of *all* requests with the full length mix, so a layout is scored by its
busiest TP degree on the whole sample: :class:`BlindCosts` (one instance's cost and critical path),
:class:`BlindTable` (the exact best layout for every GPU budget), :func:`evaluate_blind` (a fixed
multiset) and :func:`blind_instances` (its per-instance view). For one TP degree this model and the
bucket model agree exactly. The measurement behind the model and the pipeline shift are described in
:mod:`libra.policies.planner.buckets`.

Pure numpy arithmetic on a :class:`~libra.policies.planner.rollout_dp.RolloutSample`.
"""

from __future__ import annotations

import copy
import itertools
import math

import numpy as np

from libra.policies.cost.rollout import RolloutCostModel
from libra.policies.planner.rollout_dp import RolloutSample, agentic_cost
from libra.policies.planner.types import PlannerError, RolloutInstance

__all__ = ["BLIND_ROUTINGS", "BlindCosts", "BlindTable", "blind_instances", "evaluate_blind"]

#: ``PlannerConfig.routing`` values that ignore request lengths, and how each splits the requests.
BLIND_ROUTINGS = ("length_blind", "round_robin")


class BlindCosts:
    """What one instance of a layout costs when the router ignores lengths (see :class:`BlindTable`).

    ``cost(tp, d)`` / ``chain(tp, d)``: :func:`~libra.policies.planner.rollout_dp.agentic_cost` of one
    TP-``tp`` instance serving ``1/d`` of the *whole* sample (token, request, call and tool-second
    sums divided by ``min(d, n)``, the full length mix: the longest request and the longest-decoding
    trajectory stay whole, since any instance may draw them). ``weighted``: the share divisor of an
    instance is ``W / tp`` (``W`` = the layout's rollout GPUs: least connections on ``load / tp``,
    what ``least_loaded`` does), else the instance count ``I`` (``round_robin``). Cached per TP."""

    def __init__(self, cm: RolloutCostModel, sample: RolloutSample, overlap_steps: int = 1, *,
                 weighted: bool = True, chain_bound: bool = True) -> None:
        if overlap_steps < 1:
            raise PlannerError(f"overlap_steps must be >= 1, got {overlap_steps}")
        self.cm = cm
        self.chain_bound = chain_bound  # False: the throughput objective (agentic_cost)
        self.sample = sample
        self.overlap_steps = overlap_steps
        self.weighted = weighted
        seg = sample.segments()
        whole = int(np.flatnonzero((seg.jj == 0) & (seg.ii == sample.size))[0])
        self._whole = seg
        self._idx = whole
        self.total = float(seg.n[whole])
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._top = 0
        self.offset = 0.0

    def shifted(self, offset: float) -> BlindCosts:
        """The same costs with the pipeline shift ``offset`` (see :meth:`BucketCosts.shifted`): :meth:`cost`
        becomes ``max(cost, (chain + offset) / L)``; :meth:`layout` stays unshifted."""
        out = copy.copy(self)
        out.offset = float(offset)
        out._cache = dict(self._cache)  # its own dict: ``reserve`` may clear it
        return out

    def reserve(self, top: int) -> None:
        """Size the per-TP grids for layouts of up to ``top`` GPUs / instances at once."""
        if top > self._top:
            self._cache.clear()
            self._top = top

    def divisor(self, tp: int, n_gpus: int, n_instances: int) -> float:
        """The share divisor of one TP-``tp`` instance in a layout of ``n_instances`` instances on
        ``n_gpus`` GPUs."""
        return n_gpus / tp if self.weighted else float(n_instances)

    def _grid(self, tp: int, top: int) -> tuple[np.ndarray, np.ndarray]:
        """``(cost, chain)`` for the divisors ``d = x / tp`` (weighted) or ``d = x`` (count) for
        ``x = 0..top``; ``inf`` where the divisor is below 1."""
        self.reserve(top)
        out = self._cache.get(tp)
        if out is None:
            x = np.arange(self._top + 1, dtype=float)
            d = x / tp if self.weighted else x
            ok = d >= 1.0 - 1e-12
            seg = self._whole
            rep = [None if getattr(seg, f) is None else getattr(seg, f)[self._idx:self._idx + 1].repeat(int(ok.sum()))
                   for f in _SEG_FIELDS]
            one = type(seg)(np.ones(1, bool), *rep)
            cost, chain = agentic_cost(self.cm, tp, one, np.minimum(d[ok], self.total), self.overlap_steps,
                                       chain_bound=self.chain_bound)
            c = np.full(x.size, np.inf)
            h = np.full(x.size, np.inf)
            c[ok], h[ok] = cost, chain
            out = self._cache[tp] = (c, h)
        return out

    def cost(self, tp: int, d: float) -> float:
        """Seconds for one TP-``tp`` instance serving ``1/d`` of the sample (``inf`` if it cannot hold
        the longest request; shifted by :attr:`offset`). ``d`` must be an integer (count) or ``x / tp``
        for an integer ``x``."""
        c, h = self._at(tp, d)
        if self.offset > 0.0 and self.overlap_steps > 1:
            return max(c, (h + self.offset) / self.overlap_steps)
        return c

    def chain(self, tp: int, d: float) -> float:
        """The matching undivided critical path (``chain`` of ``agentic_cost``)."""
        return self._at(tp, d)[1]

    def _at(self, tp: int, d: float) -> tuple[float, float]:
        x = round(d * tp) if self.weighted else round(d)
        c, h = self._grid(tp, max(self._top, x))
        return float(c[x]), float(h[x])

    def layout(self, tps: tuple[int, ...]) -> tuple[float, float]:
        """``(time, chain)`` of the TP multiset ``tps``: the max over the TP degrees present of one
        instance's cost (and critical path); ``(inf, inf)`` for an empty layout."""
        if not tps:
            return math.inf, math.inf
        w, n = sum(tps), len(tps)
        vals = [self._at(tp, self.divisor(tp, w, n)) for tp in sorted(set(tps))]
        return max(v[0] for v in vals), max(v[1] for v in vals)


_SEG_FIELDS = ("jj", "ii", "prompt", "gen", "n", "calls", "tool", "max_seq", "gen_star", "tool_star", "gen_prompt",
               "gen_sq")


class BlindTable:
    """The exact best length-blind layout for every GPU budget ``0..budget``.

    Model (``PlannerConfig.routing`` in :data:`BLIND_ROUTINGS`): the router ignores buckets and every
    instance draws its share of *all* requests with the full length mix (:class:`BlindCosts`). So a
    layout's rollout time is the max over the TP degrees present of one instance's cost, and its chain
    the max of their critical paths: the longest trajectory may land on the slowest instance type
    present (the worst TP present bounds the chain). The cost of a multiset depends only on the set
    ``S`` of TP degrees present and on ``W`` (GPUs used; weighted) or ``I`` (instances; count), so the
    search enumerates ``S`` (respecting ``require_heterogeneous``: ``|S| >= 2``) and ``W`` / ``I``:

    - weighted: every ``W <= budget`` reachable as ``sum k_t t`` with every ``k_t >= 1``, with the
      fewest instances (a coin-change DP; ``max_instances`` applies to that count);
    - count: every ``I`` with its fewest GPUs ``sum S + (I - |S|) min S`` (one of each TP, the rest on
      the smallest).

    ``time(g)`` is the minimum over layouts using at most ``g`` GPUs (idle GPUs allowed). Ties: fewer
    GPUs, then fewer instances, then fewer distinct TPs, then the smaller TPs. Exact for this model
    (``tests/unit/test_planner_routing.py`` checks it against every multiset). Consequence: a
    heterogeneous layout is never predicted faster than the homogeneous layout of its smallest TP on
    the same GPUs (weighted) or the same instance count (count): heterogeneity only costs.
    """

    def __init__(self, costs: BlindCosts, tps: tuple[int, ...], budget: int, *,
                 require_heterogeneous: bool = False, max_instances: int | None = None) -> None:
        if budget < 0:
            raise PlannerError(f"rollout budget must be >= 0, got {budget}")
        self.costs = costs
        self.tps = tuple(sorted(set(tps)))
        self.budget = budget
        costs.reserve(budget)
        cands: list[tuple[float, int, int, int, tuple[int, ...], tuple[int, ...]]] = []
        for m in range(2 if require_heterogeneous else 1, len(self.tps) + 1):
            for subset in itertools.combinations(self.tps, m):
                cands.extend(self._layouts(subset, max_instances))
        # best[g]: the best layout on exactly g GPUs, then a running minimum over budgets
        best: list[tuple[float, int, int, int, tuple[int, ...]] | None] = [None] * (budget + 1)
        for time, w, n, m, subset, layout in cands:
            key = (time, w, n, m, subset, layout)
            if best[w] is None or key < best[w]:  # type: ignore[operator]
                best[w] = key  # type: ignore[assignment]
        self._best: list[tuple[float, tuple[int, ...]]] = []
        run: tuple | None = None
        for g in range(budget + 1):
            if best[g] is not None and (run is None or best[g] < run):  # type: ignore[operator]
                run = best[g]
            self._best.append((run[0], run[5]) if run is not None else (math.inf, ()))

    def _layouts(self, subset: tuple[int, ...], cap: int | None) -> list[tuple]:
        """Every candidate layout over exactly the TP set ``subset`` (see the class docstring)."""
        base, m, out = sum(subset), len(subset), []
        if base > self.budget:
            return out
        if self.costs.weighted:
            coins = _fewest_coins(subset, self.budget - base)
            for w in range(base, self.budget + 1):
                extra = coins[w - base]
                if extra is None or (cap is not None and m + len(extra) > cap):
                    continue
                layout = tuple(sorted(subset + extra))
                time = max(self.costs.cost(tp, w / tp) for tp in subset)
                out.append((time, w, len(layout), m, subset, layout))
            return out
        low = subset[0]
        for n in range(m, (cap if cap is not None else self.budget) + 1):
            w = base + (n - m) * low
            if w > self.budget:
                break
            time = max(self.costs.cost(tp, n) for tp in subset)
            out.append((time, w, n, m, subset, tuple(sorted(subset + (low,) * (n - m)))))
        return out

    def time(self, g: int) -> float:
        """Optimal makespan with at most ``g`` GPUs (``inf`` if no layout is feasible)."""
        return self._entry(g)[0]

    def layout(self, g: int) -> tuple[int, ...]:
        """The optimal TP multiset for ``g`` GPUs, ascending (empty if infeasible)."""
        time, layout = self._entry(g)
        return layout if math.isfinite(time) else ()

    def chain(self, g: int) -> float:
        """The optimal layout's longest critical path (0.0 if infeasible)."""
        layout = self.layout(g)
        return self.costs.layout(layout)[1] if layout else 0.0

    def _entry(self, g: int) -> tuple[float, tuple[int, ...]]:
        if not 0 <= g <= self.budget:
            raise PlannerError(f"budget {g} outside the solved range 0..{self.budget}")
        return self._best[g]


def _fewest_coins(coins: tuple[int, ...], top: int) -> list[tuple[int, ...] | None]:
    """For every amount ``0..top``: the fewest ``coins`` summing to it (ascending; None if none does).
    Ties: the lexicographically smallest multiset (deterministic)."""
    best: list[tuple[int, ...] | None] = [()] + [None] * top
    for a in range(1, top + 1):
        for c in coins:
            prev = best[a - c] if c <= a else None
            if prev is None:
                continue
            cand = tuple(sorted(prev + (c,)))
            cur = best[a]
            if cur is None or (len(cand), cand) < (len(cur), cur):
                best[a] = cand
    return best


def evaluate_blind(costs: BlindCosts, tps: tuple[int, ...]) -> float:
    """Makespan of the fixed TP multiset ``tps`` under length-blind routing (``inf`` if empty or if a
    TP present cannot hold the longest request)."""
    return costs.layout(tuple(tps))[0]


def blind_instances(costs: BlindCosts, tps: tuple[int, ...]) -> tuple[RolloutInstance, ...]:
    """One :class:`RolloutInstance` per instance of ``tps``: the whole length range, its share of the
    (weighted) requests and its TP's predicted time."""
    lengths, w, n = costs.sample.lengths, sum(tps), len(tps)
    lo, hi = float(lengths[0]), float(lengths[-1])
    out = []
    for tp in sorted(tps):
        d = costs.divisor(tp, w, n)
        out.append(RolloutInstance(tp, lo, hi, costs.total / min(d, costs.total), costs.cost(tp, d)))
    return tuple(out)
