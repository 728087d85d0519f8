"""Lent slots in BrokerState (no sockets): a reclaim stops work at once, moves the pinned trajectories with the
migration mode the deadline allows, takes back hand-backs without counting a loss, says when the contexts
moved, takes back late work after the grace, and a lent slot's new bid ends the reclaim."""

from __future__ import annotations

import pytest

from libra.broker.events import PeerMessage
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m

C = b"client"
LENT, OWNED = b"lent", b"own"


def sent(out: list, cls: type) -> list:
    return [c for c in out if isinstance(getattr(c, "msg", None), cls)]


def setup(kv_s: float = 1e-3) -> BrokerState:
    s = BrokerState(BrokerConfig(router="round_robin", kv_move_s_per_token=kv_s, reclaim_grace_s=2.0))
    s.handle(PeerMessage(C, m.ClientHello("c", 1)), 0)
    caps = {"generate": ["*"]}
    s.handle(PeerMessage(LENT, m.ActorHello("lent", "h", "gpu1", 1, caps, ["generate"], 2,
                                            {"lend": {"owner": "serving", "rule": "headroom"}})), 0)
    s.handle(PeerMessage(LENT, m.Bid(["generate"], 2)), 0)
    return s


def owned(s: BrokerState, now: float) -> list:
    caps = {"generate": ["*"]}
    out = s.handle(PeerMessage(OWNED, m.ActorHello("own", "h", "gpu0", 1, caps, ["generate"], 2)), now)
    return out + s.handle(PeerMessage(OWNED, m.Bid(["generate"], 2)), now)


def gen(s: BrokerState, rid: str, traj: str, now: float, **args: object) -> list:
    out = s.handle(PeerMessage(C, m.Submit(rid, "generate", "", dict(args), traj)), now)
    s.validate()
    return out


def test_a_lent_slot_is_marked_and_an_owned_slot_may_not_reclaim() -> None:
    s = setup()
    owned(s, 0)
    assert s.actors[LENT].lent_owner == "serving" and s.actors[OWNED].lent_owner == ""
    out = s.handle(PeerMessage(OWNED, m.OwnerReclaim("x", 5.0)), 1.0)
    assert sent(out, m.Error) and "generate" in s.actors[OWNED].accepting


@pytest.mark.parametrize("label", [{"rule": "headroom"}, {"owner": ""}, {"owner": 7}, "serving"])
def test_a_malformed_lend_label_is_refused_at_the_hello_not_taken_for_an_owned_slot(label: object) -> None:
    s = BrokerState(BrokerConfig())
    out = s.handle(PeerMessage(LENT, m.ActorHello("lent", "h", "gpu1", 1, {"generate": ["*"]}, ["generate"], 2,
                                                  {"lend": label})), 0)
    errs = sent(out, m.Error)
    assert errs and "lend label" in errs[0].msg.message and LENT not in s.actors


def test_reclaim_moves_pinned_trajectories_by_the_deadline_and_hands_back_without_a_loss() -> None:
    s = setup(kv_s=1e-3)  # 1 ms a token: 1,000 tokens move in 1 s
    (a1,) = [c.msg for c in sent(gen(s, "r1", "short", 1.0, prompt_tokens=1000), m.Assign)]
    (a2,) = [c.msg for c in sent(gen(s, "r2", "long", 1.0, prompt_tokens=9000), m.Assign)]
    for a in (a1, a2):  # both turns ran on the lent slot: both trajectories are pinned there
        s.handle(PeerMessage(LENT, m.WorkResult(a.work_id, a.lease, True, {"gen_tokens": 10})), 2.0)
    (a3,) = [c.msg for c in sent(gen(s, "r3", "short", 3.0), m.Assign)]  # running on the lent slot
    out = s.handle(PeerMessage(LENT, m.OwnerReclaim("serving", 5.0, "slo_headroom_low")), 4.0)
    assert s.actors[LENT].accepting == frozenset() and s.actors[LENT].reclaimed_until == 9.0
    assert not sent(out, m.ContextsMoved)  # it still holds r3, and two trajectories have not moved
    out = owned(s, 4.5)  # capacity to move to; nothing queued yet
    # the running turn comes back at the hand-back point: re-queued at the front, no loss counted
    out = s.handle(PeerMessage(LENT, m.Handback(a3.work_id, a3.lease, "owner_reclaim")), 5.0)
    (re,) = [c.msg for c in sent(out, m.Assign)]
    assert re.work_id == a3.work_id and re.route["mode"] == "kv" and re.route["reclaimed_from"] == "lent"
    assert s.works[a3.work_id].failures == 0 and re.attempt == 2
    (b,) = [c.msg for c in sent(gen(s, "r4", "long", 5.5), m.Assign)]  # 9,010 tokens: 9 s > 3.5 s left
    assert s.works[b.work_id].actor == OWNED and b.route["mode"] == "reprefill"
    out = s.handle(PeerMessage(OWNED, m.WorkResult(re.work_id, re.lease, True, {"gen_tokens": 5})), 6.0)
    assert not sent(out, m.ContextsMoved)  # "long" has not finished a turn elsewhere yet
    out = s.handle(PeerMessage(OWNED, m.WorkResult(b.work_id, b.lease, True, {"gen_tokens": 5})), 6.5)
    (moved,) = sent(out, m.ContextsMoved)
    assert moved.peer == LENT
    st = s.status("q", 7.0).stats["lending"]
    assert (st["reclaims"], st["moved_kv"], st["moved_reprefill"], st["contexts_moved"]) == (1, 1, 1, 1)


def test_work_still_held_after_the_grace_is_taken_back_and_runs_elsewhere() -> None:
    s = setup()
    (a,) = [c.msg for c in sent(gen(s, "r1", "t", 1.0, prompt_tokens=10), m.Assign)]
    s.handle(PeerMessage(LENT, m.OwnerReclaim("serving", 2.0)), 1.0)
    owned(s, 1.5)
    s.handle(PeerMessage(LENT, m.Heartbeat()), 3.4)
    assert not sent(s.handle(_tick(), 3.5), m.Revoke)  # deadline 3.0, grace 2.0: not yet
    s.handle(PeerMessage(LENT, m.Heartbeat()), 5.4)
    s.handle(PeerMessage(OWNED, m.Heartbeat()), 5.4)
    out = s.handle(_tick(), 5.5)
    (rv,) = sent(out, m.Revoke)
    assert rv.peer == LENT and rv.msg.work_id == a.work_id
    (re,) = [c.msg for c in sent(out, m.Assign)]
    assert re.work_id == a.work_id and s.works[a.work_id].actor == OWNED and s.works[a.work_id].failures == 0
    assert sent(out, m.ContextsMoved)  # nothing held and the deadline passed
    # the late result of the revoked lease is stale: the work is not completed twice
    s.handle(PeerMessage(LENT, m.WorkResult(a.work_id, a.lease, True, {"gen_tokens": 1})), 5.6)
    assert s.works[a.work_id].actor == OWNED and s.stats["stale_results"] == 1
    s.validate()


def test_a_new_bid_for_generate_ends_the_reclaim() -> None:
    s = setup()
    s.handle(PeerMessage(LENT, m.OwnerReclaim("serving", 1.0)), 1.0)
    out = s.handle(PeerMessage(LENT, m.Bid([], 2)), 1.75)  # the engine released: the GPU is the owner's
    assert s.actors[LENT].reclaimed_until == 1.0 + 1.0
    assert s.status("q", 1.8).stats["lending"]["handback_slack_s"] == [0.25]
    assert any(getattr(c, "event", "") == "capacity_handed_back" for c in out)
    out = s.handle(PeerMessage(LENT, m.Bid(["generate"], 2)), 30.0)
    assert s.actors[LENT].reclaimed_until == 0.0 and "generate" in s.actors[LENT].accepting
    assert any(getattr(c, "event", "") == "capacity_lent" for c in out)
    (a,) = [c.msg for c in sent(gen(s, "r1", "t", 31.0), m.Assign)]
    assert s.works[a.work_id].actor == LENT
    assert s.status("q", 32.0).stats["lending"]["lent_again"] == 1


def test_a_slot_lent_again_before_its_empty_bid_still_times_its_hand_back_as_a_bound() -> None:
    s = setup()
    s.handle(PeerMessage(LENT, m.OwnerReclaim("serving", 2.0)), 1.0)
    out = s.handle(PeerMessage(LENT, m.Bid(["generate"], 2)), 2.5)  # released and rebuilt: it bids again at once
    (ev,) = [c for c in out if getattr(c, "event", "") == "capacity_handed_back"]
    assert ev.fields["at_latest"] is True and ev.fields["slack_s"] == 0.5
    assert s.status("q", 3.0).stats["lending"]["handback_slack_s"] == [0.5]


def _tick():
    from libra.broker.events import Tick

    return Tick()


def test_an_operator_may_not_direct_a_lent_slot_to_train() -> None:
    s = setup()
    out = s.handle(PeerMessage(C, m.DirectRequest("d1", "lent", ["train"])), 1.0)
    (reply,) = [c.msg for c in sent(out, m.Reply)]
    assert not reply.ok and "never trains" in reply.error
    assert not sent(out, m.Directive)
