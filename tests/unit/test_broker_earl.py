"""EARL's selector in the broker: a switch when the average context enters a new range of the profile table,
hysteresis at a boundary, the OOM guard, the engines' max TP, and the switch applied through role directives
by the broker core (``[broker.planner] parallelism = "earl"``)."""

from __future__ import annotations

import pytest

from libra.broker.earl import EarlLoop, EarlSettings, earl_plan
from libra.broker.events import PeerMessage, Send, Tick
from libra.broker.plan_decider import PlannerSettings
from libra.broker.state import BrokerConfig, BrokerState
from libra.policies.cost import RolloutCostModel, load_hardware, load_model
from libra.protocol import messages as m

# a800 / qwen3-30b-a3b on 2 GPUs at load 8: TP 1 is best below ~20.5K tokens, TP 1 runs out of memory above it
# (TP 2 holds up to ~95K); the boundary is where the cost model's OOM line crosses
HW, MODEL = "a800", "qwen3-30b-a3b"


def loop(**kw: object) -> EarlLoop:
    s = EarlSettings.from_dict({"interval_s": 1.0, "min_turns": 4, "window": 8, "loads": [8], "configs": [1, 2],
                                **kw})
    return EarlLoop(s, RolloutCostModel(load_hardware(HW), load_model(MODEL)))


def feed(e: EarlLoop, context: int, n: int = 8) -> None:
    for _ in range(n):
        e.observe(context)


def test_switch_on_entering_a_new_range_and_back() -> None:
    e = loop()
    feed(e, 2_000)
    assert e.decide(1.0, n_gpus=2, load=4, max_tp=2, current_tp=1) is None  # short contexts: TP 1 is best
    assert e.decisions[-1]["reason"] == "range_changed"  # the first decision enters a range, keeping TP 1
    feed(e, 40_000)
    assert e.decide(2.0, n_gpus=2, load=4, max_tp=2, current_tp=1) == 2
    assert e.decisions[-1]["reason"] == "switch" and e.switches == 1
    feed(e, 40_000)
    assert e.decide(3.0, n_gpus=2, load=4, max_tp=2, current_tp=2) is None  # same range: kept
    feed(e, 2_000)
    assert e.decide(4.0, n_gpus=2, load=4, max_tp=2, current_tp=2) == 1  # back in the short range


def test_too_few_turns_decides_nothing() -> None:
    e = loop()
    feed(e, 40_000, n=3)
    assert e.decide(1.0, n_gpus=2, load=4, max_tp=2, current_tp=1) is None
    assert e.decisions[-1]["reason"] == "too_few_turns"


def test_hysteresis_holds_near_a_boundary_unless_past_the_margin() -> None:
    # EARL Fig. 3 at 16 responses: TP 4 wins at 16K, TP 8 at 32K (no OOM); the ranges meet at 32768/sqrt(2)
    e = loop(source="earl_fig3", configs=[4, 8], loads=[16], hysteresis=0.1, window=4)
    feed(e, 16_384, n=4)
    assert e.decide(1.0, n_gpus=8, load=16, max_tp=8, current_tp=4) is None
    edge = 32_768 / 2**0.5
    feed(e, int(edge * 1.04), n=4)  # 4% into TP 8's range: inside the margin, TP 4 still fits
    assert e.decide(2.0, n_gpus=8, load=16, max_tp=8, current_tp=4) is None
    assert e.decisions[-1]["reason"] == "hysteresis"
    feed(e, int(edge * 1.2), n=4)  # past the margin: switch
    assert e.decide(3.0, n_gpus=8, load=16, max_tp=8, current_tp=4) == 8
    feed(e, int(edge * 0.97), n=4)  # back just below the boundary: held at TP 8
    assert e.decide(4.0, n_gpus=8, load=16, max_tp=8, current_tp=8) is None
    assert e.decisions[-1]["reason"] == "hysteresis"


def test_the_oom_guard_beats_hysteresis() -> None:
    e = loop(hysteresis=0.9)  # a margin so wide that only the OOM guard can move it
    feed(e, 2_000)
    e.decide(1.0, n_gpus=2, load=8, max_tp=2, current_tp=1)
    sel = e._sel
    assert sel is not None
    ctx = 30_000
    assert sel.ooms(1, ctx, 8) and not sel.ooms(2, ctx, 8)
    feed(e, ctx)
    assert e.decide(2.0, n_gpus=2, load=8, max_tp=2, current_tp=1) == 2


def test_never_above_the_engines_max_tp() -> None:
    e = loop()
    feed(e, 40_000)
    assert e.decide(1.0, n_gpus=2, load=4, max_tp=1, current_tp=1) is None  # HF engines: TP 1 only
    assert e.decisions[-1]["reason"] == "only_config" and e.decisions[-1]["tp"] == 1
    feed(e, 40_000)
    assert e.decide(2.0, n_gpus=2, load=4, max_tp=1, current_tp=2) == 1  # a group above the cap goes back
    fig3 = loop(source="earl_fig3", configs=[1, 2, 4, 8])
    feed(fig3, 40_000)
    assert fig3.decide(1.0, n_gpus=8, load=8, max_tp=4, current_tp=4) is None
    assert fig3.decisions[-1]["reason"] == "table_exceeds_max_tp"


def test_fig3_table_switches_to_tp8_at_long_context_and_high_load() -> None:
    e = loop(source="earl_fig3", configs=[4, 8], loads=[8, 16, 32, 64, 128])
    feed(e, 1_024)
    assert e.decide(1.0, n_gpus=8, load=16, max_tp=8, current_tp=4) is None  # Fig. 3: TP 4 wins short contexts
    feed(e, 32_768)
    assert e.decide(2.0, n_gpus=8, load=128, max_tp=8, current_tp=4) == 8  # TP 4 OOMs at 32K x 128


def test_settings_are_checked() -> None:
    for bad, match in [({"source": "x"}, "source"), ({"hysteresis": 1.5}, "hysteresis"), ({"configs": [3]}, "configs"),
                       ({"interval_s": 0}, "interval_s"), ({"loads": []}, "loads"), ({"nope": 1}, "unknown")]:
        with pytest.raises(ValueError, match=match):
            EarlSettings.from_dict(bad)
    with pytest.raises(ValueError, match="parallelism"):
        PlannerSettings.from_dict({"allocation": "grp", "parallelism": "magic"})
    with pytest.raises(ValueError, match="hysteresis"):
        PlannerSettings.from_dict({"allocation": "grp", "parallelism": "earl", "earl": {"hysteresis": -1}})


def test_earl_plan_keeps_training_and_fills_every_rollout_gpu() -> None:
    p = earl_plan(None, 6, 4)
    assert p.n_train == 0 and p.rollout_tps == (2, 4) and p.n_gpus == 6
    assert earl_plan(None, 2, 2).rollout_tps == (2,)
    with pytest.raises(ValueError):
        earl_plan(None, 0, 2)


def _gpu_actor(s: BrokerState, peer: bytes, k: int, now: float) -> None:
    hello = m.ActorHello(f"h/gpu{k}", "h", f"gpu{k}", 1, {"generate": ["*"]}, ["generate"], 4,
                         {"slot_kind": "gpu", "engine": "stand-in", "max_tp": 2})
    s.handle(PeerMessage(peer, hello), now)
    s.handle(PeerMessage(peer, m.Bid(["generate"], 4)), now)


def test_the_broker_switches_the_rollout_tp_group_through_directives() -> None:
    planner = {"allocation": "grp", "hardware": HW, "model": MODEL, "interval_s": 1e6, "parallelism": "earl",
               "earl": {"interval_s": 1.0, "min_turns": 4, "window": 8, "loads": [8], "configs": [1, 2]}}
    s = BrokerState(BrokerConfig(heartbeat_s=100.0, liveness=3, router="least_loaded", planner=planner))
    now = 0.0
    s.handle(PeerMessage(b"c", m.ClientHello("client", 1)), now)
    _gpu_actor(s, b"a0", 0, now)
    _gpu_actor(s, b"a1", 1, now)
    s.handle(Tick(), now)  # starts EARL's clock
    i = 0

    def turns(context: int, n: int) -> list:
        nonlocal i
        out = []
        for _ in range(n):
            i += 1
            out += s.handle(PeerMessage(b"c", m.Submit(f"r{i}", "generate", "", {"prompt_ids": [7] * context},
                                                       f"t{i}", 60.0)), now)
        for c in out:
            if isinstance(c, Send) and isinstance(c.msg, m.Assign):
                peer = c.peer
                s.handle(PeerMessage(peer, m.WorkResult(c.msg.work_id, c.msg.lease, True, {"gen_tokens": 1})), now)
        return out

    turns(1_000, 6)
    now += 1.5
    out = s.handle(Tick(), now)
    assert not [c for c in out if isinstance(c, Send) and isinstance(c.msg, m.Directive)]  # short: TP 1 stays
    turns(30_000, 6)
    now += 1.5
    out = s.handle(Tick(), now)
    directives = {c.peer: c.msg for c in out if isinstance(c, Send) and isinstance(c.msg, m.Directive)}
    assert set(directives) == {b"a0", b"a1"}
    cfgs = sorted((d.config["tp"], d.config["rank"], d.config["group"]) for d in directives.values())
    assert [c[:2] for c in cfgs] == [(2, 0), (2, 1)] and cfgs[0][2] == cfgs[1][2]  # one TP-2 group
    earl = s.planner.summary()["earl"]  # type: ignore[union-attr]
    assert earl["switches"] == 1 and earl["decisions"][-1]["tp"] == 2
    s.validate()


def test_with_a_deployed_plan_earl_regroups_only_the_rollout_gpus() -> None:
    from libra.policies.cost.training import TrainConfig
    from libra.policies.planner.types import Plan, RolloutInstance

    planner = {"allocation": "grp", "hardware": HW, "model": MODEL, "interval_s": 1e6, "parallelism": "earl",
               "earl": {"interval_s": 1.0, "min_turns": 4, "window": 8, "loads": [8], "configs": [1, 2]}}
    s = BrokerState(BrokerConfig(heartbeat_s=100.0, liveness=3, router="least_loaded", planner=planner))
    now = 0.0
    s.handle(PeerMessage(b"c", m.ClientHello("client", 1)), now)
    peers = [f"a{k}".encode() for k in range(4)]
    for k, p in enumerate(peers):
        hello = m.ActorHello(f"h/gpu{k}", "h", f"gpu{k}", 1, {"generate": ["*"], "train": ["*"]}, ["generate"], 4,
                             {"slot_kind": "gpu", "engine": "stand-in", "max_tp": 2})
        s.handle(PeerMessage(p, hello), now)
        s.handle(PeerMessage(p, m.Bid(["generate"], 4)), now)
    inst = RolloutInstance(1, 0.0, float("inf"), 0.0, 0.0)
    base = Plan(4, 2, TrainConfig(1, 1, 2, 1), (inst, inst), 1.0, 1.0)
    s.planner.plan = base  # type: ignore[union-attr]  # as if the planner's round had deployed it

    def settle(out: list) -> None:  # every directed actor drains and bids in its new role, wave by wave
        while True:
            ds = [(c.peer, c.msg) for c in out if isinstance(c, Send) and isinstance(c.msg, m.Directive)]
            if not ds:
                return
            out = []
            for p, d in ds:
                out += s.handle(PeerMessage(p, m.DirectiveDone(d.directive_id, d.kinds)), now)
                out += s.handle(PeerMessage(p, m.Bid([] if d.config.get("rank", 0) else d.kinds, 4)), now)

    settle(s.apply_plan(base, now))
    trainers = {a.actor_id for a in s.actors.values() if a.directive_config.get("role") == "train"}
    assert len(trainers) == 2
    s.handle(Tick(), now)
    for i in range(6):
        s.handle(PeerMessage(b"c", m.Submit(f"r{i}", "generate", "", {"prompt_ids": [7] * 30_000}, f"t{i}", 60.0)),
                 now)
    now += 1.5
    out = s.handle(Tick(), now)
    directed = {c.msg.config["role"]: c for c in out if isinstance(c, Send) and isinstance(c.msg, m.Directive)}
    assert set(directed) == {"rollout"}  # the trainers are left alone
    settle(out)
    roles = {a.actor_id: a.directive_config for a in s.actors.values()}
    assert {aid for aid, r in roles.items() if r["role"] == "train"} == trainers
    rollout = [r for r in roles.values() if r["role"] == "rollout"]
    assert sorted((r["tp"], r["rank"]) for r in rollout) == [(2, 0), (2, 1)]
    s.validate()
