"""Measured costs (libra/policies/planner/measured.py), the job host's per-step costs and predictions, and
the Elastic Hybrid Pool deciding with them. Pure: no processes."""

from __future__ import annotations

import math

import pytest

from libra.broker.ehp import ActorView, EhpSettings, ElasticPool
from libra.broker.job_host import JobHost, JobSpec
from libra.broker.plan_decider import PlannerLoop, PlannerSettings
from libra.policies.planner.measured import MeasuredCosts, log_error, prediction_error


# ---------------------------------------------------------------------------------------------- MeasuredCosts
def test_the_first_step_sets_the_rates_and_later_ones_are_averaged() -> None:
    c = MeasuredCosts(alpha=0.5)
    assert not c.ready and c.predict(2, 2) is None
    rates = c.observe(gen_tokens=400, rollout_s=2.0, instances=2, train_tokens=800, train_s=4.0, ranks=1)
    assert rates == (100.0, 200.0)
    assert c.ready and (c.rollout_tok_s, c.train_tok_s) == (100.0, 200.0)
    c.observe(gen_tokens=600, rollout_s=1.0, instances=2, train_tokens=800, train_s=2.0, ranks=1)  # 300, 400
    assert (c.rollout_tok_s, c.train_tok_s) == (200.0, 300.0) and c.gen_tokens == 600 and c.steps == 2


def test_a_step_that_measured_nothing_leaves_the_rates_alone() -> None:
    c = MeasuredCosts()
    assert c.observe(gen_tokens=0, rollout_s=0.0, instances=0, train_tokens=10, train_s=1.0, ranks=1) == (None, 10.0)
    assert c.rollout_tok_s is None and not c.ready and c.predict(1, 1) is None
    with pytest.raises(ValueError, match="alpha"):
        MeasuredCosts(alpha=0.0)


def test_the_prediction_is_linear_in_instances_and_ranks_and_overlaps_under_lag() -> None:
    c = MeasuredCosts(overlap=True)
    c.observe(gen_tokens=1000, rollout_s=5.0, instances=2, train_tokens=3000, train_s=10.0, ranks=1)  # 100, 300
    p = c.predict(2, 1)
    assert (p.rollout_s, p.train_s, p.step_s) == (5.0, 10.0, 10.0)
    assert c.predict(4, 2).step_s == 5.0 and c.predict(1, 1).rollout_s == 10.0
    seq = MeasuredCosts(overlap=False)
    seq.observe(gen_tokens=1000, rollout_s=5.0, instances=2, train_tokens=3000, train_s=10.0, ranks=1)
    assert seq.predict(2, 1).step_s == 15.0  # lag 0: rollout, then training
    assert c.predict(0, 1) is None and c.predict(1, 0) is None


def test_move_gain_says_whether_a_slot_is_better_training_or_rolling_out() -> None:
    c = MeasuredCosts(overlap=True)
    c.observe(gen_tokens=1000, rollout_s=1.0, instances=4, train_tokens=4000, train_s=10.0, ranks=1)  # train-bound
    assert c.move_gain(4, 1, 1) > 0  # 10 s -> max(1.33, 5) s
    r = MeasuredCosts(overlap=True)
    r.observe(gen_tokens=1000, rollout_s=10.0, instances=2, train_tokens=100, train_s=1.0, ranks=2)  # rollout-bound
    assert r.move_gain(2, 2, 1) < 0 and r.move_gain(2, 2, -1) > 0
    assert c.move_gain(1, 1, 1) is None  # no rollout instance left to predict


def test_prediction_error_is_the_mean_absolute_log_ratio_over_predicted_steps() -> None:
    assert log_error(2.0, 1.0) == pytest.approx(math.log(2)) and log_error(None, 1.0) is None
    assert prediction_error([(None, 3.0), (2.0, 1.0), (1.0, 2.0), (0.0, 1.0)]) == pytest.approx(math.log(2))
    assert prediction_error([(None, 1.0)]) is None


def test_the_planner_loop_keeps_the_measured_costs_in_its_summary() -> None:
    loop = PlannerLoop(PlannerSettings.from_dict({"allocation": "grp"}))
    assert loop.summary()["measured_costs"] is None
    c = MeasuredCosts()
    c.observe(gen_tokens=10, rollout_s=1.0, instances=1, train_tokens=20, train_s=1.0, ranks=1)
    loop.measured(c)
    assert loop.summary()["measured_costs"]["train_tok_s_per_rank"] == 20.0


# ---------------------------------------------------------------------------------------------- the job host
SPEC = {"steps": 3, "prompts_per_step": 2, "group_size": 3, "max_policy_lag": 0, "world_size": 2, "env": "arith",
        "micro_batch_tokens": 4096}
ROWS = [{"question": f"{i}+1", "answer": i + 1} for i in range(4)]


def run_step(h: JobHost, t: float, train_s: float, tokens: int = 40) -> None:
    """One step: six episodes (rollout window 1 s, from their runner's clock), then both ranks train ``train_s``."""
    for i, w in enumerate(h.take_work(t)):
        h.on_reply(w.tag, True, {"reward": float(i % 2), "versions": [h.state.version], "gen_tokens": tokens // 2,
                                 "tokens": tokens, "ref": {"endpoint": "tcp://127.0.0.1:1", "name": f"traj/{t}/{i}"},
                                 "info": {"start": 1.0, "end": 2.0}}, "", t + 1.0)
    train = h.take_work(t + 1.0)
    assert [w.kind for w in train] == ["train", "train"]
    for w in train:
        r = w.args["rank"]
        h.on_reply(w.tag, True, {"rank": r, "weights_version": h.state.version + 1, "checksum": "c",
                                 "weights": {"endpoint": "tcp://t:1", "name": "w", "version": 1} if r == 0 else None},
                   "", t + 1.0 + train_s)


def test_each_step_records_its_measured_costs_and_the_prediction_made_before_it() -> None:
    h = JobHost("j", JobSpec.from_mapping(SPEC), ROWS, 0.0)
    h.rollout_instances = 3
    run_step(h, -100.0, 50.0)  # step 1: set-up in its seconds, measured but kept out of the costs
    s0 = h.records[-1]
    assert s0["train_tok_s_per_rank"] == pytest.approx(240 / 50.0 / 2) and s0["predicted_step_s"] is None
    run_step(h, 0.0, 2.0)
    s1 = h.records[-1]
    assert s1["rollout_instances"] == 3 and s1["train_ranks"] == 2
    assert s1["rollout_tok_s_per_instance"] == pytest.approx(120 / 1.0 / 3)  # 6 x 20 generated tokens in 1 s
    assert s1["train_tok_s_per_rank"] == pytest.approx(240 / 2.0 / 2)  # 6 x 40 trained tokens in 2 s on 2 ranks
    assert s1["predicted_step_s"] is None and s1["predicted_rollout_s"] is None and s1["predicted_train_s"] is None
    assert h.poll(0)["prediction_error"] is None
    h.rollout_instances = 6  # twice the instances: the rollout is predicted twice as fast
    run_step(h, 10.0, 4.0)
    s2 = h.records[-1]
    assert s2["predicted_rollout_s"] == pytest.approx(0.5) and s2["predicted_train_s"] == pytest.approx(2.0)
    assert s2["predicted_step_s"] == pytest.approx(2.5)  # lag 0: rollout then training
    assert s2["step_time_s"] == pytest.approx(12.0) and s2["train_time_s"] == pytest.approx(4.0)
    assert s2["measured_costs"]["train_tok_s_per_rank"] == pytest.approx(0.5 * 60 + 0.5 * 30)
    assert h.poll(0)["prediction_error"] == pytest.approx(abs(math.log(2.5 / 12.0)))


# ---------------------------------------------------------------------------------------------- the EHP
CORE = [ActorView("h/t0", False, ("train",)), ActorView("h/t1", False, ("train",))]
ROLLOUT = [ActorView("h/x0", True, ("generate",)), ActorView("h/r0", False, ("generate",)),
           ActorView("h/r1", False, ("generate",))]


def ehp_pool(**ehp: object) -> ElasticPool:
    p = ElasticPool(EhpSettings.from_planner({"ehp": ehp}))
    p.observe(CORE + ROLLOUT, 0.0, 0.0)
    return p


def costs(rollout_tok_s: float, train_tok_s: float) -> MeasuredCosts:
    c = MeasuredCosts(overlap=True)  # 3 instances and 2 ranks measured, 3000 generated and 6000 trained tokens
    c.observe(gen_tokens=3000, rollout_s=3000 / rollout_tok_s / 3, instances=3, train_tokens=6000,
              train_s=6000 / train_tok_s / 2, ranks=2)
    return c


def test_the_pool_borrows_only_when_the_measured_costs_predict_a_faster_step() -> None:
    # training takes 3x rollout (the hysteresis borrows), and the costs agree: 2 -> 3 ranks saves time
    p = ehp_pool(warmup_steps=0)
    g = p.plan_step(2, 2, True, 10.0, 30.0, costs=costs(100.0, 100.0))
    assert [d["action"] for d in p.decisions] == ["borrow"] and p.decisions[0]["reason"].endswith("_measured_gain")
    assert p.prediction["move"] == "borrow" and p.prediction["gain_s"] > 0 and g.step == 2
    # the same hysteresis signal, but the measured rollout is so slow that losing an instance costs more
    q = ehp_pool(warmup_steps=0)
    q.plan_step(2, 2, True, 10.0, 30.0, costs=costs(1.0, 100.0))
    assert q.decisions == [] and q.prediction["gain_s"] <= 0 and q.signal.reason == "training_bottleneck"
    # without measured costs the hysteresis decides alone, as before
    r = ehp_pool(warmup_steps=0)
    r.plan_step(2, 2, True, 10.0, 30.0)
    assert [d["action"] for d in r.decisions] == ["borrow"] and r.decisions[0]["reason"] == "training_bottleneck"


def test_a_forced_schedule_is_never_gated_by_the_measured_costs() -> None:
    p = ehp_pool(force=[[1, 1]])
    p.plan_step(1, 2, False, None, None, costs=costs(1.0, 1e9))  # the costs would never borrow
    assert [(d["action"], d["reason"]) for d in p.decisions] == [("borrow", "forced")]


def test_warm_up_steps_are_measured_but_not_kept() -> None:
    c = MeasuredCosts(alpha=0.5, warmup=1)
    first = c.observe(gen_tokens=100, rollout_s=1.0, instances=1, train_tokens=500, train_s=5.0, ranks=1)
    assert first == (100.0, 100.0) and not c.ready and c.predict(1, 1) is None  # step 1: set-up in its seconds
    c.observe(gen_tokens=100, rollout_s=1.0, instances=1, train_tokens=500, train_s=0.5, ranks=1)
    assert c.ready and c.train_tok_s == 1000.0 and c.predict(1, 1).train_s == 0.5
    with pytest.raises(ValueError, match="warmup"):
        MeasuredCosts(warmup=-1)
