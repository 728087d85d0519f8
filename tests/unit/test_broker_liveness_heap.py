"""Actor liveness by a deadline heap (libra.broker.liveness): the same verdicts as a scan of every session
each tick, at the same ticks, exactly once; plus the registry's O(1) actor-id index and counted offers."""

from __future__ import annotations

import random
from types import SimpleNamespace

from libra.broker.events import PeerMessage, Tick
from libra.broker.liveness import LivenessHeap
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m


class Broker:
    def __init__(self) -> None:
        self.s = BrokerState(BrokerConfig(heartbeat_s=1.0, liveness=3))
        self.now = 0.0

    def msg(self, peer: bytes, msg: object) -> list:
        out = self.s.handle(PeerMessage(peer, msg), self.now)
        self.s.validate()
        return out

    def hello(self, peer: bytes, actor_id: str, tools: tuple[str, ...] = ("echo",)) -> None:
        self.msg(peer, m.ActorHello(actor_id, "h", actor_id, 1, {"action": list(tools)}, ["action"], 1))
        self.msg(peer, m.Bid(["action"], 1))

    def tick(self, dt: float) -> list:
        self.now += dt
        out = self.s.handle(Tick(), self.now)
        self.s.validate()
        return out


def expiries(out: list, peer: bytes | None = None) -> list:
    return [c for c in out if isinstance(getattr(c, "msg", None), m.Disconnect) and "expired" in c.msg.reason
            and (peer is None or c.peer == peer)]


def test_silent_actor_is_lost_exactly_once_at_the_first_tick_past_liveness() -> None:
    b = Broker()
    b.hello(b"p1", "a1")
    lost_at = []
    for _ in range(40):  # 10 s of 0.25 s ticks; dead after 3 silent heartbeat intervals (now - last_seen > 3)
        if expiries(b.tick(0.25), b"p1"):
            lost_at.append(b.now)
    assert lost_at == [3.25]
    assert b.s.stats["actors_expired"] == 1
    assert b.s.actors == {}


def test_chatty_actor_is_never_lost_and_is_beaten_every_idle_interval_while_idle_every_second_while_busy() -> None:
    b = Broker()  # heartbeat 1 s, idle heartbeat 3 s (the default: 3 x heartbeat)
    b.hello(b"p1", "a1")
    b.hello(b"p2", "a2")  # silent: lost, while p1 stays
    beats = {"idle": 0, "busy": 0}
    for i in range(1, 481):  # 120 s: the first 60 idle, the next 60 holding work
        if i == 241:
            b.msg(b"c", m.ClientHello("c1", 1))
            out = b.msg(b"c", m.Submit("r1", "action", "echo", {"x": 1}))
            assert [c for c in out if c.peer == b"p1" and isinstance(c.msg, m.Assign)]
        out = b.tick(0.25)
        beats["idle" if i <= 240 else "busy"] += sum(1 for c in out if c.peer == b"p1" and isinstance(c.msg, m.Heartbeat))
        assert not expiries(out, b"p1")
        if i % 4 == 0:
            b.msg(b"p1", m.Heartbeat())
    assert b.s.stats["actors_expired"] == 1
    assert [s.actor_id for s in b.s.actors.values()] == ["a1"]
    assert 19 <= beats["idle"] <= 20 and 58 <= beats["busy"] <= 60


def test_idle_heartbeat_equal_to_heartbeat_beats_idle_actors_every_second_as_before() -> None:
    b = Broker()
    b.s = BrokerState(BrokerConfig(heartbeat_s=1.0, liveness=3, idle_heartbeat_s=1.0))
    b.hello(b"p1", "a1")
    beats = 0
    for i in range(1, 241):
        beats += sum(1 for c in b.tick(0.25) if c.peer == b"p1" and isinstance(c.msg, m.Heartbeat))
        if i % 4 == 0:
            b.msg(b"p1", m.Heartbeat())
    assert 58 <= beats <= 60


def test_reconnect_on_a_new_socket_replaces_the_old_entry() -> None:
    b = Broker()
    b.hello(b"old", "a1")
    b.tick(2.0)
    b.hello(b"new", "a1")  # the same actor on a new socket: the old session goes, its heap entry goes stale
    assert list(b.s.actors) == [b"new"]
    lost_at = []
    for _ in range(40):
        out = b.tick(0.25)
        assert not expiries(out, b"old")
        if expiries(out, b"new"):
            lost_at.append(b.now)
    assert lost_at == [5.25]  # 3 s after the new hello at t=2, not after the old one


def test_goodbye_then_hello_on_the_same_socket_counts_from_the_new_session() -> None:
    b = Broker()
    b.hello(b"p1", "a1")
    b.tick(2.5)
    b.msg(b"p1", m.Goodbye("restart"))
    assert b.s.actors == {}
    b.tick(0.5)
    b.hello(b"p1", "a1")  # t = 3: the first session's deadline (3) must not expire this one
    lost_at = [b.now for _ in range(40) if expiries(b.tick(0.25), b"p1")]
    assert lost_at == [6.25]
    assert b.s.stats["actors_expired"] == 1


def test_heap_gives_the_scan_verdicts_under_random_traffic() -> None:
    """The oracle: every tick, scan every live session in open order (dead if silent for more than
    dead_after, else a heartbeat if nothing was sent for heartbeat_s, idle_heartbeat_s while it holds no work,
    then counted as sent)."""
    rng = random.Random(7)
    hb, idle, dead_after = 1.0, 2.5, 3.0
    heap = LivenessHeap(hb, dead_after, idle)
    live: dict[bytes, SimpleNamespace] = {}
    shadow: dict[bytes, list[float]] = {}  # peer -> [last_seen, last_sent] as the scan sees them
    now, opened = 0.0, 0
    for _ in range(3000):
        now += rng.choice((0.05, 0.25, 0.25, 0.5, 1.3))
        for _ in range(rng.randrange(4)):
            peer = b"p%d" % rng.randrange(30)
            r = rng.random()
            if peer not in live and r < 0.5:
                opened += 1
                live[peer] = SimpleNamespace(peer=peer, last_seen=now, last_sent=now, held=set())
                shadow[peer] = [now, now]
                heap.add(live[peer], opened)
            elif peer in live and r < 0.1:
                heap.discard(peer)
                del live[peer], shadow[peer]
            elif peer in live:  # a frame from it, or (sometimes) traffic the broker sent it
                live[peer].last_seen = shadow[peer][0] = now
                if r > 0.8:
                    live[peer].last_sent = shadow[peer][1] = now
                if r > 0.9:  # it takes work (the broker rekeys it), or hands its last back
                    live[peer].held = set() if live[peer].held else {"w"}
                    if live[peer].held:
                        heap.rekey(live[peer])
        want = []
        for peer, clocks in shadow.items():
            if now - clocks[0] > dead_after:
                want.append((peer, "dead"))
            elif now - clocks[1] >= (hb if live[peer].held else idle):
                clocks[1] = now
                want.append((peer, "heartbeat"))
        got = heap.due(live, now)
        assert got == want
        for peer, verdict in got:
            if verdict == "dead":
                del live[peer], shadow[peer]
    assert len(heap) == len(live)


def test_actor_index_and_offers_follow_sessions() -> None:
    b = Broker()
    b.hello(b"p1", "a1", ("echo", "sleep"))
    b.hello(b"p2", "a2", ("echo",))
    reg = b.s._sessions
    assert reg.actor_by_id("a2").peer == b"p2"
    assert reg.offers("action") == {"echo", "sleep"}
    b.msg(b"p1", m.Goodbye("done"))
    assert reg.actor_by_id("a1") is None
    assert reg.offers("action") == {"echo"}
    b.msg(b"p2", m.Goodbye("done"))
    assert reg.offers("action") == frozenset()


def test_best_actor_stops_early_but_picks_what_a_full_scan_picks() -> None:
    """best_actor stops at the first serving actor with the largest capacity free; a full scan (the most
    free credit, the first on ties) must agree under random capacities, rebids, held work and goodbyes."""
    rng = random.Random(3)
    b = Broker()
    reg = b.s._sessions
    for i in range(40):
        tools = ("echo",) if i % 3 else ("echo", "sleep")
        b.hello(b"p%d" % i, f"a{i}", tools)
    for step in range(400):
        sess = rng.choice(list(reg.actors.values()))
        r = rng.random()
        if r < 0.3:
            reg.rebid(sess, rng.randrange(0, 5))
        elif r < 0.6:
            sess.held = {f"w{step}-{j}" for j in range(rng.randrange(0, 3))}
        elif r < 0.65 and len(reg.actors) > 5:
            reg.close_actor(sess.peer, 0.0)
        for key in (("action", "echo"), ("action", "sleep")):
            want, most = None, 0
            for s in reg.actors.values():
                if s.free > most and s.serves(*key):
                    want, most = s, s.free
            assert reg.best_actor(key) is want


def test_no_actor_is_declared_dead_on_a_tick_the_shell_marks_behind() -> None:
    # the shell stopped reading at its per-pass limit: the silent actor's heartbeat may be among the unread frames
    b = Broker()
    b.hello(b"p1", "a1")
    b.now = 3.5
    out = b.s.handle(Tick(behind=True), b.now)
    assert not expiries(out) and [s.actor_id for s in b.s.actors.values()] == ["a1"]
    assert b.s.stats["ticks_behind"] == 1
    b.msg(b"p1", m.Heartbeat())  # it was alive: its beat was waiting
    assert not expiries(b.tick(0.25))
    lost = [b.now for _ in range(20) if expiries(b.tick(0.25), b"p1")]  # silent from now on: lost on time
    assert lost == [6.75]


def test_a_lost_actor_does_not_make_the_broker_offer_an_empty_queue_to_every_other_actor() -> None:
    # each loss offered queued work to every actor with free credit: with nothing queued that was a scan of all
    # actors per loss, and a wave of losses at 19,000 actors stalled the loop into a collapse (bench control_plane)
    b = Broker()
    for i in range(50):
        b.hello(b"p%d" % i, f"a{i}")
    fills: list[str] = []
    real = b.s._dispatch.fill
    b.s._dispatch.fill = lambda sess, now, out: (fills.append(sess.actor_id), real(sess, now, out))[1]
    b.msg(b"p0", m.Goodbye("gone"))
    for _ in range(20):  # the other 49 fall silent and expire together
        b.tick(0.25)
    assert b.s.stats["actors_expired"] == 49 and fills == []
    b.hello(b"p99", "a99")  # with work queued that nobody serves, a loss still offers it to the others
    b.msg(b"c", m.ClientHello("c1", 1))
    b.msg(b"c", m.Submit("r1", "action", "sleep", {}))
    b.msg(b"p98", m.ActorHello("a98", "h", "a98", 1, {"action": ["echo"]}, ["action"], 1))
    b.msg(b"p98", m.Goodbye("gone"))
    assert "a99" in fills


def test_the_idle_heartbeat_defaults_to_three_heartbeats_and_is_never_shorter_than_one() -> None:
    import pytest

    assert BrokerConfig().idle_beat_s == 3.0 and BrokerConfig(heartbeat_s=2.0).idle_beat_s == 6.0
    assert BrokerConfig(idle_heartbeat_s=1.0).idle_beat_s == 1.0  # every actor beaten alike, as before
    with pytest.raises(ValueError, match="idle_heartbeat_s .* must be at least heartbeat_s"):
        BrokerConfig(idle_heartbeat_s=0.5)
    (w,) = [c.msg for c in BrokerState(BrokerConfig(heartbeat_s=0.5)).handle(
        PeerMessage(b"p", m.ActorHello("a", "h", "s", 1, {"action": ["echo"]}, ["action"], 1)), 0.0)
        if isinstance(getattr(c, "msg", None), m.Welcome)]
    assert (w.heartbeat_s, w.idle_heartbeat_s) == (0.5, 1.5)  # the actor learns both from its Welcome
