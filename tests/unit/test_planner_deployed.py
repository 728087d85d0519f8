"""The planner's deployed-layout model (``GlobalResourcePlanner.evaluate_deployed``, ``buckets.threshold_buckets``)
and the bench's run-long prediction of a static layout (``OwnedPlanner.predicted_step_s``).

A deployed plan keeps the bucket thresholds it was planned with until a round re-plans it; on the R2E-like
trace the lengths grow ~4x over a run, so the profiled first step predicted a 17.4 s step for a layout the
simulator ran at 63 s (``bench borrowed``, 48 GPUs, 300 steps). Simulator and planner are deterministic."""

from __future__ import annotations

import math

import numpy as np
import pytest

from libra.policies.cost import RolloutCostModel, TrainingCostModel, load_hardware, load_model
from libra.policies.planner.buckets import threshold_buckets
from libra.policies.planner.search import GlobalResourcePlanner
from libra.policies.planner.types import PlannerConfig, PlannerError, Workload
from libra.sim.borrowed_plan import OwnedPlanner
from libra.sim.config import SimConfig, default_prompts
from libra.sim.engine import Simulator
from libra.sim.workloads import generate

A800, MODEL = load_hardware("a800"), load_model("qwen3-14b")


def _planner() -> GlobalResourcePlanner:
    cfg = PlannerConfig(n_gpus=24, global_batch=32, granularity=8, min_train_gpus=8, min_rollout_gpus=8)
    return GlobalResourcePlanner(RolloutCostModel(A800, MODEL), TrainingCostModel(A800, MODEL), cfg)


def _workload(scale: float, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    rows = [(float(rng.integers(500, 2000)) * scale, float(rng.lognormal(7.0, 0.8)) * scale, 4.0, 20.0)
            for _ in range(32)]
    return Workload.from_pairs(rows)


def test_deployed_equals_the_plan_on_its_own_workload_and_grows_past_its_thresholds() -> None:
    planner, short, long = _planner(), _workload(1.0), _workload(4.0)
    plan = planner.search(short)
    assert len(plan.buckets()) >= 2  # a heterogeneous layout: thresholds matter
    same = planner.evaluate_deployed(plan, short)
    assert same.t_rollout == pytest.approx(plan.t_rollout) and same.t_train == pytest.approx(plan.t_train)
    resplit, deployed = planner.evaluate(plan, long), planner.evaluate_deployed(plan, long)
    assert deployed.t_train == pytest.approx(resplit.t_train)
    # the longer requests all exceed the planned thresholds: the last bucket serves them, slower than re-split
    assert deployed.t_rollout > resplit.t_rollout
    assert [i.n_requests > 0 for i in deployed.rollout].count(True) == plan.buckets()[-1].n_instances


def test_threshold_buckets_route_by_length_and_refuse_a_gap() -> None:
    planner = _planner()
    ctx = planner._context(_workload(1.0))
    lengths = ctx.costs.sample.lengths
    cut = float(lengths[10])
    bks = threshold_buckets(ctx.costs, [(1, 2, cut), (4, 1, math.inf)])
    assert bks == [(1, 2, 0, int(np.searchsorted(lengths, cut, "right"))), (4, 1, bks[0][3], lengths.size)]
    assert threshold_buckets(ctx.costs, [(1, 1, 0.0), (8, 1, math.inf)]) == [(8, 1, 0, lengths.size)]
    with pytest.raises(PlannerError, match="leave requests longer"):
        threshold_buckets(ctx.costs, [(1, 1, cut)])


def test_a_static_layout_is_predicted_over_the_drifting_run_not_its_first_step() -> None:
    cfg = SimConfig(gpus=16, seed=0)
    trajs = generate("r2e", 30, default_prompts(16), 16, 0)
    op = OwnedPlanner(trajs, cfg)
    measured = Simulator(trajs, cfg, op.layout).run().step_time_s["mean"]
    # the first step's workload alone predicts a fraction of it (7.9 s against 46 s measured)
    assert op.owned_plan.objective < 0.5 * measured
    assert 0.8 <= op.predicted_step_s() / measured <= 1.25
