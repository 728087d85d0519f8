"""Reference (pre-optimisation) ARL-Tangram scheduler, kept verbatim for equivalence tests and benchmarks.

:class:`ReferenceElasticScheduler` is the ``tangram`` policy exactly as first implemented (issue #5): it
recomputes the unit split and rebuilds the completion-time heap from scratch for every eviction trial.
:class:`libra.policies.actions.tangram.ElasticScheduler` must make the same decisions (same grants, same
units, same order) on every input; ``tests/unit/test_actions_tangram_equiv.py`` checks that on randomised
instances and ``python -m libra.bench.actions_sched`` times both. Not registered as a policy; do not use it
in production code. Pure: no I/O, clocks or threads.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from itertools import chain

from libra.policies.actions.model import ActionSpec, Grant
from libra.policies.actions.views import RunningView, release_list, scan_order

__all__ = ["ReferenceElasticScheduler"]

_INF = math.inf


def _split_greedy(specs: Sequence[ActionSpec], leftover: int) -> tuple[list[int], float]:
    """Exact split for convex curves: the ``leftover`` largest marginal gains (ties to the earliest action)."""
    return _ConvexSplit(specs).solve(leftover)


def split_units_dp(specs: Sequence[ActionSpec], leftover: int, dp_top: int = 32) -> tuple[list[int], float]:
    """DP over unit counts: extra units per action (beyond its minimum) minimising ``Σ duration``, using at most
    ``leftover`` units in total. Handles any profile and ``sizes`` restriction. Only the first ``dp_top``
    actions are given extra units. Returns ``(extras, total_duration)``.
    """
    n = len(specs)
    extras = [0] * n
    total = 0.0
    for s in specs:
        total += s.durations[s.min_units]
    if leftover <= 0 or n == 0:
        return extras, total
    top = min(n, dp_top)
    cap = min(leftover, sum(s.max_units - s.min_units for s in specs[:top]))
    # f[u]: best Σ duration of the processed actions using exactly u extra units.
    f = [0.0] + [_INF] * cap
    choices: list[list[int]] = []
    for s in specs[:top]:
        lo, d = s.min_units, s.durations
        opts = [(e, d[lo + e]) for e in range(0, min(s.max_units - lo, cap) + 1) if d[lo + e] < _INF]
        g = [_INF] * (cap + 1)
        arg = [0] * (cap + 1)
        for u in range(cap + 1):
            fu = f[u]
            if fu == _INF:
                continue
            for e, de in opts:
                v = u + e
                if v > cap:
                    break
                c = fu + de
                if c < g[v] - 1e-15:
                    g[v] = c
                    arg[v] = e
        f = g
        choices.append(arg)
    best_u = min(range(cap + 1), key=lambda u: (f[u], u))
    u = best_u
    for i in range(top - 1, -1, -1):
        e = choices[i][u]
        extras[i] = e
        u -= e
    rest = sum(s.durations[s.min_units] for s in specs[top:])
    return extras, f[best_u] + rest


def split_units(specs: Sequence[ActionSpec], leftover: int, dp_top: int = 32) -> tuple[list[int], float]:
    """Best split of ``leftover`` extra units of one elastic resource among ``specs`` (beyond their minimums).

    Returns ``(extras, Σ duration)`` with ``extras[i] <= max_i - min_i`` and ``Σ extras <= leftover``.
    Exact for convex duration curves (greedy on marginal gains); otherwise the DP of :func:`split_units_dp`.
    """
    for s in specs:
        if not s.convex:
            return split_units_dp(specs, leftover, dp_top)
    return _split_greedy(specs, leftover)


class ReferenceElasticScheduler:
    """The ``tangram`` policy: FCFS window + per-resource greedy eviction minimising estimated ``Σ ACT``.

    Parameters: ``window`` (n, max candidates), ``depth`` (max evictions per partition per decision; 0
    disables eviction), ``lookahead`` (queued actions beyond the candidates that enter the estimate, per
    resource), ``max_scan`` (queue entries read per decision, default ``4·window + lookahead``), ``dp_top``
    (candidates given extra units by the non-convex DP), ``keep_head`` (never evict a partition's first
    candidate: no waiting for more units). Raises ``ValueError`` for a bad parameter.
    """

    name = "tangram_reference"

    def __init__(
        self,
        *,
        window: int = 64,
        depth: int = 2,
        lookahead: int = 4,
        max_scan: int | None = None,
        dp_top: int = 32,
        keep_head: bool = False,
    ) -> None:
        for pname, val, lo in (("window", window, 1), ("depth", depth, 0), ("lookahead", lookahead, 0), ("dp_top", dp_top, 1)):
            if isinstance(val, bool) or not isinstance(val, int) or val < lo:
                raise ValueError(f"tangram: {pname} must be an integer >= {lo}, got {val!r}")
        if max_scan is None:
            max_scan = 4 * window + lookahead
        if isinstance(max_scan, bool) or not isinstance(max_scan, int) or max_scan < window:
            raise ValueError(f"tangram: max_scan must be an integer >= window ({window}), got {max_scan!r}")
        self.window = window
        self.depth = depth
        self.lookahead = lookahead
        self.max_scan = max_scan
        self.dp_top = dp_top
        self.keep_head = bool(keep_head)

    def trajectory_finished(self, trajectory: str, now: float) -> None:
        """No per-trajectory state: resources return to the pool when each action ends."""

    def schedule(
        self,
        queue: Sequence[ActionSpec],
        free: Mapping[str, int],
        running: Sequence[RunningView],
        now: float,
    ) -> list[Grant]:
        """Decide which queued actions start now and with how many units.

        ``queue`` is read once in FCFS order; ``free`` is what no running action holds; ``running`` gives
        projected release times (a :class:`~libra.policies.actions.views.RunningSet` makes that O(k)).
        Returns grants in queue order; every grant fits ``free`` jointly.
        """
        avail = dict(free)
        cands: list[tuple[int, ActionSpec]] = []
        waiting: dict[str, list[tuple[int, ActionSpec]]] = {}
        window, lookahead = self.window, self.lookahead
        limit = self.max_scan
        extra_reads = -1  # counts reads after the window filled
        pos = -1
        for spec in scan_order(queue, free):
            pos += 1
            if pos >= limit:
                break
            if extra_reads < 0:
                items = spec.items
                for r, u in items:
                    if avail.get(r, 0) < u:
                        break
                else:
                    for r, u in items:
                        avail[r] -= u
                    cands.append((pos, spec))
                    if len(cands) >= window:
                        extra_reads = 0
                    continue
            else:
                extra_reads += 1
                if extra_reads > lookahead:
                    break
            if lookahead:
                k = spec.key
                if k is not None:
                    w = waiting.get(k)
                    if w is None:
                        waiting[k] = [(pos, spec)]
                    elif len(w) < lookahead:
                        w.append((pos, spec))
                else:
                    for r, _u in spec.items:
                        w = waiting.get(r)
                        if w is None:
                            waiting[r] = [(pos, spec)]
                        elif len(w) < lookahead:
                            w.append((pos, spec))
        if not cands:
            return []

        # Partition: an elastic action by its key resource, any other action by its first resource. Only a
        # partition with an elastic candidate has anything to decide.
        parts: dict[str, list[tuple[int, ActionSpec]]] = {}
        elastic_parts: set[str] = set()
        for pc in cands:
            s = pc[1]
            if s.max_units > s.min_units:
                k = s.key
                elastic_parts.add(k)  # type: ignore[arg-type]
            elif s.items:
                k = s.items[0][0]
            else:
                continue
            g = parts.get(k)  # type: ignore[arg-type]
            if g is None:
                parts[k] = [pc]  # type: ignore[index]
            else:
                g.append(pc)
        units_of: dict[str, int] = {}
        evicted: set[str] = set()
        for r in elastic_parts:
            self._decide_partition(r, parts[r], avail.get(r, 0), waiting.get(r, ()), running, now, units_of, evicted)

        grants: list[Grant] = []
        for _pos, s in cands:
            if s.id in evicted:
                continue
            if s.key is None or s.max_units == s.min_units:
                grants.append(Grant(s.id, s.demand))
            else:
                u = dict(s.demand)
                u[s.key] = units_of[s.id]
                grants.append(Grant(s.id, u))
        return grants

    # ----------------------------------------------------------------------------------------- internals

    def _decide_partition(
        self,
        r: str,
        group: list[tuple[int, ActionSpec]],
        leftover: int,
        waiting: Sequence[tuple[int, ActionSpec]],
        running: Sequence[RunningView],
        now: float,
        units_of: dict[str, int],
        evicted: set[str],
    ) -> None:
        """Split ``leftover`` units of ``r`` over ``group`` (FCFS order; elastic and fixed actions) and evict
        trailing candidates while the estimated Σ ACT improves. Writes ``units_of`` and ``evicted``."""
        need = 0
        convex = True
        for _p, s in group:
            need += s.max_units - s.min_units
            if not s.convex:
                convex = False
        if leftover >= need:
            for _p, s in group:
                units_of[s.id] = s.max_units
            return
        # Elastic candidates get the split; fixed ones contribute a constant duration and release.
        el: list[ActionSpec] = []
        is_el: list[bool] = []
        fixed_rel: list[tuple[float, int]] = []
        fixed_dur: list[float] = []
        for _p, s in group:
            if s.max_units > s.min_units:
                el.append(s)
                is_el.append(True)
            else:
                d = s.durations[0] if s.key is None else s.durations[s.min_units]
                fixed_dur.append(d)
                fixed_rel.append((now + d, s.demand.get(r, 0)))
                is_el.append(False)
        fixed_cost = sum(fixed_dur)
        # Evictions free at most the demand of the last ``depth`` candidates.
        cap = leftover + sum(s.demand.get(r, 0) for _p, s in group[max(0, len(group) - self.depth) :]) if self.depth else leftover
        splitter = _ConvexSplit(el, cap) if convex else None
        extras, cost = splitter.solve(leftover) if splitter else split_units_dp(el, leftover, self.dp_top)
        k, ne, nf = len(group), len(el), len(fixed_rel)
        if self.depth:
            base = release_list(running, r)  # a fresh list: heapified in place, never mutated afterwards
            heapq.heapify(base)
            j = cost + fixed_cost + _waiting_cost(r, el, extras, fixed_rel, leftover, (), waiting, base, now)
            freed = leftover
            floor = 1 if self.keep_head else 0
            for _ in range(self.depth):
                if k <= floor:
                    break
                k2 = k - 1
                last = group[k2][1]
                freed2 = freed + last.demand.get(r, 0)
                ne2, nf2, fixed2 = ne, nf, fixed_cost
                if is_el[k2]:
                    ne2 -= 1
                    if splitter is not None:
                        splitter.drop_last()
                else:
                    nf2 -= 1
                    fixed2 -= fixed_dur[nf2]
                if splitter is not None:
                    ext2, cost2 = splitter.solve(freed2)
                else:
                    ext2, cost2 = split_units_dp(el[:ne2], freed2, self.dp_top)
                cost2 += fixed2
                # Only an improvement matters: the estimate stops once it cannot beat j.
                j2 = cost2 + _waiting_cost(
                    r, el[:ne2], ext2, fixed_rel[:nf2], freed2, group[k2:], waiting, base, now, j - cost2
                )
                if j2 < j - 1e-9:
                    k, j, extras, freed, ne, nf, fixed_cost = k2, j2, ext2, freed2, ne2, nf2, fixed2
                else:
                    break
            for _p, s in group[k:]:
                evicted.add(s.id)
        for s, e in zip(el[:ne], extras):
            units_of[s.id] = s.min_units + e


class _ConvexSplit:
    """Exact unit split for convex duration curves, supporting removal of the last action (eviction).

    Holds every marginal gain of every action, negated and sorted ascending (largest gain first).
    """

    __slots__ = ("specs", "neg", "base", "cap")

    def __init__(self, specs: Sequence[ActionSpec], cap: int | None = None) -> None:
        # Only an action's first ``cap`` gains can be among the ``cap`` largest of all (each action's gains
        # are non-increasing), so a split of at most ``cap`` units needs no more.
        self.specs = list(specs)
        self.cap = cap
        if cap is None:
            self.neg = sorted(chain.from_iterable(s.neg_gains for s in specs))
        else:
            self.neg = sorted(chain.from_iterable(s.neg_gains[:cap] for s in specs))
        base = 0.0
        for s in specs:
            base += s.durations[s.min_units]
        self.base = base

    def drop_last(self) -> None:
        s = self.specs.pop()
        neg = self.neg
        for g in s.neg_gains[: self.cap]:
            del neg[bisect_left(neg, g)]
        self.base -= s.durations[s.min_units]

    def solve(self, leftover: int) -> tuple[list[int], float]:
        """Extras per action and ``Σ duration`` for ``leftover`` units (``leftover <= cap`` when capped)."""
        specs, neg = self.specs, self.neg
        if self.cap is not None and leftover > self.cap:
            raise ValueError(f"split of {leftover} units asked of a splitter capped at {self.cap}")
        if leftover <= 0:
            return [0] * len(specs), self.base
        if leftover >= len(neg):
            cap = self.cap
            return [len(s.gains) if cap is None else min(len(s.gains), cap) for s in specs], self.base + sum(neg)
        thr = neg[leftover - 1]
        extras = [bisect_left(s.neg_gains, thr) for s in specs]  # gains strictly above the threshold
        rest = leftover - sum(extras)
        if rest > 0:
            for i, s in enumerate(specs):
                ties = bisect_right(s.neg_gains, thr) - extras[i]
                if ties > 0:
                    take = ties if ties < rest else rest
                    extras[i] += take
                    rest -= take
                    if rest == 0:
                        break
        return extras, self.base + sum(neg[:leftover])


def _waiting_cost(
    r: str,
    sched: Sequence[ActionSpec],
    extras: Sequence[int],
    fixed_rel: list[tuple[float, int]],
    leftover: int,
    evicted: Sequence[tuple[int, ActionSpec]],
    waiting: Sequence[tuple[int, ActionSpec]],
    base: list[tuple[float, int]],
    now: float,
    bound: float = _INF,
    max_wait_pops: int = 4,
) -> float:
    """Completion-time-heap estimate of ``Σ (completion - now)`` over the evicted + waiting actions.

    Projected releases ``(time, units)`` come from the running actions (``base``, already a heap; a release
    overdue at ``now`` counts as ``now``), the scheduled candidates (``fixed_rel`` for the fixed ones,
    ``sched``/``extras`` for the elastic ones), and each waiting action once the estimate starts it. Waiting actions start in FCFS order: a fixed one as soon as its demand is free; an
    elastic one at the release (among the next ``max_wait_pops`` after it first fits) that gives it the
    earliest completion, taking what is free then up to its maximum. Returns early (a value ``>= bound``)
    once the sum reaches ``bound``: every term is non-negative.
    """
    if not evicted and not waiting:
        return 0.0
    if evicted and waiting:
        order = sorted(chain(evicted, waiting), key=_pos)
    else:
        order = evicted or waiting
    # Two heaps: the running actions' (copied: only popped entries cost anything) and a small one for the
    # candidates and the waiting actions the estimate starts.
    bheap = base[:]
    heap = fixed_rel + [(now + s.durations[s.min_units + e], s.min_units + e) for s, e in zip(sched, extras)]
    heapq.heapify(heap)
    pool = leftover - sum(extras)
    t = now
    total = 0.0
    pop, push = heapq.heappop, heapq.heappush
    for _p, w in order:
        need = w.demand.get(r, 0)
        while pool < need:
            if bheap and (not heap or bheap[0][0] <= heap[0][0]):
                tr, u = pop(bheap)
            elif heap:
                tr, u = pop(heap)
            else:
                break
            if tr > t:
                t = tr
            pool += u
        if w.key == r and w.max_units > w.min_units:
            d = w.durations
            hi, lo = w.max_units, w.min_units
            m = pool if pool < hi else hi
            if m < lo:
                m = lo
            while d[m] == _INF and m > lo:
                m -= 1
            best_fin, best_t, best_pool, used = t + d[m], t, pool, 0
            if pool < hi:
                extra: list[tuple[float, int]] = []
                p, tt = pool, t
                for _ in range(max_wait_pops):
                    if bheap and (not heap or bheap[0][0] <= heap[0][0]):
                        rel = pop(bheap)
                    elif heap:
                        rel = pop(heap)
                    else:
                        break
                    extra.append(rel)
                    tr = rel[0]
                    if tr >= best_fin:
                        break
                    if tr > tt:
                        tt = tr
                    p += rel[1]
                    m2 = p if p < hi else hi
                    while d[m2] == _INF and m2 > lo:
                        m2 -= 1
                    fin = tt + d[m2]
                    if fin < best_fin:
                        best_fin, best_t, best_pool, used = fin, tt, p, len(extra)
                    if p >= hi:
                        break
                for rel in extra[used:]:
                    push(heap, rel)
                t, pool = best_t, best_pool
                m = pool if pool < hi else hi
                while d[m] == _INF and m > lo:
                    m -= 1
            dur = d[m]
        else:
            m = need
            dur = w.durations[0] if w.key is None else w.durations[w.min_units]
        total += (t - now) + dur
        if total >= bound:
            return total
        if m:
            pool -= m
            push(heap, (t + dur, m))
    return total


def _pos(pc: tuple[int, ActionSpec]) -> int:
    return pc[0]
