"""ARL-Tangram elastic action scheduler (``tangram``; docs/papers.md §2.4, §4 item 12).

Objective: minimise the total action completion time ``Σ ACT = Σ (queueing + execution)``. One decision:

1. **FCFS candidate window.** Scan the queue in order and take the first ``window`` actions whose *minimum*
   demand fits what is still free (an action that does not fit is skipped, not waited for). The scan is
   bounded by ``max_scan`` entries; after the window is full up to ``lookahead`` more actions are read as
   "waiting" for the estimate below.
2. **Partition** the candidates by resource: an elastic action by its key elastic resource (``cpu@n03``,
   ``gpu`` ...), any other action by its first resource. Partitions without an elastic candidate are
   granted as they are.
3. **Greedy eviction**, per elastic partition, with leftover ``L`` units after every candidate's minimum:
   - if ``L`` covers every candidate's maximum, all run at their maximum (nothing can improve on that);
   - else split ``L`` among the candidates minimising ``Σ duration`` (:func:`split_units`, exact), and
     estimate ``J = Σ duration(candidates) + Σ estimated ACT(waiting)``. The waiting actions (evicted
     candidates plus ``lookahead`` queued actions that need this resource, in FCFS order) are placed on a
     **completion-time heap** of projected releases (running actions' ``expected_end``, the candidates'
     ``now + duration``, then each waiting action's own completion): a fixed action starts once its demand
     is free, an elastic one at the release that gives it the earliest completion (it may wait for more
     units), taking what is free then up to its maximum;
   - tentatively evict the *last* candidate of the partition (elastic or not; its demand returns to ``L``)
     and re-evaluate; accept while ``J`` strictly improves, at most ``depth`` times (the search-depth
     bound). The sole candidate may be evicted too: then the estimate judged waiting for more units better
     than starting narrow now.

Exactness of the split: for convex duration curves (Amdahl, convex tables, no size restriction) taking the
``L`` largest marginal gains is optimal for this separable convex problem, so :func:`split_units` does that
in O(N log N) over the first ``L + freed`` gains of each candidate; otherwise it runs the DP over unit
counts (O(k·L·m)) on the first ``dp_top`` candidates (later ones get their minimum). Both are checked
against brute force in the tests.

Hot path (issue #5: window 64, depth 2). Every per-candidate quantity is computed once per action, at
``ActionSpec`` construction (``row = (solo, part_units, span, min_duration, convex, grant)``, the duration
and gain tables, ``grant`` = the grant at exactly the demand), and a decision reads whole columns at C
speed instead of looping over the candidates in Python:

- **bulk window**: the first ``window`` queue entries are read with ``islice`` and their columns with one
  ``zip(*rows)``; when they all demand a single resource ``r`` and their sum fits (then the FCFS scan
  would take every one), the per-action scan loop and the partitioning are skipped entirely; otherwise
  the general scan runs (same decisions);
- an eviction trial differs from the previous one by one candidate and a few freed units: the
  candidates' capped marginal gains are sorted once; a trial finds its threshold by walking past the
  evicted candidates' gains in that list (:func:`split_sorted`) and re-sums only its prefix (in the same
  ascending order as a split over the reduced list, so the sums are bit-identical);
- the candidates' projected releases are built once (one pass over the window when every candidate runs
  at its minimum) and filtered by a provable pop horizon; a trial copies the short list and moves the few
  entries whose units changed;
- the running actions' releases come pre-sorted from :class:`~libra.policies.actions.views.RunningSet`
  (kept sorted on ``add`` / ``remove``), so the completion-time "heap" is a sorted list read in order plus
  one small heap (the candidates' releases and those the estimate pushes): the estimate costs
  O(releases it pops), not O(running + candidates);
- grants: every kept candidate's precomputed ``grant``, replaced only for the elastic candidates given
  extra units.

Not done, by design: state carried across decisions (and memoising the estimate on the window): a
candidate of one decision is a candidate of the next only if that decision evicted it, at most ``depth``
per partition, so a full window shares at most ``depth / window`` of its candidates with the previous one;
windows that do recur are those of one or two candidates, already cheap. A lower-bound pruning of trial
estimates (shortest durations of the waiting actions) proved too weak to pay for itself (it skips ~5 % of
the rejected trials on random instances, none on the benchmark's, where both trials are accepted).

``tests/unit/test_actions_tangram_oracle.py`` checks the decisions against slow oracles written from this
description (brute-force splits, a flat-list release simulation, the greedy eviction over them) on small
instances and on the benchmark's contended snapshots. Bounded work per decision: ``max_scan`` queue
entries, ``window`` candidates, ``depth + 1`` estimates of at most ``lookahead + depth`` waiting actions each.

The eviction search (:func:`~libra.policies.actions.tangram_evict.evict_convex`,
:func:`~libra.policies.actions.tangram_evict.evict_dp`) is in :mod:`libra.policies.actions.tangram_evict`.

Pure: ``schedule`` reads its arguments and returns grants; the scheduler holds only its parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain, compress, islice
from operator import attrgetter, not_

from libra.policies.actions.estimate import note_waiting
from libra.policies.actions.model import ActionSpec, Grant
from libra.policies.actions.split import convex_extras, split_units, split_units_dp
from libra.policies.actions.tangram_evict import evict_convex, evict_dp, gather
from libra.policies.actions.views import RunningView, scan_order

__all__ = ["ElasticScheduler", "split_units", "split_units_dp"]

# Column accessors: the hot path extracts one field of every candidate with C-level ``map`` calls.
_neg_gains = attrgetter("neg_gains")
_part = attrgetter("part")
_grant = attrgetter("grant")  # an action's grant at exactly its demand (built with the spec)
_row = attrgetter("row")  # (solo, part_units, span, min_duration, convex, grant)


class ElasticScheduler:
    """The ``tangram`` policy: FCFS window + per-resource greedy eviction minimising estimated ``Σ ACT``.

    Parameters: ``window`` (n, max candidates), ``depth`` (max evictions per partition per decision; 0
    disables eviction), ``lookahead`` (queued actions beyond the candidates that enter the estimate, per
    resource), ``max_scan`` (queue entries read per decision, default ``4·window + lookahead``), ``dp_top``
    (candidates given extra units by the non-convex DP), ``keep_head`` (never evict a partition's first
    candidate: no waiting for more units). Raises ``ValueError`` for a bad parameter.
    """

    name = "tangram"

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
        projected release times (a :class:`~libra.policies.actions.views.RunningSet` makes that O(1)).
        Returns grants in queue order; every grant fits ``free`` jointly.
        """
        window, lookahead = self.window, self.lookahead
        limit = self.max_scan
        it = scan_order(queue, free)
        # Bulk window: the first ``window`` entries, read at C speed. When every one demands a single unit
        # count of one and the same resource and their sum fits, the FCFS scan would take all of them (each
        # fits what the earlier ones left), so the per-action loop is skipped. ``limit >= window``.
        head = list(islice(it, window))
        n = len(head)
        if not n:
            return []
        # The columns (solo, part_units, span, min_duration, convex, grant) of the window, one attribute read
        # per action (``ActionSpec.row``) and one transposition.
        solos, units, spans, mind, convs, grants0 = zip(*map(_row, head))
        r = solos[0]
        if r is not None and solos.count(r) == n:
            a = free.get(r, 0)
            need = sum(units)
            if need <= a:
                if not any(spans):
                    return list(grants0)
                # The waiting actions filed under r (see note_waiting): at most ``lookahead`` reads, so the
                # per-resource bound cannot bind.
                waiting: list[tuple[int, ActionSpec]] = []
                if n == window and lookahead:
                    for pos, spec in zip(range(n, min(n + lookahead, limit)), it):
                        key = spec.key
                        if key == r if key is not None else r in spec.demand:
                            waiting.append((pos, spec))
                k, el, extras = self._decide_partition(r, head, range(n), (units, spans, mind, convs), a - need,
                                                       waiting, running, now)
                grants = list(grants0[:k] if k < n else grants0)
                if any(extras):
                    _regrant(grants, compress(range(k), spans), el, extras, r)
                return grants
        return self._schedule_general(chain(head, it), free, running, now)

    def _schedule_general(
        self,
        it: Iterator[ActionSpec],
        free: Mapping[str, int],
        running: Sequence[RunningView],
        now: float,
    ) -> list[Grant]:
        """:meth:`schedule` for any window: the FCFS scan action by action (:meth:`_scan_window`), then every
        partition."""
        cand, cpos, avail, waiting = self._scan_window(it, free)
        if not cand:
            return []

        # Partition: an elastic action by its key resource, any other action by its first resource
        # (``ActionSpec.part``). Only a partition with an elastic candidate has anything to decide.
        n = len(cand)
        keys = list(map(_part, cand))
        k0 = keys[0]
        groups: dict[str | None, list[int] | None]
        if keys.count(k0) == n:
            groups = {k0: None}  # None: the whole window, in order
        else:
            groups = {}
            for i, k in enumerate(keys):
                g = groups.get(k)
                if g is None:
                    groups[k] = [i]
                else:
                    g.append(i)
        grants = list(map(_grant, cand))  # every candidate at its demand; elastic ones re-granted below
        drop: list[int] = []
        for r, idx in groups.items():
            if r is None:
                continue
            if idx is None:
                gspecs, gpos = cand, cpos
            else:
                gspecs = [cand[i] for i in idx]
                gpos = [cpos[i] for i in idx]
            _solos, units, spans, mind, convs, _g = zip(*map(_row, gspecs))
            if not any(spans):
                continue
            k, el, extras = self._decide_partition(r, gspecs, gpos, (units, spans, mind, convs), avail.get(r, 0),
                                                   waiting.get(r, ()), running, now)
            if k < len(gspecs):
                drop.extend(range(k, len(gspecs)) if idx is None else idx[k:])
            if any(extras):
                _regrant(grants, compress(range(len(gspecs)) if idx is None else idx, spans), el, extras, r)
        if drop:
            keep = [True] * n
            for i in drop:
                keep[i] = False
            return list(compress(grants, keep))
        return grants

    def _scan_window(
        self, it: Iterator[ActionSpec], free: Mapping[str, int]
    ) -> tuple[list[ActionSpec], list[int], dict[str, int], dict[str, list[tuple[int, ActionSpec]]]]:
        """The FCFS scan of :meth:`_schedule_general`: returns the candidates (the first ``window`` actions
        whose minimum demand fits what the earlier ones left), their queue positions, what is still free
        after them, and the waiting actions filed by resource (:func:`note_waiting`)."""
        avail = dict(free)
        cand: list[ActionSpec] = []
        cpos: list[int] = []
        waiting: dict[str, list[tuple[int, ActionSpec]]] = {}
        window, lookahead = self.window, self.lookahead
        limit = self.max_scan
        pos = -1
        full = False
        # Phase 1: fill the window; actions that do not fit are waiting.
        for spec in it:
            pos += 1
            if pos >= limit:
                break
            items = spec.items
            if len(items) == 1:
                r, u = items[0]
                a = avail.get(r, 0)
                if a >= u:
                    avail[r] = a - u
                    cand.append(spec)
                    cpos.append(pos)
                    if len(cand) >= window:
                        full = True
                        break
                    continue
            else:
                for r, u in items:
                    if avail.get(r, 0) < u:
                        break
                else:
                    for r, u in items:
                        avail[r] -= u
                    cand.append(spec)
                    cpos.append(pos)
                    if len(cand) >= window:
                        full = True
                        break
                    continue
            if lookahead:
                note_waiting(waiting, pos, spec, lookahead)
        # Phase 2: up to ``lookahead`` more reads, all waiting.
        if full and lookahead:
            reads = 0
            for spec in it:
                pos += 1
                reads += 1
                if pos >= limit or reads > lookahead:
                    break
                note_waiting(waiting, pos, spec, lookahead)
        return cand, cpos, avail, waiting

    # ----------------------------------------------------------------------------------------- internals

    def _decide_partition(
        self,
        r: str,
        gspecs: list[ActionSpec],
        gpos: Sequence[int],
        cols: tuple[Sequence[int], Sequence[int], Sequence[float], Sequence[bool]],
        leftover: int,
        waiting: Sequence[tuple[int, ActionSpec]],
        running: Sequence[RunningView],
        now: float,
    ) -> tuple[int, list[ActionSpec], list[int]]:
        """Split ``leftover`` units of ``r`` over the partition ``gspecs`` (FCFS order, queue positions
        ``gpos``; elastic and fixed actions) and evict trailing candidates while the estimated Σ ACT improves.
        ``cols`` are the partition's ``(part_units, span, min_duration, convex)`` columns (``part_units`` is
        each candidate's demand of ``r``).

        Returns ``(k, el, extras)``: the first ``k`` candidates start (the rest are evicted), ``el`` lists the
        partition's elastic candidates and ``extras`` the units of ``r`` beyond the minimum of the first
        ``len(extras)`` of them (the elastic ones kept), in order."""
        units, spans, mind, convs = cols
        if leftover >= sum(spans):
            return len(gspecs), list(compress(gspecs, spans)), list(compress(spans, spans))
        convex = all(convs)
        # Elastic candidates get the split; fixed ones contribute a constant duration and release.
        ng = len(gspecs)
        el = list(compress(gspecs, spans))
        if len(el) == ng:
            fdem: list[int] = []
            fixed_dur: list[float] = []
        else:
            nsp = list(map(not_, spans))
            fdem = list(compress(units, nsp))
            fixed_dur = list(compress(mind, nsp))
        depth = self.depth
        if not depth:
            if convex:
                neg = gather(list(map(_neg_gains, el)), spans, leftover)
                neg.sort()
                extras = convex_extras(el, neg, leftover, leftover)
            else:
                extras, _cost = split_units_dp(el, leftover, self.dp_top)
            return ng, el, extras
        fixed_cost = sum(fixed_dur)
        # Evictions free at most the demand of the last ``depth`` candidates.
        cap = leftover + sum(units[max(0, ng - depth):])
        if convex:
            k, extras = evict_convex(r, gspecs, gpos, cols, el, fdem, fixed_dur, leftover, cap, fixed_cost,
                                     waiting, running, now, depth=depth, keep_head=self.keep_head)
        else:
            k, extras = evict_dp(r, gspecs, gpos, el, fdem, fixed_dur, leftover, fixed_cost, waiting, running, now,
                                 depth=depth, keep_head=self.keep_head, dp_top=self.dp_top)
        return k, el, extras


def _regrant(grants: list[Grant], idx: Iterable[int], el: Sequence[ActionSpec], extras: Sequence[int], r: str) -> None:
    """Replace ``grants[i]`` (the demand grant of elastic candidate ``el[j]``, ``i`` the ``j``-th index of
    ``idx``) by a grant with ``min + extras[j]`` units of ``r`` wherever ``extras[j] > 0``."""
    new = tuple.__new__
    for i, s, e in zip(idx, el, extras):
        if e:
            m = s.min_units + e
            if s.solo is None:
                u = dict(s.demand)
                u[r] = m
            else:
                u = {r: m}
            grants[i] = new(Grant, (s.id, u, None))
