"""The planner's residency model: a running batch's context is generation-weighted (long requests stay
resident longest), and ``PlannerConfig(residency=False)`` keeps the earlier mean-request model."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.bench import planner_accuracy
from libra.policies.cost import TrainingCostModel, load_hardware, load_model
from libra.policies.planner.allocators import GlobalResourcePlanner, PlannerConfig
from libra.policies.planner.buckets import BucketCosts
from libra.policies.planner.rollout_dp import RolloutSample, resident_prompt
from libra.policies.planner.types import Workload
from planner_refs import RM  # reference cost model (tests/unit)

TM = TrainingCostModel(load_hardware("a800"), load_model("qwen3-14b"))
F = RM.cal.kv_reserve_gen_fraction


def test_resident_prompt_spreads_the_payload_over_the_turns() -> None:
    p = np.array([1000.0, 1000.0, 1000.0])
    assert resident_prompt(p, np.array([1.0, 2.0, 4.0])).tolist() == [1000.0, 750.0, 625.0]
    assert resident_prompt(p, np.array([0.0, 0.0, 0.0])).tolist() == [1000.0] * 3  # no calls: as one


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5000), st.floats(1, 30000), st.integers(1, 8)), min_size=1, max_size=12))
def test_resident_context_is_the_generation_weighted_mean(items: list[tuple[float, float, int]]) -> None:
    p = np.array([x[0] for x in items])
    g = np.array([x[1] for x in items])
    c = np.array([float(x[2]) for x in items])
    rp = resident_prompt(p, c)
    ctx, reserve = RM.resident_context(p.mean(), g.mean(), g.sum(), float((g * rp).sum()), float((g * g).sum()))
    # by loops: every generated token is one step during which the request holds its context
    held = sum(gi * (rpi + gi / 2) for gi, rpi in zip(g, rp)) / g.sum()
    assert ctx == pytest.approx(held, rel=1e-9)
    assert reserve == pytest.approx(sum(gi * (rpi + F * gi) for gi, rpi in zip(g, rp)) / g.sum(), rel=1e-9)
    # with one shared prompt the weighted context is p + sum(g^2) / (2 sum(g)) >= p + mean(g) / 2
    same_p = RM.resident_context(1000.0, g.mean(), g.sum(), float((g * 1000.0).sum()), float((g * g).sum()))[0]
    assert same_p >= 1000.0 + g.mean() / 2 - 1e-6


def test_without_residency_sums_the_mean_request_sizes_the_batch() -> None:
    ctx, reserve = RM.resident_context(2000.0, 3000.0)
    assert (ctx, reserve) == (3500.0, 2000.0 + F * 3000.0)
    # identical requests: both models agree
    n, p, g = 8, 2000.0, 3000.0
    assert RM.resident_context(p, g, n * g, n * g * p, n * g * g) == pytest.approx((ctx, reserve))
    assert RM.segment_cost(1, n * p, n * g, n, p + g) == pytest.approx(
        RM.segment_cost(1, n * p, n * g, n, p + g, gen_prompt_sum=n * g * p, gen_sq_sum=n * g * g))


def _long_tail(n: int = 64) -> list[tuple[float, float, float]]:
    rng = np.random.default_rng(3)
    gen = np.minimum(np.exp(rng.normal(np.log(1500), 1.2, n)), 30000).round()
    return [(800.0, float(x), 1.0) for x in gen]


def test_a_long_tail_shrinks_a_kv_bound_batch_and_the_flag_restores_the_old_model() -> None:
    reqs = _long_tail()
    wl = Workload.from_pairs(reqs)
    on, off = (RolloutSample.from_workload(wl, residency=r) for r in (True, False))
    assert on.segments().gen_prompt is not None and off.segments().gen_prompt is None
    c_on, c_off = BucketCosts(RM, on), BucketCosts(RM, off)
    n = on.size
    # TP-1 holds little KV: the long requests' residency makes the batch smaller and the instance slower
    assert c_on.cost(1, 4)[0, n] > c_off.cost(1, 4)[0, n]
    # the off model is exactly segment_cost without residency sums (the earlier planner)
    p, g = sum(r[0] for r in reqs), sum(r[1] for r in reqs)
    expect = RM.segment_cost(1, p / 4, g / 4, len(reqs) / 4, max(r[0] + r[1] for r in reqs), max(r[1] for r in reqs))
    assert c_off.cost(1, 4)[0, n] == pytest.approx(float(expect), rel=1e-12)
    cfg = PlannerConfig(n_gpus=16, global_batch=64, group_size=16, granularity=8, min_train_gpus=8, min_rollout_gpus=8)
    with_res = GlobalResourcePlanner(RM, TM, cfg).plan_fixed(reqs, 8, (1,) * 8)
    without = GlobalResourcePlanner(RM, TM, PlannerConfig(**{**_fields(cfg), "residency": False})).plan_fixed(
        reqs, 8, (1,) * 8)
    assert with_res.t_rollout > without.t_rollout


def _fields(cfg: PlannerConfig) -> dict[str, object]:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}


def test_planner_accuracy_bench_measures_both_models_on_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    assert planner_accuracy.main(["--cases", "2:1", "--gpus", "16", "--train", "8", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    (case,) = out["cases"]
    assert [r["layout"] for r in case["rows"]] == ["8xTP1", "4xTP2", "2xTP4", "1xTP8"]
    for r in case["rows"]:
        assert r["sim_s"] > 0 and math.isfinite(r["residency_s"]) and math.isfinite(r["mean_s"])
    for name in ("residency", "mean"):
        assert case[name]["regret"] >= 1.0 and out["summary"][name]["mean_abs_log_error"] >= 0
    with pytest.raises(SystemExit):
        planner_accuracy.main(["--cases", "2-1"])


def test_planner_accuracy_bench_scores_a_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from libra.sim.workloads import generate
    from libra.traces import write_trace

    path = tmp_path / "held_out.jsonl"
    write_trace(path, generate("search_r1", 2, 2, 16, 3))
    assert planner_accuracy.main(["--cases", "2:1", "--gpus", "16", "--train", "8", "--trace", str(path),
                                  "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (case,) = out["cases"]
    assert out["trace"] == str(path) and case["trajectories"] == 32
    assert all(r["sim_s"] > 0 and math.isfinite(r["residency_s"]) for r in case["rows"])
