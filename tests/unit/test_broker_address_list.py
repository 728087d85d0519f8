"""A broker address list (a primary and standbys): parsing, and the pure cores' decision to move to the next
address. An actor (``ActorState``) and a client (``ClientCore``) move when the broker they use is SILENT; a live
broker's ``Disconnect`` (it restarted and forgot them) keeps them where they are; one address never moves."""

from __future__ import annotations

import pytest

from libra.actors.state import ActorIdentity, ActorState, Connect, Note, Received, SendMsg, Start, Tick, WorkDone
from libra.client import BadAddress
from libra.client.core import (ROTATE_AFTER_PINGS, ClientCore, Connect as ClientConnect, MoveBroker,
                               Received as ClientReceived, Resend, SendBroker, Submit, Tick as ClientTick)
from libra.client.direct import DirectLease
from libra.client.probe import port_accepts
from libra.protocol import decode
from libra.protocol import messages as m
from libra.transport.endpoints import address_problem, endpoints_problem, parse_endpoint, parse_endpoints

A, B, C = "tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555", "ipc:///tmp/libra-b3.sock"


# ---------------------------------------------------------------------------------------------- parsing
def test_a_list_is_split_at_commas_or_taken_as_a_sequence_in_order() -> None:
    assert parse_endpoints(f"{A},{B}") == [A, B]
    assert parse_endpoints([A, B, C]) == parse_endpoints((A, B, C)) == [A, B, C]
    assert parse_endpoints(A) == [parse_endpoint(A)]


def test_one_bad_address_says_exactly_what_it_said_before() -> None:
    assert endpoints_problem("127.0.0.1:5555") == address_problem("127.0.0.1:5555")
    with pytest.raises(BadAddress) as exc:
        parse_endpoints("localhost")
    assert str(exc.value) == address_problem("localhost")


@pytest.mark.parametrize("bad, item, why", [
    (f"{A},10.0.0.2:5555", "item 2 of 2", "no scheme"),
    (f"{A},", "item 2 of 2", "empty"),
    (f"{A}, {B}", "item 2 of 2", "spaces"),
    ([A, "http://x:1", B], "item 2 of 3", "not a ZeroMQ transport"),
    (f"tcp://*:5555,{B}", "item 1 of 2", "for a bind"),
])
def test_a_bad_item_is_named_with_its_place_and_its_fault(bad: object, item: str, why: str) -> None:
    with pytest.raises(BadAddress) as exc:
        parse_endpoints(bad)
    assert item in str(exc.value) and why in str(exc.value) and isinstance(exc.value, ValueError)


def test_an_empty_list_is_refused() -> None:
    with pytest.raises(BadAddress):
        parse_endpoints([])


def test_the_probe_of_a_list_reports_none_when_no_item_is_tcp() -> None:
    assert port_accepts(f"{C},ipc:///tmp/other.sock") is None


# -------------------------------------------------------------------------------------------- the actor
def _actor(addresses: int) -> ActorState:
    ident = ActorIdentity("h/cpu0", "h", "cpu0", 42, {"action": ["echo"]})
    return ActorState(ident, ["action"], 2, heartbeat_s=1.0, liveness=3, addresses=addresses)


def _connects(out: list) -> list[int]:
    return [c.address for c in out if type(c) is Connect]


def _silence(a: ActorState, since: float) -> tuple[list, float]:
    """Let the broker be silent past its liveness window, then the back-off: the commands of both ticks."""
    t = since + a.heartbeat_s * a.liveness + 0.01
    out = a.handle(Tick(), t)
    t += a.backoff_s + 0.01  # the back-off before the next hello
    return out + a.handle(Tick(), t), t


def test_a_silent_broker_moves_the_actor_to_the_next_address_round_robin() -> None:
    a = _actor(3)
    assert _connects(a.handle(Start(), 0.0)) == [0]
    a.handle(Received(m.Welcome("s1", "b1", 1.0, 3, 1 << 20)), 0.0)
    out, t = _silence(a, 0.0)
    assert _connects(out) == [1]
    (note,) = [c for c in out if type(c) is Note and c.event == "broker_silent"]
    assert (note.fields["address"], note.fields["next_address"]) == (0, 1)
    out, t = _silence(a, t)  # the next address is silent too (a standby not yet serving): on to the third
    assert _connects(out) == [2]
    out, t = _silence(a, t)
    assert _connects(out) == [0]  # round robin


def test_work_held_across_a_move_is_offered_to_the_new_broker_in_the_hello() -> None:
    a = _actor(2)
    a.handle(Start(), 0.0)
    a.handle(Received(m.Welcome("s1", "b1", 1.0, 3, 1 << 20)), 0.0)
    a.handle(Received(m.Assign("w1", 7, 1, "action", "echo", {})), 0.5)
    a.handle(Received(m.Assign("w2", 8, 1, "action", "echo", {})), 0.5)
    a.handle(WorkDone("w2", 8, True, {}), 0.6)  # sent just before the broker went silent
    out, _ = _silence(a, 0.6)
    (hello,) = [c.msg for c in out if type(c) is SendMsg and type(c.msg) is m.ActorHello]
    assert _connects(out) == [1] and sorted(hello.held) == [["w1", 7, 1], ["w2", 8, 1]]


def test_a_live_brokers_disconnect_keeps_the_actor_on_the_same_address() -> None:
    a = _actor(2)
    a.handle(Start(), 0.0)
    a.handle(Received(m.Welcome("s1", "b1", 1.0, 3, 1 << 20)), 0.0)
    out, t = _silence(a, 0.0)
    assert _connects(out) == [1]
    a.handle(Received(m.Welcome("s2", "b2", 1.0, 3, 1 << 20)), t)
    assert _connects(a.handle(Received(m.Disconnect("restarted")), t + 0.5)) == [1]


def test_one_address_never_moves() -> None:
    a = _actor(1)
    a.handle(Start(), 0.0)
    t = 0.0
    for _ in range(3):
        out, t = _silence(a, t)
        assert _connects(out) == [0] and "address" not in [c for c in out if type(c) is Note][0].fields


# ------------------------------------------------------------------------------------------- the client
PING = 1.0
WELCOME = m.Welcome("s1", "b1", 1.0, 3, 1 << 20)


def _client(urls: list[str], direct: bool = False) -> ClientCore:
    core = ClientCore(urls[0], "c1", 42, 64 << 20, ping_s=PING, urls=urls, direct=direct)
    core.handle(ClientConnect(), 0.0)
    core.handle(ClientReceived([WELCOME]), 0.0)
    return core


def _submit(core: ClientCore, rid: str, now: float) -> None:
    core.handle(Submit(rid, "action", "echo", {"n": rid}, None, 60.0, now + 60.0, rid), now)


def _moves(out: list) -> list[str]:
    return [a.url for a in out if type(a) is MoveBroker]


def test_a_client_moves_after_rotate_after_pings_of_silence_while_calls_wait() -> None:
    core = _client([A, B])
    _submit(core, "r1", 1.0)
    _submit(core, "r2", 1.0)
    limit = PING * ROTATE_AFTER_PINGS  # silent since the welcome at 0.0
    for t in (1.0, 2.0, limit):
        assert _moves(core.handle(ClientTick(), t)) == []  # pings, but stays
    out = core.handle(ClientTick(), limit + 0.01)
    assert _moves(out) == [B] and core.broker_url == B and not core.welcomed
    assert type(out[0]) is MoveBroker  # the socket moves before the hello goes
    (hello,) = [decode(a.frames).msg for a in out if type(a) is SendBroker]
    assert type(hello) is m.ClientHello
    assert _moves(core.handle(ClientTick(), limit + 1.0)) == []  # the silence clock restarted at the move
    out = core.handle(ClientReceived([WELCOME]), limit + 1.5)
    (resend,) = [a for a in out if type(a) is Resend]
    assert sorted(decode(f).msg.request_id for f in resend.frames) == ["r1", "r2"]  # the same ids, once
    assert [a for a in core.handle(ClientReceived([WELCOME]), limit + 1.6) if type(a) is Resend] == []


def test_a_client_goes_round_robin_and_drops_the_old_sessions_direct_leases() -> None:
    core = _client([A, B, C], direct=True)
    lease = DirectLease("l5", "echo", "h/cpu0", "tcp://10.0.0.9:4000", 0.0)
    core.direct.by_id[lease.lease_id] = core.direct.by_tool["echo"] = lease  # type: ignore[union-attr]
    core.direct.asking["lr"] = ("echo", 0.0)  # type: ignore[union-attr]
    _submit(core, "r1", 0.5)
    t = 0.0
    seen = []
    for _ in range(3):
        t += PING * ROTATE_AFTER_PINGS + 0.01
        seen += _moves(core.handle(ClientTick(), t))
    d = core.direct
    assert seen == [B, C, A] and not d.by_id and not d.by_tool and not d.asking  # type: ignore[union-attr]


def test_a_live_brokers_disconnect_does_not_move_the_client() -> None:
    core = _client([A, B])
    _submit(core, "r1", 0.5)
    out = core.handle(ClientReceived([m.Disconnect("restarted")]), 1.0)
    assert _moves(out) == [] and core.broker_url == A
    assert any(type(decode(a.frames).msg) is m.ClientHello for a in out if type(a) is SendBroker)


def test_no_move_with_one_address_or_with_nothing_waiting() -> None:
    one = _client([A])
    _submit(one, "r1", 0.5)
    idle = _client([A, B])
    for t in (5.0, 50.0, 500.0):
        assert _moves(one.handle(ClientTick(), t)) == [] and _moves(idle.handle(ClientTick(), t)) == []


def test_an_unanswered_first_hello_moves_the_client_too() -> None:
    core = ClientCore(A, "c1", 42, 64 << 20, ping_s=PING, urls=[A, B])
    assert _moves(core.handle(ClientTick(), 100.0)) == []  # no hello yet: nothing to time
    core.handle(ClientConnect(), 100.0)
    assert _moves(core.handle(ClientTick(), 100.0 + PING * ROTATE_AFTER_PINGS + 0.01)) == [B]


# ------------------------------------------------------------------------------------------- the wiring
def test_the_cli_and_the_supervisor_take_a_list_and_name_a_bad_item(capsys: pytest.CaptureFixture) -> None:
    from libra.actors.supervisor import Supervisor
    from libra.cli import _bad_broker

    assert _bad_broker("status", f"{A},{B}") is None
    assert _bad_broker("status", f"{A},nope") == 2 and "item 2 of 2" in capsys.readouterr().err
    sup = Supervisor([A, B], ["cpu0"])
    argv = sup.children[0].argv
    assert argv[argv.index("--broker") + 1] == f"{A},{B}"
    with pytest.raises(BadAddress):
        Supervisor(f"{A},{B}:x", ["cpu0"])


def test_no_broker_at_any_address_is_reported_naming_every_address() -> None:
    from libra.client import BrokerUnreachable, Client
    from libra.local import free_port

    urls = [f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"]
    with pytest.raises(BrokerUnreachable) as exc:
        Client(urls, connect_timeout=0.2)
    assert f"{urls[0]} or {urls[1]}" in str(exc.value) and "is it running there?" in str(exc.value)
