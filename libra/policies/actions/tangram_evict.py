"""The greedy eviction search of the ``tangram`` elastic scheduler
(:class:`~libra.policies.actions.tangram.ElasticScheduler`; docs/papers.md §2.4).

For one resource partition whose candidates do not all fit at their maximum, :func:`evict_convex` (convex
duration curves: the split reads the candidates' marginal gains, sorted once, and each eviction trial is
evaluated incrementally) and :func:`evict_dp` (non-convex curves or size restrictions: the DP split is re-run
per trial) tentatively evict the partition's trailing candidates, at most ``depth`` of them, while the
estimated ``Σ ACT`` strictly improves. :func:`gather` collects the candidates' capped marginal gains.
The scheduler's module docstring describes the search and the hot-path choices. Pure functions.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Sequence
from functools import reduce
from itertools import chain, compress, repeat
from operator import add, attrgetter, getitem, le
from operator import ne as ne_

from libra.policies.actions.estimate import estimate_act, merge_pos, release_horizon, split_sorted
from libra.policies.actions.model import ActionSpec
from libra.policies.actions.split import split_units_dp
from libra.policies.actions.views import RunningView, sorted_releases

__all__ = ["evict_convex", "evict_dp", "gather"]

_INF = math.inf
# Column accessors (see the scheduler): one field of every candidate with C-level ``map`` calls.
_durations = attrgetter("durations")
_min_units = attrgetter("min_units")
_neg_gains = attrgetter("neg_gains")


def evict_convex(
    r: str,
    gspecs: list[ActionSpec],
    gpos: Sequence[int],
    cols: tuple[Sequence[int], Sequence[int], Sequence[float], Sequence[bool]],
    el: list[ActionSpec],
    fdem: list[int],
    fixed_dur: list[float],
    leftover: int,
    cap: int,
    fixed_cost: float,
    waiting: Sequence[tuple[int, ActionSpec]],
    running: Sequence[RunningView],
    now: float,
    *,
    depth: int,
    keep_head: bool,
) -> tuple[int, list[int]]:
    """Greedy eviction with the convex split, evaluated incrementally (see :mod:`libra.policies.actions.tangram`).

    Returns ``(k, extras)``: the first ``k`` candidates stay, and ``extras`` gives the extra units of the
    elastic ones among them (in order; as long as the number of elastic candidates kept)."""
    units, spans, mind, _convs = cols
    ng, ne = len(gspecs), len(el)
    floor = 1 if keep_head else 0
    nev = min(depth, ng - floor)  # trailing candidates an eviction trial may remove
    # ---- trial 0: the split of ``leftover`` units over every candidate
    negs = list(map(_neg_gains, el))
    el_spans = list(compress(spans, spans))
    neg = gather(negs, el_spans, cap)
    neg.sort()
    base = reduce(add, compress(mind, spans), 0.0)  # left to right, as Σ over the elastic candidates
    L = leftover
    extras, cost = split_sorted(el, negs, el_spans, neg, (), L, cap, base)
    # ---- the candidates' releases an estimate can reach
    brel = sorted_releases(running, r)
    horizon = release_horizon(r, brel, waiting, gspecs[ng - nev:] if nev > 0 else ())
    crel, horizon = _reachable_releases(el, extras, units, mind, fdem, fixed_dur, horizon, now)
    j = cost + fixed_cost + estimate_act(r, crel, brel, L - sum(extras), waiting, now, _INF)
    if nev <= 0:
        return ng, extras
    # ---- eviction trials: trial t keeps the first ``ng - t`` candidates and splits ``freed >= L`` units
    # over the elastic ones left: the sorted gains minus the evicted candidates' (``removed``).
    k, freed, ne_all = ng, L, ne
    removed: list[float] = []  # every capped negated gain of the evicted elastic candidates, ascending
    for _ in range(nev):
        k2 = k - 1
        u_last = units[k2]
        freed2 = freed + u_last
        if spans[k2]:
            last = gspecs[k2]
            ne2 = ne - 1
            base2 = base - mind[k2]
            fixed2 = fixed_cost
            removed2 = sorted(removed + list(negs[ne2][:cap]))
            m = last.min_units + extras[ne2]
            rel_out = (now + last.durations[m], m)
        else:
            ne2, base2, removed2 = ne, base, removed
            fixed2 = fixed_cost - mind[k2]
            rel_out = (now + mind[k2], u_last)
        if ne2 == ne_all:
            ext2, cost2 = split_sorted(el, negs, el_spans, neg, removed2, freed2, cap, base2)
        else:
            ext2, cost2 = split_sorted(el[:ne2], negs[:ne2], el_spans[:ne2], neg, removed2, freed2, cap, base2)
        cost2 += fixed2
        order = merge_pos(list(zip(gpos[k2:], gspecs[k2:])), waiting)
        # The releases: drop the evicted candidate's, move those of the kept ones whose units changed.
        crel2 = _moved_releases(crel, rel_out, horizon, el, ne2, extras, ext2, now)
        # Only an improvement matters: the estimate stops once it cannot beat j.
        j2 = cost2 + estimate_act(r, crel2, brel, freed2 - sum(ext2), order, now, j - cost2)
        if j2 < j - 1e-9:
            k, j, extras, freed, ne, base, fixed_cost, removed, crel = (
                k2, j2, ext2, freed2, ne2, base2, fixed2, removed2, crel2)
        else:
            break
    return k, extras


def _reachable_releases(
    el: list[ActionSpec],
    extras: list[int],
    units: Sequence[int],
    mind: Sequence[float],
    fdem: list[int],
    fixed_dur: list[float],
    horizon: float,
    now: float,
) -> tuple[list[tuple[float, int]], float]:
    """The sorted releases ``(time, units)`` of a partition's candidates at the split ``extras`` that fall at
    or before ``horizon``, and the horizon (unbounded when a zero-unit release breaks its pop bound)."""
    if any(extras):
        if fdem and min(fdem) < 1:
            horizon = _INF  # a zero-unit release breaks the pop bound behind the horizon
        ms = list(map(add, map(_min_units, el), extras))
        times = list(map(add, repeat(now), map(getitem, map(_durations, el), ms)))
        if horizon == _INF:
            crel = list(zip(times, ms))
            if fdem:
                crel += zip(map(add, repeat(now), fixed_dur), fdem)
        else:
            crel = list(compress(zip(times, ms), map(le, times, repeat(horizon))))
            if fdem:
                ftimes = list(map(add, repeat(now), fixed_dur))
                crel += compress(zip(ftimes, fdem), map(le, ftimes, repeat(horizon)))
    else:
        # Every candidate at its minimum (no unit left to split): one pass over the partition, elastic and
        # fixed alike; ``part_units`` is the minimum of r (elastic) or the demand of r (fixed).
        if min(units) < 1:
            horizon = _INF
        times = list(map(add, repeat(now), mind))
        if horizon == _INF:
            crel = list(zip(times, units))
        else:
            crel = list(compress(zip(times, units), map(le, times, repeat(horizon))))
    crel.sort()
    return crel, horizon


def _moved_releases(
    crel: list[tuple[float, int]],
    rel_out: tuple[float, int],
    horizon: float,
    el: list[ActionSpec],
    ne: int,
    extras: list[int],
    ext2: list[int],
    now: float,
) -> list[tuple[float, int]]:
    """A copy of the sorted releases ``crel`` without the evicted candidate's ``rel_out``, and with the
    releases of the kept elastic candidates (the first ``ne`` of ``el``) whose units changed moved from their
    ``extras`` to their ``ext2`` units."""
    crel2 = crel[:]
    if rel_out[0] <= horizon:
        del crel2[bisect_left(crel2, rel_out)]
    for i in compress(range(ne), map(ne_, extras, ext2)):
        s = el[i]
        d = s.durations
        m = s.min_units + extras[i]
        tr = now + d[m]
        if tr <= horizon:
            del crel2[bisect_left(crel2, (tr, m))]
        m = s.min_units + ext2[i]
        tr = now + d[m]
        if tr <= horizon:
            insort(crel2, (tr, m))
    return crel2


def evict_dp(
    r: str,
    gspecs: list[ActionSpec],
    gpos: Sequence[int],
    el: list[ActionSpec],
    fdem: list[int],
    fixed_dur: list[float],
    leftover: int,
    fixed_cost: float,
    waiting: Sequence[tuple[int, ActionSpec]],
    running: Sequence[RunningView],
    now: float,
    *,
    depth: int,
    keep_head: bool,
    dp_top: int,
) -> tuple[int, list[int]]:
    """Greedy eviction with the DP split (non-convex curves or size restrictions); the DP is re-run per
    trial. Returns ``(k, extras)`` like :func:`evict_convex`."""
    frel = [(now + d, u) for d, u in zip(fixed_dur, fdem)]
    extras, cost = split_units_dp(el, leftover, dp_top)
    brel = sorted_releases(running, r)
    crel = sorted(frel + [(now + s.durations[s.min_units + e], s.min_units + e) for s, e in zip(el, extras)])
    j = cost + fixed_cost + estimate_act(r, crel, brel, leftover - sum(extras), waiting, now, _INF)
    k, ne, nf, freed = len(gspecs), len(el), len(frel), leftover
    floor = 1 if keep_head else 0
    for _ in range(depth):
        if k <= floor:
            break
        k2 = k - 1
        last = gspecs[k2]
        freed2 = freed + last.demand.get(r, 0)
        ne2, nf2, fixed2 = ne, nf, fixed_cost
        if last.span:
            ne2 -= 1
        else:
            nf2 -= 1
            fixed2 -= fixed_dur[nf2]
        ext2, cost2 = split_units_dp(el[:ne2], freed2, dp_top)
        cost2 += fixed2
        crel2 = sorted(frel[:nf2] + [(now + s.durations[s.min_units + e], s.min_units + e)
                                     for s, e in zip(el[:ne2], ext2)])
        order = merge_pos(list(zip(gpos[k2:], gspecs[k2:])), waiting)
        j2 = cost2 + estimate_act(r, crel2, brel, freed2 - sum(ext2), order, now, j - cost2)
        if j2 < j - 1e-9:
            k, j, extras, freed, ne, nf, fixed_cost = k2, j2, ext2, freed2, ne2, nf2, fixed2
        else:
            break
    return k, extras


def gather(negs: list[tuple[float, ...]], spans: Sequence[int], cap: int) -> list[float]:
    """The first ``cap`` entries of every negated-gain tuple in ``negs``, concatenated (unsorted); ``spans``
    bounds their lengths."""
    if cap < max(spans):
        return list(chain.from_iterable(map(getitem, negs, repeat(slice(None, cap)))))
    return list(chain.from_iterable(negs))
