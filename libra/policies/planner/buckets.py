"""The GRP rollout DP over *buckets*: what a heterogeneous plan costs once it is deployed as buckets.

Role: the default rollout model of the planner search (``PlannerConfig.pooled_buckets``). A deployed
plan does not give each rollout instance its own length range: :func:`libra.broker.pools.bucket_specs`
merges the instances of one TP degree into one bucket (name ``tp<N>``, one ``max_tokens`` threshold,
buckets ordered by ascending TP), and every router spreads a bucket's requests over its instances by
least connections. So each of the ``k`` instances of a bucket serves about ``1/k`` of the bucket's
requests, with the bucket's mix of lengths, and a longer request never goes to a smaller TP than a
shorter one. The instance-level DP of ``planner_rollout.py`` (one contiguous sub-range per instance)
predicts a routing that no router implements: it under-estimates the busiest instance of a bucket
whenever lengths, and so per-turn overheads and decode tails, differ inside the bucket.

Model (contracts):

- ``bucket_cost(tp, k, j..i)`` = :func:`~libra.policies.planner.rollout_dp.agentic_cost` of one
  instance's share: token, request, serving-call and tool-second sums divided by ``min(k, n)``
  (instances beyond the request count idle), while the longest request (``max_seq``: the OOM check)
  and the longest-decoding trajectory (its generated tokens and tool seconds: the critical-path
  bound) stay whole. With ``overlap_steps = L > 1`` (an asynchronous pipeline whose policy lag lets
  the rollouts of ``L`` consecutive steps overlap) the chain enters as ``chain / L``: the next
  step's requests fill the instances while the longest trajectory of this step still runs, so the
  steady-state period per step is the work term or ``1/L`` of the chain, whichever is larger. The
  undivided chain (:meth:`BucketCosts.chain`) feeds the plan's pipeline bound (``Plan.t_chain``);
- :class:`BucketTable`: for every GPU budget ``0..G``, the best layout of at most one bucket per TP
  degree, buckets tiling the length-sorted sample in ascending TP order, GPUs left idle allowed. States
  carry the number of distinct TPs used (``require_heterogeneous``: >= 2) and the instance count
  (``max_instances``). Exact for this model (``tests/unit/test_planner_buckets.py`` checks it against
  brute force). Ties: the first minimum (fewer instances, smaller ``j``; a TP left unused wins a tie).
- :func:`evaluate_buckets`: the fixed multiset's best split (every instance of a TP in its bucket; a
  bucket may serve nothing, its GPUs still held).

The model above assumes the router keeps each request in the bucket of its length
(``PlannerConfig.routing = "by_length"``, C-MLFQ-like routers; they realise it only in part, since they
start small and move at tool returns). Length-blind routers (``least_loaded``, ``round_robin``) do not:
they spread trajectories over all instances whatever their length (measured in the simulator with a
frozen ``4xTP1 + 4xTP2 + 5xTP4`` plan under ``least_loaded``: 153 / 320 / 645 trajectories per TP-1 /
TP-2 / TP-4 instance, i.e. shares proportional to TP, with the same length mix). For them
(``routing = "length_blind"``: shares ``tp / W``; ``"round_robin"``: ``1 / I``) :class:`BlindCosts`,
:class:`BlindTable`, :func:`evaluate_blind` and :func:`blind_instances` score a layout by its busiest
TP degree on the whole sample (see :class:`BlindTable`). For one TP degree both models agree exactly.
C-MLFQ's rule (start in the smallest bucket, move at a tool return) is ``routing = "start_small"``,
modelled in ``planner_start_small.py`` (not mapped to any simulated router by default; see BENCHMARKS.md).

Pipeline shift: :meth:`BucketCosts.shifted` / :meth:`BlindCosts.shifted` return the same costs with each
bucket (instance type) cost raised to ``max(cost, (chain + offset) / L)``; with ``offset = T_train`` the
tables then minimise the full lag-``L`` plan objective (``PlannerConfig.exact_pipeline``,
``planner_search.py``). Unshifted (``offset = 0``) everything above is unchanged.

Pure numpy arithmetic on a :class:`~libra.policies.planner.rollout_dp.RolloutSample`.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections import Counter

import numpy as np

from libra.policies.cost.rollout import RolloutCostModel
from libra.policies.planner.rollout_dp import RolloutSample, agentic_cost
from libra.policies.planner.types import PlannerError, RolloutInstance

__all__ = ["BLIND_ROUTINGS", "BlindCosts", "BlindTable", "BucketCosts", "BucketTable", "blind_instances",
           "bucket_instances", "evaluate_blind", "evaluate_buckets", "next_state"]

Bucket = tuple[int, int, int, int]
"""``(tp, k instances, j, i)``: a bucket of ``k`` TP-``tp`` instances serving sorted items ``j..i-1``."""


def next_state(s: int, k: int, n_c: int, het: bool, cap: int | None) -> int:
    """The bucket DPs' state after adding a bucket of ``k`` instances to state ``s``.

    A state is ``h * n_c + c``: ``h`` the distinct TP degrees used so far, counted up to 2 (only with
    ``het``, the "at least two TP degrees" constraint; else 0) and ``c`` the instances so far (only with
    an instance ``cap``; else 0, ``n_c = 1``). ``-1`` when the cap would be exceeded."""
    h, c = divmod(s, n_c)
    h2 = min(2, h + 1) if het else 0
    c2 = c + k if cap is not None else 0
    if cap is not None and c2 > cap:
        return -1
    return h2 * n_c + c2


class BucketCosts:
    """``cost(tp, k)[j, i]``: seconds for the busiest of ``k`` TP-``tp`` instances pooling items
    ``j..i-1`` (``inf`` for ``j >= i`` and for segments whose longest request does not fit). Cached.
    ``offset`` (0 unless built by :meth:`shifted`): the pipeline shift applied by :meth:`cost`;
    :meth:`chain`, :meth:`layout_time` and :meth:`layout_chain` are always unshifted."""

    def __init__(self, cm: RolloutCostModel, sample: RolloutSample, overlap_steps: int = 1) -> None:
        if overlap_steps < 1:
            raise PlannerError(f"overlap_steps must be >= 1, got {overlap_steps}")
        self.cm = cm
        self.sample = sample
        self.overlap_steps = overlap_steps
        self.P, self.G, self.W = sample.prefix()
        self.seg = sample.segments()
        self._flat = np.full((sample.size + 1,) * 2, -1)
        self._flat[self.seg.valid] = np.arange(int(self.seg.valid.sum()))
        self._cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.offset = 0.0
        self._shifted: dict[tuple[int, int], np.ndarray] = {}

    def shifted(self, offset: float) -> BucketCosts:
        """The same costs with the pipeline shift ``offset`` (a known ``T_train``): every bucket cost
        becomes ``max(cost, (chain + offset) / L)``, so that the DP's maximum over buckets, maxed with
        ``T_train``, is the plan objective ``pipeline_objective`` (unchanged at ``L = 1``). Shares
        the unshifted cache."""
        out = copy.copy(self)
        out.offset = float(offset)
        out._shifted = {}
        return out

    def _both(self, tp: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(cost matrix, chain vector over the valid segments)`` of ``k`` TP-``tp`` instances."""
        key = (tp, k)
        out = self._cache.get(key)
        if out is None:
            seg = self.seg
            cost, chain = agentic_cost(self.cm, tp, seg, np.minimum(float(k), seg.n), self.overlap_steps)
            c = np.full((self.sample.size + 1,) * 2, np.inf)
            c[seg.valid] = cost
            out = self._cache[key] = (c, chain)
        return out

    def cost(self, tp: int, k: int) -> np.ndarray:
        """The ``(n + 1, n + 1)`` cost matrix of a bucket of ``k >= 1`` TP-``tp`` instances (shifted by
        :attr:`offset`, see :meth:`shifted`)."""
        c = self._both(tp, k)[0]
        if self.offset <= 0.0 or self.overlap_steps <= 1:
            return c
        out = self._shifted.get((tp, k))
        if out is None:
            out = c.copy()
            v = self.seg.valid
            out[v] = np.maximum(c[v], (self._both(tp, k)[1] + self.offset) / self.overlap_steps)
            self._shifted[(tp, k)] = out
        return out

    def layout_time(self, buckets: list[Bucket]) -> float:
        """The unshifted makespan of ``buckets`` (``inf`` for none)."""
        return max((float(self._both(tp, k)[0][j, i]) for tp, k, j, i in buckets), default=math.inf)

    def chain(self, tp: int, k: int) -> np.ndarray:
        """The matching ``(n + 1, n + 1)`` serial critical paths (``chain`` of :func:`agentic_cost`,
        undivided; ``inf`` where ``j >= i``)."""
        h = np.full((self.sample.size + 1,) * 2, np.inf)
        h[self.seg.valid] = self._both(tp, k)[1]
        return h

    def layout_chain(self, buckets: list[Bucket]) -> float:
        """The longest critical path over ``buckets`` (0.0 for none)."""
        return max((float(self._both(tp, k)[1][self._flat[j, i]]) for tp, k, j, i in buckets), default=0.0)


class BucketTable:
    """The bucket DP solved for every GPU budget ``0..budget`` (see the module docstring).

    ``time(g)``: optimal makespan with ``g`` GPUs (``inf`` if infeasible); ``buckets(g)``: the optimal
    buckets ``(tp, k, j, i)`` in length order (empty if infeasible).
    """

    def __init__(self, costs: BucketCosts, tps: tuple[int, ...], budget: int, *,
                 require_heterogeneous: bool = False, max_instances: int | None = None) -> None:
        if budget < 0:
            raise PlannerError(f"rollout budget must be >= 0, got {budget}")
        self.costs = costs
        self.tps = tuple(sorted(set(tps)))
        self.budget = budget
        self.het = require_heterogeneous
        self.cap = max_instances
        self.n = costs.sample.size
        self.n_h = 3 if self.het else 1
        self.n_c = (self.cap + 1) if self.cap is not None else 1
        S, G1, n1 = self.n_h * self.n_c, budget + 1, self.n + 1
        dp = np.full((S, G1, n1), np.inf)
        dp[0, :, 0] = 0.0  # nothing served yet: any number of GPUs idle
        self._layers: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for tp in self.tps:
            new = dp.copy()
            ch_k = np.zeros((S, G1, n1), np.int32)
            ch_j = np.zeros((S, G1, n1), np.int32)
            ch_s = np.zeros((S, G1, n1), np.int32)
            for k in range(1, budget // tp + 1):
                if self.cap is not None and k > self.cap:
                    break
                w = k * tp
                c = costs.cost(tp, k)
                for s in range(S):
                    t = self._next(s, k)
                    if t < 0:
                        continue
                    prev = dp[s, : G1 - w]  # (G1 - w, n1) over j
                    if not np.isfinite(prev).any():
                        continue
                    cand = np.maximum(prev[:, :, None], c[None, :, :])
                    arg = cand.argmin(axis=1)
                    val = np.take_along_axis(cand, arg[:, None, :], axis=1)[:, 0, :]
                    tgt = new[t, w:]
                    upd = val < tgt
                    if upd.any():
                        tgt[upd] = val[upd]
                        ch_k[t, w:][upd] = k
                        ch_j[t, w:][upd] = arg[upd]
                        ch_s[t, w:][upd] = s
            self._layers.append((dp, ch_k, ch_j, ch_s))
            dp = new
        self._dp = dp
        h = np.arange(S) // self.n_c
        self._final = np.flatnonzero(h >= 2) if self.het else np.arange(S)

    def _next(self, s: int, k: int) -> int:
        return next_state(s, k, self.n_c, self.het, self.cap)

    def _final_state(self, g: int) -> tuple[int, float]:
        if not 0 <= g <= self.budget:
            raise PlannerError(f"budget {g} outside the solved range 0..{self.budget}")
        col = self._dp[self._final, g, self.n]
        idx = int(np.argmin(col))
        return int(self._final[idx]), float(col[idx])

    def time(self, g: int) -> float:
        """Optimal makespan with ``g`` GPUs (``inf`` if no layout is feasible)."""
        return self._final_state(g)[1]

    def buckets(self, g: int) -> list[Bucket]:
        """Back-track the optimal buckets for ``g`` GPUs, in length (and TP) order."""
        s, value = self._final_state(g)
        if not math.isfinite(value):
            return []
        out: list[Bucket] = []
        i = self.n
        for layer in range(len(self.tps) - 1, -1, -1):
            _, ch_k, ch_j, ch_s = self._layers[layer]
            k = int(ch_k[s, g, i])
            if k == 0:
                continue
            tp = self.tps[layer]
            j = int(ch_j[s, g, i])
            out.append((tp, k, j, i))
            s, g, i = int(ch_s[s, g, i]), g - k * tp, j
        if i != 0:  # pragma: no cover - a finite value always tiles the sample
            raise RuntimeError("bucket DP back-tracking did not reach the first request")
        return out[::-1]


def evaluate_buckets(costs: BucketCosts, tps: tuple[int, ...]) -> tuple[float, list[Bucket]]:
    """Best makespan of the fixed TP multiset ``tps`` deployed as buckets (every instance of a TP in
    its bucket, buckets in ascending TP order; a bucket may serve nothing). Returns ``(time,
    buckets)`` with the non-empty buckets (``inf`` and ``[]`` if infeasible or ``tps`` is empty)."""
    if not tps:
        return math.inf, []
    counts = Counter(tps)
    n1 = costs.sample.size + 1
    dp = np.full(n1, np.inf)
    dp[0] = 0.0
    choices: list[tuple[int, int, np.ndarray]] = []
    for tp in sorted(counts):
        k = counts[tp]
        cand = np.maximum(dp[:, None], costs.cost(tp, k))
        arg = cand.argmin(axis=0)
        val = cand[arg, np.arange(n1)]
        stay = dp <= val
        choices.append((tp, k, np.where(stay, np.arange(n1), arg)))
        dp = np.where(stay, dp, val)
    value = float(dp[-1])
    if not math.isfinite(value):
        return math.inf, []
    out: list[Bucket] = []
    i = n1 - 1
    for tp, k, by_j in reversed(choices):
        j = int(by_j[i])
        if j < i:
            out.append((tp, k, j, i))
        i = j
    return value, out[::-1]


def bucket_instances(costs: BucketCosts, buckets: list[Bucket]) -> tuple[RolloutInstance, ...]:
    """One :class:`RolloutInstance` per instance of each bucket: the bucket's length range, ``1/k`` of
    its (weighted) requests and the bucket's predicted time."""
    W, lengths = costs.W, costs.sample.lengths
    out = []
    for tp, k, j, i in buckets:
        c = float(costs.cost(tp, k)[j, i])
        out.extend(RolloutInstance(tp, float(lengths[j]), float(lengths[i - 1]), float(W[i] - W[j]) / k, c)
                   for _ in range(k))
    return tuple(out)


# ---------------------------------------------------------------------------------------------------------
# Length-blind routing (``PlannerConfig.routing`` = ``"length_blind"`` or ``"round_robin"``)

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
                 weighted: bool = True) -> None:
        if overlap_steps < 1:
            raise PlannerError(f"overlap_steps must be >= 1, got {overlap_steps}")
        self.cm = cm
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
            cost, chain = agentic_cost(self.cm, tp, one, np.minimum(d[ok], self.total), self.overlap_steps)
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
