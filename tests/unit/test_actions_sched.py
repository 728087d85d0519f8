"""Action schedulers: exact unit splitting, the tangram window/eviction, the baselines and the registry."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from libra.policies.actions.registry import (
    ActionQueue,
    ActionSpec,
    Amdahl,
    ElasticScheduler,
    ElasticSpec,
    FixedDoPScheduler,
    PerTrajectoryScheduler,
    RunningSet,
    RunningView,
    TableProfile,
    make_action_scheduler,
    split_units,
    split_units_dp,
)


def build(aid: str, t: float, p: float = 0.7, lo: int = 1, hi: int = 16, res: str = "cpu", traj: str = "t") -> ActionSpec:
    return ActionSpec(aid, traj, "build", {res: lo}, t, ElasticSpec(res, hi, Amdahl(p)))


def light(aid: str, t: float = 0.3, res: str = "cpu", traj: str = "t") -> ActionSpec:
    return ActionSpec(aid, traj, "edit", {res: 1}, t)


def brute_split(specs: list[ActionSpec], leftover: int) -> float:
    ranges = []
    for s in specs:
        if s.key is None:
            ranges.append([0])
        else:
            ranges.append([m for m in range(s.min_units, s.max_units + 1) if not math.isinf(s.durations[m])])
    best = math.inf
    for combo in itertools.product(*ranges):
        extra = sum(m - s.min_units for m, s in zip(combo, specs) if s.key is not None)
        if extra <= leftover:
            best = min(best, sum(s.durations[m] if s.key is not None else s.durations[0] for m, s in zip(combo, specs)))
    return best


def check_split(specs: list[ActionSpec], leftover: int, extras: list[int], total: float) -> None:
    assert len(extras) == len(specs)
    assert sum(extras) <= max(leftover, 0)
    recomputed = 0.0
    for s, e in zip(specs, extras):
        assert 0 <= e <= s.max_units - s.min_units
        d = s.durations[s.min_units + e] if s.key is not None else s.durations[0]
        assert not math.isinf(d)
        recomputed += d
    assert total == pytest.approx(recomputed)


@pytest.mark.parametrize("seed", range(30))
def test_convex_split_is_optimal(seed: int) -> None:
    rng = random.Random(seed)
    specs = [
        build(f"a{i}", rng.uniform(0.5, 10), rng.uniform(0.3, 0.95), lo=rng.randint(1, 2), hi=rng.randint(2, 6))
        for i in range(rng.randint(1, 4))
    ]
    if rng.random() < 0.5:
        specs.append(light("l"))
    leftover = rng.randint(0, 14)
    extras, total = split_units(specs, leftover)
    check_split(specs, leftover, extras, total)
    assert total == pytest.approx(brute_split(specs, leftover))


@pytest.mark.parametrize("seed", range(30))
def test_dp_split_is_optimal_for_non_convex_profiles_and_sizes(seed: int) -> None:
    rng = random.Random(100 + seed)
    specs = []
    for i in range(rng.randint(1, 4)):
        if rng.random() < 0.5:
            specs.append(
                ActionSpec(f"g{i}", "t", "judge", {"gpu": 1}, rng.uniform(1, 5), ElasticSpec("gpu", 4, Amdahl(rng.random()), sizes=(1, 2, 4)))
            )
        else:
            # speedups 1, 1.1, 1.2, 3.6: a late jump, not convex in duration
            specs.append(ActionSpec(f"n{i}", "t", "x", {"gpu": 1}, rng.uniform(1, 5), ElasticSpec("gpu", 4, TableProfile((1.0, 0.55, 0.4, 0.9)))))
    leftover = rng.randint(0, 10)
    extras, total = split_units(specs, leftover)
    check_split(specs, leftover, extras, total)
    assert total == pytest.approx(brute_split(specs, leftover))
    # The DP also handles convex specs exactly.
    conv = [build(f"c{i}", rng.uniform(1, 9), hi=5) for i in range(3)]
    e2, t2 = split_units_dp(conv, leftover)
    check_split(conv, leftover, e2, t2)
    assert t2 == pytest.approx(brute_split(conv, leftover))


def random_instance(rng: random.Random, n: int) -> tuple[list[ActionSpec], dict[str, int], RunningSet]:
    queue: list[ActionSpec] = []
    for i in range(n):
        res = rng.choice(["cpu@n0", "cpu@n1"])
        u = rng.random()
        if u < 0.4:
            queue.append(build(f"b{i}", rng.uniform(1, 12), rng.uniform(0.6, 0.8), lo=rng.choice([1, 1, 2]), res=res, traj=f"t{i}"))
        elif u < 0.9:
            queue.append(light(f"l{i}", rng.uniform(0.1, 1.0), res=res, traj=f"t{i}"))
        else:
            queue.append(ActionSpec(f"g{i}", f"t{i}", "reward", {"gpu": rng.choice([1, 2, 4])}, 0.5))
    free = {"cpu@n0": rng.randint(0, 40), "cpu@n1": rng.randint(0, 40), "gpu": rng.randint(0, 8)}
    running = RunningSet(
        RunningView(f"r{i}", f"rt{i}", {rng.choice(["cpu@n0", "cpu@n1", "gpu"]): rng.randint(1, 8)}, rng.uniform(0, 3))
        for i in range(rng.randint(0, 30))
    )
    return queue, free, running


def check_grants(queue: list[ActionSpec], free: dict[str, int], grants: list) -> None:
    by_id = {s.id: s for s in queue}
    seen = set()
    used: dict[str, int] = {}
    for g in grants:
        assert g.action_id not in seen
        seen.add(g.action_id)
        s = by_id[g.action_id]
        for r, u in s.demand.items():
            assert g.units[r] >= u  # at least the minimum demand
        if s.key is not None:
            m = g.units[s.key]
            assert s.min_units <= m <= s.max_units and not math.isinf(s.durations[m])
        for r, u in g.units.items():
            used[r] = used.get(r, 0) + u
    for r, u in used.items():
        assert u <= free.get(r, 0), f"{r}: granted {u} > free {free.get(r, 0)}"


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("name", ["tangram", "fixed_dop"])
def test_grants_fit_free_jointly_and_queue_index_changes_nothing(seed: int, name: str) -> None:
    rng = random.Random(seed)
    queue, free, running = random_instance(rng, rng.randint(1, 80))
    sched = make_action_scheduler(name, window=rng.choice([4, 16, 64]))
    grants = sched.schedule(queue, free, running, now=1.0)
    check_grants(queue, free, grants)
    again = sched.schedule(ActionQueue(queue), free, list(running), now=1.0)
    assert again == grants


def test_window_without_eviction_takes_the_first_n_that_fit() -> None:
    rng = random.Random(7)
    for _ in range(20):
        queue, free, running = random_instance(rng, 60)
        n = rng.choice([3, 10, 64])
        grants = ElasticScheduler(window=n, depth=0).schedule(queue, free, running, 0.0)
        avail = dict(free)
        expect = []
        for s in queue:
            if len(expect) == n:
                break
            if all(avail.get(r, 0) >= u for r, u in s.demand.items()):
                for r, u in s.demand.items():
                    avail[r] -= u
                expect.append(s.id)
        assert [g.action_id for g in grants] == expect


def test_plenty_of_units_gives_every_elastic_action_its_maximum() -> None:
    queue = [build("a", 8.0), build("b", 2.0, hi=8), light("c")]
    grants = ElasticScheduler().schedule(queue, {"cpu": 100}, [], 0.0)
    assert {g.action_id: g.units["cpu"] for g in grants} == {"a": 16, "b": 8, "c": 1}


def test_contended_units_follow_the_optimal_split() -> None:
    queue = [build("short", 1.0), build("long", 20.0)]
    grants = ElasticScheduler(depth=0).schedule(queue, {"cpu": 10}, [], 0.0)
    got = {g.action_id: g.units["cpu"] for g in grants}
    assert sum(got.values()) == 10 and got["long"] > got["short"]
    specs = list(queue)
    best = brute_split(specs, 8)
    assert sum(s.duration(got[s.id]) for s in specs) == pytest.approx(best)


def test_eviction_waits_for_units_when_that_completes_sooner() -> None:
    """One core free now, 15 more in 10 ms: starting a 10 s build on one core is worse than waiting."""
    queue = [build("b", 10.0, p=0.9)]
    running = [RunningView("r", "x", {"cpu": 15}, expected_end=0.01)]
    assert ElasticScheduler(depth=2).schedule(queue, {"cpu": 1}, running, 0.0) == []
    narrow = ElasticScheduler(depth=0).schedule(queue, {"cpu": 1}, running, 0.0)
    assert [(g.action_id, g.units["cpu"]) for g in narrow] == [("b", 1)]
    head = ElasticScheduler(depth=2, keep_head=True).schedule(queue, {"cpu": 1}, running, 0.0)
    assert [g.action_id for g in head] == ["b"]
    # If the release is far away, starting now is better.
    late = [RunningView("r", "x", {"cpu": 15}, expected_end=50.0)]
    assert [g.action_id for g in ElasticScheduler(depth=2).schedule(queue, {"cpu": 1}, late, 0.0)] == ["b"]


def test_eviction_of_a_trailing_light_action_feeds_the_build() -> None:
    """Two free cores: a long build and a short edit. Giving the build both cores saves more than the edit
    loses by waiting for a release that comes almost at once."""
    queue = [build("b", 30.0, p=0.95), light("e", 0.2)]
    running = [RunningView("r", "x", {"cpu": 1}, expected_end=0.001)]
    grants = ElasticScheduler(depth=1).schedule(queue, {"cpu": 2}, running, 0.0)
    assert [(g.action_id, g.units["cpu"]) for g in grants] == [("b", 2)]


def test_fixed_dop_clamps_and_blocks_without_backfill() -> None:
    queue = [build("a", 4.0, hi=2), build("b", 4.0), light("c")]
    g = FixedDoPScheduler(dop=4).schedule(queue, {"cpu": 5}, [], 0.0)
    assert [(x.action_id, x.units["cpu"]) for x in g] == [("a", 2), ("c", 1)]
    strict = FixedDoPScheduler(dop=4, backfill=False).schedule(queue, {"cpu": 5}, [], 0.0)
    assert [x.action_id for x in strict] == ["a"]


def test_per_trajectory_sandbox_is_reserved_until_the_trajectory_ends() -> None:
    sch = PerTrajectoryScheduler(sandbox={"cpu": 4})
    a1 = build("a1", 4.0, res="cpu@n0", traj="A")
    b1 = light("b1", res="cpu@n0", traj="B")
    g = sch.schedule([a1, b1], {"cpu@n0": 4}, RunningSet(), 0.0)
    assert [(x.action_id, dict(x.units)) for x in g] == [("a1", {"cpu@n0": 4})]
    assert sch.reserved_units() == {"cpu@n0": 4}
    # A's action finished; its sandbox stays reserved, so B still cannot get one ...
    assert sch.schedule([b1], {"cpu@n0": 4}, RunningSet(), 1.0) == []
    # ... while A's next action runs at once in A's sandbox.
    a2 = light("a2", res="cpu@n0", traj="A")
    g2 = sch.schedule([b1, a2], {"cpu@n0": 4}, RunningSet(), 1.0)
    assert [(x.action_id, dict(x.units)) for x in g2] == [("a2", {"cpu@n0": 4})]
    sch.trajectory_finished("A", 2.0)
    assert sch.reserved_units() == {}
    g3 = sch.schedule([b1], {"cpu@n0": 4}, RunningSet(), 2.0)
    assert [x.action_id for x in g3] == ["b1"]


def test_per_trajectory_relocates_a_sandbox_to_a_node_with_room() -> None:
    sch = PerTrajectoryScheduler(sandbox={"cpu": 3})
    a = light("a", res="cpu@n0", traj="A")
    g = sch.schedule([a], {"cpu@n0": 2, "cpu@n1": 8}, RunningSet(), 0.0)
    assert [dict(x.units) for x in g] == [{"cpu@n1": 3}]
    assert a.dop_for(g[0].units) == 0  # a non-elastic action has no DoP


def test_per_trajectory_one_action_at_a_time_per_sandbox() -> None:
    sch = PerTrajectoryScheduler(sandbox={"cpu": 2})
    a1, a2 = light("a1", traj="A"), light("a2", traj="A")
    rs = RunningSet()
    g = sch.schedule([a1, a2], {"cpu": 10}, rs, 0.0)
    assert [x.action_id for x in g] == ["a1"]
    rs.add(RunningView("a1", "A", g[0].units, 1.0))
    assert sch.schedule([a2], {"cpu": 8}, rs, 0.5) == []


def test_registry_names_and_errors() -> None:
    assert make_action_scheduler("tangram").name == "tangram"
    assert make_action_scheduler("fifo_fixed_dop", dop=16).dop == 16  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"unknown action scheduler: 'sjf' \(known: tangram, fixed_dop"):
        make_action_scheduler("sjf")
    with pytest.raises(ValueError, match="unknown parameter 'dop'"):
        make_action_scheduler("tangram", dop=4)
    with pytest.raises(ValueError, match="window"):
        make_action_scheduler("tangram", window=0)
    with pytest.raises(ValueError, match="sandbox"):
        make_action_scheduler("per_trajectory", sandbox={"cpu": 0})
