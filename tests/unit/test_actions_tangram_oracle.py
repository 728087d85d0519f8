"""The optimised ``tangram`` scheduler makes exactly the decisions of the reference implementation.

:class:`~libra.bench.tangram_ref.ReferenceElasticScheduler` is the first implementation, kept
verbatim. On randomised instances (convex and non-convex profiles, size-restricted GPU actions, fixed and
multi-resource actions, ties in the marginal gains, overdue releases, every parameter) both must return the
same grants, with the same units, in the same order. Also checks the sorted release index of
:class:`RunningSet` that the optimised estimate relies on.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
from libra.bench.tangram_ref import ReferenceElasticScheduler
from libra.policies.actions.views import sorted_releases

RES = ["cpu@n0", "cpu@n1", "gpu"]
# A few shared (T, p) pairs make equal marginal gains across actions likely (the tie rule matters).
SHARED = [(4.0, 0.7), (2.0, 0.5), (8.0, 0.9), (3.0, 0.0), (5.0, 1.0)]
NONCONVEX = TableProfile((1.0, 0.55, 0.4, 0.9))


def _spec(rng: random.Random, i: int) -> ActionSpec:
    kind = rng.random()
    traj = f"t{i % 7}"
    if kind < 0.45:  # CPU-elastic build (convex)
        res = rng.choice(RES[:2])
        lo = rng.choice([1, 1, 1, 2])
        hi = rng.choice([lo, lo + 1, 4, 8, 16]) if lo <= 4 else 16
        hi = max(hi, lo)
        t, p = rng.choice(SHARED) if rng.random() < 0.4 else (round(rng.uniform(0.2, 20.0), 3), round(rng.random(), 2))
        demand = {res: lo}
        if rng.random() < 0.15:
            demand["mem"] = rng.randint(1, 3)
        return ActionSpec(f"b{i}", traj, "build", demand, t, ElasticSpec(res, hi, Amdahl(p)))
    if kind < 0.55:  # GPU action restricted to cells of 1/2/4 (not convex: the DP path)
        lo = rng.choice([1, 2])
        return ActionSpec(f"g{i}", traj, "judge", {"gpu": lo}, rng.uniform(0.5, 6.0),
                          ElasticSpec("gpu", 4, Amdahl(rng.random()), sizes=tuple(s for s in (1, 2, 4) if s >= lo)))
    if kind < 0.6:  # a non-convex profiled table
        res = rng.choice(RES[:2])
        return ActionSpec(f"n{i}", traj, "x", {res: 1}, rng.uniform(1.0, 5.0), ElasticSpec(res, 4, NONCONVEX))
    if kind < 0.65:  # elastic in name only (max == min)
        res = rng.choice(RES[:2])
        return ActionSpec(f"e{i}", traj, "pinned", {res: 2}, rng.uniform(0.1, 3.0), ElasticSpec(res, 2, Amdahl(0.5)))
    res = rng.choice(RES)
    demand = {res: rng.choice([1, 1, 2, 4])}
    if rng.random() < 0.1:
        demand["mem"] = 1
    t = rng.choice([0.3, 0.5]) if rng.random() < 0.3 else rng.uniform(0.05, 2.0)
    return ActionSpec(f"f{i}", traj, "edit", demand, t)


def _instance(seed: int, n: int, tight: bool) -> tuple[list[ActionSpec], dict[str, int], list[RunningView], float]:
    rng = random.Random(seed)
    queue = [_spec(rng, i) for i in range(n)]
    hi = 12 if tight else 80
    free = {"cpu@n0": rng.randint(0, hi), "cpu@n1": rng.randint(0, hi), "gpu": rng.randint(0, 8), "mem": rng.randint(0, 6)}
    now = rng.choice([0.0, 1.0, 5.0])
    running = [
        RunningView(f"r{i}", f"rt{i}", {rng.choice(RES): rng.randint(1, 8)},
                    rng.choice([now, now + 0.5]) if rng.random() < 0.2 else rng.uniform(now - 1.0, now + 4.0))
        for i in range(rng.randint(0, 40))
    ]
    return queue, free, running, now


params = st.fixed_dictionaries({
    "window": st.sampled_from([1, 2, 4, 8, 16, 64]),
    "depth": st.integers(0, 4),
    "lookahead": st.integers(0, 6),
    "keep_head": st.booleans(),
    "dp_top": st.sampled_from([1, 4, 32]),
})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), n=st.integers(1, 90), tight=st.booleans(), p=params,
       indexed=st.booleans())
def test_optimised_tangram_decides_exactly_like_the_reference(seed: int, n: int, tight: bool, p: dict, indexed: bool) -> None:
    queue, free, running, now = _instance(seed, n, tight)
    # The same views for both: an ActionQueue skips closed resources, which changes what max_scan reaches.
    q = ActionQueue(queue) if indexed else queue
    ref = ReferenceElasticScheduler(**p).schedule(q, free, RunningSet(running) if indexed else running, now)
    got = ElasticScheduler(**p).schedule(q, free, RunningSet(running) if indexed else running, now)
    assert got == ref
    # The optimised scheduler reads a plain running list exactly like the indexed set.
    assert ElasticScheduler(**p).schedule(q, free, running if indexed else RunningSet(running), now) == ref


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31), m=st.sampled_from([32, 64, 96, 128, 256, 1024]), depth=st.integers(1, 4))
def test_contended_coding_snapshots_match_the_reference(seed: int, m: int, depth: int) -> None:
    """The benchmark's shape (builds up to 16 cores + one-core edits, 200 running 4-core actions), where
    evictions are accepted: the incremental trials must agree with recomputing everything."""
    rng = random.Random(seed)
    specs = []
    for i in range(96):
        if i % 2 == 0:
            specs.append(ActionSpec(f"q{i}", f"t{i}", "build", {"cpu": 1}, rng.lognormvariate(1.5, 1.0),
                                    ElasticSpec("cpu", 16, Amdahl(rng.uniform(0.6, 0.8)))))
        else:
            specs.append(ActionSpec(f"q{i}", f"t{i}", "edit", {"cpu": 1}, rng.lognormvariate(-1.0, 0.6)))
    running = [RunningView(f"r{i}", f"rt{i}", {"cpu": 4}, rng.uniform(0.0, 3.0)) for i in range(200)]
    free = {"cpu": m}
    ref = ReferenceElasticScheduler(window=64, depth=depth).schedule(specs, free, running, 0.0)
    got = ElasticScheduler(window=64, depth=depth).schedule(specs, free, RunningSet(running), 0.0)
    assert got == ref


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 30), st.sampled_from(RES), st.integers(1, 4),
                              st.sampled_from([0.5, 1.0, 1.5, 2.0])), max_size=80))
def test_running_set_keeps_its_release_index_sorted(ops: list) -> None:
    rs = RunningSet()
    for add, i, res, units, end in ops:
        aid = f"a{i}"
        if add and aid not in rs:
            rs.add(RunningView(aid, f"t{i % 3}", {res: units, "mem": 1}, end))
        elif not add and aid in rs:
            rs.remove(aid)
        for r in RES + ["mem"]:
            assert sorted_releases(rs, r) == sorted(release_list(rs, r))
            assert sorted_releases(list(rs), r) == sorted(release_list(rs, r))


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**31), n_run=st.integers(0, 120), n_wait=st.integers(0, 6), n_ev=st.integers(0, 3))
def test_completion_time_estimate_matches_the_reference_heap(seed: int, n_run: int, n_wait: int, n_ev: int) -> None:
    """The sorted-list estimate with the release horizon equals the reference completion-time heap."""
    from libra.policies.actions import estimate as ae
    from libra.bench import tangram_ref as ref

    rng = random.Random(seed)
    r, now = "cpu", rng.choice([0.0, 2.0])
    specs = [_spec(rng, i) for i in range(40)]
    specs = [s for s in specs if s.part in ("cpu@n0", "cpu@n1")]
    specs = [ActionSpec(s.id, s.trajectory, s.tool, {r: s.demand[s.part]}, s.base_duration,
                        None if s.elastic is None else ElasticSpec(r, s.elastic.max_units, s.elastic.profile))
             for s in specs]
    sched = [s for s in specs[:20] if s.span]
    extras = [rng.randint(0, s.span) for s in sched]
    fixed_rel = [(now + s.min_duration, s.part_units) for s in specs[:20] if not s.span]
    tail = [(p, s) for p, s in enumerate(specs[20:], start=20)]
    evicted, waiting = tail[:n_ev], tail[n_ev:n_ev + n_wait]
    # Small running releases and an empty pool make the estimate pop deep into both release lists.
    big = rng.random() < 0.3
    base = [(rng.choice([now, now + 0.25, rng.uniform(now - 1, now + 3)]), rng.randint(1, 8) if big else 1)
            for _ in range(n_run)]
    pool = rng.randint(0, 6) if big else 0
    leftover = pool + sum(extras)
    heap = base[:]
    import heapq

    heapq.heapify(heap)
    want = ref._waiting_cost(r, sched, extras, fixed_rel, leftover, evicted, waiting, heap, now)
    crel = sorted(fixed_rel + [(now + s.durations[s.min_units + e], s.min_units + e) for s, e in zip(sched, extras)])
    brel = sorted(base)
    order = ae.merge_pos(evicted, waiting)
    horizon = ae.release_horizon(r, brel, waiting, [s for _p, s in evicted])
    near = [c for c in crel if c[0] <= horizon]
    assert ae.estimate_act(r, crel, brel, pool, order, now, float("inf")) == want
    assert ae.estimate_act(r, near, brel, pool, order, now, float("inf")) == want


def _one_resource_spec(rng: random.Random, i: int, res: str) -> ActionSpec:
    """An action demanding only ``res`` (the bulk-window path), occasionally one that also needs ``mem``."""
    kind = rng.random()
    traj = f"t{i % 5}"
    if kind < 0.45:
        lo = rng.choice([1, 1, 2])
        hi = rng.choice([lo, lo + 1, 4, 8, 16])
        t, p = rng.choice(SHARED) if rng.random() < 0.5 else (round(rng.uniform(0.2, 20.0), 3), round(rng.random(), 2))
        return ActionSpec(f"b{i}", traj, "build", {res: lo}, t, ElasticSpec(res, max(hi, lo), Amdahl(p)))
    if kind < 0.5:  # not convex: the DP path
        return ActionSpec(f"n{i}", traj, "x", {res: 1}, rng.uniform(1.0, 5.0), ElasticSpec(res, 4, NONCONVEX))
    if kind < 0.53:  # size-restricted (not convex)
        return ActionSpec(f"g{i}", traj, "judge", {res: 1}, rng.uniform(0.5, 6.0),
                          ElasticSpec(res, 4, Amdahl(rng.random()), sizes=(1, 2, 4)))
    if kind < 0.56:  # a second resource: the window leaves the bulk path
        return ActionSpec(f"m{i}", traj, "edit", {res: 1, "mem": 1}, rng.uniform(0.05, 2.0))
    t = rng.choice([0.3, 0.5]) if rng.random() < 0.3 else rng.uniform(0.05, 2.0)
    return ActionSpec(f"f{i}", traj, "edit", {res: rng.choice([1, 1, 2])}, t)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), n=st.integers(1, 100), p=params, indexed=st.booleans(),
       slack=st.integers(-3, 40), n_run=st.integers(0, 60))
def test_bulk_window_decides_exactly_like_the_reference(seed: int, n: int, p: dict, indexed: bool, slack: int,
                                                        n_run: int) -> None:
    """Windows of single-resource actions (the bulk path of ``schedule``): free units around the window's
    total demand (exactly enough, a few short, plenty), every parameter, ties in the gains, evictions."""
    rng = random.Random(seed)
    res = "cpu@n0"
    queue = [_one_resource_spec(rng, i, res) for i in range(n)]
    head = sum(s.demand[res] for s in queue[: p["window"]])
    free = {res: max(0, head + slack), "mem": rng.randint(0, 3)}
    now = rng.choice([0.0, 2.5])
    running = [RunningView(f"r{i}", f"rt{i}", {res: rng.randint(1, 4)},
                           rng.choice([now, now + 0.5]) if rng.random() < 0.2 else rng.uniform(now - 1.0, now + 4.0))
               for i in range(n_run)]
    q = ActionQueue(queue) if indexed else queue
    ref = ReferenceElasticScheduler(**p).schedule(q, free, running, now)
    assert ElasticScheduler(**p).schedule(q, free, RunningSet(running), now) == ref
    assert ElasticScheduler(**p).schedule(q, free, running, now) == ref


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 30), leftover=st.integers(0, 60), drops=st.integers(0, 4),
       capped=st.booleans())
def test_split_after_evictions_matches_the_reference_splitter(seed: int, n: int, leftover: int, drops: int,
                                                              capped: bool) -> None:
    """``split_sorted`` (gains sorted once, evicted owners' gains skipped) equals the reference
    ``_ConvexSplit`` after ``drop_last`` calls: same extras, bit-identical cost."""
    from bisect import insort as _insort

    from libra.policies.actions import estimate as ae
    from libra.policies.actions import tangram_evict as at
    from libra.bench import tangram_ref as ref

    rng = random.Random(seed)
    el = []
    for i in range(n):
        t, pp = rng.choice(SHARED) if rng.random() < 0.5 else (rng.uniform(0.2, 20.0), rng.random())
        lo = rng.choice([1, 2])
        el.append(ActionSpec(f"b{i}", "t", "build", {"cpu": lo}, t, ElasticSpec("cpu", rng.choice([lo + 1, 4, 8, 16]), Amdahl(pp))))
    drops = min(drops, n)
    cap = leftover + drops * rng.randint(0, 3) if capped else 10**6
    splitter = ref._ConvexSplit(el, cap)
    negs = [s.neg_gains for s in el]
    spans = [s.span for s in el]
    neg = at.gather(negs, spans, cap)
    neg.sort()
    base = 0.0
    for s in el:
        base += s.min_duration
    removed: list[float] = []
    units = leftover
    for d in range(drops + 1):
        ne = n - d
        if d:
            splitter.drop_last()
            base -= el[ne].min_duration
            for v in negs[ne][:cap]:
                _insort(removed, v)
            units = min(cap, units + rng.randint(0, 3))
        want = splitter.solve(units)
        got = ae.split_sorted(el[:ne], negs[:ne], spans[:ne], neg, removed, units, cap, base)
        assert got == want


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
