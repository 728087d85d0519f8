"""The GRP rollout DP over *buckets*: what a heterogeneous plan costs once it is deployed as buckets.

Role: the default rollout model of the planner search (``PlannerConfig.pooled_buckets``). A deployed
plan does not give each rollout instance its own length range: :func:`libra.broker.plan_applier.bucket_specs`
merges the instances of one TP degree into one bucket (name ``tp<N>``, one ``max_tokens`` threshold,
buckets ordered by ascending TP), and every router spreads a bucket's requests over its instances by
least connections. So each of the ``k`` instances of a bucket serves about ``1/k`` of the bucket's
requests, with the bucket's mix of lengths, and a longer request never goes to a smaller TP than a
shorter one. The instance-level DP of :mod:`~libra.policies.planner.rollout_dp` (one contiguous sub-range per instance)
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
TP degree on the whole sample (see :class:`BlindTable`; they live in
:mod:`libra.policies.planner.length_blind`, re-exported here). For one TP degree both models agree exactly.
C-MLFQ's rule (start in the smallest bucket, move at a tool return) is ``routing = "start_small"``,
modelled in :mod:`~libra.policies.planner.start_small` (not mapped to any simulated router by default; see BENCHMARKS.md).

Pipeline shift: :meth:`BucketCosts.shifted` / :meth:`BlindCosts.shifted` return the same costs with each
bucket (instance type) cost raised to ``max(cost, (chain + offset) / L)``; with ``offset = T_train`` the
tables then minimise the full lag-``L`` plan objective (``PlannerConfig.exact_pipeline``,
:mod:`~libra.policies.planner.search`). Unshifted (``offset = 0``) everything above is unchanged.

Pure numpy arithmetic on a :class:`~libra.policies.planner.rollout_dp.RolloutSample`.
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import numpy as np

from libra.policies.cost.rollout import RolloutCostModel
from libra.policies.planner.length_blind import (
    BLIND_ROUTINGS,
    BlindCosts,
    BlindTable,
    blind_instances,
    evaluate_blind,
)
from libra.policies.planner.rollout_dp import RolloutSample, agentic_cost
from libra.policies.planner.types import PlannerError, RolloutInstance

__all__ = ["BLIND_ROUTINGS", "BlindCosts", "BlindTable", "BucketCosts", "BucketTable", "blind_instances",
           "bucket_instances", "evaluate_blind", "evaluate_buckets", "next_state", "threshold_buckets"]

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

    def __init__(self, cm: RolloutCostModel, sample: RolloutSample, overlap_steps: int = 1, *,
                 chain_bound: bool = True) -> None:
        if overlap_steps < 1:
            raise PlannerError(f"overlap_steps must be >= 1, got {overlap_steps}")
        self.cm = cm
        self.sample = sample
        self.overlap_steps = overlap_steps
        self.chain_bound = chain_bound  # False: the throughput objective (agentic_cost)
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
            cost, chain = agentic_cost(self.cm, tp, seg, np.minimum(float(k), seg.n), self.overlap_steps,
                                       chain_bound=self.chain_bound)
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
        self._layers: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._dp = self._solve()
        S = self.n_h * self.n_c
        h = np.arange(S) // self.n_c
        self._final = np.flatnonzero(h >= 2) if self.het else np.arange(S)

    def _solve(self) -> np.ndarray:
        """Fill :attr:`_layers` (one per TP: the DP before it and its choices) and return the final DP.

        Same recurrence, order and ties as the dense update ``new[t, g, i] = min over (k, s, j) of
        max(dp[s, g - k*tp, j], cost_k[j, i])`` (``k`` outer, ``s`` inner, strict improvement, first
        ``j``), computed on less: (1) only the items ``j`` some budget of ``dp[s]`` reaches (the others
        are ``inf`` in every row, and a first minimum that is finite is never one of them); (2) only the
        items ``i`` that ``cost_k`` can end a bucket at (other columns are ``inf``: never an update);
        (3) once per *distinct* row of ``dp[s]`` over budgets: ``dp[s, g]`` is piecewise constant in
        ``g`` (before the first TP it is one row for every budget), so budgets sharing a row share the
        candidate and its ``argmin``; (4) the last TP only for the whole sample (``i = n``), the one end
        :meth:`time` and :meth:`buckets` read there (its other columns keep the previous layer's values
        and no choices: never read). Every value is a ``max``/``min`` of the same floats, so what the
        table answers is bit-identical to the dense DP (``tests/unit/test_planner_buckets_fast.py``)."""
        S, G1, n1 = self.n_h * self.n_c, self.budget + 1, self.n + 1
        dp = np.full((S, G1, n1), np.inf)
        dp[0, :, 0] = 0.0  # nothing served yet: any number of GPUs idle
        all_ends = np.arange(n1)
        for layer, tp in enumerate(self.tps):
            ends = all_ends if layer < len(self.tps) - 1 else all_ends[-1:]
            new = dp.copy()
            ch_k = np.zeros((S, G1, n1), np.int32)
            ch_j = np.zeros((S, G1, n1), np.int32)
            ch_s = np.zeros((S, G1, n1), np.int32)
            rows = [_distinct_rows(dp[s]) for s in range(S)]
            for k in range(1, self.budget // tp + 1):
                if self.cap is not None and k > self.cap:
                    break
                w = k * tp
                c = self.costs.cost(tp, k)
                for s in range(S):
                    t = self._next(s, k)
                    if t < 0 or rows[s] is None:
                        continue
                    js, gid, uniq = rows[s]
                    cj = c[js]
                    cols = ends[np.isfinite(cj[:, ends]).any(axis=0)]
                    if cols.size == 0:
                        continue
                    m = int(gid[G1 - w - 1]) + 1  # distinct rows among budgets 0..G1-w-1
                    arg, val = _min_max(uniq[:m], cj[:, cols], np.searchsorted(js, cols))
                    val = val[gid[: G1 - w]]
                    sub = new[t, w:]
                    cur = sub[:, cols]
                    upd = val < cur
                    if not upd.any():
                        continue
                    sub[:, cols] = np.where(upd, val, cur)
                    for ch, v in ((ch_k, k), (ch_j, js[arg][gid[: G1 - w]]), (ch_s, s)):
                        blk = ch[t, w:]
                        blk[:, cols] = np.where(upd, v, blk[:, cols])
            self._layers.append((dp, ch_k, ch_j, ch_s))
            dp = new
        return dp

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



def _distinct_rows(d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(js, gid, uniq)`` of a ``(budgets, items)`` DP slice: the items finite in some row, each
    budget's distinct-row index (runs of equal consecutive rows share one) and those rows restricted
    to ``js``; None when every entry is ``inf``."""
    js = np.flatnonzero(np.isfinite(d).any(axis=0))
    if js.size == 0:
        return None
    sub = d[:, js]
    change = np.any(sub[1:] != sub[:-1], axis=1)
    gid = np.concatenate(([0], np.cumsum(change)))
    return js, gid, sub[np.concatenate(([0], np.flatnonzero(change) + 1))]



def _min_max(rows: np.ndarray, c: np.ndarray, starts: np.ndarray, blocks: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """``(argmin, min)`` over ``j`` of ``max(rows[r, j], c[j, q])`` for every ``(r, q)``, first ``j`` on
    ties, in ``blocks`` slices of the columns ``q`` (ascending bucket ends): ``starts[q]`` counts the
    ``j`` below column ``q``'s end, past which ``c`` is ``inf`` (``j >= i``), so a slice scans only the
    ``j`` below its last end. A column with no finite candidate gets ``(0, inf)``, as a full scan would."""
    m, nq = rows.shape[0], c.shape[1]
    arg = np.zeros((m, nq), np.intp)
    val = np.full((m, nq), np.inf)
    step = -(-nq // blocks)
    for a in range(0, nq, step):
        b = min(nq, a + step)
        p = int(starts[b - 1])
        if p == 0:
            continue
        cand = np.maximum(rows[:, :p, None], c[None, :p, a:b])
        arg[:, a:b] = cand.argmin(axis=1)
        val[:, a:b] = np.take_along_axis(cand, arg[:, None, a:b], axis=1)[:, 0, :]
    return arg, val


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


def threshold_buckets(costs: BucketCosts, deployed: list[tuple[int, int, float]]) -> list[Bucket]:
    """The buckets of a *deployed* layout on ``costs``'s sample: ``deployed`` lists ``(tp, k instances,
    max_tokens)`` in ascending TP order (``Plan.buckets()``); each request goes to the first bucket whose
    ``max_tokens`` holds its length, as the broker's bucket thresholds route it. Unlike
    :func:`evaluate_buckets`, the split is not re-chosen for the sample: thresholds planned on shorter
    requests send a longer sample to the last bucket. Empty buckets are left out."""
    lengths, out, j = costs.sample.lengths, [], 0
    for tp, k, max_tokens in deployed:
        i = costs.sample.size if math.isinf(max_tokens) else max(j, int(np.searchsorted(lengths, max_tokens, "right")))
        if i > j:
            out.append((tp, k, j, i))
        j = i
    if j < costs.sample.size:  # past the last threshold (not expected: the last bucket takes everything)
        raise PlannerError(f"deployed buckets {deployed} leave requests longer than {lengths[j - 1] if j else 0}")
    return out


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
