"""Borrowed GPUs in the planner (libra/policies/planner/borrowed.py): elastic rollout capacity, never training;
the plan stays valid with them gone; the expected revocation cost lowers the predicted gain. Brute force over
``n_train`` as in test_planner.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from libra.policies.cost import RolloutCostModel, TrainingCostModel, load_hardware, load_model
from libra.policies.planner.search import GlobalResourcePlanner
from libra.policies.planner.types import PlannerConfig
from libra.policies.planner.borrowed import (BorrowedCapacity, expected_step_s, place_borrowed, plan_with_borrowed,
                                             revocation_cost_s)
from libra.policies.planner.types import PlannerError, Workload

A800, MODEL = load_hardware("a800"), load_model("qwen3-4b")


def _planner(n_gpus: int) -> GlobalResourcePlanner:
    cfg = PlannerConfig(n_gpus=n_gpus, global_batch=8, group_size=2, max_micro_batch=4)
    return GlobalResourcePlanner(RolloutCostModel(A800, MODEL), TrainingCostModel(A800, MODEL), cfg)


def _requests(n: int, seed: int) -> list[tuple[float, float]]:
    rng = np.random.default_rng(seed)
    return [(float(rng.integers(200, 2000)), float(rng.integers(500, 30000))) for _ in range(n)]


@pytest.mark.parametrize(("owned", "borrowed", "seed"), [(6, 4, 0), (8, 8, 1), (5, 3, 2)])
def test_borrowed_plan_never_trains_on_them_and_is_the_brute_force_best(owned: int, borrowed: int, seed: int) -> None:
    planner, reqs = _planner(owned), _requests(16, seed)
    bp = plan_with_borrowed(planner, reqs, BorrowedCapacity(borrowed))
    assert bp.uses_borrowed  # rollout-bound requests: more rollout GPUs pay
    assert bp.plan.n_train <= owned - 1  # training on owned GPUs only, one owned GPU left rolling out
    assert bp.plan.n_gpus == owned + borrowed
    # valid with every borrowed GPU gone: the same training layout on the owned GPUs, the rest roll out
    alone = planner.plan_fixed(reqs, bp.plan.n_train, None, bp.plan.train)
    assert math.isfinite(alone.objective)
    # brute force: every n_train the owned GPUs allow, rollout on the rest plus the borrowed ones
    big = GlobalResourcePlanner(planner.rollout_model, planner.train_model,
                                PlannerConfig(n_gpus=owned + borrowed, global_batch=8, group_size=2, max_micro_batch=4))
    best = min(big.plan_fixed(reqs, n).objective for n in range(1, owned))
    assert bp.plan.objective == pytest.approx(best, rel=1e-12)
    assert bp.gain == pytest.approx(bp.owned.objective / bp.plan.objective) and bp.gain > 1.0


def test_revocation_cost_lowers_the_predicted_gain_until_borrowing_does_not_pay() -> None:
    planner, reqs = _planner(6), _requests(16, 0)
    cost = revocation_cost_s(planner.rollout_model, in_flight=8, context_tokens=8000, turn_gen_tokens=2000,
                             replan_s=2.0)
    assert cost > 2.0
    gains = [plan_with_borrowed(planner, reqs, BorrowedCapacity(4, rate, cost)).gain for rate in (0.0, 10.0, 100.0)]
    assert gains[0] > gains[1] > gains[2] >= 1.0
    never = plan_with_borrowed(planner, reqs, BorrowedCapacity(4, 1e6, cost))
    assert not never.uses_borrowed and never.gain == 1.0 and never.plan is never.owned
    p = plan_with_borrowed(planner, reqs, BorrowedCapacity(4)).plan
    assert expected_step_s(p, 2, BorrowedCapacity(4, 10.0, cost)) > p.objective == expected_step_s(p, 2, BorrowedCapacity(4))


def test_no_borrowed_gpus_is_the_owned_plan_and_bad_input_is_refused() -> None:
    planner, reqs = _planner(6), _requests(8, 3)
    bp = plan_with_borrowed(planner, reqs, BorrowedCapacity(0))
    assert bp.plan is bp.owned and bp.plan.objective == planner.search(reqs).objective
    for bad in ({"gpus": -1}, {"gpus": 2, "revocations_per_gpu_hour": -1.0}, {"gpus": 2, "revocation_cost_s": math.nan}):
        with pytest.raises(PlannerError):
            BorrowedCapacity(**bad)  # type: ignore[arg-type]


def test_place_borrowed_keeps_the_bucket_shares_in_every_prefix() -> None:
    owned = {"short": 4, "medium": 4, "long": 8}
    out = place_borrowed(owned, 48)
    assert {b: out.count(b) for b in owned} == {"short": 12, "medium": 12, "long": 24}
    for k in range(1, 49):
        for b, g in owned.items():
            assert abs(out[:k].count(b) - g * k / 16) < 1.0 + 1e-9
    assert place_borrowed(owned, 0) == []
    with pytest.raises(PlannerError):
        place_borrowed({"a": 0}, 3)
    assert place_borrowed(owned, 5, "smallest") == ["short"] * 5  # the first (smallest-context) bucket
    with pytest.raises(PlannerError, match="unknown policy"):
        place_borrowed(owned, 3, "everywhere")
    assert Workload  # the planner's own input type is what plan_with_borrowed takes


def test_training_bound_work_still_never_trains_on_borrowed_gpus() -> None:
    planner = _planner(4)
    reqs = [(float(p), 64.0) for p in range(2000, 2016)]  # short generations: training wants every GPU
    bp = plan_with_borrowed(planner, reqs, BorrowedCapacity(8))
    assert bp.plan.n_train <= 3
    big = GlobalResourcePlanner(planner.rollout_model, planner.train_model,
                                PlannerConfig(n_gpus=12, global_batch=8, group_size=2, max_micro_batch=4))
    assert big.search(reqs).n_train > 3  # an unrestricted search would train on borrowed GPUs
