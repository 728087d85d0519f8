"""``ActorState``: the actor's pure core. ``handle(event, now) -> list[Command]``.

No sockets, threads or clocks. The runtime shell (``runtime.py``) feeds it what happened (a message
from the broker, a finished piece of work, an engine that finished reconfiguring, a timer tick) and
executes what it returns (send a message, (re)connect, start or cancel work, reconfigure the engine).

Lifecycle (``ActorPhase``)::

    connecting ──Welcome──► ready ──Directive──► draining ──(nothing running)──► switching
        ▲                     ▲                                                  │
        └──broker silent / Disconnect (back-off)                     Reconfigured┘ (DirectiveDone + Bid)

A directive that makes the slot a member (rank > 0) of a rollout TP group (``tp > 1``) leaves it bidding for
nothing until the next directive: the group's leader (rank 0) holds the one engine over the group's GPUs.

Liveness after Paranoid Pirate: any frame from the broker is a heartbeat; after ``liveness`` silent
intervals (``heartbeat_s`` while it holds broker work, ``idle_heartbeat_s`` from the ``Welcome`` while it holds
none: the broker beats idle actors less often) the actor abandons the session, waits a back-off that doubles up to ``max_backoff_s``, and
reconnects on a new socket. With a broker address list (``addresses > 1``: a primary and a standby) the
reconnect after a silence goes to the next address, round robin (``Connect.address``); a ``Disconnect`` from a
live broker (it restarted and forgot us) reconnects to the same one.

Work survives a lost session (a broker restart, a network blip): what runs keeps running, a result that
finishes without a session waits in ``unsent``, and so do the results sent in the last ``2 × idle heartbeat
× liveness`` seconds (a broker killed just after they left may never have recorded them). The next
``ActorHello`` lists all of it in ``held`` (``[work_id, lease, attempt]``); the broker adopts what it can
and revokes the rest, and after ``Welcome`` the actor sends the results it still holds. Work held without
a session past its budget is cancelled. Nothing is ever run twice because a session was lost.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from libra.protocol import messages as m

from .commands import CancelWork, Connect, Note, Reconfigure, SendMsg, StartWork
from .lending import LendCore, OwnerChanged
from .phases import _TRANSITIONS, ActorPhase, InvalidActorTransition
from .readings import GpuSampled, KvUse, kv_credit


# ---------------------------------------------------------------- events
@dataclass(frozen=True, slots=True)
class Start:
    """The runtime is up: connect and say hello."""


@dataclass(slots=True)  # not frozen: built per message on the hot path (see protocol.messages)
class Received:
    msg: Any


@dataclass(slots=True)  # not frozen: built per message on the hot path (see protocol.messages)
class WorkDone:
    work_id: str
    lease: int
    ok: bool
    output: Any = None
    error_code: str = ""
    error: str = ""
    duration_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Reconfigured:
    directive_id: int
    ok: bool = True
    error: str = ""
    capacity: int | None = None  # the engine's capacity in its new role, when it changed


@dataclass(frozen=True, slots=True)
class Tick:
    pass


@dataclass(frozen=True, slots=True)
class Stop:
    """Leave: hand back what has not started and say goodbye."""


@dataclass(slots=True)
class ActorIdentity:
    actor_id: str
    host: str
    slot: str
    pid: int
    capabilities: dict[str, list[str]]
    labels: dict[str, Any] = field(default_factory=dict)


def group_membership(config: dict[str, Any]) -> tuple[str, int, int]:
    """``(group, tp, rank)`` of a directive's rollout TP group (``("", 1, 0)`` when the directive puts the slot
    in none: another role, or TP 1). Rank 0 leads the group and holds its one engine; ranks > 0 are members."""
    tp = int(config.get("tp", 1) or 1)
    if config.get("role") != "rollout" or tp <= 1:
        return ("", 1, 0)
    return (str(config.get("group", "")), tp, int(config.get("rank", 0) or 0))


class ActorState:
    """The actor core. Mutated only through :meth:`handle`."""

    def __init__(self, ident: ActorIdentity, kinds: list[str], capacity: int, *, heartbeat_s: float = 1.0,
                 liveness: int = 3, initial_backoff_s: float = 0.1, max_backoff_s: float = 5.0,
                 kv_rebid_threshold: float = 0.1, addresses: int = 1) -> None:
        if not 0.0 <= kv_rebid_threshold <= 1.0:
            raise ValueError(f"kv_rebid_threshold must be within [0, 1], got {kv_rebid_threshold!r}")
        self.ident = ident
        self.kinds = [k for k in kinds if k in ident.capabilities]
        self.capacity = capacity  # what the last bid offered (the KV credit lowers it below base_capacity)
        self.base_capacity = capacity  # the role's slot count: the most it ever bids
        # a KvUse credit that moves by more than this fraction of base_capacity from the last bid is re-bid
        self.kv_rebid_threshold = kv_rebid_threshold
        self.rebids = 0
        self.heartbeat_s = heartbeat_s
        self.idle_heartbeat_s = heartbeat_s  # the broker's beat while we hold none of its work (from Welcome)
        self.liveness = liveness
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.backoff_s = initial_backoff_s
        self.phase = ActorPhase.CONNECTING
        self.running: dict[str, int] = {}  # work_id -> lease
        self.started: dict[str, tuple[int, float]] = {}  # running work_id -> (attempt, deadline)
        # results waiting for a session: work_id -> (result, attempt, deadline)
        self.unsent: dict[str, tuple[m.WorkResult, int, float]] = {}
        # results sent recently (the broker may have died before recording them): work_id -> (result,
        # attempt, deadline, sent at); re-offered in the next hello if the session is lost
        self.recent: OrderedDict[str, tuple[m.WorkResult, int, float, float]] = OrderedDict()
        self.max_recent = 10_000
        self.waiting: deque[m.Assign] = deque()  # assigned beyond capacity (should be rare)
        self.directive: m.Directive | None = None
        self.next_directive: m.Directive | None = None  # arrived while switching: applied when the switch ends
        self.last_recv = 0.0
        self.last_send = 0.0
        self.connect_at: float | None = None  # a reconnect scheduled after back-off
        self.sessions = 0
        self.stopping = False
        self.group: tuple[str, int, int] = ("", 1, 0)  # (name, tp, rank) of this slot's rollout TP group
        self.gpu: dict[str, float] = {}  # the last NVML sample of this slot's GPU (GPU slots only)
        # the broker address list (``--broker A,B``): how many, and the one the next Connect opens; a silent
        # broker moves the actor to the next (round robin), a live broker's Disconnect does not
        self.addresses = max(1, addresses)
        self.address = 0
        self.lend = LendCore(ident.labels, self.kinds)  # a lent slot's reclaims (lending.py); inert otherwise

    # ------------------------------------------------------------------
    def _go(self, to: ActorPhase) -> None:
        if (self.phase, to) not in _TRANSITIONS:
            raise InvalidActorTransition(f"actor {self.ident.actor_id}: {self.phase.value} -> {to.value}")
        self.phase = to

    def _send(self, msg: Any, now: float, out: list[Any]) -> None:
        self.last_send = now
        out.append(SendMsg(msg))

    def _hello(self) -> m.ActorHello:
        i = self.ident
        held = [[wid, lease, self.started.get(wid, (1, 0.0))[0]] for wid, lease in self.running.items()]
        held += [[wid, r.lease, attempt] for wid, (r, attempt, _) in self.unsent.items()]
        kinds = [] if self.lend.reclaimed else list(self.kinds)
        return m.ActorHello(i.actor_id, i.host, i.slot, i.pid, i.capabilities, kinds, self.capacity, i.labels, held)

    def _lose_session(self) -> None:
        """The session is gone: running work keeps running; unstarted work is dropped (the broker queues
        it again); results sent recently are kept to be offered again."""
        self.waiting.clear()
        for wid, (r, attempt, deadline, _) in self.recent.items():
            self.unsent.setdefault(wid, (r, attempt, deadline))
        self.recent.clear()

    def _connect(self, now: float, out: list[Any]) -> None:
        self._lose_session()
        self.next_directive = None  # the new session's broker directs afresh
        if self.phase is not ActorPhase.CONNECTING:
            self._go(ActorPhase.CONNECTING)
        self.sessions += 1
        self.last_recv = now
        self.connect_at = None
        out.append(Connect(self.address))
        self._send(self._hello(), now, out)

    # ------------------------------------------------------------------
    def handle(self, event: Any, now: float) -> list[Any]:
        out: list[Any] = []
        t = type(event)
        if t is Received:
            self.last_recv = now
            self._on_message(event.msg, now, out)
        elif t is WorkDone:
            self._on_done(event, now, out)
        elif t is Tick:
            self._on_tick(now, out)
        elif t is Reconfigured:
            self._on_reconfigured(event, now, out)
        elif t is Start:
            self._connect(now, out)
        elif t is KvUse:
            self._on_kv_use(event, now, out)
        elif t is OwnerChanged:
            self.lend.on_owner(self, event, now, out)
        elif t is GpuSampled:
            self.gpu = dict(event.gpu)
            if self.phase is not ActorPhase.CONNECTING:
                self._send(m.Heartbeat(self.gpu), now, out)
        elif t is Stop:
            self.stopping = True
            for a in self.waiting:
                self._send(m.Handback(a.work_id, a.lease, "actor stopping"), now, out)
            self.waiting.clear()
            self._send(m.Goodbye("actor stopping"), now, out)
        else:
            raise TypeError(f"unknown actor event {event!r}")
        return out

    def _on_message(self, msg: Any, now: float, out: list[Any]) -> None:
        t = type(msg)
        if t is m.Assign:
            if self.phase is ActorPhase.CONNECTING:
                return  # from an old session; the broker has re-queued it
            if self.lend.reclaimed:  # sent before the broker heard of the reclaim: it runs elsewhere
                self._send(m.Handback(msg.work_id, msg.lease, "owner_reclaim"), now, out)
            elif len(self.running) < self.capacity:
                self._start(msg, now, out)
            else:
                self.waiting.append(msg)
        elif t is m.Welcome:
            if self.phase is not ActorPhase.CONNECTING:
                return
            self.heartbeat_s, self.liveness = msg.heartbeat_s, msg.liveness
            self.idle_heartbeat_s = max(msg.heartbeat_s, msg.idle_heartbeat_s)
            self.backoff_s = self.initial_backoff_s
            self._go(ActorPhase.READY)
            out.append(Note("actor_registered", {"session": msg.session, "broker": msg.broker_id,
                                                 "held": len(self.running), "results": len(self.unsent)}))
            for r, attempt, deadline in self.unsent.values():  # work the broker adopted at our hello
                self._sent(r, attempt, deadline, now, out)
            self.unsent.clear()
            self._send(m.Bid([] if self.lend.reclaimed else list(self.kinds), self.capacity), now, out)
            self.lend.on_welcome(self, now, out)
        elif t is m.Revoke:
            if self.running.get(msg.work_id) == msg.lease:
                del self.running[msg.work_id]
                self.started.pop(msg.work_id, None)
                out.append(CancelWork(msg.work_id, msg.reason))
                self._start_waiting(out, now)
            else:
                self.waiting = deque(a for a in self.waiting if a.work_id != msg.work_id)
                for buf in (self.unsent, self.recent):
                    kept = buf.get(msg.work_id)
                    if kept is not None and kept[0].lease == msg.lease:
                        del buf[msg.work_id]
            self._maybe_switch(now, out)
        elif t is m.Directive:
            self._on_directive(msg, now, out)
        elif t is m.ContextsMoved:
            self.lend.on_moved(self, now, out)
        elif t is m.Disconnect:
            if msg.code == "actor_id_in_use":  # another live actor holds our id: say hello again later
                out.append(Note("actor_id_refused", {"reason": msg.reason, "retry_in_s": self.backoff_s}, "error"))
                self._back_off(now, out)
                return
            out.append(Note("broker_disconnected_us", {"reason": msg.reason}))
            self._connect(now, out)
        elif t is m.Error:
            out.append(Note("broker_error", {"code": msg.code, "message": msg.message}))
        elif t is m.Heartbeat:
            pass
        else:
            out.append(Note("unexpected_message", {"kind": t.__name__}))

    def _on_directive(self, msg: m.Directive, now: float, out: list[Any]) -> None:
        if self.phase is ActorPhase.CONNECTING:
            return
        if self.lend.reclaimed:  # the owner has the GPU: nothing to switch (lent again, it bids afresh)
            self._send(m.DirectiveDone(msg.directive_id, []), now, out)
            return
        if self.phase is ActorPhase.SWITCHING:  # the engine is being rebuilt: the newer directive follows it
            self.next_directive = msg
            out.append(Note("directive_held", {"directive": msg.directive_id, "kinds": msg.kinds,
                                               "switching_to": self.directive.kinds if self.directive else None}))
            return
        self.directive = msg
        if msg.mode == "handback":
            for a in self.waiting:
                self._send(m.Handback(a.work_id, a.lease, "directive"), now, out)
            self.waiting.clear()
        self._go(ActorPhase.DRAINING)
        out.append(Note("directive_received", {"directive": msg.directive_id, "kinds": msg.kinds,
                                               "mode": msg.mode, "running": len(self.running)}))
        self._maybe_switch(now, out)

    def _maybe_switch(self, now: float, out: list[Any]) -> None:
        if self.phase is ActorPhase.DRAINING and not self.running and not self.waiting and not self.lend.holding(now):
            d = self.directive
            assert d is not None
            self._go(ActorPhase.SWITCHING)
            out.append(Reconfigure(d.directive_id, list(d.kinds), dict(d.config)))

    def _on_reconfigured(self, ev: Reconfigured, now: float, out: list[Any]) -> None:
        d = self.directive
        if self.phase is not ActorPhase.SWITCHING or d is None or d.directive_id != ev.directive_id:
            return  # a stale reconfiguration (we reconnected meanwhile)
        if ev.ok:
            self.group = group_membership(d.config)
            # a member of a rollout TP group holds no engine: its leader serves the group, it bids for nothing
            self.kinds = [] if self.group[2] > 0 else [k for k in d.kinds if k in self.ident.capabilities]
            if ev.capacity is not None and ev.capacity > 0:
                self.base_capacity = ev.capacity
            self.capacity = self.base_capacity  # a new role or engine: its KV credit starts afresh
        else:
            out.append(Note("reconfigure_failed", {"directive": d.directive_id, "error": ev.error}))
        self.directive = None
        self._go(ActorPhase.READY)
        if not self.lend.on_released(self, d, now, out):  # the slot's own switches are not the broker's
            self._send(m.DirectiveDone(d.directive_id, list(self.kinds)), now, out)
        held, self.next_directive = self.next_directive, None
        if held is not None:  # no bid for these kinds: the broker awaits the held directive's (it runs at once)
            self._on_directive(held, now, out)
            return
        self._send(m.Bid(list(self.kinds), self.capacity), now, out)

    def _on_kv_use(self, ev: KvUse, now: float, out: list[Any]) -> None:
        """Re-bid when the KV credit moved by more than the threshold from the last bid (only while ready, with
        kinds to bid for: a drain or a switch ends in its own bid, with the base capacity)."""
        if self.phase is not ActorPhase.READY or not self.kinds or self.directive is not None:
            return
        credit = kv_credit(ev.used, ev.seqs, self.base_capacity)
        if abs(credit - self.capacity) <= self.kv_rebid_threshold * self.base_capacity or credit == self.capacity:
            return
        out.append(Note("kv_rebid", {"capacity": credit, "was": self.capacity, "kv_used": round(ev.used, 4),
                                     "seqs": ev.seqs}))
        self.capacity = credit
        self.rebids += 1
        self._send(m.Bid(list(self.kinds), credit, True), now, out)

    def _on_done(self, ev: WorkDone, now: float, out: list[Any]) -> None:
        if self.running.get(ev.work_id) != ev.lease:
            return  # revoked (or cancelled): the broker would drop it anyway
        del self.running[ev.work_id]
        attempt, deadline = self.started.pop(ev.work_id, (1, now))
        r = m.WorkResult(ev.work_id, ev.lease, ev.ok, ev.output, ev.error_code, ev.error, ev.duration_s)
        if self.phase is ActorPhase.CONNECTING:  # no session: deliver it after the next Welcome
            self.unsent[ev.work_id] = (r, attempt, deadline)
        else:
            self._sent(r, attempt, deadline, now, out)
        self._start_waiting(out, now)
        self._maybe_switch(now, out)

    def _sent(self, r: m.WorkResult, attempt: int, deadline: float, now: float, out: list[Any]) -> None:
        self._send(r, now, out)
        self.recent[r.work_id] = (r, attempt, deadline, now)
        self.recent.move_to_end(r.work_id)
        if len(self.recent) > self.max_recent:
            self.recent.popitem(last=False)

    def _start(self, a: m.Assign, now: float, out: list[Any]) -> None:
        self.running[a.work_id] = a.lease
        self.started[a.work_id] = (a.attempt, now + a.budget_s)
        out.append(StartWork(a))

    def _start_waiting(self, out: list[Any], now: float) -> None:
        while self.waiting and len(self.running) < self.capacity:
            self._start(self.waiting.popleft(), now, out)

    def _back_off(self, now: float, out: list[Any]) -> None:
        """Abandon the session and say hello again after the back-off (which doubles up to its cap)."""
        self._lose_session()
        if self.phase is not ActorPhase.CONNECTING:
            self._go(ActorPhase.CONNECTING)
        self.connect_at = now + self.backoff_s
        self.backoff_s = min(self.max_backoff_s, self.backoff_s * 2)

    def _on_tick(self, now: float, out: list[Any]) -> None:
        if self.stopping:
            return
        if self.phase is ActorPhase.CONNECTING:
            self._expire_held(now, out)
        else:
            window = 2 * self.idle_heartbeat_s * self.liveness  # the longest a silent broker goes unnoticed
            while self.recent and next(iter(self.recent.values()))[3] < now - window:
                self.recent.popitem(last=False)
            self.lend.on_tick(self, now, out)
        if self.connect_at is not None:
            if now >= self.connect_at:
                self._connect(now, out)
            return
        beat = self.heartbeat_s if self.running or self.waiting else self.idle_heartbeat_s
        if now - self.last_recv > beat * self.liveness:
            fields: dict[str, Any] = {"silent_s": round(now - self.last_recv, 3), "retry_in_s": self.backoff_s}
            if self.addresses > 1:  # a silent broker may be gone for good: try the next address in the list
                fields["address"], self.address = self.address, (self.address + 1) % self.addresses
                fields["next_address"] = self.address
            out.append(Note("broker_silent", fields))
            self._back_off(now, out)
            return
        if now - self.last_send >= self.heartbeat_s:
            self._send(m.Heartbeat(self.gpu), now, out)

    def _expire_held(self, now: float, out: list[Any]) -> None:
        """Without a session, work held past its budget is given up (the broker has failed it by then)."""
        for wid in [w for w, (_, deadline) in self.started.items() if deadline < now]:
            del self.started[wid]
            if self.running.pop(wid, None) is not None:
                out.append(CancelWork(wid, "budget spent without a broker session"))
        for wid in [w for w, (_, _, deadline) in self.unsent.items() if deadline < now]:
            del self.unsent[wid]
