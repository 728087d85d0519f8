"""Two supervisors on one host: the broker refuses an actor id that another supervisor run holds live,
instead of letting the two knock each other off; a restarted slot of the same run still replaces its session."""

from __future__ import annotations

from libra.actors.state import ActorIdentity, ActorState, Connect, Note, Received, Start, Tick
from libra.broker.events import Log, PeerMessage, Send, Tick as BrokerTick
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m

OLD, NEW = b"sock-old", b"sock-new"


def hello(instance: str, pid: int) -> m.ActorHello:
    return m.ActorHello("h/cpu0", "h", "cpu0", pid, {"action": ["echo"]}, ["action"], 2, {"instance": instance})


def broker() -> BrokerState:
    s = BrokerState(BrokerConfig(heartbeat_s=1.0, liveness=3))
    s.handle(PeerMessage(OLD, hello("run-a", 100)), 0.0)
    return s


def test_a_live_id_of_another_supervisor_run_is_refused() -> None:
    s = broker()
    out = s.handle(PeerMessage(NEW, hello("run-b", 200)), 1.0)
    (d,) = [c.msg for c in out if isinstance(c, Send) and c.peer == NEW]
    assert isinstance(d, m.Disconnect) and d.code == "actor_id_in_use"
    assert "pid 100" in d.reason and "--actor-id-prefix" in d.reason
    assert any(isinstance(c, Log) and c.event == "actor_id_in_use" for c in out)
    assert not any(isinstance(c, Send) and c.peer == OLD for c in out)  # the live actor is left alone
    assert [a.pid for a in s.actors.values()] == [100] and s.stats["hellos_refused"] == 1
    s.validate()


def test_a_restarted_slot_of_the_same_run_replaces_its_session() -> None:
    s = broker()
    out = s.handle(PeerMessage(NEW, hello("run-a", 300)), 1.0)
    assert any(isinstance(c, Send) and c.peer == NEW and isinstance(c.msg, m.Welcome) for c in out)
    assert [a.pid for a in s.actors.values()] == [300]


def test_an_id_whose_session_went_silent_can_be_taken_over() -> None:
    s = broker()
    s.handle(BrokerTick(), 2.0)
    out = s.handle(PeerMessage(NEW, hello("run-b", 200)), 3.5)  # silent past liveness x heartbeat (3 s)
    assert any(isinstance(c, Send) and c.peer == NEW and isinstance(c.msg, m.Welcome) for c in out)
    assert [a.pid for a in s.actors.values()] == [200]


def test_a_refused_actor_backs_off_before_it_says_hello_again() -> None:
    a = ActorState(ActorIdentity("h/cpu0", "h", "cpu0", 200, {"action": ["echo"]}, {"instance": "run-b"}),
                   ["action"], 2)
    a.handle(Start(), 0.0)
    out = a.handle(Received(m.Disconnect("actor id 'h/cpu0' is already live", "actor_id_in_use")), 0.1)
    assert not any(isinstance(c, Connect) for c in out)  # no hello storm
    (note,) = [c for c in out if isinstance(c, Note)]
    assert note.event == "actor_id_refused" and note.level == "error"
    assert not any(isinstance(c, Connect) for c in a.handle(Tick(), 0.1 + a.initial_backoff_s / 2))
    assert any(isinstance(c, Connect) for c in a.handle(Tick(), 0.1 + a.initial_backoff_s + 0.01))
