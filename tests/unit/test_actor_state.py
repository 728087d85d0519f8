"""ActorState driven by events with no sockets: handshake, work, directives, liveness and reconnect."""

from __future__ import annotations

from libra.actors.state import (ActorIdentity, ActorPhase, ActorState, CancelWork, Connect, Received, Reconfigure,
                                Reconfigured, SendMsg, Start, StartWork, Stop, Tick, WorkDone)
from libra.protocol import messages as m


def make(capacity: int = 2) -> ActorState:
    ident = ActorIdentity("h/cpu0", "h", "cpu0", 42, {"action": ["echo"], "train": ["*"]})
    return ActorState(ident, ["action"], capacity, heartbeat_s=1.0, liveness=3)


def msgs(cmds: list, cls: type) -> list:
    return [c.msg for c in cmds if isinstance(c, SendMsg) and isinstance(c.msg, cls)]


def welcome() -> Received:
    return Received(m.Welcome("s1", "b", 0.5, 4, 1 << 20))


def ready(capacity: int = 2) -> ActorState:
    a = make(capacity)
    a.handle(Start(), 0.0)
    a.handle(welcome(), 0.0)
    return a


def assign(wid: str, lease: int) -> Received:
    return Received(m.Assign(wid, lease, 1, "action", "echo", {"x": wid}))


def test_start_connects_and_says_hello_then_bids_on_welcome() -> None:
    a = make()
    out = a.handle(Start(), 0.0)
    assert isinstance(out[0], Connect)
    (hello,) = msgs(out, m.ActorHello)
    assert hello.actor_id == "h/cpu0" and hello.kinds == ["action"] and hello.capacity == 2
    out = a.handle(welcome(), 0.1)
    (bid,) = msgs(out, m.Bid)
    assert bid.kinds == ["action"] and bid.capacity == 2
    assert a.phase is ActorPhase.READY and (a.heartbeat_s, a.liveness) == (0.5, 4)


def test_assign_starts_work_and_done_sends_result_with_lease() -> None:
    a = ready()
    out = a.handle(assign("w1", 7), 1.0)
    assert [type(c) for c in out] == [StartWork]
    out = a.handle(WorkDone("w1", 7, True, {"x": "w1"}, duration_s=0.01), 1.1)
    (r,) = msgs(out, m.WorkResult)
    assert (r.work_id, r.lease, r.ok, r.output) == ("w1", 7, True, {"x": "w1"})


def test_over_capacity_waits_locally_then_starts() -> None:
    a = ready(capacity=1)
    a.handle(assign("w1", 1), 1.0)
    assert a.handle(assign("w2", 2), 1.0) == []
    out = a.handle(WorkDone("w1", 1, True), 1.1)
    assert any(isinstance(c, StartWork) and c.assign.work_id == "w2" for c in out)


def test_revoke_cancels_and_result_is_not_sent() -> None:
    a = ready()
    a.handle(assign("w1", 1), 1.0)
    out = a.handle(Received(m.Revoke("w1", 1, "timeout")), 1.1)
    assert any(isinstance(c, CancelWork) and c.work_id == "w1" for c in out)
    assert msgs(a.handle(WorkDone("w1", 1, True), 1.2), m.WorkResult) == []


def test_directive_drains_reconfigures_then_reports_and_bids() -> None:
    a = ready()
    a.handle(assign("w1", 1), 1.0)
    out = a.handle(Received(m.Directive(5, ["train"], "finish", {"tp": 2})), 1.1)
    assert a.phase is ActorPhase.DRAINING and not any(isinstance(c, Reconfigure) for c in out)
    out = a.handle(WorkDone("w1", 1, True), 1.2)
    assert msgs(out, m.WorkResult)
    (rc,) = [c for c in out if isinstance(c, Reconfigure)]
    assert rc.kinds == ["train"] and rc.config == {"tp": 2} and a.phase is ActorPhase.SWITCHING
    out = a.handle(Reconfigured(5), 2.0)
    assert [type(x) for x in (msgs(out, m.DirectiveDone) + msgs(out, m.Bid))] == [m.DirectiveDone, m.Bid]
    assert msgs(out, m.Bid)[0].kinds == ["train"] and a.phase is ActorPhase.READY


def test_handback_directive_returns_waiting_work() -> None:
    a = ready(capacity=1)
    a.handle(assign("w1", 1), 1.0)
    a.handle(assign("w2", 2), 1.0)
    out = a.handle(Received(m.Directive(1, ["train"], "handback")), 1.1)
    (hb,) = msgs(out, m.Handback)
    assert hb.work_id == "w2" and hb.lease == 2


def test_failed_reconfiguration_keeps_old_kinds() -> None:
    a = ready()
    a.handle(Received(m.Directive(1, ["train"])), 1.0)
    out = a.handle(Reconfigured(1, ok=False, error="no GPU"), 1.1)
    assert msgs(out, m.Bid)[0].kinds == ["action"]


def test_heartbeat_when_quiet_and_reconnect_with_backoff_when_broker_silent() -> None:
    a = ready()
    a.handle(Received(m.Heartbeat()), 0.0)
    assert msgs(a.handle(Tick(), 0.6), m.Heartbeat)  # heartbeat_s is 0.5 after welcome
    a.handle(assign("w1", 1), 0.6)
    out = a.handle(Tick(), 2.7)  # silent > 0.5 × 4
    # the session is lost but the work is not: it keeps running (a broker restart must not run it twice)
    assert not any(isinstance(c, CancelWork) for c in out) and a.phase is ActorPhase.CONNECTING
    assert not any(isinstance(c, Connect) for c in out)  # waits the back-off first
    out = a.handle(Tick(), 2.7 + a.initial_backoff_s + 0.01)
    assert isinstance(out[0], Connect)
    (hello,) = msgs(out, m.ActorHello)
    assert hello.held == [["w1", 1, 1]]  # the new hello says what it still holds
    # no session: its result waits for the next Welcome instead of going nowhere
    assert msgs(a.handle(WorkDone("w1", 1, True), 3.0), m.WorkResult) == []
    # back-off doubles while the broker stays silent
    first = a.backoff_s
    out = a.handle(Tick(), 3.0 + 10)
    assert a.backoff_s == min(a.max_backoff_s, first * 2)
    out = a.handle(Tick(), 13.0 + a.backoff_s)
    assert msgs(out, m.ActorHello)[0].held == [["w1", 1, 1]]  # still held, now as a finished result
    out = a.handle(welcome(), 14.0)
    (r,) = msgs(out, m.WorkResult)
    assert (r.work_id, r.lease, r.ok) == ("w1", 1, True) and msgs(out, m.Bid)


def test_disconnect_reconnects_immediately() -> None:
    a = ready()
    out = a.handle(Received(m.Disconnect("expired")), 1.0)
    assert isinstance(out[1], Connect) or any(isinstance(c, Connect) for c in out)
    assert a.phase is ActorPhase.CONNECTING and a.sessions == 2


def test_stop_hands_back_waiting_and_says_goodbye() -> None:
    a = ready(capacity=1)
    a.handle(assign("w1", 1), 1.0)
    a.handle(assign("w2", 2), 1.0)
    out = a.handle(Stop(), 2.0)
    assert [x.work_id for x in msgs(out, m.Handback)] == ["w2"] and msgs(out, m.Goodbye)


def test_work_survives_a_disconnect_and_the_next_hello_carries_it() -> None:
    a = ready()
    a.handle(Received(m.Assign("w1", 4, 2, "action", "echo", {}, None, 30.0)), 1.0)
    out = a.handle(Received(m.Disconnect("unknown session: say hello again")), 1.5)
    assert not any(isinstance(c, CancelWork) for c in out) and a.running == {"w1": 4}
    (hello,) = msgs(out, m.ActorHello)
    assert hello.held == [["w1", 4, 2]]  # work id, lease, attempt
    # it finishes before the new broker welcomes us: the result waits, then goes out after Welcome
    assert msgs(a.handle(WorkDone("w1", 4, True, "out"), 2.0), m.WorkResult) == []
    out = a.handle(welcome(), 2.1)
    (r,) = msgs(out, m.WorkResult)
    assert (r.work_id, r.lease, r.output) == ("w1", 4, "out") and not a.unsent
    assert msgs(a.handle(Tick(), 2.2), m.WorkResult) == []  # sent once


def test_a_result_sent_just_before_the_session_was_lost_is_offered_again() -> None:
    a = ready()
    a.handle(assign("w1", 1), 1.0)
    assert msgs(a.handle(WorkDone("w1", 1, True, "x"), 1.1), m.WorkResult)
    # the broker died right after: it may never have recorded that result
    out = a.handle(Received(m.Disconnect("unknown session: say hello again")), 1.5)
    assert msgs(out, m.ActorHello)[0].held == [["w1", 1, 1]]
    (r,) = msgs(a.handle(welcome(), 1.6), m.WorkResult)
    assert r.work_id == "w1" and r.output == "x"
    # results older than the window are forgotten and not offered in later hellos
    a.handle(Received(m.Heartbeat()), 30.0)
    a.handle(Tick(), 30.0)
    assert msgs(a.handle(Received(m.Disconnect("x")), 30.1), m.ActorHello)[0].held == []


def test_a_revoke_at_hello_drops_the_held_copy() -> None:
    a = ready()
    a.handle(assign("w1", 1), 1.0)
    a.handle(assign("w2", 2), 1.0)
    a.handle(WorkDone("w2", 2, True), 1.05)  # sent, kept as recent
    out = a.handle(Received(m.Disconnect("x")), 1.5)
    assert sorted(msgs(out, m.ActorHello)[0].held) == [["w1", 1, 1], ["w2", 2, 1]]
    out = a.handle(Received(m.Revoke("w1", 1, "running elsewhere")), 1.6)
    assert [c.work_id for c in out if isinstance(c, CancelWork)] == ["w1"] and "w1" not in a.running
    a.handle(Received(m.Revoke("w2", 2, "unknown or already answered")), 1.6)
    assert msgs(a.handle(welcome(), 1.7), m.WorkResult) == []  # nothing left to deliver
    assert msgs(a.handle(WorkDone("w1", 1, True), 1.8), m.WorkResult) == []


def test_work_held_without_a_session_past_its_budget_is_cancelled() -> None:
    a = ready()
    a.handle(Received(m.Assign("w1", 1, 1, "action", "sleep", {}, None, 5.0)), 1.0)
    a.handle(Tick(), 1.0 + 4 * 0.5 + 0.1)  # broker silent: session lost, work kept
    assert a.phase is ActorPhase.CONNECTING and a.running == {"w1": 1}
    out = a.handle(Tick(), 6.5)  # past the budget, still no session
    assert [c.work_id for c in out if isinstance(c, CancelWork)] == ["w1"] and not a.running


def test_a_directive_while_switching_is_held_and_follows_the_switch() -> None:
    # the Elastic Hybrid Pool may release a hybrid slot while it is still switching to train: the actor must not
    # crash (switching -> draining is no transition); it finishes the switch, then applies the newer directive
    a = ready()
    a.handle(Received(m.Directive(1, ["train"])), 1.0)
    assert a.phase is ActorPhase.SWITCHING
    out = a.handle(Received(m.Directive(2, ["action"], "finish", {"role": "back"})), 1.1)
    assert a.phase is ActorPhase.SWITCHING and not msgs(out, m.Bid)
    out = a.handle(Reconfigured(1), 1.2)
    assert [d.directive_id for d in msgs(out, m.DirectiveDone)] == [1] and not msgs(out, m.Bid)
    (rc,) = [c for c in out if isinstance(c, Reconfigure)]
    assert rc.directive_id == 2 and rc.kinds == ["action"] and a.phase is ActorPhase.SWITCHING
    out = a.handle(Reconfigured(2), 1.3)
    assert [d.directive_id for d in msgs(out, m.DirectiveDone)] == [2] and a.phase is ActorPhase.READY
    assert msgs(out, m.Bid)[0].kinds == ["action"] and a.next_directive is None


def test_an_idle_actor_waits_liveness_idle_beats_for_the_broker_a_busy_one_liveness_beats() -> None:
    # the broker beats an actor that holds none of its work only every idle_heartbeat_s (3 s here)
    a = make()
    a.handle(Start(), 0.0)
    a.handle(Received(m.Welcome("s1", "b", 1.0, 3, 1 << 20, 3.0)), 0.0)
    assert a.phase is ActorPhase.READY and a.idle_heartbeat_s == 3.0
    assert msgs(a.handle(Tick(), 1.0), m.Heartbeat)  # it still beats every heartbeat_s itself
    a.handle(Tick(), 8.9)  # silent 8.9 s, idle: within 3 x 3 s
    assert a.phase is ActorPhase.READY
    a.handle(Received(m.Heartbeat()), 9.0)
    a.handle(assign("w1", 1), 9.5)
    a.handle(Tick(), 12.4)  # busy: silent 2.9 s is within 3 x 1 s
    assert a.phase is ActorPhase.READY
    a.handle(Tick(), 12.6)  # silent 3.1 s while holding work: the broker is gone
    assert a.phase is ActorPhase.CONNECTING


def test_an_idle_actor_keeps_a_sent_result_as_long_as_it_may_take_to_notice_a_dead_broker() -> None:
    a = make()
    a.handle(Start(), 0.0)
    a.handle(Received(m.Welcome("s1", "b", 1.0, 3, 1 << 20, 3.0)), 0.0)
    a.handle(assign("w1", 1), 0.5)
    assert msgs(a.handle(WorkDone("w1", 1, True, "x"), 1.0), m.WorkResult)
    # the broker died just as the result left; idle now, the actor notices only after 9 s of silence
    out = a.handle(Tick(), 0.5 + 9.1)
    assert a.phase is ActorPhase.CONNECTING
    out = a.handle(Tick(), 0.5 + 9.1 + a.backoff_s + 0.01)
    assert msgs(out, m.ActorHello)[0].held == [["w1", 1, 1]]  # still offered to the next broker
