"""Adoption in the broker core: after a restart from the journal (or a dropped session), work an actor still
holds goes back to it instead of running again; copies that cannot be adopted are revoked; restored work
nobody adopts is queued after the grace period, and ``attempts`` counts every start."""

from __future__ import annotations

from libra.broker.events import JournalWrite, PeerMessage, Restore, Send, Tick
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m

A1, A2, A3, C = b"actor-1", b"actor-2", b"actor-3", b"client"
CFG = BrokerConfig(heartbeat_s=1.0, liveness=3)


def sent(cmds: list, cls: type, peer: bytes | None = None) -> list:
    return [c.msg for c in cmds if isinstance(c, Send) and isinstance(c.msg, cls) and (peer is None or c.peer == peer)]


class Run:
    """One broker core with a clock; every step checks the invariants."""

    def __init__(self, journaling: bool = True) -> None:
        self.s = BrokerState(CFG, journaling=journaling)
        self.now = 0.0
        self.journal: list[JournalWrite] = []

    def do(self, event: object, dt: float = 0.0) -> list:
        self.now += dt
        out = self.s.handle(event, self.now)  # type: ignore[arg-type]
        self.s.validate()
        self.journal += [c for c in out if isinstance(c, JournalWrite)]
        return out

    def msg(self, peer: bytes, msg: object, dt: float = 0.0) -> list:
        return self.do(PeerMessage(peer, msg), dt)

    def hello(self, peer: bytes, actor_id: str, capacity: int = 2, held: list | None = None) -> list:
        caps = {"action": ["echo", "sleep", "bash"]}
        return self.msg(peer, m.ActorHello(actor_id, "h", actor_id, 1, caps, ["action"], capacity, {}, held or []))

    def submit(self, rid: str) -> list:
        return self.msg(C, m.Submit(rid, "action", "bash", {"command": rid}, None, 600.0))


def _journal_of_a_run() -> tuple[list, list, dict[str, m.Assign]]:
    """A broker with two actors (capacity 2) and five calls: four run (two per actor), one waits. The
    broker then dies: return what its journal kept (accepted without a reply, done) and the Assigns."""
    r = Run()
    r.hello(A1, "a1")
    r.hello(A2, "a2")
    r.msg(C, m.ClientHello("c1", 1))
    assigns: dict[str, m.Assign] = {}
    for i in range(5):
        for a in sent(r.submit(f"r{i}"), m.Assign):
            assigns[a.work_id] = a
    assert len(assigns) == 4 and len(r.s.queues[("action", "bash")]) == 1
    accepted: dict[tuple, dict] = {}
    for rec in r.journal:  # what journal_store would load back
        key = (rec.client_id, rec.request_id)
        if rec.op == "accept":
            accepted[key] = dict(rec.data)
        elif rec.op == "start":
            accepted[key].update(lease=rec.data["lease"], attempt=rec.data["attempt"], actor_id=rec.data["actor_id"])
    return [(c, rid, d) for (c, rid), d in accepted.items()], [], assigns


def _holder(assigns: dict[str, m.Assign], peer_of: dict[str, bytes], peer: bytes) -> list[list]:
    return [[a.work_id, a.lease, a.attempt] for a in assigns.values() if peer_of[a.work_id] == peer]


def test_restored_work_is_adopted_by_its_surviving_actor_and_its_result_accepted() -> None:
    accepted, done, assigns = _journal_of_a_run()
    # the restarted broker: the same work ids, leases and attempt counts, parked for the grace period
    r = Run()
    assert r.do(Restore(accepted, done)) == []
    assert sorted(r.s.works) == ["w1", "w2", "w3", "w4", "w5"] and not any(r.s.queues.values())
    peer_of = {wid: (A1 if i % 2 == 0 else A2) for i, wid in enumerate(sorted(assigns))}
    # a new actor (no held work) joins during the grace period: it gets no restored work
    assert sent(r.hello(A3, "a3"), m.Assign) == []
    # the surviving actor says hello again with the work it holds: adopted, nothing revoked
    held1 = _holder(assigns, peer_of, A1)
    out = r.hello(A1, "a1", held=held1)
    assert sent(out, m.Revoke) == [] and sent(out, m.Welcome, A1)
    assert {wid for wid, *_ in held1} == r.s.actors[A1].held
    adopted = {w.work_id for w in r.s.works.values() if w.actor == A1}
    assert adopted == {wid for wid, *_ in held1}
    starts = [rec for rec in r.journal if rec.op == "start"]
    assert {rec.data["work_id"] for rec in starts} == adopted  # the adoption is journaled too
    # its results are accepted; each Reply says the work was started once
    for wid, lease, _ in held1:
        (reply,) = sent(r.msg(A1, m.WorkResult(wid, lease, True, {"ran": wid})), m.Reply)
        assert reply.ok and reply.attempts == 1 and reply.output == {"ran": wid}
    assert r.s.stats["stale_results"] == 0


def test_a_second_copy_is_revoked_and_new_leases_stay_unique() -> None:
    accepted, done, assigns = _journal_of_a_run()
    r = Run()
    r.do(Restore(accepted, done))
    wid, a = next(iter(assigns.items()))
    assert sent(r.hello(A1, "a1", held=[[wid, a.lease, a.attempt]]), m.Revoke) == []
    # another actor claims the same work (a stale copy from an older lease): revoked, not adopted
    out = r.hello(A2, "a2", held=[[wid, a.lease, 1], ["w999", 3, 1]])
    assert sorted((v.work_id, v.lease) for v in sent(out, m.Revoke, A2)) == [(wid, a.lease), ("w999", 3)]
    assert wid not in r.s.actors[A2].held and r.s.works[wid].actor == A1
    i = out.index(next(c for c in out if isinstance(c, Send) and isinstance(c.msg, m.Welcome)))
    assert all(out.index(c) < i for c in out if isinstance(c, Send) and isinstance(c.msg, m.Revoke))
    # new work gets a work id and a lease no earlier run of the broker gave out (on a third actor: both
    # holders are back, so their unclaimed work was queued at their hellos and fills them)
    r.hello(A3, "a3", capacity=2)
    r.msg(C, m.ClientHello("c1", 1))
    (fresh,) = sent(r.submit("new"), m.Assign)
    assert fresh.work_id == "w6" and fresh.lease > max(x.lease for x in assigns.values())


def test_unadopted_restored_work_is_queued_after_the_grace_period_with_truthful_attempts() -> None:
    accepted, done, assigns = _journal_of_a_run()
    r = Run()
    r.do(Restore(accepted, done))
    r.hello(A3, "a3", capacity=8)  # a fresh actor: the old ones died with the broker
    grace = 2 * CFG.heartbeat_s * CFG.liveness + 5.0
    while r.now + 1.0 < grace:  # still waiting for the old actors
        r.msg(A3, m.Heartbeat(), dt=1.0)
        assert sent(r.do(Tick()), m.Assign) == []
    r.msg(A3, m.Heartbeat())
    out = r.do(Tick(), 1.0)
    again = {a.work_id: a for a in sent(out, m.Assign, A3)}
    assert sorted(again) == ["w1", "w2", "w3", "w4", "w5"]
    for wid, a in again.items():
        before = assigns[wid].attempt if wid in assigns else 0
        assert a.attempt == before + 1  # started once before the crash (or never), once now
        (reply,) = sent(r.msg(A3, m.WorkResult(wid, a.lease, True, 1)), m.Reply)
        assert reply.attempts == before + 1
    # a late hello from an old actor now finds its work answered: revoked
    wid = next(iter(assigns))
    (rv,) = sent(r.hello(A1, "a1", held=[[wid, assigns[wid].lease, 1]]), m.Revoke)
    assert rv.work_id == wid


def test_a_live_broker_gives_a_reconnecting_actor_back_its_queued_work_and_revokes_what_moved() -> None:
    r = Run(journaling=False)
    r.msg(C, m.ClientHello("c1", 1))
    r.hello(A1, "a1", capacity=2)
    (a1, a2) = sent(r.submit("r1") + r.submit("r2"), m.Assign, A1)
    # the actor reconnects on a new socket (a blip): its old session is replaced, its work stays with it
    out = r.hello(A2, "a1", capacity=2, held=[[a1.work_id, a1.lease, 1], [a2.work_id, a2.lease, 1]])
    assert sent(out, m.Revoke) == [] and sent(out, m.Assign) == []
    assert r.s.actors[A2].held == {a1.work_id, a2.work_id} and A1 not in r.s.actors
    (reply,) = sent(r.msg(A2, m.WorkResult(a1.work_id, a1.lease, True, "x")), m.Reply)
    assert reply.attempts == 1
    # the broker drops the session (silent); one call waits queued, the other moves to another actor
    r.msg(A2, m.Heartbeat(), dt=0.0)
    r.do(Tick(), 3.5)
    assert not r.s.actors and len(r.s.queues[("action", "bash")]) == 1
    # it comes back with the same work: still queued, so adopted (attempt unchanged, nothing runs again)
    out = r.hello(A1, "a1", held=[[a2.work_id, a2.lease, 1]])
    assert sent(out, m.Revoke) == [] and sent(out, m.Assign) == [] and r.s.works[a2.work_id].actor == A1
    (reply,) = sent(r.msg(A1, m.WorkResult(a2.work_id, a2.lease, True, "y")), m.Reply)
    assert reply.output == "y" and reply.attempts == 1
    # a third call: its actor is dropped, another actor takes it; the old copy is revoked on hello
    (a3,) = sent(r.submit("r3"), m.Assign, A1)
    r.hello(A3, "a3")
    r.msg(A3, m.Heartbeat(), dt=3.5)
    out = r.do(Tick(), 0.1)
    (moved,) = sent(out, m.Assign, A3)
    assert moved.work_id == a3.work_id and moved.attempt == 2
    (rv,) = sent(r.hello(A2, "a1", held=[[a3.work_id, a3.lease, 1]]), m.Revoke, A2)
    assert (rv.work_id, rv.lease) == (a3.work_id, a3.lease)


def test_bad_held_entries_are_ignored() -> None:
    r = Run()
    out = r.hello(A1, "a1", held=[["w1"], [1, 2, 3], "x", ["w2", -1, 1], ["w3", 2, "a"]])
    assert sent(out, m.Welcome) and sent(out, m.Revoke) == [m.Revoke("w3", 2, "unknown or already answered")]


def test_the_journal_store_loads_work_ids_leases_and_attempts(tmp_path) -> None:
    from libra.broker.journal_store import BrokerJournal

    j = BrokerJournal(tmp_path / "j.sqlite")
    body = {"kind": "action", "name": "bash", "args": {}, "trajectory": None, "timeout_s": 60.0}
    j.write(JournalWrite("accept", "c1", "r1", {**body, "work_id": "w7"}))
    j.write(JournalWrite("accept", "c1", "r2", {**body, "work_id": "w8"}))
    j.write(JournalWrite("start", "c1", "r1", {"work_id": "w7", "lease": 3, "attempt": 1, "actor_id": "a1"}))
    j.write(JournalWrite("start", "c1", "r1", {"work_id": "w7", "lease": 9, "attempt": 2, "actor_id": "a2"}))
    j.write(JournalWrite("start", "c1", "r2", {"work_id": "w8", "lease": 4, "attempt": 1, "actor_id": "a1"}))
    j.write(JournalWrite("done", "c1", "r2", {"ok": True, "output": 1, "work_id": "w8", "attempts": 1}))
    j.close()
    j = BrokerJournal(tmp_path / "j.sqlite")
    accepted, done = j.load()
    assert accepted == [("c1", "r1", {**body, "work_id": "w7", "lease": 9, "attempt": 2, "actor_id": "a2"})]
    assert [(c, rid) for c, rid, _ in done] == [("c1", "r2")]
    j.close()


def test_a_copy_from_another_actor_or_an_older_broker_is_never_adopted() -> None:
    # a broker without a journal restarted: its work ids and leases start over, so an old actor's
    # (work id, lease) may name a different request that waits here now
    r = Run(journaling=False)
    r.msg(C, m.ClientHello("c1", 1))
    r.hello(A1, "x")
    (a,) = sent(r.submit("r1"), m.Assign, A1)
    assert (a.work_id, a.lease) == ("w1", 1)
    r.do(Tick(), 3.5)  # x went silent: w1 waits in the queue again
    assert not r.s.actors and r.s.works["w1"].state.value == "queued"
    out = r.hello(A2, "y", held=[["w1", 1, 1]])  # y held an older broker's w1
    (rv,) = sent(out, m.Revoke, A2)
    assert (rv.work_id, rv.lease) == ("w1", 1) and r.s.stats["adopted"] == 0
    # the queued work goes to y as a new assignment instead (a new lease, counted as a new start)
    (again,) = sent(out, m.Assign, A2)
    assert (again.work_id, again.lease, again.attempt) == ("w1", 2, 2)
    # x itself comes back with the lease it had: w1 is leased to y now, so x's copy is revoked too
    (rv,) = sent(r.hello(A3, "x", held=[["w1", 1, 1]]), m.Revoke, A3)
    assert rv.work_id == "w1" and r.s.works["w1"].actor == A2
