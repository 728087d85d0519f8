"""The GRP rollout dynamic program: heterogeneous TP instances over length-sorted requests.

Role: given a rollout GPU budget, choose a multiset of instance TP degrees and a contiguous split of
the length-sorted requests among them that minimises the makespan (docs/papers.md §1.3.2):

    dp[g][i] = min( dp[g - 1][i],                                               (an idle GPU)
                    min over tp <= g, j < i:  max(dp[g - tp][j], Cost(tp, j..i)) )  (an instance)

Contracts:

- :class:`RolloutSample` sorts the requests by total length and keeps at most ``max_requests`` of them
  at evenly spaced quantiles, each standing for ``batch / k`` requests; segment sums come from prefix
  sums, so ``Cost`` is O(1) (and whole cost matrices are built at once with numpy). A multi-turn
  request (``Workload.turns``) pays the cost model's per-request serving overhead once per turn;
  ``Cost`` is :func:`agentic_cost`: the instance's work, bounded below by the serial critical path
  of its longest-decoding trajectory (turn overheads and prefills, decode, tool seconds).
- :class:`RolloutTable` runs the DP for every budget ``0..G`` in one pass: the table for budget ``G``
  answers every smaller budget too (the planner's per-budget memo). The inner ``min over j`` is one
  vectorised numpy reduction per ``(g, tp)``.
- Optional constraints carried in the DP state: ``require_heterogeneous`` (a bitmask of the TP
  degrees of the non-idle instances; a final state needs >= 2 bits) and ``max_instances`` (a count of
  non-idle instances). The idle transition leaves one GPU unused (the reference's "idle instance"
  of TP ``t`` is ``t`` idle GPUs); idle GPUs add neither a bit nor a count.
- Ties are broken deterministically (first minimum in ``tps`` order, then the smallest ``j``); an
  instance wins a tie against leaving a GPU idle.
- :func:`evaluate_layout` scores a fixed TP multiset on a sample (used to re-evaluate a deployed plan).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from libra.policies.cost.rollout import RolloutCostModel
from libra.policies.planner.chain import drained_time, solo_chain
from libra.policies.planner.types import PlannerError, RolloutInstance, Workload

__all__ = ["RolloutSample", "RolloutTable", "SegmentStats", "agentic_cost", "cost_matrices", "evaluate_layout",
           "resident_prompt", "segment_stats", "to_instances"]


@dataclass(frozen=True, slots=True)
class RolloutSample:
    """Length-sorted requests (possibly down-sampled) with per-item weights and prefix sums."""

    lengths: np.ndarray
    prompt: np.ndarray
    gen: np.ndarray
    weight: np.ndarray
    calls: np.ndarray | None = None  # serving calls per item (multi-turn requests); None = 1 each
    tool: np.ndarray | None = None  # tool seconds per item (agentic trajectories); None = 0 each
    residency: bool = True  # segments carry residency sums (False: batches sized by the mean request)

    @classmethod
    def from_workload(cls, workload: Workload, batch: int | None = None, max_requests: int = 64, *,
                      residency: bool = True) -> RolloutSample:
        """Sort ``workload`` by total length and keep <= ``max_requests`` items at evenly spaced
        quantiles (always the shortest and the longest); weights scale the sample to ``batch``
        requests (default: the workload's size). ``residency``: see :meth:`segments`."""
        if max_requests < 1:
            raise PlannerError(f"max_requests must be >= 1, got {max_requests}")
        order = np.argsort(workload.totals, kind="stable")
        prompt, gen = workload.prompt_tokens[order], workload.gen_tokens[order]
        calls = workload.turns[order] if workload.turns is not None else None
        tool = workload.tool_seconds[order] if workload.tool_seconds is not None else None
        n = prompt.size
        if n > max_requests:
            idx = np.unique(np.round(np.linspace(0, n - 1, max_requests)).astype(int))
            prompt, gen = prompt[idx], gen[idx]
            calls = calls[idx] if calls is not None else None
            tool = tool[idx] if tool is not None else None
        total = float(batch if batch is not None else n)
        weight = np.full(prompt.size, total / prompt.size)
        return cls(prompt + gen, prompt, gen, weight, calls, tool, residency)

    @property
    def size(self) -> int:
        """Number of items in the sample."""
        return int(self.lengths.size)

    def segments(self) -> SegmentStats:
        """Every contiguous segment ``j..i-1`` of the sample, flattened (see :class:`SegmentStats`);
        without the residency sums when ``residency`` is False."""
        ones = np.ones(self.size)
        seg = segment_stats(self.lengths, self.prompt, self.gen, self.weight,
                            self.calls if self.calls is not None else ones,
                            self.tool if self.tool is not None else 0.0 * ones)
        return seg if self.residency else replace(seg, gen_prompt=None, gen_sq=None)

    def prefix(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Prefix sums ``(weighted prompt, weighted gen, weight)``, each of length ``size + 1``."""
        z = np.zeros(1)
        return (
            np.concatenate([z, np.cumsum(self.prompt * self.weight)]),
            np.concatenate([z, np.cumsum(self.gen * self.weight)]),
            np.concatenate([z, np.cumsum(self.weight)]),
        )


def resident_prompt(prompt: np.ndarray, calls: np.ndarray) -> np.ndarray:
    """Mean prefilled context of a request while it generates: its ``prompt`` (prompt + tool payload)
    arrives in ``calls`` equal parts, one before each turn, and it generates evenly across the turns,
    so turn ``k`` holds ``k / calls`` of it: ``prompt * (1 + 1 / calls) / 2`` (the whole prompt for a
    single-turn request). The same arrival model as the start-small planner (``start_small``)."""
    return prompt * (1.0 + 1.0 / np.maximum(calls, 1.0)) / 2.0


def segment_stats(lengths: np.ndarray, prompt: np.ndarray, gen: np.ndarray, weight: np.ndarray,
                  calls: np.ndarray, tool: np.ndarray, star_gen: np.ndarray | None = None,
                  star_tool: np.ndarray | None = None) -> SegmentStats:
    """Every contiguous segment ``j..i-1`` (``j < i``) of per-item arrays, flattened.

    Sums (``prompt``, ``gen``, request ``weight``, ``calls``, ``tool``, and the residency sums
    ``gen * resident_prompt(prompt, calls)`` and ``gen * gen``) are weighted by ``weight`` and taken from prefix sums; ``max_seq`` is the largest ``lengths`` entry of the segment (the last one
    when ``lengths`` ascends, as in a :class:`RolloutSample`); the segment's *star* is its item with
    the largest ``star_gen`` (default ``gen``; ties: the last), and ``gen_star`` / ``tool_star`` are
    that item's ``star_gen`` / ``star_tool`` (default ``tool``). The start-small model
    (``planner/start_small.py``) passes a trajectory's remaining turns as the summed arrays and its
    whole generation as ``star_gen``."""
    n = int(lengths.size)
    star_gen = gen if star_gen is None else star_gen
    star_tool = tool if star_tool is None else star_tool
    z = np.zeros(1)
    P = np.concatenate([z, np.cumsum(prompt * weight)])
    G = np.concatenate([z, np.cumsum(gen * weight)])
    W = np.concatenate([z, np.cumsum(weight)])
    C = np.concatenate([z, np.cumsum(calls * weight)])
    T = np.concatenate([z, np.cumsum(tool * weight)])
    GP = np.concatenate([z, np.cumsum(gen * resident_prompt(prompt, calls) * weight)])
    GG = np.concatenate([z, np.cumsum(gen * gen * weight)])
    j, i = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    valid = j < i
    jj, ii = j[valid], i[valid]
    star = np.zeros((n + 1, n + 1), dtype=int)
    top = np.zeros((n + 1, n + 1))
    for a in range(n):
        g = star_gen[a:]
        run = np.maximum.accumulate(g)
        last = np.maximum.accumulate(np.where(g >= run, np.arange(g.size), 0))
        star[a, a + 1:] = a + last
        top[a, a + 1:] = np.maximum.accumulate(lengths[a:])
    s = star[valid]
    return SegmentStats(valid, jj, ii, P[ii] - P[jj], G[ii] - G[jj], W[ii] - W[jj], C[ii] - C[jj],
                        T[ii] - T[jj], top[valid], star_gen[s], star_tool[s], GP[ii] - GP[jj], GG[ii] - GG[jj])


@dataclass(frozen=True, slots=True)
class SegmentStats:
    """Flattened sums of every segment ``j..i-1`` of a :class:`RolloutSample` (``valid`` masks the
    ``(n + 1, n + 1)`` matrix, ``jj``/``ii`` index it): weighted prompt, generated, request, call and
    tool-second sums, the longest total length, the generated tokens and tool seconds of the
    segment's item that generates the most (``gen_star``, ``tool_star``), and the residency sums
    ``gen_prompt = sum(w * gen * resident_prompt)`` and ``gen_sq = sum(w * gen^2)`` (``None``: unknown;
    the running batch is then sized by the mean request, see :func:`agentic_cost`)."""

    valid: np.ndarray
    jj: np.ndarray
    ii: np.ndarray
    prompt: np.ndarray
    gen: np.ndarray
    n: np.ndarray
    calls: np.ndarray
    tool: np.ndarray
    max_seq: np.ndarray
    gen_star: np.ndarray
    tool_star: np.ndarray
    gen_prompt: np.ndarray | None = None
    gen_sq: np.ndarray | None = None


def agentic_cost(cm: RolloutCostModel, tp: int, seg: SegmentStats, share: Any = None,
                 overlap_steps: int = 1, share_tail: bool = False,
                 chain_bound: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(cost, chain)`` of one TP-``tp`` instance serving ``1/share`` of each segment (``share``
    None: the whole segment), vectorised over the segments.

    Terms (per instance; sums are the instance's share, ``L = overlap_steps``):

    - resident context: a request holds KV only while it decodes, one token per step, so a request
      that generates ``g`` tokens is resident ``g`` steps, holding on average ``c = resident_prompt +
      g / 2`` tokens (:func:`resident_prompt`: payloads arrive turn by turn). The KV the instance reads
      over the segment is ``sum(g * c)`` token-steps, so the running batch's mean context ``ctx`` is
      the *generation-weighted* mean ``sum(g * c) / sum(g)``, and the batch ``b0`` the cost model's
      steady batch for the matching reserve (``RolloutCostModel.resident_context``), not the
      per-request mean ``avg_prompt + avg_gen / 2``: long requests stay resident longer (the
      inspection paradox). Without residency sums (``seg.gen_prompt`` None) the per-request mean;
    - ``stall = calls * per_request_overhead + prefill(prompt, n)``: serial work that stalls every
      running sequence of the instance (the simulator charges each turn the same way);
    - occupancy: a trajectory holds a batch slot only while it generates; while it waits on a tool the
      slot is free. Its time in tools is ``f = tool / (tool + gen * step(b0))`` of its active life
      (``b0``: the cost model's steady batch, ``step(b0)`` its decode step), so the running batch is
      ``b = max(1, b0 * (1 - f))`` and the decode step is re-evaluated at ``b``;
    - ``work = stall + gen / b * step(b)``: the instance's busy time;
    - ``chain = L * stall + gen_star * step(b) + tool_star``: the serial critical path of the segment's
      longest-decoding trajectory. It decodes one token per step, waits for its tools, and is
      interrupted by the instance's serial work; with a policy lag ``L`` it lives about ``L`` steps'
      periods, so it sees about ``L`` steps' stalls. A lower bound of the longest chain (the item
      with the most generated tokens, not the max over items). ``share_tail=True`` (the reference
      instance-level DP) decodes ``max_seq * gen / total`` tokens on the chain instead of
      ``gen_star``, as ``segment_cost`` without ``max_gen`` does;
    - ``cost = max(work, chain / L)`` (``inf`` if the longest request does not fit; 0 for no request).
      With no tool seconds this equals ``segment_cost``'s ``stall + max(gen / b0, gen_star / L) *
      step(b0)`` given the same residency sums. ``chain_bound=False`` (the throughput objective,
      ``PlannerConfig.objective``): ``cost = drained_time(work, chain / L, solo_chain / L)``, the busy
      time or, when the longest trajectory outlasts it, that trajectory's drained tail at batch 1.
    """
    share = 1.0 if share is None else share
    share = np.maximum(np.asarray(share, dtype=float), 1e-12)
    p, g, n = seg.prompt / share, seg.gen / share, seg.n / share
    calls, tool = seg.calls / share, seg.tool / share
    safe_n = np.maximum(n, 1e-12)
    avg_p, avg_g = p / safe_n, g / safe_n
    ctx, reserve = cm.resident_context(avg_p, avg_g, seg.gen, seg.gen_prompt, seg.gen_sq)
    ctx = np.asarray(ctx, dtype=float)
    b0 = np.asarray(cm.batch_for_reserve(tp, n, reserve), dtype=float)
    step0 = np.asarray(cm.decode_step(tp, b0, b0 * ctx), dtype=float)
    if np.any(tool > 0):
        f = tool / np.maximum(tool + g * step0, 1e-12)
        b = np.maximum(b0 * (1.0 - f), 1.0)
        step = np.asarray(cm.decode_step(tp, b, b * ctx), dtype=float)
    else:
        b, step = b0, step0
    stall = calls * float(cm.cal.per_request_overhead_s) + np.asarray(cm.prefill_time(tp, p, n), dtype=float)
    chain = overlap_steps * stall + (seg.max_seq * seg.gen / np.maximum(seg.prompt + seg.gen, 1e-12)
                                     if share_tail else seg.gen_star) * step + seg.tool_star
    work = stall + g / b * step
    if chain_bound:
        cost = np.maximum(work, chain / overlap_steps)
    else:  # the throughput objective: the busy time, never below the longest trajectory's drained tail
        cost = drained_time(work, chain / overlap_steps, solo_chain(cm, tp, seg, p, n) / overlap_steps)
    zero = n <= 0
    if zero.any():
        cost[zero] = 0.0
        chain[zero] = 0.0
    oom = seg.max_seq > cm.token_capacity(tp)
    cost[oom] = np.inf
    chain[oom] = np.inf
    return cost, chain


def cost_matrices(cm: RolloutCostModel, sample: RolloutSample, tps: tuple[int, ...], overlap_steps: int = 1,
                  chains: dict[int, np.ndarray] | None = None, chain_bound: bool = True) -> dict[int, np.ndarray]:
    """``C[tp][j, i]`` = seconds for one TP-``tp`` instance to serve sorted items ``j..i-1``
    (:func:`agentic_cost` with the whole segment on the instance).

    Entries with ``j >= i`` are ``inf`` (an empty instance is the DP's idle transition); a segment
    whose longest request does not fit the instance is ``inf``. If ``chains`` is given it receives
    the matching critical-path matrices (``chain`` of :func:`agentic_cost`).
    """
    seg = sample.segments()
    n = sample.size
    out: dict[int, np.ndarray] = {}
    for tp in tps:
        cost, chain = agentic_cost(cm, tp, seg, None, overlap_steps, share_tail=True, chain_bound=chain_bound)
        c = np.full((n + 1, n + 1), np.inf)
        c[seg.valid] = cost
        out[tp] = c
        if chains is not None:
            h = np.full((n + 1, n + 1), np.inf)
            h[seg.valid] = chain
            chains[tp] = h
    return out


class RolloutTable:
    """The rollout DP solved for every GPU budget ``0..budget`` (see the module docstring).

    ``time(g)`` is the optimal makespan with ``g`` GPUs (``inf`` if infeasible); ``instances(g)``
    back-tracks the optimal instances as ``(tp, j, i)`` triples in length order.
    """

    def __init__(
        self,
        costs: dict[int, np.ndarray],
        budget: int,
        *,
        require_heterogeneous: bool = False,
        max_instances: int | None = None,
    ) -> None:
        if budget < 0:
            raise PlannerError(f"rollout budget must be >= 0, got {budget}")
        self.tps = tuple(sorted(costs))
        self.costs = costs
        self.budget = budget
        self.n = next(iter(costs.values())).shape[0] - 1
        self.het = require_heterogeneous
        self.cap = max_instances
        n_masks = 1 << len(self.tps) if self.het else 1
        n_counts = (self.cap + 1) if self.cap is not None else 1
        self.n_counts = n_counts
        self.n_states = n_masks * n_counts
        self._trans = [self._transitions(k, n_masks, n_counts) for k in range(len(self.tps))]
        mask_of = np.arange(self.n_states) // n_counts
        popcount = np.array([int(m).bit_count() for m in mask_of])
        self._final = np.flatnonzero(popcount >= 2) if self.het else np.arange(self.n_states)
        self._dp: list[np.ndarray] = []
        self._kind: list[np.ndarray] = []
        self._ch_t: list[np.ndarray] = []
        self._ch_j: list[np.ndarray] = []
        self._ch_s: list[np.ndarray] = []
        self._solve()

    def _transitions(self, k: int, n_masks: int, n_counts: int) -> np.ndarray:
        out = np.full(self.n_states, -1)
        for s in range(self.n_states):
            mask, count = divmod(s, n_counts)
            new_mask = (mask | (1 << k)) if self.het else 0
            new_count = count + 1 if self.cap is not None else 0
            if self.cap is not None and new_count > self.cap:
                continue
            out[s] = new_mask * n_counts + new_count
        return out

    def _solve(self) -> None:
        S, n1 = self.n_states, self.n + 1
        cols = np.arange(n1)
        dp0 = np.full((S, n1), np.inf)
        dp0[0, 0] = 0.0
        self._append(
            dp0,
            np.zeros((S, n1), np.int8),
            np.zeros((S, n1), np.int8),
            np.zeros((S, n1), np.int32),
            np.zeros((S, n1), np.int32),
        )
        for g in range(1, self.budget + 1):
            best = np.full((S, n1), np.inf)
            kind = np.zeros((S, n1), np.int8)
            ch_t = np.zeros((S, n1), np.int8)
            ch_j = np.zeros((S, n1), np.int32)
            ch_s = np.zeros((S, n1), np.int32)
            for k, tp in enumerate(self.tps):
                if tp > g:
                    continue
                prev = self._dp[g - tp]
                if S == 1:  # the common case: one state, plain 2-D reductions
                    cand2 = np.maximum(prev[0][:, None], self.costs[tp])
                    arg1 = cand2.argmin(axis=0)
                    val1 = cand2[arg1, cols]
                    upd = val1 < best[0]
                    if upd.any():
                        best[0, upd] = val1[upd]
                        kind[0, upd], ch_t[0, upd], ch_j[0, upd] = 2, k, arg1[upd]
                    continue
                cand = np.maximum(prev[:, :, None], self.costs[tp][None, :, :])
                arg = cand.argmin(axis=1)
                val = np.take_along_axis(cand, arg[:, None, :], axis=1)[:, 0, :]
                trans = self._trans[k]
                for s in range(S):
                    t_state = trans[s]
                    if t_state < 0:
                        continue
                    upd = val[s] < best[t_state]
                    if not upd.any():
                        continue
                    best[t_state, upd] = val[s, upd]
                    kind[t_state, upd], ch_t[t_state, upd] = 2, k
                    ch_j[t_state, upd] = arg[s, upd]
                    ch_s[t_state, upd] = s
            # An idle GPU last: on a tie the DP deploys the GPU instead of leaving it unused.
            prev = self._dp[g - 1]
            better = prev < best  # state and position unchanged
            if better.any():
                best = np.where(better, prev, best)
                kind[better] = 1
                ch_s[better] = np.broadcast_to(np.arange(S)[:, None], (S, n1))[better]
                ch_j[better] = np.broadcast_to(cols, (S, n1))[better]
            self._append(best, kind, ch_t, ch_j, ch_s)

    def _append(self, dp: np.ndarray, kind: np.ndarray, ch_t: np.ndarray, ch_j: np.ndarray, ch_s: np.ndarray) -> None:
        self._dp.append(dp)
        self._kind.append(kind)
        self._ch_t.append(ch_t)
        self._ch_j.append(ch_j)
        self._ch_s.append(ch_s)

    def _final_state(self, g: int) -> tuple[int, float]:
        col = self._dp[g][self._final, self.n]
        idx = int(np.argmin(col))
        return int(self._final[idx]), float(col[idx])

    def time(self, g: int) -> float:
        """Optimal makespan with ``g`` GPUs (``inf`` if no layout is feasible)."""
        if not 0 <= g <= self.budget:
            raise PlannerError(f"budget {g} outside the solved range 0..{self.budget}")
        return self._final_state(g)[1]

    def instances(self, g: int) -> list[tuple[int, int, int]]:
        """Back-track the optimal layout for ``g`` GPUs: ``(tp, j, i)`` per non-idle instance,
        ordered by the requests it serves. Empty if infeasible."""
        s, value = self._final_state(g)
        if not math.isfinite(value):
            return []
        out: list[tuple[int, int, int]] = []
        i = self.n
        while g > 0:
            kind = int(self._kind[g][s, i])
            tp = self.tps[int(self._ch_t[g][s, i])]
            if kind == 1:
                g -= 1
            elif kind == 2:
                j = int(self._ch_j[g][s, i])
                out.append((tp, j, i))
                s, i, g = int(self._ch_s[g][s, i]), j, g - tp
            else:  # pragma: no cover - finite values always carry a choice
                raise RuntimeError("rollout DP back-tracking reached an unset state")
        return out[::-1]


def evaluate_layout(costs: dict[int, np.ndarray], tps: tuple[int, ...]) -> tuple[float, list[tuple[int, int, int]]]:
    """Best makespan of the fixed TP multiset ``tps`` on the sample behind ``costs``.

    Every instance serves a contiguous (possibly empty) run of the sorted requests, in any order of
    the instances: a DP over sub-multisets. Returns ``(time, [(tp, j, i), ...])`` for the non-empty
    instances (``inf`` and ``[]`` if infeasible). Raises :class:`PlannerError` if a TP in ``tps``
    has no cost matrix.
    """
    if not tps:
        return math.inf, []
    kinds = sorted(set(tps))
    missing = [t for t in kinds if t not in costs]
    if missing:
        raise PlannerError(f"no rollout cost matrix for TP {missing} (have {sorted(costs)})")
    counts = [tps.count(t) for t in kinds]
    n1 = next(iter(costs.values())).shape[0]
    start = np.full(n1, np.inf)
    start[0] = 0.0
    dp: dict[tuple[int, ...], np.ndarray] = {tuple([0] * len(kinds)): start}
    choice: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
    for vec in itertools.product(*(range(c + 1) for c in counts)):
        if not any(vec):
            continue
        best = np.full(n1, np.inf)
        by_k = np.zeros(n1, np.int32)
        by_j = np.arange(n1)
        for k, t in enumerate(kinds):
            if vec[k] == 0:
                continue
            prev = dp[tuple(v - (1 if idx == k else 0) for idx, v in enumerate(vec))]
            cand = np.maximum(prev[:, None], costs[t])
            arg = cand.argmin(axis=0)
            val = np.minimum(cand[arg, np.arange(n1)], prev)
            arg = np.where(prev <= cand[arg, np.arange(n1)], np.arange(n1), arg)
            upd = val < best
            best = np.where(upd, val, best)
            by_k = np.where(upd, k, by_k)
            by_j = np.where(upd, arg, by_j)
        dp[vec] = best
        choice[vec] = (by_k, by_j)
    full = tuple(counts)
    value = float(dp[full][n1 - 1])
    if not math.isfinite(value):
        return math.inf, []
    out: list[tuple[int, int, int]] = []
    vec, i = full, n1 - 1
    while any(vec):
        by_k, by_j = choice[vec]
        k, j = int(by_k[i]), int(by_j[i])
        if j < i:
            out.append((kinds[k], j, i))
        vec = tuple(v - (1 if idx == k else 0) for idx, v in enumerate(vec))
        i = j
    return value, out[::-1]


def to_instances(
    sample: RolloutSample, costs: dict[int, np.ndarray], segments: list[tuple[int, int, int]]
) -> tuple[RolloutInstance, ...]:
    """Turn DP segments into :class:`RolloutInstance` records (length range, weighted count, time)."""
    _, _, W = sample.prefix()
    return tuple(
        RolloutInstance(
            tp=tp,
            min_tokens=float(sample.lengths[j]),
            max_tokens=float(sample.lengths[i - 1]),
            n_requests=float(W[i] - W[j]),
            time=float(costs[tp][j, i]),
        )
        for tp, j, i in segments
    )
