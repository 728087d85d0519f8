"""BrokerState driven by events with no sockets: bids, assignment, results, expiry, leases, directives."""

from __future__ import annotations

import pytest

from libra.broker.events import BadFrame, PeerMessage, Send, Tick
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import ProtocolCode, ProtocolError
from libra.protocol import messages as m

A1, A2, C = b"actor-1", b"actor-2", b"client"


def sent(cmds: list[Send], cls: type, peer: bytes | None = None) -> list:
    return [c.msg for c in cmds if isinstance(getattr(c, "msg", None), cls) and (peer is None or c.peer == peer)]


class Harness:
    def __init__(self, **cfg: object) -> None:
        self.s = BrokerState(BrokerConfig(heartbeat_s=1.0, liveness=3, **cfg))  # type: ignore[arg-type]
        self.now = 0.0

    def msg(self, peer: bytes, msg: object, dt: float = 0.0) -> list[Send]:
        self.now += dt
        out = self.s.handle(PeerMessage(peer, msg), self.now)
        self.s.validate()
        return out

    def tick(self, dt: float) -> list[Send]:
        self.now += dt
        out = self.s.handle(Tick(), self.now)
        self.s.validate()
        return out

    def actor(self, peer: bytes, actor_id: str, capacity: int = 1, tools: tuple[str, ...] = ("echo", "sleep"),
              kinds: tuple[str, ...] = ("action",)) -> list[Send]:
        caps = {"action": list(tools), "train": ["*"], "generate": ["*"]}
        out = self.msg(peer, m.ActorHello(actor_id, "h", actor_id, 1, caps, list(kinds), capacity))
        return out + self.msg(peer, m.Bid(list(kinds), capacity))

    def client(self) -> list[Send]:
        return self.msg(C, m.ClientHello("client-1", 1))

    def submit(self, rid: str, tool: str = "echo", args: object = 1, timeout: float = 60.0) -> list[Send]:
        return self.msg(C, m.Submit(rid, "action", tool, args, "traj-1", timeout))


@pytest.fixture
def h() -> Harness:
    h = Harness()
    h.client()
    return h


def test_hello_gets_welcome_with_liveness_contract(h: Harness) -> None:
    out = h.msg(A1, m.ActorHello("a1", "h", "cpu0", 1, {"action": ["echo"]}, ["action"], 2))
    (w,) = sent(out, m.Welcome, A1)
    assert w.heartbeat_s == 1.0 and w.liveness == 3


def test_submit_is_assigned_to_a_bidding_actor_and_result_goes_back_once(h: Harness) -> None:
    h.actor(A1, "a1")
    out = h.submit("r1", args={"x": 1})
    (a,) = sent(out, m.Assign, A1)
    assert (a.kind, a.name, a.args, a.attempt, a.trajectory) == ("action", "echo", {"x": 1}, 1, "traj-1")
    out = h.msg(A1, m.WorkResult(a.work_id, a.lease, True, {"x": 1}))
    (r,) = sent(out, m.Reply, C)
    assert r.ok and r.output == {"x": 1} and r.request_id == "r1" and r.actor_id == "a1"
    # a duplicate result (same lease) is stale now and produces nothing
    assert h.msg(A1, m.WorkResult(a.work_id, a.lease, True, {"x": 1})) == []
    assert h.s.stats["stale_results"] == 1


def test_work_waits_in_queue_until_capacity_frees_fcfs(h: Harness) -> None:
    h.actor(A1, "a1", capacity=1)
    (a1,) = sent(h.submit("r1"), m.Assign)
    assert sent(h.submit("r2"), m.Assign) == []
    assert sent(h.submit("r3"), m.Assign) == []
    assert h.s.snapshot("s", h.now).queues == {"action:echo": 2}
    out = h.msg(A1, m.WorkResult(a1.work_id, a1.lease, True, 1))
    (a2,) = sent(out, m.Assign, A1)
    assert h.s.works[a2.work_id].request_id == "r2"


def test_least_loaded_actor_is_chosen(h: Harness) -> None:
    h.actor(A1, "a1", capacity=4)
    h.actor(A2, "a2", capacity=4)
    peers = [sent(h.submit(f"r{i}"), m.Assign)[0] and h.s.works[f"w{i + 1}"].actor for i in range(4)]
    assert peers.count(A1) == 2 and peers.count(A2) == 2


def test_actor_expiry_requeues_to_other_actor_with_new_lease(h: Harness) -> None:
    h.actor(A1, "a1")
    h.actor(A2, "a2")
    (a,) = sent(h.submit("r1", "sleep", {"seconds": 10}), m.Assign)
    holder, other = (A1, A2) if h.s.works[a.work_id].actor == A1 else (A2, A1)
    h.msg(other, m.Heartbeat(), dt=2.0)
    out = h.tick(1.5)  # holder silent for 3.5 s > 3 × 1 s
    (again,) = sent(out, m.Assign, other)
    assert again.work_id == a.work_id and again.attempt == 2 and again.lease != a.lease
    assert sent(out, m.Disconnect, holder)
    # the dead actor's late result is dropped (it is not even registered any more)
    late = h.msg(holder, m.WorkResult(a.work_id, a.lease, True, "late"))
    assert sent(late, m.Reply) == [] and sent(late, m.Disconnect, holder)
    (r,) = sent(h.msg(other, m.WorkResult(again.work_id, again.lease, True, "ok")), m.Reply, C)
    assert r.output == "ok" and r.attempts == 2


def test_stale_lease_from_live_actor_is_dropped(h: Harness) -> None:
    h.s = BrokerState(BrokerConfig(lease_s=5.0))
    h.client()
    h.actor(A1, "a1", capacity=2)
    (a,) = sent(h.submit("r1", timeout=100), m.Assign)
    h.msg(A1, m.Heartbeat(), dt=4.0)
    out = h.tick(1.5)
    (rv,) = sent(out, m.Revoke, A1)
    assert rv.lease == a.lease
    (again,) = sent(out, m.Assign, A1)
    assert again.lease != a.lease
    assert sent(h.msg(A1, m.WorkResult(a.work_id, a.lease, True, "old")), m.Reply) == []
    (r,) = sent(h.msg(A1, m.WorkResult(again.work_id, again.lease, True, "new")), m.Reply)
    assert r.output == "new"


def test_retries_are_bounded_then_typed_failure() -> None:
    h = Harness(max_retries=1)
    h.client()
    h.actor(A1, "a1")
    sent(h.submit("r1", timeout=1000), m.Assign)
    h.tick(3.5)  # a1 expires: loss 1, requeued (no actor)
    h.actor(A2, "a2")
    out = h.tick(3.5)  # a2 expires too: loss 2 > max_retries
    (r,) = sent(out, m.Reply, C)
    assert not r.ok and r.error_code == "retries_exhausted"


def test_deadline_fails_queued_and_leased_work_with_timeout(h: Harness) -> None:
    h.actor(A1, "a1", capacity=1)
    (a,) = sent(h.submit("r1", timeout=2.0), m.Assign)
    h.submit("r2", timeout=2.0)
    h.msg(A1, m.Heartbeat(), dt=1.0)
    out = h.tick(1.5)
    replies = sent(out, m.Reply, C)
    assert sorted(r.request_id for r in replies) == ["r1", "r2"]
    assert all(r.error_code == "timeout" for r in replies)
    assert sent(out, m.Revoke, A1)[0].work_id == a.work_id


def test_unknown_tool_and_bad_kind(h: Harness) -> None:
    h.actor(A1, "a1")
    (r,) = sent(h.submit("r1", tool="nope"), m.Reply)
    assert r.error_code == "unknown_tool" and "echo" in r.error
    (r,) = sent(h.msg(C, m.Submit("r2", "bogus", "x", None)), m.Reply)
    assert r.error_code == "bad_request"


def test_resubmitted_request_id_never_runs_twice(h: Harness) -> None:
    h.actor(A1, "a1")
    (a,) = sent(h.submit("r1"), m.Assign)
    assert h.submit("r1") == []  # in flight: no second assignment
    (r,) = sent(h.msg(A1, m.WorkResult(a.work_id, a.lease, True, 7)), m.Reply)
    (again,) = sent(h.submit("r1"), m.Reply)  # finished: answered from the record
    assert again == r and h.s.stats["submitted"] == 1


def test_busy_when_queue_bound_reached() -> None:
    h = Harness(max_queued_per_key=2)
    h.client()
    h.actor(A1, "a1", capacity=1)
    h.submit("r0")
    h.submit("r1")
    h.submit("r2")
    (r,) = sent(h.submit("r3"), m.Reply)
    assert r.error_code == "busy" and r.retry_after_s > 0


def test_directive_drains_then_new_bid_switches_kinds(h: Harness) -> None:
    h.actor(A1, "a1", capacity=1)
    (a,) = sent(h.submit("r1"), m.Assign)
    did, cmds = h.s.direct("a1", ["train"], h.now)
    (d,) = sent(cmds, m.Directive, A1)
    assert d.kinds == ["train"] and d.directive_id == did
    assert sent(h.submit("r2"), m.Assign) == []  # draining: nothing new
    assert h.s.snapshot("s", h.now).actors[0]["state"] == "draining"
    out = h.msg(A1, m.WorkResult(a.work_id, a.lease, True, 1))
    assert sent(out, m.Reply) and not sent(out, m.Assign)
    h.msg(A1, m.DirectiveDone(did, ["train"]))
    out = h.msg(A1, m.Bid(["train"], 1))
    assert sent(out, m.Assign) == []  # it no longer accepts action work
    snap = h.s.snapshot("s", h.now)
    assert snap.actors[0]["kinds"] == ["train"] and snap.queues["action:echo"] == 1
    out = h.msg(C, m.Submit("t1", "train", "step", {}))
    (t,) = sent(out, m.Assign, A1)
    assert t.kind == "train"


def test_handback_requeues_without_counting_a_loss(h: Harness) -> None:
    h.actor(A1, "a1")
    h.actor(A2, "a2", capacity=0)
    (a,) = sent(h.submit("r1"), m.Assign, A1)
    h.s.direct("a1", ["train"], h.now, mode="handback")
    h.msg(A1, m.Handback(a.work_id, a.lease, "directive"))
    assert h.s.works[a.work_id].failures == 0
    out = h.msg(A2, m.Bid(["action"], 1))
    (b,) = sent(out, m.Assign, A2)
    assert b.work_id == a.work_id and b.attempt == 2


def test_bad_frames_known_peer_gets_error_stranger_gets_nothing(h: Harness) -> None:
    err = ProtocolError(ProtocolCode.BAD_VERSION, "nope")
    assert h.s.handle(BadFrame(b"stranger", err), 0.0) == []
    (e,) = sent(h.s.handle(BadFrame(C, err), 0.0), m.Error, C)
    assert e.code == "bad_version"
    assert "stranger" not in repr(h.s.clients) and h.s.stats["bad_frames"] == 2


def test_submit_before_hello_and_broker_messages_are_rejected(h: Harness) -> None:
    out = h.msg(b"x", m.Submit("r", "action", "echo", 1))
    assert sent(out, m.Disconnect, b"x")
    out = h.msg(C, m.Assign("w", 1, 1, "action", "echo", None))
    assert sent(out, m.Error, C)[0].code == "unexpected"


def test_reconnecting_actor_replaces_old_session_and_its_work_is_requeued(h: Harness) -> None:
    h.actor(A1, "a1")
    (a,) = sent(h.submit("r1"), m.Assign, A1)
    out = h.actor(b"actor-1-new", "a1")
    (again,) = sent(out, m.Assign, b"actor-1-new")
    assert again.work_id == a.work_id and again.attempt == 2
    assert len(h.s.actors) == 1


def test_status_snapshot_shape(h: Harness) -> None:
    h.actor(A1, "a1", capacity=3)
    sent(h.submit("r1"), m.Assign)
    (snap,) = sent(h.msg(C, m.StatusRequest("s1")), m.StatusReply, C)
    (a,) = snap.actors
    assert {"id", "host", "slot", "kinds", "state", "load", "capacity"} <= set(a)
    assert (a["id"], a["load"], a["state"], a["kinds"]) == ("a1", 1, "busy", ["action"])
    assert snap.stats["submitted"] == 1


def test_heartbeats_are_sent_to_quiet_actors(h: Harness) -> None:
    h.actor(A1, "a1")
    h.msg(A1, m.Heartbeat(), dt=0.5)
    assert not sent(h.tick(0.6), m.Heartbeat, A1)  # idle: beaten every idle_heartbeat_s (3 x heartbeat_s)
    h.msg(A1, m.Heartbeat(), dt=1.0)
    assert sent(h.tick(1.0), m.Heartbeat, A1)


def test_busy_when_client_inflight_bound_reached() -> None:
    h = Harness(max_inflight_per_client=2)
    h.client()
    h.actor(A1, "a1", capacity=1)
    h.submit("r0")
    h.submit("r1")
    (r,) = sent(h.submit("r2"), m.Reply)
    assert r.error_code == "busy" and "unanswered" in r.error and r.retry_after_s > 0
