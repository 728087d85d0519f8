"""The throughput objective sees the longest trajectory: a plan is never predicted faster than its
slowest trajectory can decode alone (batch 1, with its tools)."""

from __future__ import annotations

import numpy as np
import pytest

from libra.policies.cost import RolloutCostModel, TrainingCostModel, load_hardware, load_model
from libra.policies.planner.allocators import GlobalResourcePlanner, PlannerConfig
from libra.policies.planner.chain import drained_time
from libra.policies.planner.types import Workload


def test_drained_time_is_the_busy_time_or_the_drained_tail_never_below_either() -> None:
    assert float(drained_time(100.0, 50.0, 40.0)) == 100.0  # the chain fits in the busy time
    # half the path done at the loaded pace, the other half alone: 100 + 0.5 * 120
    assert float(drained_time(100.0, 200.0, 120.0)) == pytest.approx(160.0)
    assert float(drained_time(0.0, 200.0, 120.0)) == pytest.approx(120.0)  # nothing else to do: alone
    w, c, s = np.array([10.0, 300.0, 80.0]), np.array([500.0, 100.0, 90.0]), np.array([400.0, 90.0, 85.0])
    out = drained_time(w, c, s)
    assert np.all(out >= w) and np.all(out >= s)


@pytest.mark.parametrize("routing", ["length_blind", "by_length"])
def test_no_layout_is_predicted_faster_than_its_longest_trajectory_alone(routing: str) -> None:
    hw, model = load_hardware("a800"), load_model("qwen3-14b")
    rm, tm = RolloutCostModel(hw, model), TrainingCostModel(hw, model)
    # 255 short single-turn requests and one long agentic trajectory with 600 s of tools
    rows = [(1000.0, 500.0, 1.0, 0.0)] * 255 + [(8000.0, 20000.0, 40.0, 600.0)]
    wl = Workload.from_pairs(rows)
    cfg = PlannerConfig(n_gpus=48, global_batch=256, group_size=16, overlap_steps=1, routing=routing)
    planner = GlobalResourcePlanner(rm, tm, cfg)
    for tp in (1, 2, 4, 8):
        plan = planner.plan_fixed(wl, 16, (tp,) * (32 // tp))
        alone = 20000.0 * float(rm.decode_step(tp, 1.0, 28000.0)) + 600.0
        assert plan.t_rollout >= alone
    best = planner.search(wl)
    assert best.t_rollout >= 20000.0 * min(float(rm.decode_step(tp, 1.0, 28000.0)) for tp in (1, 2, 4, 8)) + 600.0
