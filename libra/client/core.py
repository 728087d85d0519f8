"""``ClientCore``: the client's pure core. ``handle(event, now) -> list[Action]``.

No sockets, threads, event loop or clocks: time comes in as ``now`` (monotonic seconds, the shell's clock) and
everything the client wants done comes out as an action. The same object runs inside the threaded client
(``sync.py``), the asyncio client (``aio.py``) and the unit tests; the shells own only the sockets, the
threads or the event loop, the futures and the clock.

What the core holds:

- the pending table: every request sent and not answered yet (``pending``: request id -> :class:`Call`), with
  its encoded frames (resent as is after a reconnect: same request id, never run twice) and an opaque
  ``waiter`` (the shell's future or event), which the core hands back in :class:`Resolve`;
- the deadlines (``deadlines``: a heap of ``(at, seq, request id, call)``; one timer armed for the earliest:
  :class:`ArmTimer`); a call whose deadline passes fails with ``ToolTimeout``, or ``BrokerUnreachable`` when the
  broker never welcomed this client, saying how long it really waited;
- the reconnect gate (``common.ReconnectGate``), the welcome state and the frame limit from the welcome;
- direct-lease routing (``direct.DirectRoutes``): which calls go straight to an actor, and what happens to them
  when their lease ends;
- the keepalive: one heartbeat while calls wait and the broker is silent, and idle leases given back;
- the broker address list (``urls``: a primary and standbys). With more than one address, a broker silent for
  ``ROTATE_AFTER_PINGS`` ping intervals while calls wait (or before its first welcome) is left for the next
  address, round robin (:class:`MoveBroker`): the shell opens a new socket there, the core says hello, drops
  the direct leases of the old broker's session and, after the welcome, resends each unanswered request once
  (the ``ReconnectGate`` path: same request ids). A ``Disconnect`` from a live broker never moves the client.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Any, Union

from libra.protocol import encode
from libra.protocol import messages as m

from .common import ReconnectGate, RequestIds, encode_checked, result_or_error, served_timeout, unreachable
from .direct import LEASE_ENDED, DirectRoutes
from .errors import BrokerUnreachable, ProtocolRejected, ToolTimeout

__all__ = [
    "Action", "ArmTimer", "Ask", "Call", "Cancel", "ClientCore", "Connect", "Deadline", "Event", "MoveBroker",
    "ROTATE_AFTER_PINGS", "Received", "Resend", "Resolve", "SendBroker", "SendDirect", "Submit", "Tick", "Welcomed",
]

#: With several broker addresses, the client moves to the next after this many ping intervals (``ping_s``) of
#: silence while calls wait: long enough that one lost ping or a busy broker does not move it (a restarted
#: broker answers the first ping with ``Disconnect``), short enough to follow a standby's takeover.
ROTATE_AFTER_PINGS = 3


# ---------------------------------------------------------------------------------------------------- events
@dataclass(slots=True)
class Connect:
    """Say hello to the broker (the first time; a reconnect says it by itself)."""


@dataclass(slots=True)
class Submit:
    """A call submitted: ``kind``/``name`` with ``args``, due by ``at`` (its start + ``timeout``). ``explicit_id``:
    the caller chose ``request_id`` (such calls always go through the broker, whose record makes them
    idempotent). Raises BadRequest / PayloadTooLarge, before anything is recorded, for a request that cannot
    be sent."""

    request_id: str
    kind: str
    name: str
    args: Any
    trajectory: str | None
    timeout: float
    at: float
    waiter: Any
    explicit_id: bool = False


@dataclass(slots=True)
class Ask:
    """A request-style message (``StatusRequest``, ``DirectRequest``, ``JobSubmit``, ...) waiting for its one
    reply; due by ``at`` when given (else the shell times it out and says :class:`Cancel`)."""

    msg: Any
    waiter: Any
    timeout: float = 0.0
    at: float | None = None


@dataclass(slots=True)
class Received:
    """Decoded messages from the broker (``direct=False``) or from an actor's direct socket."""

    msgs: list[Any]
    direct: bool = False


@dataclass(slots=True)
class Tick:
    """Keepalive: a heartbeat when calls wait and the broker is silent; idle leases go back."""


@dataclass(slots=True)
class Deadline:
    """The armed timer fired (or a waiter saw its deadline pass): expire every call due by ``now``."""


@dataclass(slots=True)
class Cancel:
    """Forget request ``request_id`` (its caller gave up): its reply, if one comes, is dropped."""

    request_id: str


Event = Union[Connect, Submit, Ask, Received, Tick, Deadline, Cancel]


# --------------------------------------------------------------------------------------------------- actions
@dataclass(slots=True)
class SendBroker:
    """Send ``frames`` to the broker. ``urgent``: a control message, sent at once rather than batched."""

    frames: list[bytes]
    urgent: bool = False


@dataclass(slots=True)
class SendDirect:
    """Send a direct call's ``frames`` to the actor at ``endpoint`` (one socket per endpoint)."""

    endpoint: str
    frames: list[bytes]


@dataclass(slots=True)
class Resend:
    """A reconnect is complete: resend these requests (paced, in order; queued sends are among them)."""

    frames: list[list[bytes]]


@dataclass(slots=True)
class Resolve:
    """The call behind ``waiter`` has its answer: a result, or a typed error (a ``LibraError``) to raise."""

    waiter: Any
    value: Any


@dataclass(slots=True)
class ArmTimer:
    """Deliver :class:`Deadline` at ``at`` (replaces the timer armed before)."""

    at: float


@dataclass(slots=True)
class Welcomed:
    """The broker welcomed this client (``True``) or forgot it (``False``): for the shell's connected flag."""

    value: bool


@dataclass(slots=True)
class MoveBroker:
    """Close the broker socket and open one to ``url`` (index ``address`` of the address list): the broker
    before it was silent. Comes before the hello sent there."""

    address: int
    url: str


Action = Union[SendBroker, SendDirect, Resend, Resolve, ArmTimer, Welcomed, MoveBroker]


@dataclass(slots=True)
class Call:
    """One request in flight: the message, its frames as sent, its deadline and the shell's waiter."""

    msg: Any
    frames: list[bytes]
    waiter: Any
    timeout: float = 0.0
    at: float | None = None


# ------------------------------------------------------------------------------------------------------ core
class ClientCore:
    """One client's state (see the module docstring). ``curve``: the connection uses CURVE (named in the
    BrokerUnreachable hint); ``direct``: route calls over direct leases (``libra.client.direct``)."""

    def __init__(self, broker_url: str, client_id: str, pid: int, max_frame_bytes: int, *, curve: bool = False,
                 direct: bool = False, ping_s: float = 1.0, last_rx: float = 0.0,
                 urls: list[str] | None = None) -> None:
        self.urls = list(urls or [broker_url])  # the broker address list; broker_url is the one in use
        self.address = self.urls.index(broker_url) if broker_url in self.urls else 0
        self.moved_at: float | None = None  # when the hello went to the current address (None: not yet)
        self.broker_url = broker_url
        self.client_id = client_id
        self.pid = pid
        self.max_frame_bytes = max_frame_bytes
        self.curve = curve
        self.ids = RequestIds(client_id)
        self.pending: dict[str, Call] = {}
        self.deadlines: list[tuple[float, int, str, Call]] = []  # heap
        self._seq = itertools.count()
        self.timer_at: float | None = None  # the timer the shell holds armed
        self.welcomed = False
        self.gate = ReconnectGate(retry_s=2 * ping_s)
        self.limit = max_frame_bytes  # the smaller of ours and the broker's (from its welcome)
        self.direct = DirectRoutes() if direct else None
        self.ping_s = ping_s  # while requests wait, ping a silent broker this often (detects a restart)
        self.last_rx = last_rx
        self.last_ping = 0.0
        self.next_idle_check = 0.0

    def handle(self, event: Event, now: float) -> list[Action]:
        t = type(event)
        if t is Received:
            return self._received(event, now)  # type: ignore[arg-type]
        if t is Submit:
            return self._submit(event, now)  # type: ignore[arg-type]
        if t is Ask:
            return self._ask(event)  # type: ignore[arg-type]
        if t is Deadline:
            return self._expire_due(now)
        if t is Tick:
            return self._tick(now)
        if t is Cancel:
            self._forget(event.request_id)  # type: ignore[union-attr]
            return []
        if t is Connect:
            self.moved_at = now
            return [SendBroker(encode(m.ClientHello(self.client_id, self.pid)), urgent=True)]
        raise TypeError(f"ClientCore.handle: unknown event {type(event).__name__}")

    # -------------------------------------------------------------------------------------------- submitting
    def _submit(self, ev: Submit, now: float) -> list[Action]:
        """Route one call: straight to an actor when a direct lease covers it, else through the broker."""
        out: list[Action] = []
        d = self.direct
        lease, ask = (None, False) if d is None else d.route(ev.kind, ev.name, ev.trajectory, ev.explicit_id, now)
        served = served_timeout(ev.timeout)
        if lease is not None:
            msg: Any = m.DirectCall(ev.request_id, lease.lease_id, ev.kind, ev.name, ev.args, served)
        else:
            msg = m.Submit(ev.request_id, ev.kind, ev.name, ev.args, ev.trajectory, served)
        frames = encode_checked(msg, self.limit)  # BadRequest / PayloadTooLarge: nothing recorded or sent
        if ask and d is not None:
            lrid = self.ids.next()
            d.asked(lrid, ev.name, now)
            out.append(SendBroker(encode(m.LeaseRequest(lrid, "action", ev.name))))
        call = Call(msg, frames, ev.waiter, ev.timeout, ev.at)
        self.pending[ev.request_id] = call
        if lease is not None:
            d.sent(ev.request_id, lease)  # type: ignore[union-attr]
            out.append(SendDirect(lease.endpoint, frames))
        else:
            out.append(SendBroker(frames))
        self._add_deadline(ev.request_id, call, out)
        return out

    def _ask(self, ev: Ask) -> list[Action]:
        frames = encode_checked(ev.msg, self.limit)
        call = Call(ev.msg, frames, ev.waiter, ev.timeout, ev.at)
        self.pending[ev.msg.request_id] = call
        out: list[Action] = [SendBroker(frames)]
        self._add_deadline(ev.msg.request_id, call, out)
        return out

    # --------------------------------------------------------------------------------------------- deadlines
    def _add_deadline(self, rid: str, call: Call, out: list[Action]) -> None:
        at = call.at
        if at is None:
            return
        heap = self.deadlines
        heapq.heappush(heap, (at, next(self._seq), rid, call))
        if len(heap) > 2 * len(self.pending) + 1024:  # answered calls' entries: drop them (amortised O(1))
            pending = self.pending
            heap[:] = [e for e in heap if pending.get(e[2]) is e[3]]
            heapq.heapify(heap)
        if self.timer_at is None or at < self.timer_at:
            self.timer_at = at
            out.append(ArmTimer(at))

    def _expire_due(self, now: float) -> list[Action]:
        """Expire every call whose deadline passed (skipping answered ones), then re-arm for the next."""
        self.timer_at = None
        out: list[Action] = []
        heap, pending = self.deadlines, self.pending
        while heap and heap[0][0] <= now:
            _, _, rid, call = heapq.heappop(heap)
            if pending.get(rid) is call:
                self._forget(rid)
                out.append(Resolve(call.waiter, self._timeout_error(rid, call, now)))
        while heap and pending.get(heap[0][2]) is not heap[0][3]:
            heapq.heappop(heap)
        if heap:
            self.timer_at = heap[0][0]
            out.append(ArmTimer(self.timer_at))
        return out

    def _timeout_error(self, rid: str, call: Call, now: float) -> Exception:
        """The call's deadline (its start + timeout: the caller's own, not stretched) passed without a reply:
        BrokerUnreachable if the broker never welcomed us, else ToolTimeout; either says how long it waited."""
        waited = now - (call.at or now) + call.timeout
        if not self.welcomed:
            named = self.broker_url if len(self.urls) == 1 else " or ".join(self.urls)
            return BrokerUnreachable(unreachable(named, self.curve, round(waited, 2)))
        return ToolTimeout(f"request {rid} got no reply within {call.timeout:g}s (gave up after {waited:.2f}s)")

    def _forget(self, rid: str) -> None:
        self.pending.pop(rid, None)
        if self.direct is not None:
            self.direct.answered(rid)

    # ------------------------------------------------------------------------------------------------- ticks
    def _tick(self, now: float) -> list[Action]:
        """A restarted broker does not know us; our ping makes it say Disconnect, and we then say hello again
        and resend every unanswered request (same ids: never run twice). Leases unused for a while go back
        (their actors' credit returns to the broker)."""
        if self._silent_too_long(now):
            return self._move(now)
        out: list[Action] = []
        if self.pending and now - self.last_rx > self.ping_s and now - self.last_ping > self.ping_s:
            self.last_ping = now
            out.append(SendBroker(encode(m.Heartbeat()), urgent=True))
        if self.direct is not None and now >= self.next_idle_check:
            self.next_idle_check = now + min(1.0, self.ping_s)
            for lease_id in self.direct.idle(now):
                out.append(SendBroker(encode(m.LeaseEnd(lease_id, "idle")), urgent=True))
        return out

    def _silent_too_long(self, now: float) -> bool:
        """Several addresses, calls waiting (or no welcome yet), and nothing from this one for
        ``ROTATE_AFTER_PINGS`` ping intervals since its hello: time to try the next."""
        if len(self.urls) < 2 or self.moved_at is None or not (self.pending or not self.welcomed):
            return False
        return now - max(self.last_rx, self.moved_at) > self.ping_s * ROTATE_AFTER_PINGS

    def _move(self, now: float) -> list[Action]:
        """Leave a silent broker for the next address: a new socket, a hello, and (after the welcome) each
        unanswered request resent once. The old session's direct leases are void (calls go via the broker)."""
        self.address = (self.address + 1) % len(self.urls)
        self.broker_url = self.urls[self.address]
        self.moved_at = self.last_ping = now
        self.welcomed = False
        self.gate.since = now  # the welcome that answers this hello completes a reconnect (Resend)
        if self.direct is not None:
            self.direct.reset()
        return [MoveBroker(self.address, self.broker_url), Welcomed(False),
                SendBroker(encode(m.ClientHello(self.client_id, self.pid)), urgent=True)]

    # ---------------------------------------------------------------------------------------------- receiving
    def _received(self, ev: Received, now: float) -> list[Action]:
        out: list[Action] = []
        if ev.direct:
            for msg in ev.msgs:
                if type(msg) is m.Reply:
                    self._direct_reply(msg, now, out)
            return out
        self.last_rx = now
        d = self.direct
        pending = self.pending
        for msg in ev.msgs:
            t = type(msg)
            if t is m.Reply or t is m.StatusReply:  # the hot path
                if d is not None and msg.request_id in d.asking:
                    self._lease_reply(msg, now, out)
                    continue
                call = pending.pop(msg.request_id, None)
                if call is not None:
                    out.append(Resolve(call.waiter, result_or_error(msg) if t is m.Reply else msg))
            else:
                self._control(msg, now, out)
        return out

    def _control(self, msg: Any, now: float, out: list[Action]) -> None:
        t = type(msg)
        d = self.direct
        if t is m.Welcome:
            self.limit = min(self.max_frame_bytes, msg.max_frame_bytes or self.max_frame_bytes)
            self.welcomed = True
            out.append(Welcomed(True))
            if self.gate.on_welcome():  # a reconnect is complete: resend each unanswered request once
                out.append(Resend([c.frames for c in self.pending.values() if type(c.msg) is not m.DirectCall]))
        elif t is m.LeaseEnd:
            if d is not None:  # a lost actor's unanswered calls go through the broker
                for rid in d.ended(msg.lease_id, msg.lost):
                    self._via_broker(rid, 1, out)
        elif t is m.Error:
            call = self.pending.pop(msg.request_id, None) if msg.request_id else None
            if call is not None:
                out.append(Resolve(call.waiter, ProtocolRejected(f"broker rejected request: {msg.message}")))
        elif t is m.Disconnect:
            # The broker does not know us (it restarted or expired us): one hello per reconnect; the
            # unanswered requests follow once, when the welcome comes (see ReconnectGate).
            if self.gate.on_disconnect(now):
                self.welcomed = False
                out.append(Welcomed(False))
                if d is not None:
                    d.reset()  # a new broker session knows none of our leases
                out.append(SendBroker(encode(m.ClientHello(self.client_id, self.pid)), urgent=True))

    def _lease_reply(self, msg: m.Reply, now: float, out: list[Action]) -> None:
        _, surplus = self.direct.on_lease_reply(msg, now)  # type: ignore[union-attr]
        if surplus is not None:
            out.append(SendBroker(encode(m.LeaseEnd(surplus, "surplus")), urgent=True))

    def _direct_reply(self, msg: m.Reply, now: float, out: list[Action]) -> None:
        """A direct call's reply: resolve it, or send the call via the broker if the actor refused it."""
        d = self.direct
        if d is None:
            return
        rid = msg.request_id
        if msg.error_code == LEASE_ENDED:  # refused before it ran: send it through the broker
            d.refused(rid, now)
            self._via_broker(rid, 0, out)
            return
        d.answered(rid)
        call = self.pending.get(rid)
        # not a direct call any more (sent through the broker after its lease was lost): the broker's reply,
        # which counts both runs in ``attempts``, is the one that answers it
        if call is not None and type(call.msg) is m.DirectCall:
            del self.pending[rid]
            out.append(Resolve(call.waiter, result_or_error(msg)))

    def _via_broker(self, rid: str, prior_attempts: int, out: list[Action]) -> None:
        """Send unanswered direct call ``rid`` through the broker instead (same request id)."""
        call = self.pending.get(rid)
        if call is None or type(call.msg) is not m.DirectCall:
            return
        c = call.msg
        call.msg = m.Submit(rid, c.kind, c.name, c.args, None, c.timeout_s, prior_attempts)
        call.frames = encode(call.msg)
        out.append(SendBroker(call.frames))
