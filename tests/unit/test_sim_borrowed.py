"""The borrowed-GPU simulation: the serving trace's documented statistics, the serving owner's SLO model,
Poisson spot revocations, the lent slots in the real broker, and a smoke run of ``bench borrowed --quick``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from libra.policies.cost import RolloutCostModel, load_hardware, load_model
from libra.sim.serving_owner import LendEvent, ServingCapacity, ServingFleet, run_owner, slo_violations
from libra.sim.serving_trace import DAY_S, ServingTraceError, ServingTraceParams, serving_trace

CM = RolloutCostModel(load_hardware("a800"), load_model("qwen3-14b"))


def _cap(fleet: ServingFleet) -> ServingCapacity:
    return ServingCapacity.from_cost_model(CM, fleet)


def test_trace_diurnal_statistics_hold() -> None:
    p = ServingTraceParams(bursts_per_hour=0.0, bin_s=10.0)
    tr = serving_trace(p, DAY_S, seed=1)
    assert float(tr.load.mean()) == pytest.approx(p.mean_load, rel=1e-6)
    assert float(tr.load.max()) == pytest.approx(p.peak_load, rel=1e-4)
    assert float(tr.load.max() / tr.load.min()) == pytest.approx(1 / p.trough_ratio, rel=1e-3)
    assert abs(float(tr.t[int(np.argmax(tr.load))]) - p.peak_s) <= p.bin_s
    with pytest.raises(ServingTraceError):
        ServingTraceParams(trough_ratio=0.0)


def test_trace_bursts_are_poisson_at_their_rate_and_seeded() -> None:
    p = ServingTraceParams(bursts_per_hour=2.0, bin_s=10.0)
    hours = 500
    tr = serving_trace(p, hours * 3600.0, seed=3)
    n, mean = len(tr.bursts), 2.0 * hours
    assert abs(n - mean) < 4 * math.sqrt(mean)
    lengths = np.array([b - a for a, b in tr.bursts])
    assert float(lengths.mean()) == pytest.approx(p.burst_mean_s, rel=0.15)
    on = tr.load[tr.burst] / p.diurnal(tr.t[tr.burst])
    assert np.allclose(on, p.burst_factor)
    again = serving_trace(p, hours * 3600.0, seed=3)
    assert again.bursts == tr.bursts and np.array_equal(again.load, tr.load)


def test_capacity_is_the_tpot_target_or_the_batch_cap() -> None:
    fleet = ServingFleet()
    cap = _cap(fleet)
    assert 0 < cap.per_gpu_rps and float(cap.tpot(cap.per_gpu_rps)) <= fleet.target_tpot_s + 1e-12
    assert float(cap.tpot(0.0)) == pytest.approx(cap.a)
    assert math.isinf(float(cap.tpot(1 / (cap.k * cap.output_tokens))))


def test_no_violations_without_borrowing_under_capacity() -> None:
    fleet, p = ServingFleet(gpus=16), ServingTraceParams(peak_load=0.4)  # peak with bursts 0.64: noise cannot fill it
    cap = _cap(fleet)
    tr = serving_trace(p, DAY_S, seed=0)
    arrivals = tr.arrivals(cap.per_gpu_rps * fleet.gpus, seed=0)
    assert float(tr.load.max()) < 0.65
    run = run_owner(tr, arrivals, fleet, cap, seed=0, lend=False)
    assert not run.events and slo_violations(arrivals, run.serving, cap, p.bin_s) == 0
    over = slo_violations(arrivals, run.serving // 2, cap, p.bin_s)  # half the fleet: the peak overloads it
    assert over > 0


def test_violations_grow_when_reclaims_are_slow() -> None:
    p = ServingTraceParams(bursts_per_hour=6.0)
    tr = serving_trace(p, 6 * 3600.0, seed=2, start_s=8 * 3600.0)
    out = []
    for deadline in (0.0, 5.0, 60.0):
        fleet = ServingFleet(gpus=16, deadline_s=deadline)
        cap = _cap(fleet)
        arrivals = tr.arrivals(cap.per_gpu_rps * fleet.gpus, seed=2)
        run = run_owner(tr, arrivals, fleet, cap, seed=2)
        assert run.reclaims > 0 and run.lent_gpu_s > 0
        out.append(slo_violations(arrivals, run.serving, cap, p.bin_s))
    assert out[0] < out[1] < out[2]


@pytest.mark.parametrize("rate", [1.0, 10.0])
def test_spot_revocations_are_poisson_at_the_rate_per_lent_gpu_hour(rate: float) -> None:
    p = ServingTraceParams(peak_load=0.02, bursts_per_hour=0.0, bin_s=5.0)  # idle fleet: lent nearly always
    tr = serving_trace(p, 40 * 3600.0, seed=4)
    fleet = ServingFleet(gpus=6, revocations_per_gpu_hour=rate, spot_away_s=60.0)
    cap = _cap(fleet)
    run = run_owner(tr, tr.arrivals(cap.per_gpu_rps * fleet.gpus, seed=4), fleet, cap, seed=4)
    expected = rate * run.lent_gpu_s / 3600.0
    assert expected > 30 and abs(run.spot_revocations - expected) < 4 * math.sqrt(expected)
    spots = [e for e in run.events if e.reason == "spot_notice"]
    assert len(spots) == run.spot_revocations and all(e.deadline_s == fleet.spot_deadline_s for e in spots)
    assert run.reclaims == 0  # no load-driven reclaim on an idle fleet


def test_lent_slots_join_the_real_broker_and_a_reclaim_moves_their_work() -> None:
    from libra.sim.borrowed import BorrowedSimulator
    from libra.sim.config import SimConfig
    from libra.sim.engine import Simulator
    from libra.sim.workloads import generate

    trajs = generate("r2e", 3, 1, 16, 0)
    cfg = SimConfig(gpus=16, seed=0)
    base = Simulator(trajs, cfg).run()
    events = [LendEvent(0.0, g, "lend") for g in range(8)]
    events += [LendEvent(40.0 + g, g, "reclaim", 0.5, "slo_headroom_low") for g in range(8)]
    sim = BorrowedSimulator(trajs, cfg, events, ["short", "medium", "long", "long"] * 2, join_s=1.0)
    r = sim.run()  # the engine validates the broker state at the end and raises on a stall
    s = sim.lent_summary()
    assert s["lends"] == 8 and s["reclaims"] == 8 and s["lent_busy_gpu_s"] > 0
    assert s["handbacks"] > 0  # turns that could not finish in 0.5 s came back
    assert s["broker"]["reclaims"] == 8 and s["contexts_moved"] == 8
    # every trajectory completed, once, with all of its tokens (a handed-back turn re-ran elsewhere)
    assert r.trajectories == base.trajectories == len(trajs) == len({t.id for t in sim.records})
    assert r.tokens == base.tokens


def test_online_lent_slots_are_counted_and_directed_by_the_broker_planner_rounds() -> None:
    """The grp allocation (the broker's PlannerLoop re-planning every step) with lent slots: its rounds count the
    connected, not-reclaimed lent slots as borrowed capacity, and the broker directs each one to a TP-1 instance
    in a bucket of the deployed plan; a reclaim lowers the count; nothing is lost."""
    from libra.sim.borrowed import BorrowedSimulator
    from libra.sim.config import SimConfig
    from libra.sim.engine import Simulator
    from libra.sim.workloads import generate

    trajs = generate("r2e", 4, 2, 16, 0)
    cfg = SimConfig(gpus=16, seed=0, allocation="grp")
    base = Simulator(trajs, cfg).run()
    events = [LendEvent(0.0, g, "lend") for g in range(8)]
    events += [LendEvent(60.0, g, "reclaim", 0.5, "slo_headroom_low") for g in range(4)]
    sim = BorrowedSimulator(trajs, cfg, events, [], join_s=1.0)
    r = sim.run()
    alloc = sim.alloc
    assert alloc is not None
    counted = [(d["t"], d["borrowed"]["gpus"]) for d in alloc.decisions if "borrowed" in d]
    assert counted and all(n == (8 if t < 60.0 else 4) for t, n in counted) and counted[-1][1] == 4
    assert counted[0][0] < 60.0  # a round counted all eight before the reclaim
    s = sim.lent_summary()
    assert s["lends"] == 8 and s["reclaims"] == 4 and s["directives"] >= 8 and s["lent_busy_gpu_s"] > 0
    names = {b.name for b in sim.broker.rollout.buckets}
    for g in range(8):  # every lent slot directed by the broker to a TP-1 rollout role in a plan bucket
        sess = sim.broker.actors[sim._peer(g)]
        assert sess.directive_config["role"] == "rollout" and sess.directive_config["tp"] == 1
        assert sess.directive_config["bucket"] in names and "train" not in sess.accepting
    assert sim.broker.lent_slots() == [f"lent{g:02d}" for g in range(4, 8)]
    assert all(a not in alloc.roles for a in sim.broker.lent_slots())  # never part of the owned layout
    assert r.trajectories == base.trajectories == len(trajs) and r.tokens == base.tokens


def test_bench_borrowed_quick_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    from libra.bench.borrowed import main

    assert main(["--quick", "--json", "--rates", "0,10"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["revocations_per_gpu_hour"], r["placement"]) for r in out["runs"]] == [
        (0.0, "proportional"), (0.0, "smallest"), (10.0, "proportional"), (10.0, "smallest")]  # both, same run
    assert out["borrowed_buckets"]["smallest"] == {"short": 16, "medium": 0, "long": 0}
    assert all(k.startswith("lent/tp1/short") or k.startswith("owned/") for k in out["runs"][1]["kinds"])
    for r in out["runs"]:
        assert r["serving_requests"] > 0 and r["violations_with"] >= r["violations_without"] >= 0
        assert r["slots"]["lends"] > 0 and r["ratio"] > 0
    assert out["runs"][2]["spot_revocations"] > 0 and out["modelled_only"]
    assert [r["layout"] for r in out["runs"]] == ["hetero"] * 4
    assert any("planner loop" in line for line in out["modelled_only"])  # said plainly: not driven by it
    assert any(line.startswith("the grp rows") and "ONCE" in line for line in out["modelled_only"])
    # the planner's layout in both runs of each pair, same rates and placements, same owner schedule
    pl = out["planner"]
    assert [(r["revocations_per_gpu_hour"], r["placement"]) for r in pl["runs"]] == [
        (r["revocations_per_gpu_hour"], r["placement"]) for r in out["runs"]]
    assert pl["no_borrowing"]["tokens_per_s"] > 0 and pl["no_borrowing"]["kinds"] != out["no_borrowing"]["kinds"]
    plan_train = pl["owned_plan"]["n_train"]
    for r, h in zip(pl["runs"], out["runs"]):
        assert r["layout"] == "grp" and r["ratio"] > 0 and r["slots"]["lends"] > 0
        assert r["owner_reclaims"] == h["owner_reclaims"] and r["spot_revocations"] == h["spot_revocations"]
        assert r["plan"]["capacity_gpus"] > 0 and r["plan"]["revocation_cost_s"] > 0
        assert r["plan"]["n_train"] == plan_train or r["plan"]["used"]
        assert sum(r["borrowed_buckets"].values()) == out["serving_gpus"]
        assert all(k.startswith("owned/") or k.split("/")[2] in r["borrowed_buckets"] for k in r["kinds"])
    # online: the broker's planner loop in both runs of each pair, same rates, placements and owner schedule
    on = out["online"]
    assert [(r["revocations_per_gpu_hour"], r["placement"]) for r in on["runs"]] == [
        (r["revocations_per_gpu_hour"], r["placement"]) for r in out["runs"]]
    assert on["no_borrowing"]["tokens_per_s"] > 0
    for r, h in zip(on["runs"], out["runs"]):
        assert r["layout"] == "online" and r["ratio"] > 0 and r["slots"]["lends"] > 0
        assert r["owner_reclaims"] == h["owner_reclaims"] and r["spot_revocations"] == h["spot_revocations"]
        q = r["online"]
        assert q["rounds"] > 0 and q["rounds_with_lent"] > 0 and q["mean_lent_counted"] > 0  # the rounds counted them
        assert r["slots"]["directives"] > 0  # and the broker directed them
        assert r["priced_take_backs_per_gpu_hour"] >= 0
    assert any(line.startswith("the online rows") for line in out["modelled_only"])
    with pytest.raises(SystemExit):
        main(["--rates", "-1"])
    with pytest.raises(SystemExit):
        main(["--placements", "everywhere"])
    with pytest.raises(SystemExit):
        main(["--layouts", "static"])


def test_planner_layouts_come_from_the_runtime_planner() -> None:
    from libra.broker.plan_applier import bucket_specs
    from libra.sim.borrowed_plan import OwnedPlanner
    from libra.sim.config import SimConfig, default_prompts
    from libra.sim.workloads import generate

    cfg = SimConfig(gpus=48, seed=0)
    op = OwnedPlanner(generate("r2e", 2, default_prompts(48), 16, 0), cfg)
    plan = op.owned_plan
    assert op.layout.train_gpus == plan.n_train and op.layout.rollout_gpus == plan.n_rollout
    assert sorted(i.tp for i in op.layout.instances) == sorted(plan.rollout_tps)
    assert [b.name for b in op.layout.buckets] == [b.name for b in bucket_specs(plan)]
    cm = RolloutCostModel(load_hardware(cfg.hardware), load_model(cfg.model))
    for placement in ("proportional", "smallest"):
        pb = op.borrowed(op.capacity(24, 1.0, cm), 48, placement)
        names = [b.name for b in pb.layout.buckets]
        assert len(pb.buckets) == 48 and set(pb.buckets) <= set(names)
        assert pb.layout.train_gpus == pb.decision.plan.n_train  # training on owned GPUs only, as planned
        assert pb.layout.gpus == 48 and pb.layout.train_gpus + pb.layout.rollout_gpus <= 48
        if placement == "smallest":
            assert set(pb.buckets) == {names[0]}
    assert op.capacity(0, 0.0, cm).gpus == 0
    none = op.borrowed(op.capacity(0, 0.0, cm), 4, "proportional")
    assert not none.decision.uses_borrowed and none.layout.train_gpus == plan.n_train
