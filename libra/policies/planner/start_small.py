"""The GRP rollout model for C-MLFQ's start-small routing (``PlannerConfig.routing = "start_small"``).

Role: score a heterogeneous bucket layout the way C-MLFQ realises it (docs/papers.md §1.4.3): every new
request starts in the *smallest* bucket (smallest TP present) and is migrated at a tool return to the
bucket of its length, where its remaining turns run. So the smallest bucket serves the whole of the
shortest requests *and* the first turn of every other request, and every request that leaves it pays
a migration. ``"by_length"`` (``planner/buckets.py``) instead keeps every request in the bucket of its
length for its whole life.

Model (contracts; sample sorted by total length, ``turns = calls``, ``phi = 1 / turns``):

- *First turn* of a request: ``phi`` of its prompt (prompt + tool payload: the first turn's prefill,
  the payloads spread evenly over the turns) and ``phi`` of its generated tokens, one serving call, no
  tool seconds (the tools run after it); its context is ``phi`` of its total length. The workload
  carries only per-request totals and the turn count, so the turn is the trajectory's mean turn
  (``generated / turns``). A single-turn request (``turns = 1``) *is* its first turn: it never leaves
  the smallest bucket, keeps its tool seconds and pays no migration.
- *Rest* of a multi-turn request: the other ``turns - 1`` calls, ``(1 - phi)`` of its generated tokens,
  all its tool seconds, and a prefill of ``prompt + phi * gen`` tokens: the remaining turns' new
  tokens ``(1 - phi) * prompt`` plus the migration, charged as a **re-prefill** of the context the
  first turn left (``phi * (prompt + gen)``) on the target. Re-prefill is the conservative choice: the
  simulator (and Libra) use it or a KV transfer, whichever is cheaper, and a KV transfer delays the
  one trajectory but stalls no instance. Its context reaches the full length (``max_seq``), and its
  critical path is the whole trajectory's decode and tool seconds (``gen_star`` / ``tool_star`` of
  the trajectory generating the most; the first turn is charged at the target's decode step, as the
  suffix DP below cannot know the smallest bucket's).
- *Head bucket* (smallest TP ``t0``, ``k0`` instances) serving the whole requests ``0..i0-1`` and the
  first turns of ``i0..n-1`` (``0 <= i0 <= n``): :func:`~libra.policies.planner.rollout_dp.agentic_cost`
  of one instance's share (sums over ``min(k0, n)``, every request passes through it); its chain is the
  larger of the chains of its longest-decoding whole request and of its longest first turn.
- *Rest bucket* (TP ``t > t0``, ``k`` instances) serving the rest of requests ``j..i-1``:
  ``agentic_cost`` of the rest parts, shares over ``min(k, multi-turn requests)``.
- A layout is a head bucket plus at most one rest bucket per larger TP, tiling ``i0..n`` in ascending
  TP order; its time is the max over its buckets, its chain the max of their chains. With one TP degree
  (``i0 = n``) the model equals ``"by_length"`` exactly.

:class:`StartSmallTable` finds the best layout for every GPU budget exactly for this model: a suffix DP
over the larger TPs (states: distinct TPs capped at 2 for ``require_heterogeneous``, instance count
for ``max_instances``) combined with every head ``(t0, k0, i0)``; idle GPUs allowed. Checked against
brute force in ``tests/unit/test_planner_start_small.py``. Ties: the first minimum (smaller head TP,
fewer head instances, smaller ``i0``, fewer instances in a rest bucket).

Pipeline shift (``offset``): with a policy lag ``L > 1`` the plan objective is
``max(T_train, max over buckets of max(work, (chain + T_train) / L))``
(``types.pipeline_objective``); :meth:`StartSmallCosts.shifted` returns the same costs with
every bucket cost raised to ``max(cost, (chain + offset) / L)``, so the DP minimises the full objective
for a known ``T_train`` (see ``planner/search.py``).
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import replace

import numpy as np

from libra.policies.cost.rollout import RolloutCostModel
from libra.policies.planner.buckets import next_state
from libra.policies.planner.rollout_dp import RolloutSample, SegmentStats, agentic_cost, resident_prompt, segment_stats
from libra.policies.planner.types import PlannerError, RolloutInstance

__all__ = ["StartSmallCosts", "StartSmallTable", "evaluate_start_small", "start_small_instances"]

Bucket = tuple[int, int, int, int]
"""``(tp, k, j, i)``; the first bucket of a layout is the head: ``j = 0`` and ``i = i0``."""


def _shift(cost: np.ndarray, chain: np.ndarray, offset: float, lag: int) -> np.ndarray:
    """``max(cost, (chain + offset) / lag)`` (the pipeline-shifted cost; ``cost`` unchanged at lag 1)."""
    if lag <= 1 or offset <= 0.0:
        return cost
    return np.maximum(cost, (chain + offset) / lag)


class StartSmallCosts:
    """Head and rest bucket costs of the start-small model (see the module docstring). Cached per
    ``(tp, k)``; :meth:`shifted` shares the caches."""

    def __init__(self, cm: RolloutCostModel, sample: RolloutSample, overlap_steps: int = 1, *,
                 chain_bound: bool = True) -> None:
        if overlap_steps < 1:
            raise PlannerError(f"overlap_steps must be >= 1, got {overlap_steps}")
        self.cm = cm
        self.chain_bound = chain_bound  # False: the throughput objective (agentic_cost)
        self.sample = sample
        self.overlap_steps = overlap_steps
        self.offset = 0.0
        n = sample.size
        ones = np.ones(n)
        p, g, w, lengths = sample.prompt, sample.gen, sample.weight, sample.lengths
        calls = sample.calls if sample.calls is not None else ones
        tool = sample.tool if sample.tool is not None else 0.0 * ones
        phi = 1.0 / calls
        multi = calls > 1
        zero = np.zeros(n)
        # rest parts: remaining turns + the migration's re-prefill of the first turn's context
        self.rest_seg = segment_stats(
            np.where(multi, lengths, zero), np.where(multi, p + phi * g, zero), np.where(multi, (1.0 - phi) * g, zero),
            w * multi, np.where(multi, calls - 1.0, zero), np.where(multi, tool, zero),
            np.where(multi, g, zero), np.where(multi, tool, zero))
        if not sample.residency:
            self.rest_seg = replace(self.rest_seg, gen_prompt=None, gen_sq=None)
        self._flat = np.full((n + 1,) * 2, -1)
        self._flat[self.rest_seg.valid] = np.arange(int(self.rest_seg.valid.sum()))
        # head stats for every i0 = 0..n: whole requests 0..i0-1 + first turns of i0..n-1
        fp, fg, ft, fl = phi * p, phi * g, np.where(multi, zero, tool), phi * lengths
        z = np.zeros(1)

        def pre(x: np.ndarray) -> np.ndarray:
            return np.concatenate([z, np.cumsum(x * w)])

        def suf(x: np.ndarray) -> np.ndarray:
            c = pre(x)
            return c[-1] - c

        Pw, Gw, Ww, Cw, Tw = pre(p), pre(g), pre(ones), pre(calls), pre(tool)
        i0 = np.arange(n + 1)
        whole_max = np.concatenate([z, lengths])  # lengths ascend: the longest whole request is i0 - 1
        first_max = np.concatenate([np.maximum.accumulate(fl[::-1])[::-1], z])
        # stars: the whole request generating the most in 0..i0-1, the first turn generating the most in i0..n-1
        a_idx = np.full(n + 1, -1)
        b_idx = np.full(n + 1, -1)
        for k in range(n):
            prev = a_idx[k]
            a_idx[k + 1] = k if prev < 0 or g[k] >= g[prev] else prev
        for k in range(n - 1, -1, -1):
            nxt = b_idx[k + 1]
            b_idx[k] = k if nxt < 0 or fg[k] > fg[nxt] else nxt
        a_gen = np.where(a_idx >= 0, g[np.maximum(a_idx, 0)], 0.0)
        a_tool = np.where(a_idx >= 0, tool[np.maximum(a_idx, 0)], 0.0)
        b_gen = np.where(b_idx >= 0, fg[np.maximum(b_idx, 0)], 0.0)
        b_tool = np.where(b_idx >= 0, ft[np.maximum(b_idx, 0)], 0.0)
        sums = dict(prompt=Pw + suf(fp), gen=Gw + suf(fg), n=Ww + suf(ones), calls=Cw + suf(ones),
                    tool=Tw + suf(ft), max_seq=np.maximum(whole_max, first_max),
                    gen_prompt=pre(g * resident_prompt(p, calls)) + suf(fg * fp) if sample.residency else None,
                    gen_sq=pre(g * g) + suf(fg * fg) if sample.residency else None)
        dummy = np.ones(n + 1, bool)
        self._head_a = SegmentStats(dummy, i0, i0, gen_star=a_gen, tool_star=a_tool, **sums)
        self._head_b = SegmentStats(dummy, i0, i0, gen_star=b_gen, tool_star=b_tool, **sums)
        self.total = float(sums["n"][0])
        self._head: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._rest: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._shifted: dict[tuple[str, int, int], np.ndarray] = {}

    def shifted(self, offset: float) -> StartSmallCosts:
        """The same costs with the pipeline shift ``offset`` (``T_train``; module docstring)."""
        out = copy.copy(self)
        out.offset = float(offset)
        out._shifted = {}
        return out

    def _head_both(self, tp: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        out = self._head.get((tp, k))
        if out is None:
            share = np.minimum(float(k), self._head_a.n)
            ca, ha = agentic_cost(self.cm, tp, self._head_a, share, self.overlap_steps, chain_bound=self.chain_bound)
            cb, hb = agentic_cost(self.cm, tp, self._head_b, share, self.overlap_steps, chain_bound=self.chain_bound)
            out = self._head[(tp, k)] = (np.maximum(ca, cb), np.maximum(ha, hb))
        return out

    def _rest_both(self, tp: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        out = self._rest.get((tp, k))
        if out is None:
            seg = self.rest_seg
            cost, chain = agentic_cost(self.cm, tp, seg, np.minimum(float(k), seg.n), self.overlap_steps,
                                       chain_bound=self.chain_bound)
            out = self._rest[(tp, k)] = (cost, chain)
        return out

    def head(self, tp: int, k: int) -> np.ndarray:
        """``head(tp, k)[i0]``: seconds of the busiest of ``k`` TP-``tp`` head instances serving the whole
        requests ``0..i0-1`` and the first turns of the rest (shifted by :attr:`offset`)."""
        cost, chain = self._head_both(tp, k)
        if self.offset <= 0.0 or self.overlap_steps <= 1:
            return cost
        key = ("h", tp, k)
        if key not in self._shifted:
            self._shifted[key] = _shift(cost, chain, self.offset, self.overlap_steps)
        return self._shifted[key]

    def rest(self, tp: int, k: int) -> np.ndarray:
        """``rest(tp, k)[j, i]``: seconds of the busiest of ``k`` TP-``tp`` instances serving the rest of
        requests ``j..i-1`` (``inf`` for ``j >= i``; shifted by :attr:`offset`)."""
        key = ("r", tp, k)
        out = self._shifted.get(key)
        if out is None:
            cost, chain = self._rest_both(tp, k)
            out = np.full((self.sample.size + 1,) * 2, np.inf)
            out[self.rest_seg.valid] = _shift(cost, chain, self.offset, self.overlap_steps)
            self._shifted[key] = out
        return out

    def bucket(self, b: Bucket, head: bool) -> tuple[float, float]:
        """``(unshifted cost, chain)`` of one bucket of a layout."""
        tp, k, j, i = b
        if head:
            cost, chain = self._head_both(tp, k)
            return float(cost[i]), float(chain[i])
        cost, chain = self._rest_both(tp, k)
        f = self._flat[j, i]
        return float(cost[f]), float(chain[f])

    def layout(self, buckets: list[Bucket]) -> tuple[float, float]:
        """``(time, chain)`` of a layout (unshifted; the first bucket is the head); ``(inf, 0)`` for none."""
        if not buckets:
            return math.inf, 0.0
        vals = [self.bucket(b, a == 0) for a, b in enumerate(buckets)]
        return max(v[0] for v in vals), max(v[1] for v in vals)


class StartSmallTable:
    """The exact best start-small layout for every GPU budget ``0..budget`` (module docstring).

    ``time(g)``: the optimal (shifted, if the costs are) makespan with at most ``g`` GPUs (``inf`` if
    infeasible); ``buckets(g)``: its buckets, head first, then the rest buckets in length order.
    """

    def __init__(self, costs: StartSmallCosts, tps: tuple[int, ...], budget: int, *,
                 require_heterogeneous: bool = False, max_instances: int | None = None) -> None:
        if budget < 0:
            raise PlannerError(f"rollout budget must be >= 0, got {budget}")
        self.costs = costs
        self.tps = tuple(sorted(set(tps)))
        self.budget = budget
        self.het = require_heterogeneous
        self.cap = max_instances
        n = self.n = costs.sample.size
        self.n_h = 3 if self.het else 1
        self.n_c = (self.cap + 1) if self.cap is not None else 1
        S, G1, n1 = self.n_h * self.n_c, budget + 1, n + 1
        m = len(self.tps)
        # suffix DP: R[a][s, g, j] = best over rest buckets of TPs tps[a:] serving the rest of j..n-1
        R = np.full((S, G1, n1), np.inf)
        R[0, :, n] = 0.0
        self._R: list[np.ndarray] = [R] * (m + 1)
        self._ch: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = [None] * (m + 1)
        for a in range(m - 1, 0, -1):
            tp, nxt = self.tps[a], self._R[a + 1]
            new = nxt.copy()
            ch_k = np.zeros((S, G1, n1), np.int32)
            ch_i = np.zeros((S, G1, n1), np.int32)
            ch_s = np.zeros((S, G1, n1), np.int32)
            for k in range(1, budget // tp + 1):
                if self.cap is not None and k > self.cap:
                    break
                w, c = k * tp, costs.rest(tp, k)
                for s in range(S):
                    t = self._next(s, k)
                    if t < 0:
                        continue
                    prev = nxt[s, : G1 - w]  # (G1 - w, n1) over i
                    if not np.isfinite(prev).any():
                        continue
                    cand = np.maximum(prev[:, None, :], c[None, :, :])  # (g, j, i)
                    arg = cand.argmin(axis=2)
                    val = np.take_along_axis(cand, arg[:, :, None], axis=2)[:, :, 0]
                    tgt = new[t, w:]
                    upd = val < tgt
                    if upd.any():
                        tgt[upd] = val[upd]
                        ch_k[t, w:][upd] = k
                        ch_i[t, w:][upd] = arg[upd]
                        ch_s[t, w:][upd] = s
            self._R[a] = new
            self._ch[a] = (ch_k, ch_i, ch_s)
        # the head: smallest TP tps[a], k0 instances, whole requests 0..i0-1
        best = np.full(G1, np.inf)
        self._pick: list[tuple[int, int, int, int] | None] = [None] * G1  # (a, k0, i0, suffix state)
        for a, tp in enumerate(self.tps):
            nxt = self._R[a + 1]
            for k in range(1, budget // tp + 1):
                if self.cap is not None and k > self.cap:
                    break
                w, h = k * tp, costs.head(tp, k)
                for s in range(S):
                    t = self._next(s, k)
                    if t < 0 or (self.het and t // self.n_c < 2):
                        continue
                    cand = np.maximum(nxt[s, : G1 - w], h[None, :])  # (g, i0)
                    arg = cand.argmin(axis=1)
                    val = cand[np.arange(G1 - w), arg]
                    for g in np.flatnonzero(val < best[w:]):
                        best[w + g] = val[g]
                        self._pick[w + g] = (a, k, int(arg[g]), s)
        self._best = best

    def _next(self, s: int, k: int) -> int:
        return next_state(s, k, self.n_c, self.het, self.cap)

    def _check(self, g: int) -> None:
        if not 0 <= g <= self.budget:
            raise PlannerError(f"budget {g} outside the solved range 0..{self.budget}")

    def time(self, g: int) -> float:
        """Optimal makespan with at most ``g`` GPUs (``inf`` if no layout is feasible)."""
        self._check(g)
        return float(self._best[g])

    def buckets(self, g: int) -> list[Bucket]:
        """Back-track the optimal layout for ``g`` GPUs: the head ``(t0, k0, 0, i0)``, then the rest
        buckets ``(tp, k, j, i)`` in length order (empty if infeasible)."""
        self._check(g)
        pick = self._pick[g]
        if pick is None or not math.isfinite(self._best[g]):
            return []
        a, k0, j, s = pick
        t0 = self.tps[a]
        out: list[Bucket] = [(t0, k0, 0, j)]
        g -= k0 * t0
        for b in range(a + 1, len(self.tps)):
            ch = self._ch[b]
            assert ch is not None
            k = int(ch[0][s, g, j])
            if k == 0:
                continue
            i = int(ch[1][s, g, j])
            out.append((self.tps[b], k, j, i))
            s, g, j = int(ch[2][s, g, j]), g - k * self.tps[b], i
        if j != self.n:  # pragma: no cover - a finite value always tiles the sample
            raise RuntimeError("start-small DP back-tracking did not reach the last request")
        return out


def evaluate_start_small(costs: StartSmallCosts, tps: tuple[int, ...]) -> tuple[float, list[Bucket]]:
    """Best (shifted, if the costs are) makespan of the fixed TP multiset ``tps``: the smallest TP's
    instances are the head, every larger TP one rest bucket (which may serve nothing: its GPUs are
    still held). Returns ``(time, buckets)``, head first, rest buckets that serve something
    (``inf`` and ``[]`` if infeasible or ``tps`` is empty)."""
    if not tps:
        return math.inf, []
    counts = Counter(tps)
    kinds = sorted(counts)
    n1 = costs.sample.size + 1
    R = np.full(n1, np.inf)
    R[-1] = 0.0
    choices: list[tuple[int, int, np.ndarray]] = []
    for tp in reversed(kinds[1:]):
        k = counts[tp]
        cand = np.maximum(costs.rest(tp, k), R[None, :])  # (j, i)
        arg = cand.argmin(axis=1)
        val = cand[np.arange(n1), arg]
        stay = R <= val
        choices.append((tp, k, np.where(stay, np.arange(n1), arg)))
        R = np.where(stay, R, val)
    t0, k0 = kinds[0], counts[kinds[0]]
    cand = np.maximum(costs.head(t0, k0), R)
    i0 = int(np.argmin(cand))
    value = float(cand[i0])
    if not math.isfinite(value):
        return math.inf, []
    out: list[Bucket] = [(t0, k0, 0, i0)]
    j = i0
    for tp, k, by_j in reversed(choices):
        i = int(by_j[j])
        if i > j:
            out.append((tp, k, j, i))
        j = i
    return value, out


def start_small_instances(costs: StartSmallCosts, buckets: list[Bucket]) -> tuple[RolloutInstance, ...]:
    """One :class:`RolloutInstance` per instance: the whole requests' length range of its bucket (the
    head's is ``0..0`` when it keeps none whole), its share of the (weighted) requests it serves at
    least one turn of (the head: all of them) and its bucket's unshifted time."""
    lengths = costs.sample.lengths
    W = np.concatenate([np.zeros(1), np.cumsum(costs.sample.weight)])
    out = []
    for a, (tp, k, j, i) in enumerate(buckets):
        c = costs.bucket((tp, k, j, i), a == 0)[0]
        lo, hi = (float(lengths[j]), float(lengths[i - 1])) if i > j else (0.0, 0.0)
        served = costs.total if a == 0 else float(W[i] - W[j])
        out.extend(RolloutInstance(tp, lo, hi, served / k, c) for _ in range(k))
    return tuple(out)
