"""The client's pure core (``libra.client.core.ClientCore``) alone: events in, actions out. No socket, thread,
event loop or clock: every ``now`` is given, and what the core wants sent or resolved is read off its actions."""

from __future__ import annotations

import pytest

from libra.client import BadRequest, BrokerUnreachable, PayloadTooLarge, ProtocolRejected, ToolResult, ToolTimeout
from libra.client.core import (ArmTimer, Ask, Cancel, ClientCore, Connect, Deadline, Received, Resend, Resolve,
                               SendBroker, SendDirect, Submit, Tick, Welcomed)
from libra.client.direct import LEASE_ENDED
from libra.protocol import decode
from libra.protocol import messages as m

URL = "tcp://127.0.0.1:5555"
WELCOME = m.Welcome("s1", "b1", 1.0, 3, 1 << 20)


def _core(**kw) -> ClientCore:
    return ClientCore(URL, "c1", 42, 64 << 20, **kw)


def _sent(actions: list) -> list:
    """The messages the actions send (to the broker or an actor), decoded, in order."""
    return [decode(a.frames).msg for a in actions if type(a) in (SendBroker, SendDirect)]


def _submit(core: ClientCore, rid: str, now: float, timeout: float = 10.0, waiter: object = None,
            name: str = "echo", args: object = 1) -> list:
    return core.handle(Submit(rid, "action", name, args, None, timeout, now + timeout, waiter or rid), now)


def _resolved(actions: list) -> dict:
    return {a.waiter: a.value for a in actions if type(a) is Resolve}


def test_a_call_goes_to_the_broker_arms_its_deadline_and_its_reply_resolves_it() -> None:
    core = _core()
    hello = core.handle(Connect(), 0.0)
    assert [type(x) for x in _sent(hello)] == [m.ClientHello] and hello[0].urgent
    out = _submit(core, "c1:1", 100.0, timeout=4.0, waiter="w1")
    (sub,) = _sent(out)
    assert type(sub) is m.Submit and sub.request_id == "c1:1" and sub.args == 1
    assert sub.timeout_s < 4.0  # the server times out first, so its timeout reply arrives in time
    assert ArmTimer(104.0) in out and set(core.pending) == {"c1:1"}
    done = core.handle(Received([m.Reply("c1:1", True, {"x": 1}, work_id="w", attempts=1, actor_id="a")]), 101.0)
    assert _resolved(done) == {"w1": ToolResult({"x": 1}, "w", 1, "a", 0.0)}
    assert not core.pending
    assert core.handle(Deadline(), 104.0) == []  # answered: nothing expires
    assert core.handle(Received([m.Reply("c1:1", True, 2)]), 105.0) == []  # a late duplicate: dropped


def test_a_failed_reply_and_a_broker_error_resolve_with_typed_errors() -> None:
    core = _core()
    _submit(core, "r1", 0.0)
    _submit(core, "r2", 0.0)
    out = core.handle(Received([m.Reply("r1", False, error_code="unknown_tool", error="no such tool"),
                                m.Error("bad", "garbled", request_id="r2")]), 1.0)
    got = _resolved(out)
    assert isinstance(got["r1"], Exception) and getattr(got["r1"], "code", "") == "unknown_tool"
    assert isinstance(got["r2"], ProtocolRejected) and "garbled" in str(got["r2"])


@pytest.mark.parametrize("welcomed", [False, True])
def test_a_deadline_fails_the_call_with_what_happened_and_how_long_it_waited(welcomed: bool) -> None:
    core = _core()
    if welcomed:
        core.handle(Received([WELCOME]), 0.0)
    _submit(core, "r1", 10.0, timeout=3.0)
    _submit(core, "r2", 10.0, timeout=5.0)
    assert core.handle(Deadline(), 12.9) == [ArmTimer(13.0)]  # nothing due yet: the timer is armed again
    out = core.handle(Deadline(), 13.25)
    (err,) = _resolved(out).values()
    assert isinstance(err, ToolTimeout if welcomed else BrokerUnreachable)
    assert ("3.25" in str(err)) and ArmTimer(15.0) in out  # it waited 3.25 s; r2 is next
    assert set(core.pending) == {"r2"}


def test_an_earlier_deadline_rearms_the_timer_and_a_later_one_does_not() -> None:
    core = _core()
    assert ArmTimer(10.0) in _submit(core, "r1", 0.0, timeout=10.0)
    assert not [a for a in _submit(core, "r2", 0.0, timeout=20.0) if type(a) is ArmTimer]
    assert ArmTimer(5.0) in _submit(core, "r3", 0.0, timeout=5.0)


def test_a_request_that_cannot_be_sent_is_refused_and_leaves_nothing_behind() -> None:
    core = _core()
    with pytest.raises(BadRequest, match="cannot be sent"):
        _submit(core, "r1", 0.0, args=object())
    core.handle(Received([m.Welcome("s", "b", 1.0, 3, 1000)]), 0.0)  # the broker's limit is lower
    with pytest.raises(PayloadTooLarge) as info:
        _submit(core, "r2", 0.0, args=b"x" * 2000)
    assert info.value.limit == 1000
    assert not core.pending and not core.deadlines


def test_cancel_forgets_a_call_so_its_late_reply_resolves_nothing() -> None:
    core = _core()
    _submit(core, "r1", 0.0)
    assert core.handle(Cancel("r1"), 1.0) == []
    assert not core.pending
    assert core.handle(Received([m.Reply("r1", True, 1)]), 2.0) == []
    assert [a for a in core.handle(Deadline(), 20.0) if type(a) is Resolve] == []


def test_a_reconnect_says_hello_once_and_resends_each_waiting_request_once_after_the_welcome() -> None:
    core = _core()
    core.handle(Received([WELCOME]), 0.0)
    _submit(core, "r1", 1.0)
    ask = core.handle(Ask(m.StatusRequest("s1"), "ws"), 1.0)
    assert [type(x) for x in _sent(ask)] == [m.StatusRequest]
    out = core.handle(Received([m.Disconnect(), m.Disconnect()]), 2.0)  # the second is an echo
    assert Welcomed(False) in out and [type(x) for x in _sent(out)] == [m.ClientHello]
    assert not core.welcomed
    back = core.handle(Received([WELCOME]), 2.1)
    (resend,) = [a for a in back if type(a) is Resend]
    assert sorted(decode(f).msg.request_id for f in resend.frames) == ["r1", "s1"]
    assert Welcomed(True) in back and core.gate.reconnects == 1
    assert not [a for a in core.handle(Received([WELCOME]), 2.2) if type(a) is Resend]  # once per reconnect
    assert [type(x) for x in _sent(core.handle(Received([m.Disconnect()]), 2.3))] == [m.ClientHello]


def test_the_keepalive_pings_a_silent_broker_once_per_interval_only_while_calls_wait() -> None:
    core = _core(ping_s=1.0)
    core.handle(Received([WELCOME]), 0.0)
    assert core.handle(Tick(), 5.0) == []  # nothing waits: no ping
    _submit(core, "r1", 5.0)
    beat = core.handle(Tick(), 5.1)
    assert [type(x) for x in _sent(beat)] == [m.Heartbeat] and beat[0].urgent
    assert core.handle(Tick(), 5.5) == []  # pinged within the interval
    core.handle(Received([m.Reply("other", True, 1)]), 5.9)  # the broker spoke
    assert core.handle(Tick(), 6.5) == []
    assert [type(x) for x in _sent(core.handle(Tick(), 7.0))] == [m.Heartbeat]


def _leased(core: ClientCore, now: float = 0.0) -> None:
    """Ask for a lease on ``echo`` with a first call (answered by the broker), and grant it (the actor on
    another host: tcp)."""
    rid = f"first@{now}"
    lease_req, sub = _sent(_submit(core, rid, now))
    assert type(lease_req) is m.LeaseRequest and lease_req.name == "echo" and type(sub) is m.Submit
    grant = {"lease": "L1", "actor_id": "a1", "host": "elsewhere", "endpoint": "tcp://10.0.0.9:7001"}
    assert core.handle(Received([m.Reply(lease_req.request_id, True, grant)]), now + 0.1) == []
    assert rid in _resolved(core.handle(Received([m.Reply(rid, True, 0)]), now + 0.1))


def test_a_leased_tool_goes_straight_to_its_actor_whose_reply_resolves_the_call() -> None:
    core = _core(direct=True)
    _leased(core)
    out = _submit(core, "c1:9", 1.0, waiter="w9")
    (direct,) = [a for a in out if type(a) is SendDirect]
    assert direct.endpoint == "tcp://10.0.0.9:7001" and type(decode(direct.frames).msg) is m.DirectCall
    assert _resolved(core.handle(Received([m.Reply("c1:9", True, 5)], direct=True), 1.2))["w9"].output == 5
    explicit = core.handle(Submit("mine", "action", "echo", 1, None, 5.0, 6.0, "wx", True), 1.3)
    assert [type(x) for x in _sent(explicit)] == [m.Submit]  # an explicit request id: via the broker


def test_a_refused_direct_call_goes_via_the_broker_and_a_lost_actor_s_calls_count_one_attempt() -> None:
    core = _core(direct=True)
    _leased(core)
    _submit(core, "c1:5", 1.0)
    _submit(core, "c1:6", 1.0)
    refused = core.handle(Received([m.Reply("c1:5", False, error_code=LEASE_ENDED)], direct=True), 1.1)
    (again,) = _sent(refused)
    assert type(again) is m.Submit and again.request_id == "c1:5" and again.prior_attempts == 0
    _leased(core, 3.0)  # asked again once the pause after a refusal is over
    assert [type(a) for a in _submit(core, "c1:7", 4.0) if type(a) is not ArmTimer] == [SendDirect]
    lost = core.handle(Received([m.LeaseEnd("L1", "actor lost", lost=True)]), 4.1)
    assert [(x.request_id, x.prior_attempts) for x in _sent(lost)] == [("c1:7", 1)]
    late = core.handle(Received([m.Reply("c1:7", True, 1)], direct=True), 4.2)
    assert late == [] and "c1:7" in core.pending  # the broker's reply, counting both runs, answers it
    assert _resolved(core.handle(Received([m.Reply("c1:7", True, 1, attempts=2)]), 4.3))["c1:7"].attempts == 2


def test_idle_leases_go_back_on_the_keepalive_tick() -> None:
    core = _core(direct=True)
    core.direct.idle_s = 5.0
    _leased(core)
    assert core.handle(Tick(), 3.0) == []
    (end,) = _sent(core.handle(Tick(), 6.0))
    assert type(end) is m.LeaseEnd and end.lease_id == "L1" and end.reason == "idle"


def test_an_unknown_event_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="unknown event str"):
        _core().handle("tick", 0.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("module", ["core", "common"])
def test_the_core_imports_no_socket_thread_event_loop_or_clock(module: str) -> None:
    import ast
    from pathlib import Path

    import libra.client

    path = Path(libra.client.__file__).with_name(f"{module}.py")
    banned = {"asyncio", "logging", "os", "select", "socket", "threading", "time", "uuid", "zmq"}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    assert not found & banned, f"libra/client/{module}.py imports {sorted(found & banned)}"
