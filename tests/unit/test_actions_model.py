"""Action model: durations, profiles, validation, token buckets, and the indexed running/queue views."""

from __future__ import annotations

import math
import random

import pytest

from libra.policies.actions.registry import (
    ActionModelError,
    ActionQueue,
    ActionSpec,
    Amdahl,
    ElasticSpec,
    QuotaError,
    RunningSet,
    RunningView,
    TableProfile,
    TokenBucket,
    held_units,
    release_list,
    resource_kind,
    scan_order,
)


def elastic(aid: str, t: float = 8.0, p: float = 0.7, hi: int = 16, lo: int = 1, res: str = "cpu") -> ActionSpec:
    return ActionSpec(aid, "traj", "build", {res: lo}, t, ElasticSpec(res, hi, Amdahl(p)))


def test_duration_follows_amdahl_formula() -> None:
    a = elastic("a", t=8.0, p=0.7)
    for m in (1, 2, 5, 16):
        eff = Amdahl(0.7).efficiency(m)
        assert a.duration(m) == pytest.approx(8.0 / (eff * m))
        assert a.duration(m) == pytest.approx(8.0 * (0.3 + 0.7 / m))
    assert a.duration() == pytest.approx(8.0)  # the minimum DoP


def test_duration_decreases_and_marginal_gains_shrink() -> None:
    a = elastic("a", t=5.0, p=0.8)
    ds = [a.duration(m) for m in range(1, 17)]
    assert all(x > y for x, y in zip(ds, ds[1:]))
    assert list(a.gains) == sorted(a.gains, reverse=True)
    assert sum(a.gains) == pytest.approx(a.duration(1) - a.duration(16))


def test_non_elastic_action_has_fixed_duration() -> None:
    a = ActionSpec("e", "t", "edit", {"cpu": 1}, 0.3)
    assert a.key is None and a.duration() == 0.3 and a.elastic_range == 0


def test_table_profile_validation_and_convexity() -> None:
    tp = TableProfile((1.0, 0.9, 0.8, 0.7))
    assert tp.speedup(2) == pytest.approx(1.8)
    assert tp.speedup(10) == pytest.approx(2.8)  # flat beyond the table
    assert tp.convex
    with pytest.raises(ActionModelError, match=r"E\(1\)"):
        TableProfile((0.9, 0.8))
    with pytest.raises(ActionModelError, match="must not decrease"):
        TableProfile((1.0, 0.4))  # speedup 0.8 < 1
    # A profile with a late jump in speedup is not convex in duration.
    assert not TableProfile((1.0, 0.55, 0.367, 0.5)).convex


def test_spec_validation_names_the_field() -> None:
    with pytest.raises(ActionModelError, match="base_duration"):
        ActionSpec("a", "t", "x", {"cpu": 1}, 0.0)
    with pytest.raises(ActionModelError, match=r"demand\['cpu'\]"):
        ActionSpec("a", "t", "x", {"cpu": -1}, 1.0)
    with pytest.raises(ActionModelError, match="minimum DoP"):
        ActionSpec("a", "t", "x", {"mem_gb": 4}, 1.0, ElasticSpec("cpu", 8))
    with pytest.raises(ActionModelError, match="max_units"):
        ActionSpec("a", "t", "x", {"cpu": 4}, 1.0, ElasticSpec("cpu", 2))
    with pytest.raises(ActionModelError, match="sizes"):
        ActionSpec("a", "t", "x", {"gpu": 1}, 1.0, ElasticSpec("gpu", 4, sizes=(2, 4)))
    with pytest.raises(ActionModelError, match="parallel_fraction"):
        Amdahl(1.5)


def test_sizes_restrict_units_and_dop_rounds_down() -> None:
    a = ActionSpec("g", "t", "judge", {"gpu": 1}, 4.0, ElasticSpec("gpu", 4, Amdahl(0.9), sizes=(1, 2, 4)))
    assert math.isinf(a.durations[3]) and not a.convex
    with pytest.raises(ActionModelError, match="not allowed"):
        a.duration(3)
    assert a.dop_for({"gpu": 3}) == 2
    assert a.dop_for({"gpu": 8}) == 4


def test_dop_for_accepts_a_relocated_place_of_the_same_kind() -> None:
    a = elastic("a", res="cpu@n03")
    assert resource_kind("cpu@n03") == "cpu"
    assert a.dop_for({"cpu@n05": 6}) == 6
    assert a.dop_for({"quota:x": 1}) == 1  # nothing of its kind: the minimum


def test_token_bucket_rate_burst_and_next_time() -> None:
    b = TokenBucket(rate=10.0, burst=3.0)
    assert b.available(0.0) == 3.0
    for _ in range(3):
        assert b.try_take(0.0)
    assert not b.try_take(0.0)
    assert b.next_time(0.0) == pytest.approx(0.1)
    assert b.available(0.05) == pytest.approx(0.5)
    assert b.available(10.0) == 3.0  # capped at burst
    with pytest.raises(QuotaError, match="backwards"):
        b.available(5.0)
    with pytest.raises(QuotaError, match="requested"):
        TokenBucket(1.0, 1.0).take(0.0, 2.0)
    with pytest.raises(QuotaError, match="rate"):
        TokenBucket(0.0, 1.0)


def test_token_bucket_long_run_rate_is_respected() -> None:
    b = TokenBucket(rate=200.0, burst=20.0)
    taken, t = 0, 0.0
    while t < 10.0:
        if b.try_take(t):
            taken += 1
        t = round(t + 0.001, 6)
    assert taken <= 200 * 10 + 20
    assert taken >= 200 * 10 - 5


def test_running_set_index_matches_a_plain_scan() -> None:
    rng = random.Random(3)
    views = [
        RunningView(f"a{i}", f"t{i % 7}", {rng.choice(["cpu@n0", "cpu@n1", "gpu"]): rng.randint(1, 8)}, rng.random())
        for i in range(50)
    ]
    rs = RunningSet(views)
    for v in views[::3]:
        rs.remove(v.action_id)
    plain = [v for v in views if v.action_id in rs]
    assert len(rs) == len(plain) and list(rs) == plain
    for r in ("cpu@n0", "cpu@n1", "gpu", "nothing"):
        assert sorted(release_list(rs, r)) == sorted(release_list(plain, r))
        assert held_units(rs, r) == held_units(plain, r)
    assert rs.has_trajectory(plain[0].trajectory)
    with pytest.raises(ActionModelError, match="twice"):
        rs.add(plain[0])


def test_action_queue_is_fcfs_and_skips_only_closed_resources() -> None:
    specs = []
    for i in range(40):
        res = ["cpu@n0", "cpu@n1", "gpu", "quota:s"][i % 4]
        specs.append(ActionSpec(f"a{i}", "t", "x", {res: 1}, 1.0))
    q = ActionQueue(specs)
    q.remove("a5")
    assert [s.id for s in q] == [s.id for s in specs if s.id != "a5"]
    free = {"cpu@n0": 2, "cpu@n1": 0, "gpu": 1, "quota:s": 0}
    opened = [s.id for s in scan_order(q, free)]
    expect = [s.id for s in q if free[s.items[0][0]] > 0]
    assert opened == expect
    assert [s.id for s in scan_order(q, free, ("quota:s",))] == [
        s.id for s in q if free[s.items[0][0]] > 0 or s.items[0][0] == "quota:s"
    ]
    assert [s.id for s in scan_order(list(q), free)] == [s.id for s in q]  # plain sequences: everything
