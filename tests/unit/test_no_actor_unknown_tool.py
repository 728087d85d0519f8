"""Issue #28, item 3: with no actor connected at all, a call used to wait its whole timeout and end in
``ToolTimeout (attempts: 0)``. The broker now answers ``unknown_tool`` at once ("no actor is connected that
offers ..."), as it does when actors are connected and none offers the tool, once a registration window has
passed since its first tick or since its last actor left (the time an actor needs to notice a restarted
broker, back off and say hello again; work submitted before the actors start waits within it)."""

from __future__ import annotations

from libra.broker.events import PeerMessage, Send, Tick
from libra.broker.sessions import SessionRegistry
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m

CFG = BrokerConfig(heartbeat_s=1.0, liveness=3)  # window: 2 x 1 x 3 + 5 = 11 s
WINDOW = 11.0


def _submit(s: BrokerState, rid: str, now: float) -> list[m.Reply]:
    out = s.handle(PeerMessage(b"c", m.Submit(rid, "action", "echo", 1, None, 60.0)), now)
    return [c.msg for c in out if isinstance(c, Send) and isinstance(c.msg, m.Reply)]


def _broker() -> BrokerState:
    s = BrokerState(CFG)
    s.handle(Tick(), 0.0)  # the broker's first tick: its registration window starts
    s.handle(PeerMessage(b"c", m.ClientHello("c1", 1)), 0.0)
    return s


def _actor(s: BrokerState, peer: bytes, now: float) -> None:
    s.handle(PeerMessage(peer, m.ActorHello("a1", "h", "s", 1, {"action": ["echo"]}, ["action"], 1, {}, [])), now)


def test_a_call_with_no_actor_connected_is_refused_at_once_after_the_registration_window() -> None:
    s = _broker()
    assert _submit(s, "early", 1.0) == []  # within the window: it waits for the actors to come
    (r,) = _submit(s, "late", WINDOW + 0.5)
    assert not r.ok and r.error_code == "unknown_tool"
    assert "no actor is connected that offers action 'echo'" in r.error
    assert s.stats["unknown_tool"] == 1
    # the early call still waits; an actor that joins takes it
    _actor(s, b"p1", WINDOW + 1.0)
    assert len(s.actors[b"p1"].held) == 1


def test_the_window_starts_again_when_the_last_actor_leaves() -> None:
    s = _broker()
    _actor(s, b"p1", 0.5)
    s.handle(PeerMessage(b"p1", m.Goodbye("restarting")), 100.0)
    assert _submit(s, "r1", 101.0) == []  # its actor may be on its way back
    (r,) = _submit(s, "r2", 100.0 + WINDOW + 0.1)
    assert r.error_code == "unknown_tool"


def test_actors_connected_none_offering_is_still_refused_at_once() -> None:
    s = _broker()
    s.handle(PeerMessage(b"p1", m.ActorHello("a1", "h", "s", 1, {"action": ["bash"]}, ["action"], 1, {}, [])), 0.1)
    (r,) = _submit(s, "r1", 0.2)
    assert r.error_code == "unknown_tool" and "offered: bash" in r.error


def test_no_tick_yet_or_actors_expected_keeps_waiting() -> None:
    reg = SessionRegistry(1.0, 3, 300.0)
    assert reg.refusal("action", "echo", 1e6, expecting=False) is None  # no tick: the clock has not started
    reg.on_tick(0.0)
    assert reg.refusal("action", "echo", WINDOW + 1, expecting=True) is None  # a hosted job's actors will come
    assert "no actor is connected" in (reg.refusal("action", "echo", WINDOW + 1, expecting=False) or "")
