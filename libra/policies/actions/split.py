"""Exact split of one elastic resource's leftover units among scheduled actions (ARL-Tangram §2.4).

:func:`split_units` gives each action extra units beyond its minimum so that ``Σ duration`` is smallest,
using at most ``leftover`` units: greedy on marginal gains for convex duration curves (optimal for this
separable convex problem), otherwise the DP over unit counts of :func:`split_units_dp`. Both are checked
against brute force in ``tests/unit/test_actions*.py``. The helpers :func:`convex_extras`,
:func:`extras_at` and :func:`convex_cost` are the greedy split's pieces, shared with the scheduler's
eviction trials (:mod:`libra.policies.actions.tangram`). Pure functions.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import chain, repeat
from operator import attrgetter

from libra.policies.actions.model import ActionSpec

__all__ = ["convex_cost", "convex_extras", "extras_at", "split_units", "split_units_dp"]

_INF = math.inf
_neg_gains = attrgetter("neg_gains")


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
    base = 0.0
    for s in specs:
        base += s.durations[s.min_units]
    neg = sorted(chain.from_iterable(s.neg_gains for s in specs))
    return convex_extras(specs, neg, leftover, None), convex_cost(base, neg, leftover)


def convex_extras(specs: Sequence[ActionSpec], neg: list[float], leftover: int, cap: int | None) -> list[int]:
    """Extra units per action when ``leftover`` units go to the largest marginal gains (ties to the earliest
    action). ``neg`` is every action's first ``cap`` gains (all if ``cap`` is ``None``), negated, ascending."""
    if leftover <= 0:
        return [0] * len(specs)
    if leftover >= len(neg):
        return [len(s.gains) if cap is None else min(len(s.gains), cap) for s in specs]
    return extras_at(specs, neg[leftover - 1], leftover)


def extras_at(specs: Sequence[ActionSpec], thr: float, leftover: int) -> list[int]:
    """Extras for threshold ``thr`` (the ``leftover``-th smallest negated gain): every gain strictly above
    it, then the gains equal to it, earliest action first, until ``leftover`` units are used."""
    negs = list(map(_neg_gains, specs))
    extras = list(map(bisect_left, negs, repeat(thr)))  # gains strictly above the threshold
    rest = leftover - sum(extras)
    if rest > 0:
        upto = list(map(bisect_right, negs, repeat(thr)))
        if sum(upto) == leftover:
            return upto  # exactly enough ties: every action takes all of its own
        for i in range(len(specs)):
            ties = upto[i] - extras[i]
            if ties > 0:
                take = ties if ties < rest else rest
                extras[i] += take
                rest -= take
                if rest == 0:
                    break
    return extras


def convex_cost(base: float, neg: list[float], leftover: int) -> float:
    """``Σ duration`` of the split: the minimum-DoP durations (``base``) minus the ``leftover`` largest gains."""
    if leftover <= 0:
        return base
    if leftover >= len(neg):
        return base + sum(neg)
    return base + sum(neg[:leftover])
