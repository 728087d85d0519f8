"""The discrete-event simulator driving the real BrokerState (libra.sim.engine) and its CLI."""

from __future__ import annotations

import json

import pytest

from libra.policies.routing.interface import MigrationQuery
from libra.sim.__main__ import main as sim_main
from libra.sim.engine import COLOCATED_SWITCH, SimConfig, Simulator
from libra.sim.cluster import SimConfigError, make_layout
from libra.traces import TrajectorySpec, Turn
from libra.sim.workload_profiles import get_profile
from libra.sim.workloads import generate

R2E = get_profile("r2e")


def _cfg(**kw: object) -> SimConfig:
    base: dict[str, object] = {"bucket_thresholds": R2E.bucket_thresholds, "size_thresholds": R2E.size_thresholds}
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


def test_same_seed_gives_identical_results() -> None:
    trajs = generate("r2e", 3, 2, 16, seed=7)
    a = Simulator(trajs, _cfg(seed=7)).run().to_dict()
    b = Simulator(trajs, _cfg(seed=7)).run().to_dict()
    assert a == b
    assert a["trajectories"] == 96 and a["steps"] == 3


@pytest.mark.parametrize("batching", ["streaming", "barrier"])
def test_48_gpu_20_step_r2e_run_completes_and_accounts_every_token(batching: str) -> None:
    trajs = generate("r2e", 20, 1, 16, seed=1)
    sim = Simulator(trajs, _cfg(gpus=48, allocation="hetero", lag=2, batching=batching))
    res = sim.run()
    assert res.steps == 20 and res.trajectories == len(trajs)
    assert res.tokens == sum(t.total_tokens for t in trajs)
    assert res.rollout_gpus + res.train_gpus == 48 and res.rollout_gpus == 16
    assert sim.trained == 20 and not sim.broker.works and not sim._live
    st = res.step_time_s
    assert 0 < st["p50"] <= st["p99"] and st["mean"] * 20 == pytest.approx(res.makespan_s)
    assert 0.0 <= res.gpu_idle_fraction < 1.0
    assert res.tokens_per_s == pytest.approx(res.tokens / res.makespan_s)
    # every generate turn ran on some instance; the broker counted them per bucket
    assert sum(res.bucket_turns.values()) == sum(t.num_turns for t in trajs)
    assert res.batching == batching
    if batching == "barrier":  # the policy-lag bound: rollout of step k+2 never starts before training of step k ends
        for k in range(18):
            assert sim.rollout_start[k + 2] >= sim.train_end[k]
        assert res.staleness["max"] <= 1
    else:  # the staleness budget (eta = 2, one group per step): group k+3 waits for training step k
        for k in range(17):
            assert sim.rollout_start[k + 3] >= sim.train_end[k]
        assert res.staleness["max"] >= 1


def _traj(tid: str, turns: list[tuple[int, int | None]]) -> TrajectorySpec:
    out = []
    for i, (gen, payload) in enumerate(turns):
        if i < len(turns) - 1:
            out.append(Turn(gen, "bash", 1.0, payload or 0, "success"))
        else:
            out.append(Turn(gen))
    return TrajectorySpec(tid, f"p-{tid}", 0, f"p-{tid}@0", 100, tuple(out))


HAND = [
    _traj("a", [(100, 50), (5000, None)]),  # remaining after return 5000 -> medium, starts medium
    _traj("b", [(3000, 10), (100, None)]),  # 3100 -> short, stays short
    _traj("c", [(100, 1000), (20000, None)]),  # 20100 -> long
    _traj("d", [(4000, 1000), (100, 0), (100, None)]),  # starts medium (4200), truly short (200) after return 1
]


def test_accuracy_and_migration_metrics_on_a_hand_built_trace() -> None:
    # the length-bucket oracle that never corrects: d is routed to medium at its first return while its truth is short
    stay = Simulator(HAND, _cfg(gpus=16, router="oracle", lag=1, router_params={"placement": "bucket"})).run()
    assert stay.routing_decisions == 4
    assert stay.routing_accuracy == pytest.approx(3 / 4)
    assert stay.migrated_token_ratio == 0.0 and stay.migrations == 0
    # oracle that follows the true remaining length: d migrates once, carrying its whole context
    follow = Simulator(HAND, _cfg(gpus=16, router="oracle", lag=1, router_params={"placement": "bucket", "follow": True})).run()
    assert follow.routing_accuracy == 1.0
    assert follow.migrations == 1
    total = sum(t.total_tokens for t in HAND)
    assert follow.migrated_token_ratio == pytest.approx((100 + 4000 + 1000) / total)
    assert follow.kv_migrations + follow.reprefill_migrations == 1


def test_routing_accuracy_scores_the_remaining_response_tokens() -> None:
    """Truth = bucket of the response tokens still to come after the first tool return, tool payloads
    included: 1,000 + 6,000 + 100 = 7,100 -> medium, although only 1,100 generated tokens remain."""
    e = _traj("e", [(100, 100), (1000, 6000), (100, None)])
    res = Simulator([e], _cfg(gpus=16, router="oracle", lag=1, router_params={"placement": "bucket"})).run()
    assert res.routing_decisions == 1 and res.routing_accuracy == 1.0  # the length-bucket oracle starts it in medium


def test_kv_transfer_cost_matches_the_paper_bounds_and_layouts_are_checked() -> None:
    sim = Simulator(HAND, _cfg(gpus=16))
    assert sim.costs.kv_seconds(MigrationQuery(40_000, True, 1, 4)) < 0.33
    assert sim.costs.kv_seconds(MigrationQuery(40_000, False, 1, 4)) <= 0.733
    lay = make_layout("hetero", 48)
    assert [i.tp for i in lay.instances] == [1, 1, 2, 4, 1, 1, 2, 4] and lay.train_gpus == 32
    assert make_layout("colocated", 48).colocated and make_layout("static_uniform", 48).rollout_gpus == 24
    with pytest.raises(SimConfigError, match="unknown allocation"):
        make_layout("nope", 48)
    with pytest.raises(SimConfigError, match="lag"):
        Simulator(HAND, _cfg(lag=0))


def test_colocated_runs_synchronously_on_all_gpus() -> None:
    trajs = generate("search_r1", 2, 1, 16, seed=3)
    sim = Simulator(trajs, SimConfig(allocation="colocated", gpus=16, lag=3))
    res = sim.run()
    assert sim.lag == 1 and res.train_gpus == res.rollout_gpus == 16
    assert sim.rollout_start[1] >= sim.train_end[0]
    # every step pays both role switches of every GPU on top of the training model's time
    switches = COLOCATED_SWITCH.snapshot_s + COLOCATED_SWITCH.restore_s + COLOCATED_SWITCH.to_rollout_s
    assert switches == pytest.approx(18.8)
    for k, steps in enumerate(sim.by_step):
        model = sim.train_time([t.total_tokens for t in steps])
        assert sim.train_end[k] - sim.train_start[k] == pytest.approx(model + switches)


def test_cli_json_has_the_contract_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_main(["--workload", "r2e", "--steps", "2", "--prompts", "1", "--router", "least_loaded",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("tokens_per_s", "trajectories_per_s", "rollout_time_s", "train_time_s", "gpu_idle_fraction",
                "routing_accuracy", "migrated_token_ratio"):
        assert isinstance(out[key], float), key
    assert set(out["step_time_s"]) >= {"mean", "p50", "p99"}
    assert "per_step" not in out
    assert sim_main(["--workload", "r2e", "--steps", "2", "--prompts", "1", "--router", "least_loaded",
                     "--allocation", "static_uniform", "--lag", "1", "--per-step", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["per_step"]
    assert [r["step"] for r in rows] == [0, 1] and all(r["trajectories"] == 16 for r in rows)
    for r in rows:
        assert r["rollout_s"] > 0 and r["train_s"] > 0
        assert r["rollout_over_train"] == pytest.approx(r["rollout_s"] / r["train_s"])
    assert sim_main(["--trace", "/nonexistent.jsonl", "--json"]) == 2


@pytest.mark.parametrize("batching", ["streaming", "barrier"])
def test_instance_credit_follows_the_observed_lengths_after_each_step(batching: str) -> None:
    from libra.sim.engine import _planner_reserve

    trajs = generate("r2e", 6, 2, 16, seed=3)
    sim = Simulator(trajs, _cfg(seed=3, batching=batching))
    first = sim.costs.reserve_tokens
    assert first == _planner_reserve(sim.costs.cm, [t for t in trajs if t.step == min(x.step for x in trajs)])
    sim.run()
    last = max(t.step for t in trajs)
    consumed = sim.former.batch_specs(len(sim.by_step) - 1)  # what the last training step consumed
    if batching == "barrier":
        assert {t.id for t in consumed} == {t.id for t in trajs if t.step == last}
    expected = _planner_reserve(sim.costs.cm, consumed)
    assert sim.costs.reserve_tokens == expected != first  # re-derived from the last trained step
    for peer, inst in sim.instances.items():
        assert inst.capacity == sim.costs.max_seqs(inst.tp)
        assert sim.broker.actors[peer].capacity == inst.capacity  # and re-bid to the broker

    fixed = Simulator(trajs, _cfg(seed=3, reserve_tokens=8192))
    fixed.run()
    assert fixed.costs.reserve_tokens == 8192  # an explicit reserve stays fixed
