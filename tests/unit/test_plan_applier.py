"""Plan application (roles per GPU slot, switch ordering) and the EHP join protocol, without sockets."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from libra.broker.hybrid import HybridReplica, JoinError, JoinState
from libra.broker.plan_applier import GpuSlot, PlanApplier, PlanError, Role, bucket_specs, layout_roles
from libra.policies.cost import RolloutCostModel, TrainingCostModel, load_hardware, load_model
from libra.policies.cost.training import TrainConfig
from libra.policies.planner.search import GlobalResourcePlanner
from libra.policies.planner.types import Plan, PlannerConfig, RolloutInstance

SLOTS = [GpuSlot(f"n{n}/gpu{i}", f"n{n}", i) for n in range(2) for i in range(8)]


def plan(n_train: int, train: TrainConfig | None, tps: list[int]) -> Plan:
    inst = tuple(RolloutInstance(tp, 0, 1000 * (k + 1), 1, 1.0) for k, tp in enumerate(sorted(tps)))
    return Plan(16, n_train, train, inst, 1.0, 1.0)


def groups_ok(roles: dict[str, Role]) -> None:
    by = {s.actor_id: s for s in SLOTS}
    members: dict[str, list[GpuSlot]] = {}
    for aid, r in roles.items():
        if r.kind != "idle":
            members.setdefault(r.group + r.bucket * (r.kind == "train"), []).append(by[aid])
    for g, ms in members.items():
        r = roles[ms[0].actor_id]
        if r.kind == "rollout" or r.size == r.tp:  # a TP group never spans nodes and is aligned
            assert len({m.node for m in ms}) == 1, g
            idx = sorted(m.index for m in ms)
            assert idx[0] % len(ms) == 0 and idx == list(range(idx[0], idx[0] + len(ms))), (g, idx)


def test_layout_of_a_searched_plan_is_valid() -> None:
    hw, model = load_hardware("a800"), load_model("qwen3-14b")
    planner = GlobalResourcePlanner(RolloutCostModel(hw, model), TrainingCostModel(hw, model),
                                    PlannerConfig(n_gpus=16, global_batch=64, granularity=1))
    rng = np.random.default_rng(0)
    work = [(float(p), float(g)) for p, g in zip(rng.integers(200, 2000, 256), rng.lognormal(7.5, 1.0, 256))]
    p = planner.search(work)
    roles = layout_roles(p, SLOTS)
    assert sum(r.kind == "train" for r in roles.values()) == p.n_train
    assert sorted(r.tp for r in roles.values() if r.kind == "rollout" and r.rank == 0) == sorted(p.rollout_tps)
    groups_ok(roles)
    specs = bucket_specs(p)
    assert [b.max_tokens for b in specs] == sorted(b.max_tokens for b in specs)


def test_layout_prefers_keeping_roles_and_rejects_what_does_not_fit() -> None:
    a = layout_roles(plan(8, TrainConfig(8, 1, 1, 1), [4, 2, 1, 1]), SLOTS)
    b = layout_roles(plan(8, TrainConfig(8, 1, 1, 1), [4, 2, 1, 1]), SLOTS, current=a, generation=1)
    assert [(r.kind, r.tp) for r in a.values()] == [(r.kind, r.tp) for r in b.values()]  # nobody moves
    with pytest.raises(PlanError):
        layout_roles(plan(16, TrainConfig(8, 1, 2, 1), [2]), SLOTS)  # 18 GPUs on 16
    with pytest.raises(PlanError):
        layout_roles(plan(8, None, [1]), SLOTS)


@pytest.mark.parametrize("before,after", [
    ((8, TrainConfig(8, 1, 1, 1), [4, 2, 1, 1]), (4, TrainConfig(4, 1, 1, 1), [8, 2, 1, 1])),
    ((4, TrainConfig(2, 1, 2, 1), [8, 4]), (12, TrainConfig(4, 1, 3, 1), [2, 2])),
    ((8, TrainConfig(8, 1, 1, 1), [8]), (8, TrainConfig(8, 1, 1, 1), [4, 4])),
])
def test_switching_never_leaves_no_training_replica_or_a_slot_in_two_roles(before, after) -> None:
    cur = layout_roles(plan(*before), SLOTS)
    tgt = layout_roles(plan(*after), SLOTS, current=cur, generation=1)
    ap = PlanApplier(cur, tgt)
    wave = ap.start()
    steps = 0
    while wave or not ap.done:
        assert ap._complete_replicas(set()) >= 1, "cluster without a complete training replica"
        assert not (set(ap.active) & ap.switching), "a slot in two roles"
        assert wave, "stuck: nothing to do but not done"
        aid, role = wave[0]
        assert role == tgt[aid]
        wave = wave[1:] + ap.on_switched(aid)
        steps += 1
    assert ap.active == tgt and steps == sum(cur[a] != tgt[a] for a in cur)


def test_join_protocol_happy_path_and_gradient_fencing() -> None:
    r = HybridReplica(("h0", "h1"))
    g = r.request()
    assert r.begin_fetch(g) and r.state_fetched(g, version=7)
    assert r.contributes_zeros
    with pytest.raises(JoinError):
        r.activate(g)  # needs a zero-gradient step first
    assert r.zero_step(g, step=10) and r.activate(g) and r.activated(g, step=11, version=8)
    assert r.state is JoinState.ACTIVE
    ok = dict(epoch=r.membership_epoch, step=11, version=8, current_step=11, current_version=8)
    assert r.accept_gradient(**ok)
    for bad in ({"epoch": 0}, {"step": 10, "current_step": 10}, {"version": 7}):
        assert not r.accept_gradient(**{**ok, **bad})


def test_stale_events_are_ignored_and_failure_rolls_back_atomically() -> None:
    r = HybridReplica(("h0", "h1"))
    g1 = r.request()
    r.begin_fetch(g1)
    assert r.member_failed("h1", g1) and r.state is JoinState.HYBRID_ROLLOUT
    g2 = r.request()
    assert g2 == g1 + 1
    assert not r.state_fetched(g1, 3)  # late event of the failed join
    assert r.state is JoinState.REQUESTED
    assert not r.member_failed("other", g2)
    for ev in itertools.islice(iter([r.begin_fetch]), 1):
        assert ev(g2)
    with pytest.raises(JoinError):
        r.request()


def test_broker_apply_plan_sends_directives_in_waves_and_roles_show_in_status() -> None:
    from libra.broker.events import PeerMessage
    from libra.broker.state import BrokerState
    from libra.protocol import messages as m

    s = BrokerState()
    caps = {"generate": ["*"], "train": ["*"], "sync": ["*"]}
    for slot in SLOTS:
        peer = slot.actor_id.encode()
        s.handle(PeerMessage(peer, m.ActorHello(slot.actor_id, slot.node, f"gpu{slot.index}", 1, caps, [], 4,
                                                {"slot_kind": "gpu"})), 0.0)
    p1 = plan(8, TrainConfig(8, 1, 1, 1), [4, 2, 1, 1])
    out = s.apply_plan(p1, 1.0)
    directives = {c.peer.decode(): c.msg for c in out if isinstance(getattr(c, "msg", None), m.Directive)}
    assert len(directives) == 16  # nobody had a role yet: everyone switches at once
    from libra.broker.events import Audit

    audited = [c.record for c in out if isinstance(c, Audit)]  # the plan change, by the broker process's own API
    assert audited and audited[0]["what"] == "plan" and {r["role"] for r in audited} == {"local"}
    for aid, d in directives.items():
        s.handle(PeerMessage(aid.encode(), m.DirectiveDone(d.directive_id, d.kinds)), 2.0)
        s.handle(PeerMessage(aid.encode(), m.Bid(d.kinds, 4)), 2.0)
    snap = s.snapshot("x", 2.0)
    assert sum(a["role"].get("role") == "train" for a in snap.actors) == 8
    assert [b.name for b in s.rollout.buckets] == ["tp1", "tp2", "tp4"]
    # a new plan moves training: the replica keeps training until the new one is up
    out = s.apply_plan(plan(4, TrainConfig(4, 1, 1, 1), [8, 2, 1, 1]), 3.0)
    first = {c.peer.decode() for c in out if isinstance(getattr(c, "msg", None), m.Directive)}
    assert first and s.plan_applier is not None and not s.plan_applier.done
    s.validate()
