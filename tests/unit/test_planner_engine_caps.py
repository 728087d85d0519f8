"""The planner plans no rollout TP group larger than the actors' engines serve (their hello labels ``engine`` and
``max_tp``: 1 for the HF engine), and a plan that would need one is refused at plan time. Pure core."""

from __future__ import annotations

import pytest

from libra.broker.config import BrokerConfig
from libra.broker.events import PeerMessage, Tick
from libra.broker.plan_applier import PlanError
from libra.broker.state import BrokerState
from libra.policies.planner.engine_caps import cap_rollout_tps, cluster_max_tp
from libra.policies.planner.types import Plan, PlannerError, RolloutInstance, TrainConfig
from libra.protocol import messages as m

CAPS = {"generate": ["*"], "train": ["*"], "sync": ["*"]}
CLIENT = b"client-1"


def test_candidate_tps_are_capped_by_the_weakest_engine() -> None:
    assert cluster_max_tp([{"max_tp": 8}, {"max_tp": 1}, {"slot_kind": "gpu"}]) == 1
    assert cluster_max_tp([{"slot_kind": "gpu"}]) is None  # nobody says: no cap
    assert cap_rollout_tps({"granularity": 8}, None) == {"granularity": 8}
    assert cap_rollout_tps({}, 1)["rollout_tps"] == (1,)
    assert cap_rollout_tps({"rollout_tps": (1, 2, 4, 8), "rollout_tp": 8}, 4) == {"rollout_tps": (1, 2, 4),
                                                                                 "rollout_tp": 4}
    with pytest.raises(PlannerError, match="no rollout TP degree"):
        cap_rollout_tps({"rollout_tps": (2, 4)}, 1)


def broker(engine: str, max_tp: int, n_gpus: int = 16) -> BrokerState:
    s = BrokerState(BrokerConfig(heartbeat_s=1e9, planner={"allocation": "grp", "interval_s": 60.0}))
    for k in range(n_gpus):
        aid = f"n{k // 8}/gpu{k % 8}"
        labels = {"slot_kind": "gpu", "engine": engine, "max_tp": max_tp}
        s.handle(PeerMessage(aid.encode(), m.ActorHello(aid, f"n{k // 8}", f"gpu{k % 8}", 1, CAPS, ["generate"], 4,
                                                       labels)), 0.0)
    s.handle(PeerMessage(CLIENT, m.ClientHello("c", 1)), 0.0)
    return s


def finish(s: BrokerState, n: int, now: float) -> None:
    view = s.rollout.view([("n0/gpu0", s.rollout.buckets[0].name, 0, 0, "n0")])
    for i in range(n):
        tid, gen = f"t{now}-{i}", 800 + 700 * (i % 7) + (30000 if i % 5 == 0 else 0)  # long tails favour big TP
        s.rollout.route(tid, {"prompt_tokens": 700}, view)
        s.rollout.turn_done(tid, {"gen_tokens": gen})
        s.handle(PeerMessage(CLIENT, m.EndTrajectory(tid, gen, True)), now)


def planned_rollout_tps(engine: str, max_tp: int) -> tuple[int, ...]:
    s = broker(engine, max_tp)
    s.handle(Tick(), 1.0)
    finish(s, 64, 10.0)
    out = s.handle(Tick(), 62.0)
    directives = [c.msg for c in out if isinstance(getattr(c, "msg", None), m.Directive)]
    assert s.planner is not None and s.planner.plan is not None and directives
    assert all(d.config["tp"] <= max_tp for d in directives if d.config.get("role") == "rollout")
    return s.planner.plan.rollout_tps


def test_hf_actors_get_only_tp1_rollout_instances() -> None:
    assert set(planned_rollout_tps("hf", 1)) == {1}
    assert max(planned_rollout_tps("vllm", 8)) <= 8


def test_a_plan_with_a_tp_group_the_engines_cannot_serve_is_refused_at_plan_time() -> None:
    s = broker("hf", 1, n_gpus=4)
    plan = Plan(4, 2, TrainConfig(1, 1, 2, 1), (RolloutInstance(2, 0, float("inf"), 10, 1.0),), 1.0, 1.0)
    with pytest.raises(PlanError, match="TP-2 rollout group but its hf engine serves TP <= 1"):
        s.apply_plan(plan, 1.0)
    ok = broker("vllm", 8, n_gpus=4)
    out = ok.apply_plan(plan, 1.0)
    rollout = [c.msg.config for c in out if isinstance(getattr(c, "msg", None), m.Directive)
               and c.msg.config.get("role") == "rollout"]
    assert sorted((r["tp"], r["rank"]) for r in rollout) == [(2, 0), (2, 1)]  # one group, a leader and a member


def test_the_brokers_engine_settings_ride_along_in_each_directive() -> None:
    s = BrokerState(BrokerConfig(heartbeat_s=1e9, engines={"dtype": "fp16", "gpu_memory_fraction": 0.5}))
    for k in range(4):
        aid = f"n0/gpu{k}"
        s.handle(PeerMessage(aid.encode(), m.ActorHello(aid, "n0", f"gpu{k}", 1, CAPS, ["generate"], 4,
                                                       {"slot_kind": "gpu", "engine": "hf", "max_tp": 1})), 0.0)
    plan = Plan(4, 2, TrainConfig(1, 1, 2, 1), (RolloutInstance(1, 0, 1e9, 5, 1.0), RolloutInstance(1, 1e9, float("inf"), 5, 1.0)),
                1.0, 1.0)
    out = s.apply_plan(plan, 1.0)
    cfgs = [c.msg.config for c in out if isinstance(getattr(c, "msg", None), m.Directive)]
    assert cfgs and all(c["dtype"] == "fp16" and c["gpu_memory_fraction"] == 0.5 for c in cfgs)
    for bad, msg in (({"dtype": "int8"}, "dtype"), ({"gpu_memory_fraction": 3}, "gpu_memory_fraction"),
                     ({"dtpye": "bf16"}, "unknown key")):
        with pytest.raises(ValueError, match=msg):
            BrokerState(BrokerConfig(engines=bad))


def test_with_earl_the_planners_round_keeps_the_rollout_tp_earl_runs() -> None:
    """``parallelism = "earl"``: EARL owns the rollout TP, so a GRP round plans GPU counts at the TP the
    rollout actors run now and never undoes an EARL switch."""
    from libra.policies.planner.engine_caps import pin_rollout_tp

    assert pin_rollout_tp({"rollout_tps": (1, 2, 4), "rollout_tp": 4}, 2) == {"rollout_tps": (2,), "rollout_tp": 2}
    assert pin_rollout_tp({"granularity": 8}, None) == {"granularity": 8}
    with pytest.raises(PlannerError, match="pinned rollout TP"):
        pin_rollout_tp({}, 0)
    free = planned_rollout_tps("vllm", 8)
    assert max(free) > 1  # on its own the planner picks larger groups for these long tails

    def earl_broker(tp: int) -> BrokerState:
        s = BrokerState(BrokerConfig(heartbeat_s=1e9, planner={"allocation": "grp", "interval_s": 60.0,
                                                               "parallelism": "earl",
                                                               "earl": {"interval_s": 1e9}}))
        for k in range(16):
            aid = f"n{k // 8}/gpu{k % 8}"
            labels = {"slot_kind": "gpu", "engine": "vllm", "max_tp": 8}
            s.handle(PeerMessage(aid.encode(), m.ActorHello(aid, f"n{k // 8}", f"gpu{k % 8}", 1, CAPS, ["generate"],
                                                           4, labels)), 0.0)
        for a in s.actors.values():  # as if EARL had switched every rollout GPU to TP `tp` earlier
            a.directive_config.update({"role": "rollout", "tp": tp, "rank": 0})
        s.handle(PeerMessage(CLIENT, m.ClientHello("c", 1)), 0.0)
        s.handle(Tick(), 1.0)
        finish(s, 64, 10.0)
        s.handle(Tick(), 62.0)
        return s

    for tp in (1, 2):
        s = earl_broker(tp)
        assert s.planner is not None and s.planner.plan is not None and s.planner.pinned_rollout_tp == tp
        assert set(s.planner.plan.rollout_tps) == {tp}
