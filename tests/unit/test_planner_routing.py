"""Router-aware planning: the length-blind rollout model (``PlannerConfig.routing``) against brute force,
and its wiring into the search and the simulator."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
from planner_refs import RM, _agentic_requests, _pooled_agentic  # direct sums of agentic_cost (tests/unit)

from libra.policies.cost import TrainingCostModel, load_hardware, load_model
from libra.policies.planner.allocators import GlobalResourcePlanner, PlannerConfig, PlannerError, Workload
from libra.policies.planner.buckets import BlindCosts, BlindTable, BucketCosts, evaluate_blind, evaluate_buckets
from libra.policies.planner.rollout_dp import RolloutSample

TM = TrainingCostModel(load_hardware("a800"), load_model("qwen3-14b"))


def _multisets(tps: tuple[int, ...], gpus: int) -> list[tuple[int, ...]]:
    """Every non-empty TP multiset on at most ``gpus`` GPUs."""
    out = []
    for counts in itertools.product(*(range(gpus // t + 1) for t in tps)):
        layout = tuple(t for t, k in zip(tps, counts) for _ in range(k))
        if layout and sum(layout) <= gpus:
            out.append(layout)
    return out


def _direct(reqs: list[tuple[float, ...]], layout: tuple[int, ...], routing: str, lag: int) -> tuple[float, float]:
    """The length-blind model by hand: every instance serves ``tp / W`` (least connections on load/tp)
    or ``1 / I`` (round robin) of all requests; the layout costs the max over its instances."""
    w, n = sum(layout), len(layout)
    vals = [_pooled_agentic(reqs, tp, w / tp if routing == "length_blind" else n, lag) for tp in set(layout)]
    return max(v[0] for v in vals), max(v[1] for v in vals)


def _brute(reqs, gpus, tps, routing, lag, het, cap) -> float:
    best = math.inf
    for layout in _multisets(tps, gpus):
        if (het and len(set(layout)) < 2) or (cap is not None and len(layout) > cap):
            continue
        best = min(best, _direct(reqs, layout, routing, lag)[0])
    return best


@pytest.mark.parametrize(("gpus", "n", "tps", "seed", "routing", "lag", "het", "cap"), [
    (8, 6, (1, 2, 4), 0, "length_blind", 1, False, None),
    (8, 7, (1, 2, 4, 8), 1, "length_blind", 2, False, None),
    (6, 5, (1, 2), 2, "length_blind", 1, True, None),
    (8, 6, (1, 2, 4), 3, "length_blind", 2, False, 3),
    (8, 6, (1, 2, 4), 4, "round_robin", 1, False, None),
    (7, 5, (1, 2, 4), 5, "round_robin", 2, True, 4),
])
def test_blind_table_equals_brute_force(gpus, n, tps, seed, routing, lag, het, cap) -> None:
    reqs = _agentic_requests(n, seed)
    costs = BlindCosts(RM, RolloutSample.from_workload(Workload.from_pairs(reqs)), lag,
                       weighted=routing == "length_blind")
    table = BlindTable(costs, tps, gpus, require_heterogeneous=het, max_instances=cap)
    for g in range(gpus + 1):
        expected = _brute(reqs, g, tps, routing, lag, het, cap)
        got = table.time(g)
        if math.isinf(expected):
            assert math.isinf(got) and table.layout(g) == ()
            continue
        assert got == pytest.approx(expected, rel=1e-9)
        layout = table.layout(g)
        assert sum(layout) <= g and (not het or len(set(layout)) >= 2) and (cap is None or len(layout) <= cap)
        time, chain = _direct(reqs, layout, routing, lag)
        assert time == pytest.approx(got, rel=1e-9) and table.chain(g) == pytest.approx(chain, rel=1e-9)
        assert evaluate_blind(costs, layout) == pytest.approx(got, rel=1e-12)


@pytest.mark.parametrize("routing", ["length_blind", "round_robin"])
def test_heterogeneity_only_costs_under_length_blind_routing(routing: str) -> None:
    """Every heterogeneous layout is predicted no faster than the homogeneous layout of its smallest TP
    on the same GPUs (load/tp shares) or with the same instance count (1/I shares, fewer GPUs)."""
    reqs = _agentic_requests(9, 7)
    costs = BlindCosts(RM, RolloutSample.from_workload(Workload.from_pairs(reqs)), 2,
                       weighted=routing == "length_blind")
    checked = 0
    for layout in _multisets((1, 2, 4, 8), 16):
        if len(set(layout)) < 2:
            continue
        low = min(layout)
        homo = (low,) * (sum(layout) // low if routing == "length_blind" else len(layout))
        assert sum(homo) <= sum(layout)
        assert evaluate_blind(costs, homo) <= evaluate_blind(costs, layout) * (1 + 1e-12)
        checked += 1
    assert checked > 50


def test_homogeneous_layouts_cost_the_same_under_every_routing() -> None:
    """One TP degree: a bucket of k instances is exactly k blind instances (the models agree)."""
    reqs = _agentic_requests(8, 3)
    sample = RolloutSample.from_workload(Workload.from_pairs(reqs))
    pooled = BucketCosts(RM, sample, 2)
    for weighted in (True, False):
        blind = BlindCosts(RM, sample, 2, weighted=weighted)
        for tp, k in itertools.product((1, 2, 4, 8), (1, 2, 3, 5)):
            layout = (tp,) * k
            assert evaluate_blind(blind, layout) == pytest.approx(evaluate_buckets(pooled, layout)[0], rel=1e-12)


@pytest.mark.parametrize("routing", ["length_blind", "round_robin"])
def test_blind_search_minimises_the_pipeline_objective_and_reevaluates_consistently(routing: str) -> None:
    cfg = PlannerConfig(n_gpus=32, global_batch=64, group_size=16, granularity=8, min_train_gpus=8,
                        min_rollout_gpus=8, overlap_steps=2, routing=routing)
    reqs = _agentic_requests(64, 11)
    planner = GlobalResourcePlanner(RM, TM, cfg)
    plan = planner.search(reqs)
    assert plan.t_chain > 0 and plan.n_train + plan.n_rollout <= 32
    for n_train in cfg.train_candidates():
        assert plan.objective <= planner.plan_fixed(reqs, n_train).objective + 1e-9
    again = planner.evaluate(plan, reqs)
    assert again.layout_key() == plan.layout_key()
    assert again.objective == pytest.approx(plan.objective, rel=1e-12)
    assert again.t_chain == pytest.approx(plan.t_chain, rel=1e-12)
    assert GlobalResourcePlanner(RM, TM, cfg, memoize=False).search(reqs) == plan
    # every instance serves the whole length range, with its share of the requests
    lo, hi = min(r[0] + r[1] for r in reqs), max(r[0] + r[1] for r in reqs)
    assert all(i.min_tokens == lo and i.max_tokens == hi for i in plan.rollout)
    assert sum(i.n_requests for i in plan.rollout) == pytest.approx(64.0)
    # the homogeneous search under the same routing is never better than the full one
    homo = GlobalResourcePlanner(RM, TM, cfg, homogeneous_rollout=True).search(reqs)
    assert plan.objective <= homo.objective + 1e-9
    assert len(Counter(plan.rollout_tps)) == 1 or plan.objective < homo.objective


def test_fixed_blind_layout_keeps_idle_and_infeasible_instances() -> None:
    cfg = PlannerConfig(n_gpus=16, global_batch=16, group_size=16, routing="length_blind")
    reqs = [(1000.0, 300000.0)] + [(500.0, 500.0)] * 15  # too long for a TP-1 instance (~240K tokens of KV)
    planner = GlobalResourcePlanner(RM, TM, cfg)
    bad = planner.plan_fixed(reqs, 8, (1, 4))
    assert math.isinf(bad.t_rollout) and bad.rollout_tps == (1, 4)


def test_routing_is_validated_and_defaults_to_by_length() -> None:
    assert PlannerConfig(n_gpus=8, global_batch=16).routing == "by_length"
    with pytest.raises(PlannerError, match="routing"):
        PlannerConfig(n_gpus=8, global_batch=16, routing="random")
    with pytest.raises(PlannerError, match="pooled_buckets"):
        PlannerConfig(n_gpus=8, global_batch=16, routing="length_blind", pooled_buckets=False)


def test_simulator_plans_for_the_router_it_runs() -> None:
    from libra.sim.planner import planner_routing

    assert planner_routing("least_loaded") == "length_blind"
    assert planner_routing("round_robin") == "round_robin"
    for router in ("cmlfq", "cmlfq_cost", "oracle", "la_mlfq"):
        assert planner_routing(router) == "by_length"
    assert planner_routing("cmlfq", "start_small") == "start_small"  # the allocation parameter overrides
