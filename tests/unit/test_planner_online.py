"""Online re-planning triggers and apply rule; the EHP borrow/release signal."""

from __future__ import annotations

import math

from dataclasses import replace

import pytest

from libra.policies.cost import TrainConfig
from libra.policies.planner.allocators import (
    Plan,
    PlannerError,
    PressureSnapshot,
    Replanner,
    RolloutInstance,
    Workload,
    ehp_signal,
    make_allocator,
)
from libra.policies.planner.online import layout_class


def _plan(n_train: int, t_train: float, t_rollout: float, tps: tuple[int, ...] = (2, 2)) -> Plan:
    inst = tuple(RolloutInstance(tp, 0.0, 1.0, 1.0, t_rollout) for tp in tps)
    return Plan(16, n_train, TrainConfig(n_train, 1, 1, 1), inst, t_train, t_rollout)


class FakeAllocator:
    """Returns fixed plans so the decision logic is tested in isolation."""

    name = "fake"

    def __init__(self, candidate: Plan, current_time: float) -> None:
        self.candidate = candidate
        self.current_time = current_time
        self.proposals = 0
        self.seen_sizes: list[int] = []

    def propose(self, workload: Workload, current: Plan | None = None) -> Plan:
        self.proposals += 1
        self.seen_sizes.append(workload.size)
        return self.candidate

    def evaluate(self, plan: Plan, workload: Workload) -> Plan:
        return replace(plan, t_train=self.current_time, t_rollout=self.current_time)


def _replanner(candidate: Plan, current_time: float, **kw: object) -> tuple[Replanner, FakeAllocator]:
    fake = FakeAllocator(candidate, current_time)
    rp = Replanner(fake, **kw)  # type: ignore[arg-type]
    rp.observe_many([(100, 400)] * 8)
    return rp, fake


CURRENT = _plan(8, 100.0, 100.0)
BETTER = _plan(4, 60.0, 60.0, (4, 4, 2, 2))


def test_history_and_warmup_gate_everything() -> None:
    fake = FakeAllocator(BETTER, 100.0)
    rp = Replanner(fake, warmup_steps=2)
    rp.observe_many([(100, 400)] * 7)
    assert rp.step(PressureSnapshot(step=10), CURRENT).reason == "insufficient_history"
    rp.observe(50, 50)
    assert rp.step(PressureSnapshot(step=1), CURRENT).reason == "warmup"
    assert fake.proposals == 0


def test_initial_plan_is_applied_without_a_trigger() -> None:
    rp, _fake = _replanner(BETTER, 100.0)
    d = rp.step(PressureSnapshot(step=3), None)
    assert d.apply and d.reason == "initial_plan" and d.plan is BETTER
    assert rp.step(PressureSnapshot(step=3), BETTER).reason == "cooldown"


@pytest.mark.parametrize(
    ("snap", "trigger"),
    [
        (PressureSnapshot(step=10), "interval"),
        (PressureSnapshot(step=3, queue_pressure=0.75), "queue_pressure"),
        (PressureSnapshot(step=3, active_pressure=0.85), "active_pressure"),
        (PressureSnapshot(step=3, rejected_total=8), "rejected_rollouts"),
        (PressureSnapshot(step=3, rollout_time=125.0, train_time=100.0), "stage_imbalance"),
    ],
)
def test_each_trigger_fires_and_applies_a_worthwhile_plan(snap: PressureSnapshot, trigger: str) -> None:
    rp, _fake = _replanner(BETTER, 100.0)
    d = rp.step(snap, CURRENT)
    assert d.trigger == trigger and d.apply and d.reason == "applied"
    assert d.raw_gain == pytest.approx(40.0) and d.net_gain == pytest.approx(25.0)
    assert d.current_time == 100.0 and d.candidate_time == 60.0


@pytest.mark.parametrize(
    "snap",
    [
        PressureSnapshot(step=3, queue_pressure=0.74, active_pressure=0.84, rejected_total=7),
        PressureSnapshot(step=3, rollout_time=124.0, train_time=100.0),
    ],
)
def test_below_thresholds_nothing_happens(snap: PressureSnapshot) -> None:
    rp, fake = _replanner(BETTER, 100.0)
    assert rp.step(snap, CURRENT).reason == "no_trigger" and fake.proposals == 0


def test_trigger_order_cooldown_then_interval_then_pressure() -> None:
    rp, _fake = _replanner(BETTER, 100.0, cooldown_steps=3, plan_interval=5)
    assert rp.step(PressureSnapshot(step=5, queue_pressure=0.9), CURRENT).trigger == "interval"
    assert rp.step(PressureSnapshot(step=7, queue_pressure=0.9), CURRENT).reason == "cooldown"
    assert rp.step(PressureSnapshot(step=8, queue_pressure=0.9), CURRENT).trigger == "queue_pressure"


def test_offline_mode_only_uses_the_interval() -> None:
    rp, _ = _replanner(BETTER, 100.0, online=False)
    assert rp.step(PressureSnapshot(step=3, queue_pressure=1.0), CURRENT).reason == "no_trigger"
    assert rp.step(PressureSnapshot(step=20), CURRENT).trigger == "interval"


def test_rejected_delta_is_counted_since_the_last_evaluation() -> None:
    rp, _ = _replanner(BETTER, 100.0)
    assert rp.step(PressureSnapshot(step=3, rejected_total=10), CURRENT).trigger == "rejected_rollouts"
    assert rp.step(PressureSnapshot(step=4, rejected_total=17), CURRENT).reason == "no_trigger"
    assert rp.step(PressureSnapshot(step=5, rejected_total=18), CURRENT).trigger == "rejected_rollouts"


@pytest.mark.parametrize(
    ("candidate", "current_time", "reason"),
    [
        (replace(CURRENT, t_train=50.0, t_rollout=50.0), 100.0, "same_layout"),
        (_plan(4, 90.0, 90.0, (8,)), 100.0, "gain_below_reconfig_cost"),  # raw 10 s < 15 s cost
        (_plan(4, 980.0, 980.0, (8,)), 1000.0, "gain_ratio_below_min"),  # net 5 s > 0 but 2% < 5%
        (_plan(4, 84.0, 84.0, (8,)), 100.0, "applied"),  # raw 16 s, net 1 s, 16%
    ],
)
def test_apply_rule(candidate: Plan, current_time: float, reason: str) -> None:
    rp, _ = _replanner(candidate, current_time)
    d = rp.step(PressureSnapshot(step=10), CURRENT)
    assert d.reason == reason and d.apply == (reason == "applied")


def test_history_window_is_bounded_and_validated() -> None:
    rp, fake = _replanner(BETTER, 100.0, max_history=16)
    rp.observe_many([(10, 10)] * 40)
    assert len(rp.history) == 16
    rp.step(PressureSnapshot(step=10), CURRENT)
    assert fake.seen_sizes == [16]
    with pytest.raises(PlannerError, match="invalid lengths"):
        rp.observe(-1, 5)
    with pytest.raises(PlannerError, match="plan_interval"):
        Replanner(fake, plan_interval=0)  # type: ignore[arg-type]


def test_replanner_with_the_real_grp_reacts_to_drift() -> None:
    alloc = make_allocator("grp", hardware="a800", model="qwen3-14b", n_gpus=48, global_batch=256, group_size=16)
    rp = Replanner(alloc, plan_interval=5, max_history=256)
    rp.observe_many([(1000, 1500 + 10 * i) for i in range(256)])
    first = rp.step(PressureSnapshot(step=1), None)
    assert first.apply and first.plan is not None
    rp.observe_many([(2000, 15000 + 40 * i) for i in range(256)])  # lengths grew ~7x
    d = rp.step(PressureSnapshot(step=5), first.plan)
    assert d.trigger == "interval" and d.current_time is not None and d.candidate_time is not None
    assert d.candidate_time <= d.current_time
    if math.isinf(d.current_time):  # the deployed training layout no longer holds the grown batch: re-plan
        assert d.apply and not d.plan.same_layout(first.plan) and math.isfinite(d.candidate_time)
    else:
        assert d.apply == (d.net_gain > 0 and d.raw_gain / d.current_time >= 0.05
                           and not d.plan.same_layout(first.plan))


def test_training_layouts_keep_headroom_for_the_observed_growth_and_an_oom_replans_at_once() -> None:
    from libra.policies.planner.training import fits

    alloc = make_allocator("grp", hardware="a800", model="qwen3-14b", n_gpus=64, global_batch=128, group_size=16)
    rp = Replanner(alloc, plan_interval=100, cooldown_steps=5, online=False, min_history=8)
    rp.observe_many([(2000, 5000)] * 128)
    first = rp.step(PressureSnapshot(step=1), None)
    assert rp.headroom == 1.0 and first.plan is not None
    rp.observe_many([(4000, 10000)] * 128)  # the longest sequence doubled in one round
    d = rp.step(PressureSnapshot(step=2), first.plan)
    assert rp.headroom == pytest.approx(2.0)
    lengths = rp.workload().training_lengths(128)
    plan = d.plan if d.apply else first.plan
    assert plan is not None and plan.train is not None
    assert fits(alloc.planner.train_model, plan.train, lengths, 2.0)  # it fits the next doubling too
    # a training step that ran out of memory re-plans at once, whatever the cooldown and interval
    oom = rp.step(PressureSnapshot(step=3, train_oom=True), plan)
    assert oom.trigger == "train_oom"


# -- EHP ------------------------------------------------------------------------------------------
def _ehp(**kw: object):
    args = {
        "step": 10,
        "train_time": 100.0,
        "rollout_time": 100.0,
        "queue_pressure": 0.1,
        "active_pressure": 0.1,
        "rollout_gpus": 32,
        "min_rollout_gpus": 8,
        "replica_gpus": 8,
        "current_replicas": 1,
    }
    args.update(kw)
    return ehp_signal(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "desired", "reason"),
    [
        ({"rollout_gpus": 15}, 0, "no_capacity"),
        ({"active_pressure": 0.8, "train_time": 500.0}, 0, "protect_rollout"),
        ({"candidate_extra_replicas": 2}, 2, "planner_request"),
        ({"candidate_extra_replicas": 9}, 3, "planner_request"),
        ({"train_time": 115.0}, 3, "training_bottleneck"),
        ({"train_time": 90.0}, 0, "rollout_bottleneck"),
        ({"train_time": 105.0}, 1, "hysteresis_hold"),
        ({"train_time": 105.0, "current_replicas": 7}, 3, "hysteresis_hold"),
    ],
)
def test_ehp_signal_rules(kw: dict, desired: int, reason: str) -> None:
    sig = _ehp(**kw)
    assert (sig.desired_replicas, sig.reason) == (desired, reason)
    assert sig.expires_step == 30


def test_ehp_signal_rejects_bad_sizes() -> None:
    with pytest.raises(PlannerError, match="replica_gpus must be >= 1"):
        _ehp(replica_gpus=0)


def test_history_records_turns_and_tool_seconds_into_the_workload() -> None:
    rp, _ = _replanner(BETTER, 100.0, max_history=16)
    rp.history.clear()  # the helper's warm-up pairs have no turns: one width per window
    rp.observe(100, 200, 3, 12.5)
    rp.observe(50, 80, 1, 0.0)
    wl = rp.workload()
    assert list(wl.calls) == [3.0, 1.0] and wl.tool_seconds is not None and list(wl.tool_seconds) == [12.5, 0.0]
    with pytest.raises(PlannerError, match="tool_seconds"):
        rp.observe(10, 10, 2, -1.0)
    with pytest.raises(PlannerError, match="tool_seconds needs turns"):
        rp.observe(10, 10, None, 1.0)
    with pytest.raises(PlannerError, match="tool_seconds"):
        Workload.from_pairs([(10, 10, 1, float("nan"))])


# -- prediction-error feedback ---------------------------------------------------------------------
HETERO = _plan(8, 100.0, 100.0, (1, 2, 4))
HOMO = _plan(8, 120.0, 120.0, (2, 2, 2))


class OfferingAllocator(FakeAllocator):
    """A fake GRP that offers its best plan and its best homogeneous plan (``candidates``)."""

    def __init__(self, offers: list[Plan], current_time: float) -> None:
        super().__init__(offers[0], current_time)
        self.offers = offers
        self.offered = 0

    def candidates(self, workload: Workload, current: Plan | None = None) -> list[Plan]:
        self.offered += 1
        return list(self.offers)


def test_layout_class_counts_distinct_rollout_tps() -> None:
    assert layout_class(HETERO) == "heterogeneous"
    assert layout_class(HOMO) == layout_class(_plan(8, 1.0, 1.0, (8,))) == "homogeneous"


def test_observe_step_keeps_a_ratio_of_sums_per_class_over_the_window() -> None:
    rp, _ = _replanner(BETTER, 100.0, error_window=2)
    assert rp.correction(HETERO) == rp.correction(HOMO) == 1.0
    assert rp.observe_step(HETERO, 150.0, 100.0) == 1.5
    assert rp.observe_step(HETERO, 50.0, 100.0) == 0.5
    assert rp.correction(HETERO) == 1.0  # (150 + 50) / (100 + 100)
    rp.observe_step(HETERO, 300.0, 100.0)  # the window keeps the last two: (50 + 300) / 200
    assert rp.correction(HETERO) == pytest.approx(1.75)
    assert rp.corrected(HETERO) == pytest.approx(1.75 * HETERO.objective)
    assert rp.correction(HOMO) == 1.0  # the other class has no history
    for bad in ((0.0, 100.0), (100.0, 0.0), (float("nan"), 100.0), (100.0, float("inf"))):
        assert rp.observe_step(HOMO, *bad) is None
    assert rp.correction(HOMO) == 1.0
    with pytest.raises(PlannerError):
        Replanner(FakeAllocator(BETTER, 1.0), error_window=0)  # type: ignore[arg-type]


def test_observe_step_predicts_with_the_allocator_on_the_history_window() -> None:
    fake = FakeAllocator(BETTER, 80.0)  # evaluate() puts every plan at 80 s
    rp = Replanner(fake, min_history=8)  # type: ignore[arg-type]
    assert rp.observe_step(HETERO, 120.0) is None  # no history yet: nothing to predict with
    rp.observe_many([(100, 400)] * 8)
    assert rp.observe_step(HETERO, 120.0) == pytest.approx(1.5)


def test_without_feedback_the_apply_rule_is_unchanged() -> None:
    offering = OfferingAllocator([HETERO, HOMO], 110.0)
    rp = Replanner(offering, plan_interval=1)  # type: ignore[arg-type]
    rp.observe_many([(100, 400)] * 8)
    dec = rp.step(PressureSnapshot(5), CURRENT)
    assert offering.offered == 0  # no observations: the plain proposal, no extra search
    assert dec.plan is HETERO and not dec.apply and dec.reason == "gain_below_reconfig_cost"  # 110 - 100 < 15
    assert dec.current_correction == dec.candidate_correction == 1.0


def test_observed_error_of_the_deployed_class_steers_the_decision() -> None:
    # deployed: a heterogeneous plan predicted at 110 s but observed at 1.5x; the GRP offers a better
    # heterogeneous plan (100 s) and a homogeneous one (120 s) with no history (correction 1.0)
    deployed = _plan(8, 110.0, 110.0, (1, 1, 2, 4))
    offering = OfferingAllocator([HETERO, HOMO], 110.0)
    rp = Replanner(offering, plan_interval=1)  # type: ignore[arg-type]
    rp.observe_many([(100, 400)] * 8)
    rp.observe_step(deployed, 165.0, 110.0)
    dec = rp.step(PressureSnapshot(5), deployed)
    assert offering.offered == 1
    assert dec.current_correction == pytest.approx(1.5) and dec.candidate_correction == 1.0
    assert dec.plan is HOMO  # 100 x 1.5 = 150 corrected, against 120
    assert dec.current_time == pytest.approx(165.0) and dec.candidate_time == pytest.approx(120.0)
    assert dec.apply and dec.reason == "applied" and dec.raw_gain == pytest.approx(45.0)
    # once the homogeneous class is observed as badly, the heterogeneous plan wins again
    rp.observe_step(HOMO, 240.0, 120.0)
    dec = rp.step(PressureSnapshot(6), HOMO)
    assert dec.plan is HETERO and dec.candidate_time == pytest.approx(150.0)


def test_a_plain_allocator_gets_its_proposal_corrected() -> None:
    rp, fake = _replanner(HOMO, 100.0, plan_interval=1)
    rp.observe_step(CURRENT, 200.0, 100.0)  # CURRENT is homogeneous (2, 2): correction 2.0 for both
    dec = rp.step(PressureSnapshot(5), CURRENT)
    assert dec.current_time == pytest.approx(200.0) and dec.candidate_time == pytest.approx(240.0)
    assert not dec.apply and dec.reason == "gain_below_reconfig_cost"


def test_grp_offers_its_best_plan_and_its_best_homogeneous_plan() -> None:
    alloc = make_allocator("grp", hardware="a800", model="qwen3-14b", n_gpus=48, global_batch=256, group_size=16,
                           granularity=8, min_train_gpus=8, min_rollout_gpus=8)
    homo = make_allocator("grp_homogeneous", hardware="a800", model="qwen3-14b", n_gpus=48, global_batch=256,
                          group_size=16, granularity=8, min_train_gpus=8, min_rollout_gpus=8)
    import numpy as np

    rng = np.random.default_rng(4)
    total = np.exp(rng.uniform(np.log(300), np.log(30000), 256)).round()
    wl = Workload.from_pairs(zip((total * 0.2).round(), (total * 0.8).round()))
    offers = alloc.candidates(wl)  # type: ignore[attr-defined]
    assert offers[0] == alloc.propose(wl)
    if len(set(offers[0].rollout_tps)) >= 2:
        assert len(offers) == 2 and offers[1].layout_key() == homo.propose(wl).layout_key()
        assert offers[1].allocator == "grp" and offers[0].objective <= offers[1].objective
    else:
        assert len(offers) == 1
    assert len(homo.candidates(wl)) == 1  # type: ignore[attr-defined]


def test_measured_reconfiguration_cost_replaces_the_configured_one_when_larger() -> None:
    rp, _ = _replanner(BETTER, 100.0, plan_interval=1, error_window=2)
    assert rp.reconfig_estimate() == 15.0
    dec = rp.step(PressureSnapshot(5), CURRENT)  # 100 -> 60: gain 40 beats the configured 15 s
    assert dec.apply and dec.reconfig_s == 15.0
    rp.observe_reconfig(-30.0)  # a deployment that cost nothing measurable counts as 0: the floor holds
    assert rp.reconfig_estimate() == 15.0
    rp.observe_reconfig(90.0)
    assert rp.reconfig_estimate() == pytest.approx(45.0)  # mean of (0, 90)
    dec = rp.step(PressureSnapshot(6), CURRENT)
    assert not dec.apply and dec.reason == "gain_below_reconfig_cost" and dec.net_gain == pytest.approx(-5.0)
    rp.observe_reconfig(10.0)  # window of two: (90, 10)
    assert rp.reconfig_estimate() == pytest.approx(50.0)
    with pytest.raises(PlannerError):
        rp.observe_reconfig(float("inf"))


def test_the_broker_planner_loop_starts_a_round_at_once_after_a_training_oom() -> None:
    from libra.broker.plan_decider import PlannerLoop, PlannerSettings

    loop = PlannerLoop(PlannerSettings.from_dict({"allocation": "grp", "interval_s": 300.0}))
    assert not loop.due(0.0) and not loop.due(10.0)  # the timer: the first round 300 s after start
    loop.train_out_of_memory()
    assert loop.due(10.0)
    for _ in range(64):
        loop.observe(2000, 5000, 1)
    job = loop.start(48, 10.0)
    assert job is not None and job.snapshot.train_oom and not loop.oom_pending
