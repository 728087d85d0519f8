"""The pooled-bucket rollout DP (planner_buckets.py) against brute force, and its planner wiring."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from libra.policies.cost_model import RolloutCostModel, TrainingCostModel, load_hardware, load_model
from libra.policies.planner import GlobalResourcePlanner, PlannerConfig, Workload
from libra.policies.planner_buckets import BucketCosts, BucketTable, evaluate_buckets
from libra.policies.planner_rollout import RolloutSample

RM = RolloutCostModel(load_hardware("a800"), load_model("qwen3-14b"))


def _requests(n: int, seed: int) -> list[tuple[float, float, float]]:
    rng = np.random.default_rng(seed)
    total = np.exp(rng.uniform(np.log(300), np.log(30000), n)).round()
    prompt = np.minimum(rng.uniform(100, 2048, n), total / 2).round()
    turns = rng.integers(1, 6, n)
    return list(zip(prompt.tolist(), (total - prompt).tolist(), turns.astype(float).tolist()))


def _pooled(reqs: list[tuple[float, float, float]], tp: int, k: int, lag: int = 1) -> float:
    """Direct sums: the busiest of ``k`` instances sharing ``reqs`` evenly."""
    n = len(reqs)
    share = min(k, n)
    p, g, c = (sum(r[x] for r in reqs) for x in range(3))
    cost = RM.segment_cost(tp, p / share, g / share, n / share, max(r[0] + r[1] for r in reqs),
                           max(r[1] for r in reqs) / lag)
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
