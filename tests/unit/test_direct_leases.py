"""Direct leases: the broker core's bookkeeping (``broker/direct_leases.py``), the actor's table
(``actors/direct.py``) and the client's routes (``client/direct.py``), each driven as a pure component."""

from __future__ import annotations

from libra.actors.direct import DirectLeaseTable
from libra.client.direct import DirectRoutes
from libra.protocol import messages as m
from libra.protocol.errors import ErrorCode
from test_broker_state import C, Harness, sent  # the broker core's test harness (tests/unit)

A1, A2 = b"actor-1", b"actor-2"
DIRECT = {"direct": "tcp://127.0.0.1:7001", "direct_ipc": "ipc:///tmp/a1.sock", "direct_tools": ["echo"]}


class Core(Harness):
    def actor(self, peer: bytes, actor_id: str, capacity: int = 2, labels: dict | None = None) -> None:  # type: ignore[override]
        self.msg(peer, m.ActorHello(actor_id, "h", actor_id, 1, {"action": ["echo", "sleep"]}, ["action"], capacity,
                                    dict(labels or {})))
        self.msg(peer, m.Bid(["action"], capacity))

    def leased(self) -> m.Reply:
        grant = sent(self.msg(C, m.LeaseRequest("L?", "action", "echo")), m.LeaseGrant, A1)
        assert grant and grant[0].client_id == "client-1" and grant[0].name == "echo"
        (reply,) = sent(self.msg(A1, m.LeaseReady(grant[0].lease_id)), m.Reply, C)
        return reply


def core() -> Core:
    c = Core()
    c.client()
    return c


def test_a_lease_reserves_one_credit_and_answers_with_the_actor_s_endpoints() -> None:
    c = core()
    c.actor(A1, "a1", labels=DIRECT)
    reply = c.leased()
    assert reply.ok and reply.output == {"lease": "L1", "actor_id": "a1", "host": "h",
                                         "endpoint": DIRECT["direct"], "ipc": DIRECT["direct_ipc"]}
    sess = c.s.actors[A1]
    assert sess.leased == 1 and sess.free == 2  # inline calls use no worker: no credit is taken
    c.msg(A1, m.LeaseReport("L1", 5, 1))
    snap = c.s.snapshot("s", c.now)
    assert snap.stats["direct_completed"] == 5 and snap.stats["direct_failed"] == 1
    assert snap.stats["leases"][0]["done"] == 5
    # the client returns it: the actor is told, the credit comes back
    out = c.msg(C, m.LeaseEnd("L1", "idle"))
    assert [x.lease_id for x in sent(out, m.LeaseEnd, A1)] == ["L1"] and sess.leased == 0 and sess.free == 2


def test_no_lease_for_a_tool_no_actor_runs_inline_nor_past_the_per_actor_bound() -> None:
    c = Core(direct_leases_per_actor=1)
    c.client()
    c.actor(A1, "a1", capacity=1, labels={"direct": "tcp://x:1", "direct_tools": ["sleep"]})
    (r,) = sent(c.msg(C, m.LeaseRequest("r1", "action", "echo")), m.Reply, C)
    assert not r.ok and r.error_code == ErrorCode.NO_LEASE.value
    assert sent(c.msg(C, m.LeaseRequest("r2", "action", "sleep")), m.LeaseGrant, A1)
    (r,) = sent(c.msg(C, m.LeaseRequest("r3", "action", "sleep")), m.Reply, C)  # a1 holds its one lease
    assert r.error_code == ErrorCode.NO_LEASE.value
    assert c.s.snapshot("s", c.now).stats["leases_refused"] == 2
    off = Core(direct_leases_per_actor=0)
    off.client()
    off.actor(A1, "a1", labels=DIRECT)
    (r,) = sent(off.msg(C, m.LeaseRequest("r1", "action", "echo")), m.Reply, C)
    assert r.error_code == ErrorCode.NO_LEASE.value and "off" in r.error


def test_leases_spread_over_actors_and_leave_brokered_work_its_credit() -> None:
    c = core()
    c.actor(A1, "a1", capacity=1, labels=DIRECT)
    c.actor(A2, "a2", capacity=1, labels=DIRECT)
    grants = [sent(c.msg(C, m.LeaseRequest(f"r{i}", "action", "echo")), m.LeaseGrant)[0] for i in range(4)]
    assert c.s.actors[A1].leased == 2 and c.s.actors[A2].leased == 2 and len({g.lease_id for g in grants}) == 4
    assert sent(c.msg(C, m.Submit("s1", "action", "sleep", 1)), m.Assign)  # the credit is still there


def test_an_actor_that_refuses_the_grant_frees_the_credit_and_the_client_hears_no_lease() -> None:
    c = core()
    c.actor(A1, "a1", labels=DIRECT)
    (g,) = sent(c.msg(C, m.LeaseRequest("r1", "action", "echo")), m.LeaseGrant, A1)
    (r,) = sent(c.msg(A1, m.LeaseReady(g.lease_id, False, "not inline")), m.Reply, C)
    assert r.request_id == "r1" and not r.ok and "not inline" in r.error
    assert c.s.actors[A1].leased == 0


def test_a_lost_actor_s_lease_is_ended_as_lost_so_the_client_resends_via_the_broker() -> None:
    c = core()
    c.actor(A1, "a1", labels=DIRECT)
    c.leased()
    out = c.tick(5.0)  # silent for longer than 3 x 1 s: expired
    (end,) = sent(out, m.LeaseEnd, C)
    assert end.lease_id == "L1" and end.lost
    assert c.s.snapshot("s", c.now).stats["leases_lost"] == 1


def test_a_role_change_or_a_client_that_left_ends_the_lease() -> None:
    c = core()
    c.actor(A1, "a1", labels=DIRECT)
    c.leased()
    c.s.direct("a1", ["generate"], c.now)
    out = c.tick(0.1)
    assert sent(out, m.LeaseEnd, A1) and not sent(out, m.LeaseEnd, C)[0].lost
    c.actor(A2, "a2", labels=DIRECT)
    grant = sent(c.msg(C, m.LeaseRequest("r2", "action", "echo")), m.LeaseGrant, A2)
    c.msg(A2, m.LeaseReady(grant[0].lease_id))
    c.msg(C, m.Goodbye("bye"))
    assert [x.lease_id for x in sent(c.tick(0.1), m.LeaseEnd, A2)] == [grant[0].lease_id]
    assert c.s.actors[A2].leased == 0


def test_prior_attempts_count_as_attempts_and_losses() -> None:
    c = core()
    c.actor(A1, "a1")
    (a,) = sent(c.msg(C, m.Submit("r1", "action", "echo", 1, None, 60.0, 1)), m.Assign, A1)
    assert a.attempt == 2
    (r,) = sent(c.msg(A1, m.WorkResult(a.work_id, a.lease, True, 1)), m.Reply, C)
    assert r.ok and r.attempts == 2
    (r,) = sent(c.msg(C, m.Submit("r2", "action", "echo", 1, None, 60.0, 9)), m.Reply, C)  # over max_retries
    assert r.error_code == ErrorCode.RETRIES_EXHAUSTED.value and r.attempts == 9


def test_the_actor_table_runs_only_calls_on_a_lease_it_holds_for_that_tool() -> None:
    t = DirectLeaseTable(frozenset({"echo"}))
    assert not t.grant(m.LeaseGrant("L1", "c", "action", "sleep")).ok
    assert t.grant(m.LeaseGrant("L2", "c", "action", "echo")).ok
    assert t.refusal(m.DirectCall("r1", "L2", "action", "echo", 1)) == ""
    assert t.refusal(m.DirectCall("r2", "L2", "action", "sleep", 1))
    assert "ended" in t.refusal(m.DirectCall("r3", "L9", "action", "echo", 1))
    t.count("L2", True)
    t.count("L2", False)
    t.end("L2")
    assert t.refusal(m.DirectCall("r4", "L2", "action", "echo", 1))
    assert [(r.lease_id, r.done, r.failed) for r in t.reports()] == [("L2", 1, 1)] and t.reports() == []


def _granted(d: DirectRoutes, tool: str = "echo", now: float = 0.0) -> None:
    lease, ask = d.route("action", tool, None, False, now)
    assert lease is None and ask
    d.asked("q1", tool, now)
    assert d.route("action", tool, None, False, now) == (None, False)  # asked once
    consumed, surplus = d.on_lease_reply(m.Reply("q1", True, {"lease": "L1", "actor_id": "a1", "host": "other",
                                                              "endpoint": "tcp://h:1", "ipc": "ipc:///x"}), now)
    assert consumed and surplus is None


def test_client_routes_only_plain_calls_and_uses_tcp_for_an_actor_on_another_host() -> None:
    d = DirectRoutes(idle_s=5.0, host="mine")
    _granted(d)
    lease, _ = d.route("action", "echo", None, False, 1.0)
    assert lease is not None and lease.endpoint == "tcp://h:1"
    assert d.route("action", "echo", "traj-1", False, 1.0) == (None, False)  # the router learns from these
    assert d.route("action", "echo", None, True, 1.0) == (None, False)  # explicit ids: the broker's record
    assert d.route("generate", "echo", None, False, 1.0) == (None, False)


def test_client_routes_a_lost_lease_s_unanswered_calls_back_oldest_first_and_returns_idle_ones() -> None:
    d = DirectRoutes(idle_s=5.0, host="mine")
    _granted(d)
    lease, _ = d.route("action", "echo", None, False, 1.0)
    for rid in ("c:10", "c:9", "c:11"):
        d.sent(rid, lease)
    d.answered("c:11")
    assert d.ended("L1", lost=True) == ["c:9", "c:10"] and not d.by_tool and not d.calls
    _granted(d, now=2.0)
    lease, _ = d.route("action", "echo", None, False, 2.0)
    d.sent("c:12", lease)
    assert d.idle(100.0) == []  # a call in flight keeps it
    d.answered("c:12")
    assert d.idle(3.0) == [] and d.idle(100.0) == ["L1"] and not d.by_id


def test_client_a_refused_call_ends_the_lease_and_a_refused_lease_waits_before_asking_again() -> None:
    d = DirectRoutes(idle_s=5.0, retry_s=10.0, host="mine")
    _granted(d)
    lease, _ = d.route("action", "echo", None, False, 1.0)
    d.sent("c:1", lease)
    d.refused("c:1", 1.0)
    assert not d.by_tool and d.route("action", "echo", None, False, 1.5) == (None, False)
    assert d.route("action", "echo", None, False, 2.5)[1]  # asks again after a short pause
    d.asked("q2", "echo", 2.5)
    consumed, _ = d.on_lease_reply(m.Reply("q2", False, None, ErrorCode.NO_LEASE.value, "no"), 3.0)
    assert consumed and d.route("action", "echo", None, False, 12.0) == (None, False)
    assert d.route("action", "echo", None, False, 13.5)[1]
    d.asked("q3", "echo", 13.5)  # never answered (lost with a broker): asked again after retry_s
    assert d.route("action", "echo", None, False, 20.0) == (None, False)
    assert d.route("action", "echo", None, False, 24.0)[1] and "q3" not in d.asking
    assert d.on_lease_reply(m.Reply("not-a-lease", True), 3.0) == (False, None)


def test_a_result_msgpack_cannot_carry_goes_as_a_typed_failure_on_both_paths() -> None:
    from libra.actors.runtime import encode_sendable
    from libra.protocol import decode_many

    msgs = [m.WorkResult("w1", 3, True, {1, 2}), m.WorkResult("w2", 4, True, [1, 2]),
            m.Reply("c:1", True, object(), "", "", "L1", 1, "a1", 0.5)]
    bad, good, reply = (d.msg for d in decode_many(encode_sendable(msgs)))
    assert (bad.work_id, bad.lease, bad.ok, bad.error_code) == ("w1", 3, False, "bad_result")
    assert "cannot be sent" in bad.error and good == msgs[1]
    assert (reply.request_id, reply.ok, reply.error_code, reply.tool_code, reply.attempts) == \
        ("c:1", False, ErrorCode.TOOL_FAILED.value, "bad_result", 1)
    assert [d.msg for d in decode_many(encode_sendable(msgs[1:2]))] == msgs[1:2]
