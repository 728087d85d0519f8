"""GPU services placed by the broker (evict on execution over each GPU actor's multi-level cells), driven
through BrokerState: calls from many trajectories share a resident replica, a second replica is restored only
while the first is busy, the least recently used idle replica is evicted for a new service, calls wait when
every cell executes, a failed restore is forgotten, and without a GPU actor the tool runs like any other."""

from __future__ import annotations

import pytest

from libra.broker.events import PeerMessage
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m
from libra.protocol.payloads_actions import ActionRoute

C = b"client"
SERVICES = {"rm_a": {"gpus": 1, "checkpoint_gb": 2.0}, "rm_b": {"gpus": 1, "checkpoint_gb": 2.0},
            "rm_big": {"gpus": 2, "checkpoint_gb": 8.0}}


def cluster(gpus: int = 2, cpu_actor: bool = True) -> BrokerState:
    s = BrokerState(BrokerConfig(action_scheduler="tangram", tools={"reward_model": {"services": SERVICES}}))
    s.handle(PeerMessage(C, m.ClientHello("c", 1)), 0)
    actors = [("g0", "gpu0", {"gpus": gpus, "cpus": [0, 1], "numa": [0, 0]})] if gpus else []
    if cpu_actor:
        actors.append(("c0", "cpu0", {"cpus": [0, 1], "numa": [0, 0]}))
    for name, slot, labels in actors:
        s.handle(PeerMessage(name.encode(), m.ActorHello(name, "h", slot, 1, {"action": ["reward_model", "echo"]},
                                                         ["action"], 8, labels)), 0)
        s.handle(PeerMessage(name.encode(), m.Bid(["action"], 8)), 0)
    return s


def call(s: BrokerState, rid: str, service: str, now: float = 1.0) -> list[m.Assign]:
    out = s.handle(PeerMessage(C, m.Submit(rid, "action", "reward_model", {"service": service, "text": "x y"},
                                           f"traj-{rid}")), now)
    s.validate()
    return [c.msg for c in out if isinstance(getattr(c, "msg", None), m.Assign)]


def finish(s: BrokerState, a: m.Assign, now: float, ok: bool = True) -> list[m.Assign]:
    out = s.handle(PeerMessage(s.works[a.work_id].actor, m.WorkResult(a.work_id, a.lease, ok, {} if ok else None,
                                                                      "" if ok else "tool_failed", "")), now)
    s.validate()
    return [c.msg for c in out if isinstance(getattr(c, "msg", None), m.Assign)]


def svc(a: m.Assign):  # type: ignore[no-untyped-def]
    r = ActionRoute.from_wire(a.route).service
    assert r is not None
    return r


def test_calls_from_many_trajectories_share_one_resident_replica() -> None:
    s = cluster()
    (first,) = call(s, "r0", "rm_a")
    assert s.works[first.work_id].actor == b"g0"  # the GPU actor, not the CPU one
    assert svc(first).restore is True and svc(first).cell.gpus == [0]
    t, a = 2.0, first
    for i in range(1, 6):  # one after another: every later trajectory hits the same replica
        finish(s, a, t)
        (a,) = call(s, f"r{i}", "rm_a", t)
        assert svc(a).restore is False and svc(a).replica == svc(first).replica
        t += 1
    assert s.actions.services.resident() == {"g0": {"rm_a": 1}}


def test_a_busy_replica_gets_a_second_one_and_a_new_service_evicts_the_lru_idle_one() -> None:
    s = cluster()
    (a1,) = call(s, "r1", "rm_a")
    (a2,) = call(s, "r2", "rm_a")  # the first replica executes: a second one is restored on the other GPU
    assert svc(a2).restore is True and svc(a2).cell.gpus != svc(a1).cell.gpus
    assert call(s, "r3", "rm_b") == []  # both cells execute: rm_b waits in its queue
    (b,) = finish(s, a1, 2.0)  # a1's cell frees: rm_b evicts that idle replica (restore on demand)
    assert svc(b).service == "rm_b" and svc(b).restore and not svc(b).shared
    assert [(e.node, e.gpus, e.service) for e in svc(b).evict] == [(0, svc(a1).cell.gpus, "rm_a")]
    finish(s, a2, 3.0)
    finish(s, b, 4.0)  # now idle: rm_a on gpu (a2's, used at 3.0) and rm_b (used at 4.0)
    (big,) = call(s, "r4", "rm_big", 5.0)  # needs both GPUs: both idle replicas go
    assert svc(big).cell.gpus == [0, 1] and len(svc(big).evict) == 2
    assert s.actions.services.resident() == {"g0": {"rm_big": 1}}


def test_lru_order_picks_the_victim() -> None:
    s = cluster()
    (a,) = call(s, "r1", "rm_a")
    (b,) = call(s, "r2", "rm_b")
    finish(s, b, 2.0)  # rm_b idle since 2.0
    finish(s, a, 3.0)  # rm_a idle since 3.0: rm_b is the least recently used
    (big,) = call(s, "r3", "rm_big", 4.0)
    assert len(svc(big).evict) == 2  # rm_big needs both cells anyway
    s2 = cluster()
    (a,) = call(s2, "r1", "rm_a")
    (b,) = call(s2, "r2", "rm_b")
    finish(s2, b, 2.0)
    finish(s2, a, 3.0)
    (a_again,) = call(s2, "r3", "rm_a", 4.0)  # a hit, on its own cell
    assert svc(a_again).restore is False and svc(a_again).cell == svc(a).cell


def test_a_failed_restore_is_not_counted_as_resident() -> None:
    s = cluster()
    (a,) = call(s, "r1", "rm_a")
    finish(s, a, 2.0, ok=False)  # e.g. the actor could not load it
    assert s.actions.services.resident() == {"g0": {}}
    (again,) = call(s, "r2", "rm_a", 3.0)
    assert svc(again).restore is True


def test_without_a_gpu_actor_the_tool_runs_on_cpu_actors_unrouted() -> None:
    s = cluster(gpus=0)
    (a,) = call(s, "r1", "rm_a")
    assert "service" not in a.route and a.route["cores"] == 1


@pytest.mark.parametrize("args", [{"text": "no service"}, {"service": 3, "text": "x"}])
def test_malformed_service_args_go_to_a_gpu_actor_unrouted_for_its_typed_refusal(args: dict) -> None:
    s = cluster(cpu_actor=False)
    out = s.handle(PeerMessage(C, m.Submit("r1", "action", "reward_model", args, "t")), 1.0)
    (a,) = [c.msg for c in out if isinstance(getattr(c, "msg", None), m.Assign)]
    assert "service" not in a.route
    finish(s, a, 2.0, ok=False)
    assert not any(s.actions.services.resident().values())


def test_gpu_memory_model_keeps_several_services_resident_on_one_cell() -> None:
    services = {"rm_a": {"gpus": 1, "checkpoint_gb": 5.0}, "rm_b": {"gpus": 1, "checkpoint_gb": 5.0},
                "rm_c": {"gpus": 1, "checkpoint_gb": 8.0}}
    decl = {"services": services, "gpu_mem_gb": 16.0, "workspace_gb": 2.0}  # 14 GB of replicas per GPU
    s = BrokerState(BrokerConfig(action_scheduler="tangram", tools={"reward_model": decl}))
    s.handle(PeerMessage(C, m.ClientHello("c", 1)), 0)
    s.handle(PeerMessage(b"g0", m.ActorHello("g0", "h", "gpu0", 1, {"action": ["reward_model"]}, ["action"], 4,
                                             {"gpus": 1})), 0)
    s.handle(PeerMessage(b"g0", m.Bid(["action"], 4)), 0)
    (a,) = call(s, "r1", "rm_a")
    assert call(s, "r2", "rm_b") == []  # the one GPU executes rm_a: rm_b waits (compute stays exclusive)
    (b,) = finish(s, a, 2.0)
    assert svc(b).shared and svc(b).restore and svc(b).evict == []  # 5 + 5 GB fit: rm_a stays resident
    finish(s, b, 3.0)
    (c,) = call(s, "r3", "rm_c", 4.0)  # 8 GB: only the least recently used (rm_a) must go
    assert [(e.service, e.gpus) for e in svc(c).evict] == [("rm_a", [0])]
    assert s.actions.services.resident() == {"g0": {"rm_b": 1, "rm_c": 1}}


def test_a_service_that_fits_no_gpu_is_refused_at_start() -> None:
    decl = {"services": {"huge": {"gpus": 1, "checkpoint_gb": 100.0}}, "gpu_mem_gb": 80.0}
    with pytest.raises(ValueError, match="huge"):
        BrokerState(BrokerConfig(action_scheduler="tangram", tools={"reward_model": decl}))


def waiting_cluster(wait: bool) -> BrokerState:
    tools = {"reward_model": {"services": {"rm": {"gpus": 1, "checkpoint_gb": 25.0}}, "wait_for_resident": wait}}
    s = BrokerState(BrokerConfig(action_scheduler="tangram", tools=tools))
    s.handle(PeerMessage(C, m.ClientHello("c", 1)), 0)
    s.handle(PeerMessage(b"g0", m.ActorHello("g0", "h", "gpu0", 1, {"action": ["reward_model"]}, ["action"], 8,
                                             {"gpus": 2})), 0)
    s.handle(PeerMessage(b"g0", m.Bid(["action"], 8)), 0)
    return s


@pytest.mark.parametrize("wait", [True, False])
def test_with_wait_for_resident_a_call_waits_for_the_busy_replica_that_frees_before_a_restore(wait: bool) -> None:
    # a restore costs 25 GB / 25 GB/s = 1 s; one call takes 0.2 s (learned from the first completed call)
    s = waiting_cluster(wait)
    (a,) = call(s, "r1", "rm", now=1.0)
    assert svc(a).restore
    finish(s, a, now=2.2)  # 1 s of restore, 0.2 s of work
    (b,) = call(s, "r2", "rm", now=3.0)  # a hit: the replica is busy until about 3.2
    assert not svc(b).restore
    placed = call(s, "r3", "rm", now=3.05)
    if wait:  # 0.15 s left on the busy replica < 1 s of restore: it waits, and runs there when b ends
        assert placed == []
        (c,) = finish(s, b, now=3.2)
        assert not svc(c).restore and svc(c).replica == svc(b).replica
    else:  # restores a second replica on the other GPU at once
        (c,) = placed
        assert svc(c).restore and svc(c).cell.gpus != svc(b).cell.gpus
