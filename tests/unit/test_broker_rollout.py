"""Generate turns routed through the rollout router inside BrokerState (no sockets)."""

from __future__ import annotations

from libra.broker.events import PeerMessage
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m

C = b"client"
BUCKETS = [{"name": "short", "tp": 1, "max_tokens": 4000}, {"name": "long", "tp": 4, "max_tokens": 40960}]


def setup(router: str = "oracle", capacity: int = 2) -> BrokerState:
    params = {"placement": "bucket"} if router == "oracle" else {}  # the oracle by the true length's bucket
    s = BrokerState(BrokerConfig(router=router, buckets=BUCKETS, router_params=params))
    s.handle(PeerMessage(C, m.ClientHello("c", 1)), 0)
    for peer, bucket in ((b"s1", "short"), (b"s2", "short"), (b"l1", "long")):
        caps = {"generate": ["*"], "action": ["echo"]}
        s.handle(PeerMessage(peer, m.ActorHello(peer.decode(), "h", peer.decode(), 1, caps, ["generate"], capacity,
                                                {"role": {"bucket": bucket}})), 0)
        s.handle(PeerMessage(peer, m.Bid(["generate"], capacity)), 0)
    return s


def gen(s: BrokerState, rid: str, traj: str, **args: object) -> m.Assign | None:
    out = s.handle(PeerMessage(C, m.Submit(rid, "generate", "", dict(args), traj)), 1.0)
    s.validate()
    assigns = [c for c in out if isinstance(getattr(c, "msg", None), m.Assign)]
    return assigns[0].msg if assigns else None


def peer_of(s: BrokerState, a: m.Assign) -> bytes:
    return s.works[a.work_id].actor  # type: ignore[return-value]


def test_oracle_places_by_true_remaining_and_assign_carries_route() -> None:
    s = setup()
    a = gen(s, "r1", "t1", prompt_tokens=100, true_remaining=30000)
    assert a is not None and a.name == "long" and peer_of(s, a) == b"l1"
    assert a.route["bucket"] == "long"
    b = gen(s, "r2", "t2", prompt_tokens=100, true_remaining=500)
    assert b is not None and b.name == "short" and peer_of(s, b) in (b"s1", b"s2")


def test_trajectory_sticks_to_its_instance_across_turns() -> None:
    s = setup(router="round_robin")
    a = gen(s, "r1", "t1", prompt_tokens=10)
    first = peer_of(s, a)
    s.handle(PeerMessage(first, m.WorkResult(a.work_id, a.lease, True, {"gen_tokens": 50})), 2.0)
    b = gen(s, "r2", "t1")
    assert peer_of(s, b) == first and b.route["reason"] == "sticky"
    assert s.rollout.trajs["t1"].generated == 50


def test_tool_return_is_seen_by_router_and_queued_turn_waits_for_its_instance() -> None:
    s = setup(router="round_robin", capacity=1)
    a = gen(s, "r1", "t1", prompt_tokens=10)
    inst = peer_of(s, a)
    s.handle(PeerMessage(inst, m.WorkResult(a.work_id, a.lease, True, {"gen_tokens": 20})), 2.0)
    # the trajectory's tool call is also an action through the broker
    s.handle(PeerMessage(inst, m.Bid(["generate", "action"], 1)), 2.0)
    out = s.handle(PeerMessage(C, m.Submit("x1", "action", "echo", {"payload_tokens": 900}, "t1")), 2.0)
    (act,) = [c.msg for c in out if isinstance(getattr(c, "msg", None), m.Assign)]
    holder = s.works[act.work_id].actor
    s.handle(PeerMessage(holder, m.WorkResult(act.work_id, act.lease, True, {"payload_tokens": 900})), 3.0)
    assert s.rollout.trajs["t1"].pending_return is not None
    assert s.rollout.trajs["t1"].pending_return.payload_tokens == 900
    # occupy t1's instance with another trajectory's turn, then t1's next turn must wait for it
    other = None
    for i in range(3):
        o = gen(s, f"o{i}", f"other{i}", prompt_tokens=10)
        if o is not None and peer_of(s, o) == inst:
            other = o
            break
    assert other is not None
    b = gen(s, "r2", "t1")
    if b is None:  # waited, sticky to its busy instance
        assert s.actors[inst].targeted == 1
        out = s.handle(PeerMessage(inst, m.WorkResult(other.work_id, other.lease, True, {"gen_tokens": 1})), 4.0)
        (b,) = [c.msg for c in out if isinstance(getattr(c, "msg", None), m.Assign)]
    assert s.works[b.work_id].actor == inst
    s.validate()


def test_end_trajectory_teaches_the_router_and_forgets_it() -> None:
    s = setup(router="cmlfq")
    a = gen(s, "r1", "t1", prompt_id="p1", prompt_tokens=10)
    assert a is not None and a.name == "short"  # C-MLFQ starts in the smallest bucket
    s.handle(PeerMessage(C, m.EndTrajectory("t1", 5000, True)), 2.0)
    assert "t1" not in s.rollout.trajs


def test_instance_death_releases_its_queued_turns_to_the_bucket() -> None:
    s = setup(router="round_robin", capacity=1)
    a = gen(s, "r1", "t1", prompt_tokens=10)
    inst = peer_of(s, a)
    s.handle(PeerMessage(inst, m.WorkResult(a.work_id, a.lease, True, {"gen_tokens": 5})), 2.0)
    # fill inst again, queue t1's next turn behind it
    blocker = None
    for i in range(4):
        o = gen(s, f"o{i}", f"o{i}", prompt_tokens=1)
        if o is not None and peer_of(s, o) == inst:
            blocker = o
            break
    assert blocker is not None
    b = gen(s, "r2", "t1")
    s.handle(PeerMessage(C, m.Heartbeat()), 2.0)
    assert b is None or s.works[b.work_id].actor == inst
    from libra.broker.events import Tick
    for p in list(s.actors):
        if p != inst:
            s.handle(PeerMessage(p, m.Heartbeat()), 5.0)
    out = s.handle(Tick(), 5.5)  # inst silent 3.5 s > 3 × 1 s: expired, its turns released to the bucket
    s.validate()
    assert inst not in s.actors
    from libra.broker.work import WorkState
    moved = {c.msg.work_id for c in out if isinstance(getattr(c, "msg", None), m.Assign)}
    w = s.works[blocker.work_id]  # its running turn is re-queued in the bucket or already re-assigned
    assert w.state is WorkState.QUEUED and w.target is None or blocker.work_id in moved
    assert all(x.target is None or x.target in s.actors for x in s.works.values())
    assert all(x.actor in s.actors for x in s.works.values() if x.actor)


def test_rollout_bookkeeping_reports_response_positions_and_learns_the_response_length() -> None:
    """The router sees positions and totals in response tokens (generated + tool-returned), the unit of the
    bucket thresholds; the broker counts them itself (docs/papers.md §1.4.1-§1.4.2)."""
    from libra.broker.rollout import RolloutRouting
    from libra.policies.routing.interface import BucketSpec

    rr = RolloutRouting("cmlfq", [BucketSpec("short", 1, 4000), BucketSpec("long", 4, 40960)])
    view = rr.view([("s1", "short", 0, 0, "h"), ("l1", "long", 0, 0, "h")])
    rr.route("t1", {"prompt_id": "p1", "prompt_tokens": 100}, view)
    rr.turn_done("t1", {"gen_tokens": 300})
    rr.tool_returned("t1", "bash", True, {"payload_tokens": 2000}, "")
    ret = rr.trajs["t1"].pending_return
    assert ret is not None and (ret.position, ret.context_tokens, ret.response_tokens) == (300, 2400, 2300)
    rr.route("t1", {}, view)
    rr.turn_done("t1", {"gen_tokens": 200})
    rr.end("t1", 500, True)  # the client counts generated tokens only
    (learned,) = rr.router.tree.history  # type: ignore[attr-defined]
    assert learned.positions == (2300,) and learned.total_output_tokens == 2500
    assert learned.remaining() == (200,)


def test_generate_before_any_rollout_instance_is_queued_then_served() -> None:
    for router in ("cmlfq", "least_loaded", "round_robin", "oracle"):
        s = BrokerState(BrokerConfig(router=router, buckets=BUCKETS))
        s.handle(PeerMessage(C, m.ClientHello("c", 1)), 0)
        out = s.handle(PeerMessage(C, m.Submit("r1", "generate", "", {"prompt_tokens": 10}, "t1")), 1.0)
        s.validate()
        assert not [c for c in out if isinstance(getattr(c, "msg", None), (m.Assign, m.Reply))], router  # queued, not failed
        assert s.works[next(iter(s.works))].route["reason"] == "no_instance"
        caps = {"generate": ["*"]}
        out = s.handle(PeerMessage(b"l1", m.ActorHello("l1", "h", "l1", 1, caps, ["generate"], 1,
                                                      {"role": {"bucket": "long"}})), 2.0)
        (a,) = [c.msg for c in out if isinstance(getattr(c, "msg", None), m.Assign)]
        s.handle(PeerMessage(b"l1", m.WorkResult(a.work_id, a.lease, True, {"gen_tokens": 5})), 3.0)
        # the trajectory was forgotten by the router when it could not be placed; its next turn starts it
        b = gen(s, "r2", "t1", prompt_tokens=15)
        assert b is not None and s.works[b.work_id].actor == b"l1", router


def test_turns_queued_under_a_removed_bucket_are_served_after_a_replan() -> None:
    from libra.policies.routing.interface import BucketSpec

    s = setup(router="round_robin", capacity=1)
    held = [gen(s, f"h{i}", f"h{i}", prompt_tokens=10) for i in range(3)]  # every instance busy
    assert all(a is not None for a in held)
    assert gen(s, "q1", "q1", prompt_tokens=10) is None  # queued under an old bucket name
    (queued,) = [w for w in s.works.values() if w.request_id == "q1"]
    old_bucket = queued.name
    # a re-plan renames the buckets; the instances drain, disconnect and a new one joins the new bucket
    s.rollout.set_buckets([BucketSpec("tp2", 2, 40960)])
    for peer in (b"s1", b"s2", b"l1"):
        s.handle(PeerMessage(peer, m.Goodbye("re-plan")), 4.0)
    assert queued.name == old_bucket and queued.actor is None
    out = s.handle(PeerMessage(b"n1", m.ActorHello("n1", "h", "n1", 1, {"generate": ["*"]}, ["generate"], 4,
                                                    {"role": {"bucket": "tp2"}})), 5.0)
    s.validate()
    assigned = {s.works[c.msg.work_id].request_id for c in out if isinstance(getattr(c, "msg", None), m.Assign)}
    assert "q1" in assigned  # the orphaned turn did not wait for an instance of a bucket that no longer exists
