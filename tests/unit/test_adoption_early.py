"""Issue #28, item 2: after a broker restart on its journal, restored work waits for the actors that held it,
not for the whole grace period. Each holder's hello lists what it still runs; what it does not claim is
queued at that hello, and once every holder is back the work that never started is queued too. The grace
period stays the upper bound for holders that never come back (test_broker_adoption.py)."""

from __future__ import annotations

from libra.broker.events import JournalWrite, Log, PeerMessage, Restore, Send, Tick
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m

CFG = BrokerConfig(heartbeat_s=1.0, liveness=3)  # grace: 2 x 1 x 3 + 5 = 11 s
CAPS = {"action": ["bash"]}


def _of(cmds: list, cls: type, peer: bytes | None = None) -> list:
    return [c.msg for c in cmds if isinstance(c, Send) and isinstance(c.msg, cls) and (peer is None or c.peer == peer)]


def _hello(s: BrokerState, peer: bytes, actor_id: str, now: float, held: list | None = None) -> list:
    out = s.handle(PeerMessage(peer, m.ActorHello(actor_id, "h", actor_id, 1, CAPS, ["action"], 2, {}, held or [])), now)
    s.validate()
    return out


def _crashed_broker() -> tuple[list, dict[str, tuple[str, m.Assign]]]:
    """Two actors of capacity 2 and five calls: two run on each, one waits; then the broker dies. Returns what
    its journal kept (accepted requests with their last start) and each started work's (actor id, Assign)."""
    s = BrokerState(CFG, journaling=True)
    out = _hello(s, b"p1", "a1", 0.0) + _hello(s, b"p2", "a2", 0.0)
    out += s.handle(PeerMessage(b"c", m.ClientHello("c1", 1)), 0.0)
    for i in range(5):
        out += s.handle(PeerMessage(b"c", m.Submit(f"r{i}", "action", "bash", {"i": i}, None, 600.0)), 0.0)
    started = {a.work_id: ({b"p1": "a1", b"p2": "a2"}[c.peer], a) for c in out
               if isinstance(c, Send) and isinstance(c.msg, m.Assign) for a in [c.msg]}
    assert sorted(aid for aid, _ in started.values()) == ["a1", "a1", "a2", "a2"]
    records: dict[tuple[str, str], dict] = {}
    for rec in (c for c in out if isinstance(c, JournalWrite)):
        if rec.op == "accept":
            records[(rec.client_id, rec.request_id)] = dict(rec.data)
        elif rec.op == "start":
            records[(rec.client_id, rec.request_id)].update(
                lease=rec.data["lease"], attempt=rec.data["attempt"], actor_id=rec.data["actor_id"])
    return [(c, r, d) for (c, r), d in records.items()], started


def _restarted(accepted: list) -> BrokerState:
    s = BrokerState(CFG, journaling=True)
    assert s.handle(Restore(accepted, []), 100.0) == []
    assert len(s.works) == 5 and not any(s.queues.values())  # all parked
    return s


def _held(started: dict, actor_id: str) -> list[list]:
    return [[wid, a.lease, a.attempt] for wid, (aid, a) in started.items() if aid == actor_id]


def test_a_holder_that_claims_nothing_has_its_work_queued_at_its_hello_not_after_the_grace() -> None:
    accepted, started = _crashed_broker()
    s = _restarted(accepted)
    unstarted = next(w for w in s.works if w not in started)
    mine2 = {wid for wid, (aid, _) in started.items() if aid == "a2"}
    # a1 comes back and claims everything it was running: adopted; a2 is still awaited, so nothing is queued
    out = _hello(s, b"n1", "a1", 100.01, held=_held(started, "a1"))
    assert _of(out, m.Revoke) == [] and _of(out, m.Assign) == []
    assert s.actors[b"n1"].held == {wid for wid, (aid, _) in started.items() if aid == "a1"}
    assert s.snapshot("q", 100.01).stats["parked"] == 3  # a2's two and the one that never started
    # a2 comes back (12 ms later, far inside the 11 s grace) holding nothing: its two works and the one that
    # never started are queued at this hello; a2 has credit for two, the third waits in the queue
    out = _hello(s, b"n2", "a2", 100.012)
    assigned = {a.work_id for a in _of(out, m.Assign, b"n2")}
    assert len(assigned) == 2 and assigned <= mine2 | {unstarted}
    assert s.snapshot("q", 100.012).stats["parked"] == 0
    assert sorted(wid for q in s.queues.values() for wid in q) == sorted((mine2 | {unstarted}) - assigned)
    # the Assigns follow the Welcome
    kinds = [type(c.msg).__name__ for c in out if isinstance(c, Send)]
    assert kinds.index("Welcome") < kinds.index("Assign")
    logs = [c for c in out if isinstance(c, Log) and c.event == "restored_work_queued"]
    assert logs and logs[0].fields["queued"] == 3 and logs[0].fields["why"] == "a2 is back"
    # a2's hello lists everything it runs and every result it may not have delivered: a start of its that it
    # does not claim never reached it (the Assign died with the broker), so the new start is its first attempt
    for a in _of(out, m.Assign, b"n2"):
        assert a.attempt == 1


def test_each_holder_releases_its_own_work_and_the_unstarted_waits_for_every_holder() -> None:
    accepted, started = _crashed_broker()
    s = _restarted(accepted)
    unstarted = next(w for w in s.works if w not in started)
    mine1 = {wid for wid, (aid, _) in started.items() if aid == "a1"}
    # a1 is back first and claims one of its two works: the other is queued at once, although a2 is not back
    keep = _held(started, "a1")[:1]
    out = _hello(s, b"n1", "a1", 100.5, held=keep)
    (again,) = _of(out, m.Assign, b"n1")
    assert again.work_id in mine1 and again.work_id != keep[0][0]
    assert s.snapshot("q", 100.5).stats["parked"] == 3  # a2's two and the unstarted one
    # a new actor that held nothing releases nothing
    assert _of(_hello(s, b"n3", "a3", 100.6), m.Assign) == []
    assert unstarted not in s.actors[b"n3"].held
    # a2 claims both of its works: the unstarted one goes at once (to a3, which has credit)
    out = _hello(s, b"n2", "a2", 100.7, held=_held(started, "a2"))
    assert [a.work_id for a in _of(out, m.Assign)] == [unstarted]
    assert s.snapshot("q", 100.7).stats["parked"] == 0


def test_restored_work_that_never_started_is_queued_at_the_first_tick() -> None:
    s = BrokerState(CFG, journaling=True)
    accepted = [("c1", f"r{i}", {"kind": "action", "name": "bash", "args": {"i": i}, "trajectory": None,
                                 "timeout_s": 600.0, "work_id": f"w{i + 1}"}) for i in range(3)]
    s.handle(Restore(accepted, []), 0.0)
    assert s.snapshot("q", 0.0).stats["parked"] == 3
    s.handle(Tick(), 0.25)
    assert s.snapshot("q", 0.25).stats["parked"] == 0 and len(s.queues[("action", "bash")]) == 3
    out = _hello(s, b"n1", "a1", 0.3)
    assert len(_of(out, m.Assign, b"n1")) == 2
