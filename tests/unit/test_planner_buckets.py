"""The pooled-bucket rollout DP (libra.policies.planner.buckets) against brute force, and its planner wiring."""

from __future__ import annotations

import itertools
import math

import pytest

from libra.policies.cost import TrainingCostModel, load_hardware, load_model
from libra.policies.planner.allocators import GlobalResourcePlanner, PlannerConfig, Workload
from libra.policies.planner.buckets import BucketCosts, BucketTable, evaluate_buckets
from libra.policies.planner.rollout_dp import RolloutSample

from planner_refs import RM, _agentic_requests, _pooled_agentic, _requests  # reference sums (tests/unit)


def _pooled(reqs: list[tuple[float, float, float]], tp: int, k: int, lag: int = 1) -> float:
    """Direct sums: the busiest of ``k`` instances sharing ``reqs`` evenly."""
    n = len(reqs)
    share = min(k, n)
    p, g, c = (sum(r[x] for r in reqs) for x in range(3))
    gp = sum(r[1] * r[0] * (1 + 1 / r[2]) / 2 for r in reqs)  # generation-weighted resident prompt
    gg = sum(r[1] * r[1] for r in reqs)
    cost = RM.segment_cost(tp, p / share, g / share, n / share, max(r[0] + r[1] for r in reqs),
                           max(r[1] for r in reqs) / lag, gp / share, gg / share)
    return float(cost) + (c - n) / share * RM.cal.per_request_overhead_s


def _brute(reqs: list[tuple[float, float, float]], gpus: int, tps: tuple[int, ...], het: bool, lag: int = 1) -> float:
    """Every ascending-TP choice of buckets with instance counts and every contiguous split."""
    reqs = sorted(reqs, key=lambda r: r[0] + r[1])
    n, best = len(reqs), math.inf
    for m in range(1, len(tps) + 1):
        for chosen in itertools.combinations(sorted(tps), m):
            if het and m < 2:
                continue
            for ks in itertools.product(*(range(1, gpus // t + 1) for t in chosen)):
                if sum(k * t for k, t in zip(ks, chosen)) > gpus:
                    continue
                for cuts in itertools.combinations(range(1, n), m - 1):
                    b = (0, *cuts, n)
                    best = min(best, max(_pooled(reqs[b[a]:b[a + 1]], chosen[a], ks[a], lag) for a in range(m)))
    return best


@pytest.mark.parametrize(("gpus", "n", "tps", "seed", "het", "lag"), [
    (8, 6, (1, 2, 4), 0, False, 1), (6, 7, (1, 2), 1, True, 1), (8, 5, (1, 2, 4, 8), 2, False, 2), (4, 6, (1, 4), 3, False, 1),
])
def test_bucket_dp_equals_brute_force(gpus: int, n: int, tps: tuple[int, ...], seed: int, het: bool, lag: int) -> None:
    reqs = _requests(n, seed)
    sample = RolloutSample.from_workload(Workload.from_pairs(reqs))
    costs = BucketCosts(RM, sample, lag)
    table = BucketTable(costs, tps, gpus, require_heterogeneous=het)
    for g in range(gpus + 1):
        expected = _brute(reqs, g, tps, het, lag)
        got = table.time(g)
        if math.isinf(expected):
            assert math.isinf(got) and table.buckets(g) == []
            continue
        assert got == pytest.approx(expected, rel=1e-9)
        bks = table.buckets(g)
        assert [b[0] for b in bks] == sorted({b[0] for b in bks})  # one bucket per TP, ascending
        assert sum(tp * k for tp, k, _, _ in bks) <= g
        assert bks[0][2] == 0 and bks[-1][3] == n and all(a[3] == b[2] for a, b in itertools.pairwise(bks))
        assert max(costs.cost(tp, k)[j, i] for tp, k, j, i in bks) == pytest.approx(got, rel=1e-12)


def test_evaluate_buckets_matches_the_table_for_its_own_layout() -> None:
    reqs = _requests(7, 5)
    costs = BucketCosts(RM, RolloutSample.from_workload(Workload.from_pairs(reqs)))
    table = BucketTable(costs, (1, 2, 4), 8)
    bks = table.buckets(8)
    layout = tuple(tp for tp, k, _, _ in bks for _ in range(k))
    value, again = evaluate_buckets(costs, layout)
    assert value == pytest.approx(table.time(8), rel=1e-12)
    assert evaluate_buckets(costs, ()) == (math.inf, [])


def test_pooled_search_deploys_one_bucket_per_tp_and_reevaluates_consistently() -> None:
    tm = TrainingCostModel(load_hardware("a800"), load_model("qwen3-14b"))
    cfg = PlannerConfig(n_gpus=48, global_batch=256, group_size=16, granularity=8, min_train_gpus=8, min_rollout_gpus=8)
    assert cfg.pooled_buckets
    reqs = _requests(256, 9)
    planner = GlobalResourcePlanner(RM, tm, cfg)
    plan = planner.search(reqs)
    again = planner.evaluate(plan, reqs)
    assert again.layout_key() == plan.layout_key()
    assert again.t_rollout == pytest.approx(plan.t_rollout) and again.t_train == pytest.approx(plan.t_train)
    by_tp: dict[int, set[tuple[float, float]]] = {}
    for inst in plan.rollout:
        by_tp.setdefault(inst.tp, set()).add((inst.min_tokens, inst.max_tokens))
    assert all(len(r) == 1 for r in by_tp.values())  # the instances of a TP share their bucket's range
    with pytest.raises(Exception):
        PlannerConfig(n_gpus=8, global_batch=8, group_size=8, overlap_steps=0)


# -- the agentic critical path: tool seconds, chain bound, pipeline objective -------------------------
def _brute_agentic(reqs: list[tuple[float, float, float, float]], gpus: int, tps: tuple[int, ...],
                   lag: int) -> tuple[float, float]:
    """``(min over layouts of max bucket cost, the chain of that layout)`` over every ascending-TP choice."""
    reqs = sorted(reqs, key=lambda r: r[0] + r[1])
    n, best = len(reqs), (math.inf, math.inf)
    for m in range(1, len(tps) + 1):
        for chosen in itertools.combinations(sorted(tps), m):
            for ks in itertools.product(*(range(1, gpus // t + 1) for t in chosen)):
                if sum(k * t for k, t in zip(ks, chosen)) > gpus:
                    continue
                for cuts in itertools.combinations(range(1, n), m - 1):
                    b = (0, *cuts, n)
                    parts = [_pooled_agentic(reqs[b[a]:b[a + 1]], chosen[a], ks[a], lag) for a in range(m)]
                    val = (max(x[0] for x in parts), max(x[1] for x in parts))
                    best = min(best, val, key=lambda v: v[0])
    return best


@pytest.mark.parametrize(("gpus", "n", "tps", "seed", "lag"), [(8, 6, (1, 2, 4), 0, 1), (8, 5, (1, 2, 4, 8), 2, 2),
                                                                (6, 7, (1, 2), 4, 3)])
def test_agentic_bucket_dp_equals_brute_force(gpus: int, n: int, tps: tuple[int, ...], seed: int, lag: int) -> None:
    reqs = _agentic_requests(n, seed)
    costs = BucketCosts(RM, RolloutSample.from_workload(Workload.from_pairs(reqs)), lag)
    table = BucketTable(costs, tps, gpus)
    for g in range(gpus + 1):
        expected, _ = _brute_agentic(reqs, g, tps, lag)
        got = table.time(g)
        if math.isinf(expected):
            assert math.isinf(got)
            continue
        assert got == pytest.approx(expected, rel=1e-9)
        bks = table.buckets(g)
        assert costs.layout_chain(bks) == pytest.approx(
            max(_pooled_agentic(sorted(reqs, key=lambda r: r[0] + r[1])[j:i], tp, k, lag)[1] for tp, k, j, i in bks),
            rel=1e-9)


def test_tool_seconds_lengthen_the_chain_and_shrink_the_batch() -> None:
    base = _requests(12, 3)
    sample0 = RolloutSample.from_workload(Workload.from_pairs([(p, g, c, 0.0) for p, g, c in base]))
    sample1 = RolloutSample.from_workload(Workload.from_pairs([(p, g, c, 300.0) for p, g, c in base]))
    c0, c1 = BucketCosts(RM, sample0, 2), BucketCosts(RM, sample1, 2)
    n = sample0.size
    # tools lengthen the chain (their seconds, less the faster decode steps of the smaller running
    # batch) and never make an instance faster
    assert c0.chain(2, 1)[0, n] < c1.chain(2, 1)[0, n] < c0.chain(2, 1)[0, n] + 300.0
    assert c1.cost(2, 1)[0, n] >= c0.cost(2, 1)[0, n]
    # without tool seconds the cost is segment_cost's (the pre-agentic model)
    assert c0.cost(2, 2)[0, n] == pytest.approx(_pooled(base, 2, 2, 2), rel=1e-12)


def test_pipeline_objective_charges_chain_plus_training_over_the_lag() -> None:
    from libra.policies.planner.types import Plan, pipeline_objective
    assert pipeline_objective(100.0, 200.0, 900.0, 1) == 200.0  # the paper's max for L = 1
    assert pipeline_objective(100.0, 200.0, 900.0, 2) == 500.0
    assert Plan(8, 4, None, (), 100.0, 200.0, t_chain=900.0, overlap_steps=2).objective == 500.0
    assert Plan(8, 4, None, (), 100.0, 200.0, colocated=True, t_chain=900.0, overlap_steps=2).objective == 300.0


@pytest.mark.parametrize("pooled", [True, False])
def test_search_with_lag_minimises_the_pipeline_objective_over_n_train(pooled: bool) -> None:
    tm = TrainingCostModel(load_hardware("a800"), load_model("qwen3-14b"))
    cfg = PlannerConfig(n_gpus=24, global_batch=64, group_size=16, granularity=8, min_train_gpus=8,
                        min_rollout_gpus=8, overlap_steps=2, pooled_buckets=pooled)
    reqs = _agentic_requests(64, 11)
    planner = GlobalResourcePlanner(RM, tm, cfg)
    plan = planner.search(reqs)
    assert plan.overlap_steps == 2 and plan.t_chain > 0
    # every n_train's own best plan (plan_fixed) is no better than the search's
    for n_train in cfg.train_candidates():
        other = planner.plan_fixed(reqs, n_train)
        assert plan.objective <= other.objective + 1e-9
    again = planner.evaluate(plan, reqs)
    assert again.objective == pytest.approx(plan.objective, rel=1e-12)
    memo = GlobalResourcePlanner(RM, tm, cfg, memoize=False).search(reqs)
    assert memo == plan
