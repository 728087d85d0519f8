"""The completion-time estimate behind the Tangram scheduler's eviction trials (ARL-Tangram §2.4).

:func:`estimate_act` projects ``Σ ACT`` of the actions left waiting by one trial: releases of the running
actions (pre-sorted) and of the candidates are popped in time order, a fixed action starts once its demand
is free and an elastic one at the release that gives it the earliest completion. :func:`release_horizon`
bounds which candidate releases any estimate of a decision can reach, :func:`split_sorted` re-splits the
leftover units for a trial from the once-sorted gains, and :func:`note_waiting` / :func:`merge_pos` keep
the waiting actions in queue order. Used only by :mod:`libra.policies.actions.tangram`; pure functions.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import chain, repeat

from libra.policies.actions.model import ActionSpec
from libra.policies.actions.split import extras_at

__all__ = ["estimate_act", "merge_pos", "note_waiting", "queue_pos", "release_horizon", "split_sorted"]

_INF = math.inf


def release_horizon(
    r: str,
    brel: list[tuple[float, int]],
    waiting: Sequence[tuple[int, ActionSpec]],
    evictable: Sequence[ActionSpec],
    max_wait_pops: int = 4,
) -> float:
    """A time after which no candidate release can matter to any estimate of this decision.

    An estimate pops releases (each worth >= 1 unit) only while a waiting action lacks units, plus at most
    ``max_wait_pops`` look-ahead pops per elastic waiting action, so it pops at most
    ``X = Σ (need + max_wait_pops·elastic)`` releases of the running actions and candidates over every
    action it may place (the waiting ones and the evictable candidates). Running releases win ties, so a
    candidate release later than the ``X``-th running release is never popped. ``inf`` when fewer than
    ``X`` running releases exist."""
    x = 0
    for _p, w in waiting:
        x += w.demand.get(r, 0)
        if w.span and w.key == r:
            x += max_wait_pops
    for w in evictable:
        x += w.demand.get(r, 0)
        if w.span and w.key == r:
            x += max_wait_pops
    if x < 1 or x > len(brel):
        return _INF
    return brel[x - 1][0]


def split_sorted(
    el: Sequence[ActionSpec],
    negs: Sequence[tuple[float, ...]],
    spans: Sequence[int],
    neg: list[float],
    removed: Sequence[float],
    units: int,
    cap: int,
    base: float,
) -> tuple[list[int], float]:
    """The convex split of ``units`` over the elastic candidates ``el`` (negated gains ``negs``, spans
    ``spans``), whose capped negated gains are ``neg`` minus the multiset ``removed`` (both ascending; the
    gains of evicted candidates), without building that difference in full: exactly the convex split of
    the remaining candidates.

    The ``units``-th smallest remaining value sits at position ``p = units - 1 + c`` of ``neg``, where ``c``
    counts the removed values ``<= neg[p]``; the cost sums the same values in the same (ascending) order as
    a split over the reduced list does. Returns ``(extras, base + Σ taken negated gains)``."""
    if units <= 0:
        return [0] * len(el), base
    nrem = len(removed)
    if units >= len(neg) - nrem:
        ext = list(map(min, spans, repeat(cap)))
        if not nrem:
            return ext, base + sum(neg)
        rest = neg[:]
        for v in removed:
            del rest[bisect_left(rest, v)]
        return ext, base + sum(rest)
    p = units - 1
    c = 0
    while c < nrem and removed[c] <= neg[p]:
        c += 1
        p += 1
    thr = neg[p]
    if c:
        prefix = neg[: p + 1]
        for v in removed[:c]:
            del prefix[bisect_left(prefix, v)]
        cost = base + sum(prefix)
    else:
        cost = base + sum(neg[:units])
    ext = list(map(bisect_right, negs, repeat(thr)))
    if sum(ext) != units:  # more ties at the threshold than units: the tie rule decides
        ext = extras_at(el, thr, units)
    return ext, cost


def note_waiting(waiting: dict[str, list[tuple[int, ActionSpec]]], pos: int, spec: ActionSpec, lookahead: int) -> None:
    """File a queued action that is not a candidate under the resources whose estimate it enters (its key
    elastic resource, else each resource it demands), at most ``lookahead`` per resource."""
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


def merge_pos(
    a: Sequence[tuple[int, ActionSpec]], b: Sequence[tuple[int, ActionSpec]]
) -> Sequence[tuple[int, ActionSpec]]:
    """``a`` and ``b`` (each ascending by queue position, positions unique) merged by position."""
    if not b:
        return a
    if not a:
        return b
    if a[-1][0] < b[0][0]:
        return [*a, *b]  # the usual case: the waiting actions were read after the candidates
    return sorted(chain(a, b), key=queue_pos)


def estimate_act(
    r: str,
    crel: list[tuple[float, int]],
    brel: list[tuple[float, int]],
    pool: int,
    order: Sequence[tuple[int, ActionSpec]],
    now: float,
    bound: float,
    max_wait_pops: int = 4,
) -> float:
    """Completion-time-heap estimate of ``Σ (completion - now)`` over the waiting actions ``order`` (FCFS).

    Projected releases ``(time, units)`` come from the running actions (``brel``, ascending) and from a heap
    of the scheduled candidates' (``crel``, ascending, so already a heap) and of each waiting action once
    the estimate starts it: two heaps in effect, the running one being a sorted list read in order.
    They are consumed in time order (a release overdue at ``now`` counts as ``now``), running releases first
    on equal times. ``pool`` units are free at ``now``. Waiting actions start in FCFS order: a fixed one as
    soon as its demand is free; an elastic one at the release (among the next ``max_wait_pops`` after it
    first fits) that gives it the earliest completion, taking what is free then up to its maximum. Returns
    early (a value ``>= bound``) once the sum reaches ``bound``: every term is non-negative. Neither list
    is modified.
    """
    if not order:
        return 0.0
    heap = crel[:]
    bi, nb = 0, len(brel)
    pop, push = heapq.heappop, heapq.heappush
    t = now
    total = 0.0
    for _p, w in order:
        need = w.demand.get(r, 0)
        while pool < need:
            if bi < nb:
                rel = brel[bi]
                if heap and heap[0][0] < rel[0]:
                    rel = pop(heap)
                else:
                    bi += 1
            elif heap:
                rel = pop(heap)
            else:
                break
            tr, u = rel
            if tr > t:
                t = tr
            pool += u
        if w.span and w.key == r:
            if pool < w.max_units:
                t, pool, bi, m = _elastic_start(w, t, pool, heap, brel, bi, max_wait_pops)
            else:
                m = w.max_units  # allowed: ``sizes`` must contain max_units
            dur = w.durations[m]
        else:
            m = need
            dur = w.min_duration
        total += (t - now) + dur
        if total >= bound:
            return total
        if m:
            pool -= m
            push(heap, (t + dur, m))
    return total


def _elastic_start(
    w: ActionSpec,
    t: float,
    pool: int,
    heap: list[tuple[float, int]],
    brel: list[tuple[float, int]],
    bi: int,
    max_wait_pops: int,
) -> tuple[float, int, int, int]:
    """When and on how many units the elastic waiting action ``w`` starts (:func:`estimate_act`), with
    ``pool`` units free at ``t``, fewer than its maximum: at the release, among the next ``max_wait_pops``
    (``brel`` from index ``bi``, then ``heap``), that gives it the earliest completion, taking what is free
    then up to its maximum. The looked-ahead releases it does not wait for go back on ``heap``. Returns
    ``(start, pool at the start, the next index into brel, units)``."""
    pop = heapq.heappop
    nb = len(brel)
    d = w.durations
    hi = w.max_units
    lo = w.min_units
    m = pool if pool > lo else lo
    while d[m] == _INF and m > lo:
        m -= 1
    best_fin = t + d[m]
    best_t, best_pool, used = t, pool, 0
    extra: list[tuple[float, int]] = []
    p, tt = pool, t
    for _ in range(max_wait_pops):
        if bi < nb:
            rel = brel[bi]
            if heap and heap[0][0] < rel[0]:
                rel = pop(heap)
            else:
                bi += 1
        elif heap:
            rel = pop(heap)
        else:
            break
        extra.append(rel)
        tr, u = rel
        if tr >= best_fin:
            break
        if tr > tt:
            tt = tr
        p += u
        m2 = p if p < hi else hi
        while d[m2] == _INF and m2 > lo:
            m2 -= 1
        fin = tt + d[m2]
        if fin < best_fin:
            best_fin, best_t, best_pool, used = fin, tt, p, len(extra)
        if p >= hi:
            break
    if used < len(extra):
        for rel in extra[used:]:
            heapq.heappush(heap, rel)
    m = best_pool if best_pool < hi else hi
    while d[m] == _INF and m > lo:
        m -= 1
    return best_t, best_pool, bi, m


def queue_pos(pc: tuple[int, ActionSpec]) -> int:
    return pc[0]
