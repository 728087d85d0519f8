"""Lent slots in the broker planner's rounds (libra/broker/plan_borrowed.py, plan_rounds.py): never in the
training layout nor directed to train, never in EARL's groups nor the Elastic Hybrid Pool's; counted as
borrowed capacity with the revocation cost in the round's decision record; placed into buckets as TP-1
rollout instances; a reclaim makes the next round due at once. Through BrokerState, no sockets."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from libra.broker.ehp import EhpSettings, ElasticPool
from libra.broker.events import PeerMessage, PlaceLent, Tick
from libra.broker.plan_decider import PlannerSettings
from libra.broker.state import BrokerConfig, BrokerState
from libra.policies.planner.types import RolloutInstance
from libra.protocol import messages as m

from test_broker_planner import CAPS, CLIENT, _directives, _finish  # the planner tests' harness (tests/unit)

LEND = {"owner": "serving", "rule": "headroom"}


def _hello_owned(s: BrokerState, owned: int) -> None:
    for k in range(owned):
        aid = f"n{k // 8}/gpu{k % 8}"
        s.handle(PeerMessage(aid.encode(), m.ActorHello(aid, f"n{k // 8}", f"gpu{k % 8}", 1, CAPS, ["generate"], 4,
                                                       {"slot_kind": "gpu"})), 0.0)


def _broker(owned: int = 16, lent: int = 8, **planner: object) -> BrokerState:
    s = BrokerState(BrokerConfig(heartbeat_s=1e9, planner={"allocation": "grp", "interval_s": 60.0,
                                                           "revocation_cost_s": 5.0, **planner}))
    _hello_owned(s, owned)
    for k in range(lent):
        aid = f"svc/gpu{k}"
        s.handle(PeerMessage(aid.encode(), m.ActorHello(aid, "svc", f"gpu{k}", 1, {"generate": ["*"]}, ["generate"], 4,
                                                       {"slot_kind": "gpu", "engine_role": "rollout",
                                                        "lend": LEND, "max_tp": 1})), 0.0)
    s.handle(PeerMessage(CLIENT, m.ClientHello("c", 1)), 0.0)
    return s


def _round(s: BrokerState, t: float) -> dict[str, m.Directive]:
    s.handle(Tick(), 1.0)
    _finish(s, 64, t - 10)
    return _directives(s.handle(Tick(), t))


def _switch_all(s: BrokerState, d: dict[str, m.Directive], now: float) -> None:
    for aid, x in d.items():
        s.handle(PeerMessage(aid.encode(), m.DirectiveDone(x.directive_id, x.kinds)), now)
        s.handle(PeerMessage(aid.encode(), m.Bid(x.kinds, 4)), now)


def test_lent_slots_are_borrowed_rollout_capacity_never_training() -> None:
    s = _broker()
    d = _round(s, 62.0)
    plan = s.planner.plan
    assert plan is not None and plan.n_gpus == 16  # the plan covers the owned GPUs only
    lent = {a: x for a, x in d.items() if a.startswith("svc/")}
    assert len(lent) == 8  # every lent slot got a role by an ordinary directive
    for x in lent.values():
        assert x.kinds == ["generate", "sync"] and x.config["role"] == "rollout" and x.config["tp"] == 1
        assert x.config["bucket"] in {f"tp{tp}" for tp in plan.rollout_tps}
    owned_train = sum(x.config.get("role") == "train" for a, x in d.items() if not a.startswith("svc/"))
    assert owned_train == plan.n_train and not any(x.config.get("role") == "train" for x in lent.values())
    rec = s.planner.decisions[-1]
    b = rec["borrowed"]  # the borrowed capacity's figures are in the round's decision record
    assert b["gpus"] == 8 and b["revocation_cost_s"] == 5.0 and b["revocations_per_gpu_hour"] == 1.0
    assert b["used"] and b["expected_s"] > 0 and b["owned_only_s"] > b["expected_s"]
    assert b["predicted_gain"] == pytest.approx(b["owned_only_s"] / b["expected_s"], rel=1e-3)
    st = s.snapshot("x", 62.0).stats["planner"]
    assert st["decisions"][-1]["borrowed"]["gpus"] == 8 and st["plan_borrowed_gpus"] == 8
    s.validate()


def test_borrowed_capacity_lets_more_owned_gpus_train_and_the_revocation_cost_can_undo_it() -> None:
    cheap = _broker(lent=16)
    _round(cheap, 62.0)
    alone = _broker(lent=0)
    _round(alone, 62.0)
    b = cheap.planner.decisions[-1]["borrowed"]
    assert b["used"] and b["predicted_gain"] > 1.0
    assert cheap.planner.plan.n_train >= alone.planner.plan.n_train
    # a revocation so costly that borrowing never pays: the owned-only plan, the record says why
    dear = _broker(lent=16, revocations_per_gpu_hour=3600.0, revocation_cost_s=1e6)
    _round(dear, 62.0)
    b = dear.planner.decisions[-1]["borrowed"]
    assert not b["used"] and b["n_train"] == alone.planner.plan.n_train
    assert dear.planner.plan.n_train == alone.planner.plan.n_train


def test_a_reclaim_makes_the_next_round_due_at_once_and_plans_without_it() -> None:
    s = _broker(lent=4)
    d = _round(s, 62.0)
    _switch_all(s, d, 63.0)
    rounds = s.planner.rounds
    assert s.plan_applier.done and s.planner.decisions[-1]["borrowed"]["gpus"] == 4
    s.handle(Tick(), 64.0)
    assert s.planner.rounds == rounds  # nothing changed: not due before interval_s
    s.handle(PeerMessage(b"svc/gpu0", m.OwnerReclaim("serving", 5.0, "slo_headroom_low")), 65.0)
    s.handle(Tick(), 66.0)
    assert s.planner.rounds == rounds + 1  # due at once after the reclaim, long before interval_s
    assert s.planner.decisions[-1]["borrowed"]["gpus"] == 3
    assert "svc/gpu0" not in s._planning.lent_slots()  # type: ignore[attr-defined]


def test_a_slot_lent_after_the_plan_is_placed_at_the_next_round_without_moving_the_owned_gpus() -> None:
    s = _broker(lent=2)
    _switch_all(s, _round(s, 62.0), 63.0)
    aid = "svc/gpu9"
    s.handle(PeerMessage(aid.encode(), m.ActorHello(aid, "svc", "gpu9", 1, {"generate": ["*"]}, ["generate"], 4,
                                                   {"slot_kind": "gpu", "lend": LEND})), 70.0)
    d = _directives(s.handle(Tick(), 71.0))  # due at once: the borrowed capacity changed
    assert s.planner.decisions[-1]["borrowed"]["gpus"] == 3
    assert s.planner.decisions[-1]["reason"] == "same_layout"  # the owned layout stays: only the new slot moves
    assert list(d) == [aid] and d[aid].config["role"] == "rollout" and d[aid].config["tp"] == 1


def test_lent_slots_are_never_plan_slots_nor_cap_the_owned_tp_nor_join_ehp() -> None:
    s = _broker(owned=8, lent=2)
    planning = s._planning  # type: ignore[attr-defined]
    assert {g.actor_id for g in planning.gpu_slots()} == {f"n0/gpu{k}" for k in range(8)}
    assert planning.max_rollout_tp() is None  # the lent slots' max_tp = 1 caps nothing
    assert planning.rollout_tp_now() == 1 and all(not s_.lent_owner for s_, _ in planning._gpu_roles()[0])
    pool = ElasticPool(EhpSettings.from_planner({"ehp": {}}))
    lent = SimpleNamespace(actor_id="svc/gpu0", labels={"engine_role": "hybrid", "lend": LEND},
                           accepting=frozenset({"generate", "train"}), directive=None, capacity=4, held=[],
                           lent_owner="serving")
    own = SimpleNamespace(actor_id="h/x0", labels={"engine_role": "hybrid"}, accepting=frozenset({"generate"}),
                          directive=None, capacity=4, held=[], lent_owner="")
    pool.observe_sessions([lent, own], 0)
    assert [a.actor_id for a in pool.actors] == ["h/x0"]  # even a mislabelled lent slot is never the pool's


def test_the_smallest_placement_puts_every_lent_slot_in_the_first_bucket() -> None:
    s = _broker(lent=4, borrowed_placement="smallest")
    d = _round(s, 62.0)
    first = f"tp{min(s.planner.plan.rollout_tps)}"
    assert [d[f"svc/gpu{k}"].config["bucket"] for k in range(4)] == [first] * 4


@pytest.mark.parametrize("bad", [{"revocations_per_gpu_hour": -1.0}, {"revocation_cost_s": float("nan")},
                                 {"borrowed_placement": "everywhere"}])
def test_bad_borrowed_settings_are_refused_naming_the_key(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        PlannerSettings.from_dict({"allocation": "grp", **bad})


def test_a_shell_that_runs_the_rounds_itself_counts_and_places_lent_slots_through_the_broker() -> None:
    """A broker without its own planner (the simulator's shell runs the PlannerLoop): ``lent_slots`` is the
    borrowed capacity to count, ``PlaceLent(plan, placement)`` and ``apply_plan(..., placement)`` direct the lent
    slots under the shell's plan by its placement, without touching the owned GPUs."""
    ref = _broker(lent=0)
    _round(ref, 62.0)
    assert ref.planner.plan is not None
    plan = replace(ref.planner.plan, rollout=(RolloutInstance(2, 0, 900, 10, 5.0), RolloutInstance(2, 0, 900, 10, 5.0),
                                              RolloutInstance(4, 900, 1e9, 10, 5.0)))  # two buckets: tp2, tp4
    s = _bare(lent=4)
    assert s.planner is None and s.lent_slots() == [f"svc/gpu{k}" for k in range(4)]
    assert s.handle(PlaceLent(None), 1.0) == []  # no plan deployed: nothing to place under
    first = "tp2"
    d = _directives(s.handle(PlaceLent(plan, "smallest"), 1.0))
    assert sorted(d) == s.lent_slots() and {x.config["bucket"] for x in d.values()} == {first}
    assert all(x.config["role"] == "rollout" and x.config["tp"] == 1 for x in d.values())
    _switch_all(s, d, 2.0)
    assert _directives(s.handle(PlaceLent(plan, "smallest"), 3.0)) == {}  # placed already: nothing moves
    spread = _directives(s.handle(PlaceLent(plan, "proportional"), 4.0))
    assert {x.config["bucket"] for x in spread.values()} == {"tp4"}  # proportional: 2 of 4 lent slots move to tp4
    assert len(spread) == 2
    _switch_all(s, spread, 5.0)
    s.handle(PeerMessage(b"svc/gpu0", m.OwnerReclaim("serving", 5.0, "slo_headroom_low")), 6.0)
    assert s.lent_slots() == ["svc/gpu1", "svc/gpu2", "svc/gpu3"]  # reclaimed: no longer borrowed capacity
    d = _directives(s.apply_plan(plan, 7.0, "smallest"))
    assert {x.config["bucket"] for a, x in d.items() if a.startswith("svc/")} == {first}
    assert "svc/gpu0" not in d and not any(x.config["role"] == "train" for a, x in d.items() if a.startswith("svc/"))
    s.validate()


def _bare(owned: int = 16, lent: int = 4) -> BrokerState:
    s = BrokerState(BrokerConfig(heartbeat_s=1e9))
    _hello_owned(s, owned)
    for k in range(lent):
        aid = f"svc/gpu{k}"
        s.handle(PeerMessage(aid.encode(), m.ActorHello(aid, "svc", f"gpu{k}", 1, {"generate": ["*"], "sync": ["*"]},
                                                       [], 4, {"slot_kind": "gpu", "lend": LEND})), 0.0)
    return s
