"""A lent slot's actor core (no sockets): the reclaim's order of events against the deadline, the engine
released only when its contexts are no longer needed, hand-backs at the hand-back point, directives refused
while the owner has the GPU, and the way back when the owner lends it again."""

from __future__ import annotations

from libra.actors.lending import OwnerChanged
from libra.actors.state import (ActorIdentity, ActorPhase, ActorState, CancelWork, Note, Received, Reconfigure,
                                Reconfigured, SendMsg, Start, Tick, WorkDone)
from libra.protocol import messages as m


def lent(capacity: int = 2) -> ActorState:
    ident = ActorIdentity("h/gpu1", "h", "gpu1", 42, {"generate": ["*"]},
                          {"lend": {"owner": "serving", "rule": "headroom"}})
    a = ActorState(ident, ["generate"], capacity, heartbeat_s=1.0, liveness=100)
    a.handle(Start(), 0.0)
    a.handle(Received(m.Welcome("s1", "b", 1.0, 100, 1 << 20)), 0.0)
    return a


def msgs(out: list, cls: type) -> list:
    return [c.msg for c in out if isinstance(c, SendMsg) and isinstance(c.msg, cls)]


def gen(wid: str, lease: int) -> Received:
    return Received(m.Assign(wid, lease, 1, "generate", "default", {}, "t-" + wid))


def test_reclaim_tells_the_broker_finishes_what_fits_and_releases_when_contexts_moved() -> None:
    a = lent()
    a.handle(gen("w1", 1), 1.0)
    out = a.handle(OwnerChanged(False, 10.0, "slo_headroom_low"), 2.0)
    (rc,) = msgs(out, m.OwnerReclaim)
    assert (rc.owner, rc.deadline_s, rc.reason) == ("serving", 10.0, "slo_headroom_low")
    assert a.phase is ActorPhase.DRAINING and not any(isinstance(c, Reconfigure) for c in out)
    out = a.handle(WorkDone("w1", 1, True, {"gen_tokens": 3}), 3.0)  # it finished in time: its result goes
    assert msgs(out, m.WorkResult) and not any(isinstance(c, Reconfigure) for c in out)  # contexts still served
    out = a.handle(Received(m.ContextsMoved("serving")), 4.0)
    (rc,) = [c for c in out if isinstance(c, Reconfigure)]
    assert rc.kinds == [] and rc.directive_id < 0
    out = a.handle(Reconfigured(rc.directive_id), 4.5)
    assert not msgs(out, m.DirectiveDone)  # the slot's own switch is not the broker's
    (bid,) = msgs(out, m.Bid)
    assert bid.kinds == []
    (note,) = [c for c in out if isinstance(c, Note) and c.event == "owner_handback"]
    assert note.fields["slack_s"] == 12.0 - 4.5


def test_what_still_runs_at_the_hand_back_point_is_cancelled_and_handed_back() -> None:
    a = lent()
    a.handle(gen("w1", 1), 1.0)
    a.handle(gen("w2", 2), 1.0)
    a.handle(OwnerChanged(False, 5.0), 2.0)  # deadline 7.0, margin 1.0: hand-back point 6.0
    out = a.handle(Tick(), 5.9)
    assert not msgs(out, m.Handback)
    out = a.handle(Tick(), 6.0)
    assert sorted(h.work_id for h in msgs(out, m.Handback)) == ["w1", "w2"]
    assert sorted(c.work_id for c in out if isinstance(c, CancelWork)) == ["w1", "w2"]
    (rc,) = [c for c in out if isinstance(c, Reconfigure)]  # nothing runs and the contexts' time is up
    assert rc.kinds == []
    assert a.handle(WorkDone("w1", 1, True), 6.1) == []  # a cancelled turn's late result goes nowhere


def test_assignments_after_the_reclaim_and_broker_directives_while_reclaimed_are_refused() -> None:
    a = lent()
    a.handle(OwnerChanged(False, 5.0), 1.0)
    out = a.handle(gen("w9", 3), 1.1)  # the broker sent it before it heard of the reclaim
    (hb,) = msgs(out, m.Handback)
    assert hb.work_id == "w9" and not a.running
    out = a.handle(Received(m.Directive(7, ["generate"], "finish", {"role": "rollout"})), 1.2)
    (done,) = msgs(out, m.DirectiveDone)
    assert (done.directive_id, done.kinds) == (7, [])


def test_lent_again_the_slot_rebuilds_its_engine_and_bids_for_generate() -> None:
    a = lent()
    a.handle(OwnerChanged(False, 0.5), 1.0)
    out = a.handle(Tick(), 1.5)
    (rel,) = [c for c in out if isinstance(c, Reconfigure)]
    out = a.handle(OwnerChanged(True), 1.6)  # the release has not finished: the allow waits for it
    assert not [c for c in out if isinstance(c, Reconfigure)]
    out = a.handle(Reconfigured(rel.directive_id), 2.0)
    (back,) = [c for c in out if isinstance(c, Reconfigure)]
    assert back.kinds == ["generate"] and back.directive_id < 0
    out = a.handle(Reconfigured(back.directive_id), 3.0)
    (bid,) = msgs(out, m.Bid)
    assert bid.kinds == ["generate"] and a.kinds == ["generate"] and not msgs(out, m.DirectiveDone)
    assert a.lend.stats == {"reclaims": 1, "handed_back": 0, "lent_again": 1}


def test_a_reclaim_without_a_session_is_told_after_the_welcome_with_what_is_left() -> None:
    a = lent()
    a.handle(Received(m.Disconnect("restart")), 1.0)  # reconnects: a new hello
    out = a.handle(OwnerChanged(False, 10.0), 1.5)
    assert not msgs(out, m.OwnerReclaim)
    out = a.handle(Received(m.Welcome("s2", "b", 1.0, 100, 1 << 20)), 4.0)
    (bid,) = msgs(out, m.Bid)
    (rc,) = msgs(out, m.OwnerReclaim)
    assert bid.kinds == [] and rc.deadline_s == 11.5 - 4.0
    assert a.phase is ActorPhase.DRAINING


def test_a_slot_the_job_owns_ignores_owner_signals() -> None:
    ident = ActorIdentity("h/gpu0", "h", "gpu0", 1, {"generate": ["*"]})
    a = ActorState(ident, ["generate"], 1)
    a.handle(Start(), 0.0)
    out = a.handle(OwnerChanged(False, 1.0), 0.5)
    assert [c.event for c in out if isinstance(c, Note)] == ["owner_signal_ignored"] and not a.lend.reclaimed
