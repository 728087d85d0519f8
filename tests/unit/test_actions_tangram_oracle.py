"""The ``tangram`` scheduler against slow, obviously-correct oracles on small instances.

The oracles are written from the rule the module documents (``libra/policies/actions/tangram.py``), not
from its code:

- the split of an elastic resource's leftover units: every allocation of extra units is enumerated
  (:func:`brute_split`);
- the completion-time estimate of the waiting actions: one flat list of projected releases, the earliest
  taken each time with ``min`` (:func:`oracle_estimate`);
- the decision: the FCFS window, the partitions, and per partition the greedy eviction of the last candidate
  while ``J = Σ duration(candidates) + estimated Σ ACT(waiting)`` improves by more than 1e-9, each ``J``
  computed with the two oracles above (:func:`oracle_schedule`).

Instances give every resource at least the largest minimum demand in units (free or held by running
actions): an action that can never start has no documented completion time (the estimate projects an
elastic one to end at ``inf``, a fixed one to start short of its demand). They draw
continuous durations, efficiencies and release times, so the best split is unique and no two
releases tie; an instance whose eviction comparison lies within 1e-12 of the threshold, or whose best split
has a runner-up within 1e-9, is skipped as ambiguous (counted: most are decided).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from libra.policies.actions import estimate as ae
from libra.policies.actions.registry import (
    ActionQueue,
    ActionSpec,
    Amdahl,
    ElasticScheduler,
    ElasticSpec,
    RunningSet,
    RunningView,
    TableProfile,
    release_list,
)
from libra.policies.actions.model import Grant
from libra.policies.actions.tangram_evict import gather
from libra.policies.actions.views import sorted_releases

RES = ["cpu@n0", "cpu@n1", "gpu"]
MAX_WAIT_POPS = 4  # the estimate's look-ahead per elastic waiting action (documented in estimate_act)


class Ambiguous(Exception):
    """The instance sits on a tie the oracle cannot decide without the code's tie rules."""


def brute_split(el: list[ActionSpec], units: int, top: int | None = None) -> tuple[list[int], float]:
    """Every allocation of at most ``units`` extra units over ``el`` (only the first ``top`` get any): the
    cheapest ``Σ duration``, and its extras."""
    top = len(el) if top is None else min(top, len(el))
    ranges = [[e for e in range(s.span + 1) if not math.isinf(s.durations[s.min_units + e])] for s in el[:top]]
    rest = sum(s.min_duration for s in el[top:])
    scored = []
    for combo in itertools.product(*ranges):
        if sum(combo) <= units:
            scored.append((sum(s.durations[s.min_units + e] for s, e in zip(el, combo)) + rest, combo))
    scored.sort(key=lambda x: x[0])
    if len(scored) > 1 and scored[1][0] - scored[0][0] < 1e-9:
        raise Ambiguous("two splits cost the same")
    return list(scored[0][1]) + [0] * (len(el) - top), scored[0][0]


def greedy_split(el: list[ActionSpec], units: int, top: int | None = None) -> tuple[list[int], float]:
    """Convex curves only: hand out the units one at a time, each to the largest marginal gain (the earliest
    action on a tie). Optimal for a separable convex problem (exchange argument); checked against
    :func:`brute_split` below."""
    assert top is None and all(s.convex for s in el)
    extras = [0] * len(el)
    for _ in range(units):
        gains = [(s.durations[s.min_units + e] - s.durations[s.min_units + e + 1], -i)
                 for i, (s, e) in enumerate(zip(el, extras)) if e < s.span]
        if not gains or max(gains)[0] <= 0:
            break
        extras[-max(gains)[1]] += 1
    return extras, sum(s.durations[s.min_units + e] for s, e in zip(el, extras))


def _fit(w: ActionSpec, p: int) -> int:
    """The most units ``w`` can run on with ``p`` free: at most its maximum, an allowed size, at least its min."""
    m = max(min(p, w.max_units), w.min_units)
    while math.isinf(w.durations[m]) and m > w.min_units:
        m -= 1
    return m


def oracle_estimate(r: str, crel: list, brel: list, pool: int, order: list, now: float) -> float:
    """``Σ (completion - now)`` of the waiting actions ``order`` (FCFS): releases are taken earliest first
    (a release overdue at ``now`` counts as ``now``); a fixed action starts once its demand of ``r`` is free;
    an elastic one (on ``r``) once its minimum is free, or at one of the next few releases if that completes
    it sooner, on what is free then up to its maximum; each started action adds its own release."""
    rel = [(t, u) for t, u in brel] + [(t, u) for t, u in crel]
    t, total = now, 0.0
    for _pos, w in order:
        need = w.demand.get(r, 0)
        while pool < need and rel:
            x = min(rel)
            rel.remove(x)
            t, pool = max(t, x[0]), pool + x[1]
        if w.span and w.key == r and pool < w.max_units:
            best = (t + w.durations[_fit(w, pool)], t, pool, 0)
            tt, p = t, pool
            ahead = sorted(rel)[:MAX_WAIT_POPS]
            for i, (tr, u) in enumerate(ahead):
                if tr >= best[0]:
                    break
                tt, p = max(tt, tr), p + u
                fin = tt + w.durations[_fit(w, p)]
                if fin < best[0]:
                    best = (fin, tt, p, i + 1)
                if p >= w.max_units:
                    break
            for x in ahead[: best[3]]:
                rel.remove(x)
            t, pool = best[1], best[2]
            m = _fit(w, pool)
            dur = w.durations[m]
        elif w.span and w.key == r:
            m, dur = w.max_units, w.durations[w.max_units]
        else:
            m, dur = need, w.min_duration
        total += (t - now) + dur
        if m:
            pool -= m
            rel.append((t + dur, m))
    return total


def _window(queue: list[ActionSpec], free: dict, window: int, lookahead: int, max_scan: int):
    """FCFS: the first ``window`` actions whose minimum demand fits what the earlier ones left; the others
    read (and up to ``lookahead`` more once the window is full) wait, filed under their key elastic resource
    or else every resource they demand, at most ``lookahead`` per resource."""
    avail, cand, waiting = dict(free), [], {}
    extra_reads = 0
    for pos, s in enumerate(queue[:max_scan]):
        if len(cand) < window and all(avail.get(r, 0) >= u for r, u in s.demand.items()):
            for r, u in s.demand.items():
                avail[r] -= u
            cand.append((pos, s))
            continue
        if len(cand) >= window:
            extra_reads += 1
            if extra_reads > lookahead:
                break
        for r in ([s.key] if s.key is not None else list(s.demand)):
            if lookahead and len(waiting.setdefault(r, [])) < lookahead:
                waiting[r].append((pos, s))
    return cand, avail, waiting


def _j(r, kept, evicted, waiting, units, brel, now, top, split):
    """``J`` of one trial and its split (``top``: how many elastic candidates the split may widen)."""
    el = [s for _p, s in kept if s.span]
    extras, cost = split(el, units, top)
    fixed = [s for _p, s in kept if not s.span]
    crel = [(now + s.min_duration, s.demand[r]) for s in fixed]
    crel += [(now + s.durations[s.min_units + e], s.min_units + e) for s, e in zip(el, extras)]
    order = sorted(evicted + waiting, key=lambda ps: ps[0])
    return cost + sum(s.min_duration for s in fixed) + oracle_estimate(r, crel, brel, units - sum(extras), order, now), extras


def oracle_schedule(queue, free, running, now, *, window, depth, lookahead, keep_head, dp_top,
                    split=brute_split) -> tuple[list, int]:
    """The decision as documented; returns ``(grants in queue order, evictions)``."""
    cand, avail, waiting = _window(queue, free, window, lookahead, 4 * window + lookahead)
    units_of = {s.id: dict(s.demand) for _p, s in cand}
    dropped: set[str] = set()
    evictions = 0
    for r in dict.fromkeys(s.part for _p, s in cand):
        group = [(p, s) for p, s in cand if s.part == r]
        if r is None or not any(s.span for _p, s in group):
            continue
        left = avail.get(r, 0)
        if left >= sum(s.span for _p, s in group):
            for _p, s in group:
                units_of[s.id][r] = s.max_units if s.span else s.demand[r]
            continue
        brel = sorted((v.expected_end, v.units[r]) for v in running if v.units.get(r, 0) > 0)
        k, units = len(group), left
        # Convex curves only: the exact greedy widens every candidate; else the DP widens the first dp_top
        # (the partition's candidates decide, for every trial).
        top = None if all(s.convex for _p, s in group) else dp_top
        j, extras = _j(r, group, [], waiting.get(r, []), units, brel, now, top, split)
        if depth:
            for _ in range(depth):
                if k <= (1 if keep_head else 0):
                    break
                units2 = units + group[k - 1][1].demand.get(r, 0)
                j2, extras2 = _j(r, group[: k - 1], group[k - 1:], waiting.get(r, []), units2, brel, now, top, split)
                if abs(j2 - (j - 1e-9)) < 1e-12:  # the sums here and there may round apart
                    raise Ambiguous("an eviction on the threshold")
                if j2 >= j - 1e-9:
                    break
                k, j, extras, units = k - 1, j2, extras2, units2
                evictions += 1
        dropped.update(s.id for _p, s in group[k:])
        for s, e in zip([s for _p, s in group[:k] if s.span], extras):
            units_of[s.id][r] = s.min_units + e
    return [Grant(s.id, units_of[s.id]) for _p, s in cand if s.id not in dropped], evictions


def _profile(rng: random.Random, hi: int):
    if rng.random() < 0.75:
        return Amdahl(rng.uniform(0.1, 0.95))
    speed = [1.0]  # a table whose speedup rises unevenly: not convex
    for m in range(2, hi + 1):
        speed.append(speed[-1] + rng.uniform(0.05, 1.0))
    return TableProfile(tuple(s / (m + 1) for m, s in enumerate(speed)))


def _spec(rng: random.Random, i: int, resources: list[str]) -> ActionSpec:
    kind, traj, res = rng.random(), f"t{i % 5}", rng.choice(resources)
    if kind < 0.5:  # elastic
        lo = rng.choice([1, 1, 2])
        hi = lo + rng.randint(0, 3)
        demand = {res: lo}
        if rng.random() < 0.1:
            demand["mem"] = 1
        sizes = None
        if rng.random() < 0.15 and hi - lo >= 2:  # size-restricted: the DP path
            sizes = tuple(sorted({lo, hi, rng.randint(lo, hi)}))
        return ActionSpec(f"e{i}", traj, "build", demand, rng.uniform(0.5, 10.0),
                          ElasticSpec(res, hi, _profile(rng, hi), sizes=sizes))
    demand = {res: rng.choice([1, 1, 2])}
    if rng.random() < 0.1:
        demand["mem"] = 1
    return ActionSpec(f"f{i}", traj, "edit", demand, rng.uniform(0.05, 3.0))


def _instance(rng: random.Random, resources: list[str]):
    queue = [_spec(rng, i, resources) for i in range(rng.randint(1, 9))]
    free = {r: rng.randint(0, 8) for r in resources} | {"mem": rng.randint(0, 3)}
    now = rng.choice([0.0, 2.0])
    running = [RunningView(f"r{i}", f"rt{i}", {rng.choice(resources): rng.randint(1, 3)}, rng.uniform(now - 1.0, now + 5.0))
               for i in range(rng.randint(0, 6))]
    for r in resources:  # every demand (at most 2 units) can be met some day (module docstring)
        if free[r] + sum(v.units.get(r, 0) for v in running) < 2:
            free[r] = 2
    params = {"window": rng.choice([1, 2, 3, 4, 8]), "depth": rng.randint(0, 3), "lookahead": rng.randint(0, 4),
              "keep_head": rng.random() < 0.3, "dp_top": rng.choice([1, 2, 32])}
    return queue, free, running, now, params


@pytest.mark.parametrize("resources", [["cpu@n0"], RES])
def test_decisions_match_the_oracle_on_small_instances(resources: list[str]) -> None:
    """One resource (mostly the bulk window) and three (partitions, the general scan). An indexed
    :class:`ActionQueue` does not read the actions whose key (else first) resource has nothing free: the
    oracle gets the queue without them."""
    rng = random.Random(29 + len(resources))
    decided = ambiguous = with_evictions = 0
    for _ in range(1500):
        queue, free, running, now, p = _instance(rng, resources)
        try:
            want, evictions = oracle_schedule(queue, free, running, now, **p)
        except Ambiguous:
            ambiguous += 1
            continue
        decided += 1
        with_evictions += evictions > 0
        for rs in (running, RunningSet(running)):
            assert ElasticScheduler(**p).schedule(queue, free, rs, now) == want, (queue, free, running, now, p)
        open_ = [s for s in queue if free.get(s.key or next(iter(s.demand)), 0) > 0]
        try:
            want_open, _ = oracle_schedule(open_, free, running, now, **p)
        except Ambiguous:
            continue
        assert ElasticScheduler(**p).schedule(ActionQueue(queue), free, RunningSet(running), now) == want_open
    assert ambiguous < decided // 20 and with_evictions > 50, (decided, ambiguous, with_evictions)


def test_greedy_split_is_the_brute_force_split_on_convex_curves() -> None:
    rng = random.Random(5)
    for _ in range(500):
        el = [ActionSpec(f"b{i}", "t", "build", {"cpu": lo}, rng.uniform(0.5, 10.0),
                         ElasticSpec("cpu", lo + rng.randint(0, 3), Amdahl(rng.uniform(0.1, 0.95))))
              for i, lo in enumerate(rng.choice([1, 2]) for _ in range(rng.randint(1, 5)))]
        units = rng.randint(0, 12)
        ext, cost = greedy_split(el, units)
        assert (ext, cost) == (brute_split(el, units)[0], pytest.approx(brute_split(el, units)[1], rel=1e-12))


@pytest.mark.parametrize("m", [32, 64, 96, 128])
def test_contended_coding_snapshots_match_the_oracle(m: int) -> None:
    """The benchmark's shape at window 64 (builds up to 16 cores and one-core edits, 200 running 4-core
    actions): the bulk window, the release horizon over many running releases, accepted evictions."""
    rng = random.Random(m)
    evicted = 0
    for depth in (1, 2, 3):
        for lookahead in (0, 4):
            specs = []
            for i in range(96):
                if i % 2 == 0:
                    specs.append(ActionSpec(f"q{i}", f"t{i}", "build", {"cpu": 1}, rng.lognormvariate(1.5, 1.0),
                                            ElasticSpec("cpu", 16, Amdahl(rng.uniform(0.6, 0.8)))))
                else:
                    specs.append(ActionSpec(f"q{i}", f"t{i}", "edit", {"cpu": 1}, rng.lognormvariate(-1.0, 0.6)))
            running = [RunningView(f"r{i}", f"rt{i}", {"cpu": 4}, rng.uniform(0.0, 3.0)) for i in range(200)]
            p = {"window": 64, "depth": depth, "lookahead": lookahead, "keep_head": False, "dp_top": 32}
            want, ev = oracle_schedule(specs, {"cpu": m}, running, 0.0, split=greedy_split, **p)
            evicted += ev
            assert ElasticScheduler(**p).schedule(specs, {"cpu": m}, RunningSet(running), 0.0) == want
    assert evicted > 0


def test_estimate_matches_the_oracle() -> None:
    """Waiting actions (fixed and elastic, in queue order) over running and candidate releases; also with
    the candidate releases cut at the release horizon, which must not change the estimate."""
    rng = random.Random(7)
    r = "cpu"
    for _ in range(2000):
        now = rng.choice([0.0, 2.0])
        specs = [_spec(rng, i, [r]) for i in range(rng.randint(1, 8))]
        order = list(enumerate(specs))
        brel = sorted((rng.uniform(now - 1, now + 4), rng.randint(1, 4)) for _ in range(rng.randint(0, 12)))
        crel = sorted((now + rng.uniform(0.1, 6.0), rng.randint(1, 4)) for _ in range(rng.randint(0, 6)))
        pool = rng.randint(0, 4)
        if pool + sum(u for _t, u in brel + crel) < 2:  # every demand (at most 2 units) can be met
            pool = 2
        want = oracle_estimate(r, crel, brel, pool, order, now)
        assert ae.estimate_act(r, crel, brel, pool, order, now, math.inf) == pytest.approx(want, rel=1e-12)
        horizon = ae.release_horizon(r, brel, order, [])
        near = [c for c in crel if c[0] <= horizon]
        assert ae.estimate_act(r, near, brel, pool, order, now, math.inf) == pytest.approx(want, rel=1e-12)


def test_split_after_evictions_matches_brute_force() -> None:
    """``split_sorted`` (gains sorted once, the evicted candidates' gains skipped) gives the cheapest split
    of the remaining candidates, with the brute force's extras."""
    rng = random.Random(11)
    checked = 0
    for _ in range(600):
        n = rng.randint(1, 5)
        el = []
        for i in range(n):
            lo = rng.choice([1, 2])
            el.append(ActionSpec(f"b{i}", "t", "build", {"cpu": lo}, rng.uniform(0.5, 10.0),
                                 ElasticSpec("cpu", lo + rng.randint(1, 3), Amdahl(rng.uniform(0.1, 0.95)))))
        negs, spans = [s.neg_gains for s in el], [s.span for s in el]
        cap = rng.randint(1, 10)
        neg = sorted(gather(negs, spans, cap))
        removed: list[float] = []
        for ne in range(n, 0, -1):
            if ne < n:
                removed = sorted(removed + list(negs[ne][:cap]))
            units = rng.randint(0, cap)
            base = sum(s.min_duration for s in el[:ne])
            try:
                want_ext, want = brute_split(el[:ne], units)
            except Ambiguous:
                continue
            ext, cost = ae.split_sorted(el[:ne], negs[:ne], spans[:ne], neg, removed, units, cap, base)
            assert ext == want_ext and cost == pytest.approx(want, rel=1e-12)
            checked += 1
    assert checked > 1000


def test_the_oracles_on_hand_worked_cases() -> None:
    """The oracles themselves, on cases small enough to work out by hand."""
    a = ActionSpec("a", "t", "build", {"cpu": 1}, 8.0, ElasticSpec("cpu", 4, Amdahl(1.0)))  # 8 / m seconds
    b = ActionSpec("b", "t", "build", {"cpu": 1}, 2.0, ElasticSpec("cpu", 4, Amdahl(1.0)))  # 2 / m seconds
    assert brute_split([a, b], 2) == ([2, 0], 8 / 3 + 2)  # a's gains (4, 1.33) beat b's first (1)
    f = ActionSpec("f", "t", "edit", {"cpu": 2}, 1.0)
    # 1 unit free, releases at 0.5 (1 unit) and 3 (2 units): f starts at 0.5 and ends at 1.5.
    assert oracle_estimate("cpu", [], [(0.5, 1), (3.0, 2)], 1, [(0, f)], 0.0) == pytest.approx(1.5)
    # a on 1 free unit now ends at 8; waiting for the release at 0.5 (4 units then) ends at 0.5 + 2.
    assert oracle_estimate("cpu", [(0.5, 3)], [], 1, [(0, a)], 0.0) == pytest.approx(2.5)
    # Window 2 over 2 free cores: a and b start on one core each; evicting b (it waits 1 s for a core
    # freed at 1.0 by a running action) gives a 2 cores: J = 4 + (1 + 2) = 7 < 8 + 2 = 10.
    grants, ev = oracle_schedule([a, b], {"cpu": 2}, [RunningView("r", "rt", {"cpu": 1}, 1.0)], 0.0,
                                 window=2, depth=1, lookahead=0, keep_head=False, dp_top=32)
    assert (grants, ev) == ([Grant("a", {"cpu": 2})], 1)
    assert ElasticScheduler(window=2, depth=1, lookahead=0).schedule(
        [a, b], {"cpu": 2}, [RunningView("r", "rt", {"cpu": 1}, 1.0)], 0.0) == grants


def test_running_set_keeps_its_release_index_sorted() -> None:
    rng = random.Random(3)
    for _ in range(100):
        rs = RunningSet()
        for _ in range(rng.randint(0, 80)):
            i, res = rng.randint(0, 30), rng.choice(RES)
            aid = f"a{i}"
            if rng.random() < 0.5 and aid not in rs:
                rs.add(RunningView(aid, f"t{i % 3}", {res: rng.randint(1, 4), "mem": 1}, rng.choice([0.5, 1.0, 1.5, 2.0])))
            elif aid in rs:
                rs.remove(aid)
            for r in RES + ["mem"]:
                assert sorted_releases(rs, r) == sorted(release_list(rs, r))
                assert sorted_releases(list(rs), r) == sorted(release_list(rs, r))


def test_spec_row_and_grant_match_the_fields() -> None:
    """The precomputed columns the hot path reads agree with the fields they stand for."""
    specs = [
        ActionSpec("a", "t", "build", {"cpu": 2}, 3.0, ElasticSpec("cpu", 8, Amdahl(0.7))),
        ActionSpec("b", "t", "edit", {"cpu": 1}, 0.5),
        ActionSpec("c", "t", "x", {"cpu": 1, "mem": 2}, 1.0),
        ActionSpec("d", "t", "judge", {"gpu": 1}, 2.0, ElasticSpec("gpu", 4, Amdahl(0.5), sizes=(1, 2, 4))),
        ActionSpec("e", "t", "noop", {}, 1.0),
    ]
    for s in specs:
        assert s.row == (s.solo, s.part_units, s.span, s.min_duration, s.convex, s.grant)
        assert s.grant == (s.id, s.demand, None) and s.grant.units is s.demand
        assert s.solo == (next(iter(s.demand)) if len(s.demand) == 1 else None)
    assert [s.solo for s in specs] == ["cpu", "cpu", None, "gpu", None]
