"""The session registry of the broker core: who is connected.

:class:`ActorSession` is one connected actor socket (its capabilities, the kinds it accepts now, its
capacity and the work it holds), :class:`ClientSession` one client socket. :class:`SessionRegistry` holds
both, the names the live actors offer per kind, liveness after 7/MDP (any frame is a heartbeat; dead after
``liveness`` silent intervals) and directives (an actor told to accept other kinds gets no new work until
it has drained and bid again). Pure: no I/O, time comes in as ``now``.

Ownership of the records: the registry creates, finds and forgets sessions and keeps their session
fields (accepting, capacity, directive, role, bucket, liveness clocks); the dispatcher
(``dispatch.Dispatcher``) keeps their work fields (``held``, ``cores_used``, ``targeted``,
``completed``) as it hands work out and takes it back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from libra.protocol import messages as m

from .events import Send
from .liveness import LivenessHeap

__all__ = ["ACTOR_MAX_BACKOFF_S", "ActorSession", "ClientSession", "SessionRegistry"]

#: The longest an actor waits between two hellos while the broker is silent (``ActorState.max_backoff_s``).
ACTOR_MAX_BACKOFF_S = 5.0


@dataclass(slots=True)
class ActorSession:
    peer: bytes
    actor_id: str
    host: str
    slot: str
    pid: int
    capabilities: dict[str, frozenset[str]]
    accepting: frozenset[str]
    capacity: int
    labels: dict[str, Any]
    connected_at: float
    last_seen: float
    last_sent: float
    held: set[str] = field(default_factory=set)
    directive: int | None = None  # id of a directive still draining
    directive_config: dict[str, Any] = field(default_factory=dict)  # role: bucket, tp, ...
    completed: int = 0
    bucket: str = ""  # rollout bucket when it accepts generate
    cores: int = 1  # CPU cores it offers to actions (labels["cores"], default its capacity)
    cores_used: int = 0  # cores granted to its running actions (action scheduler on)
    targeted: int = 0  # queued generate turns waiting for this instance
    gpu: dict[str, float] = field(default_factory=dict)  # the last NVML sample of its GPU (Heartbeat.gpu)
    leased: int = 0  # direct leases it holds (direct_leases.DirectLeases; they use no credit)
    lent_owner: str = ""  # a lent slot's owner (hello labels["lend"]["owner"]): elastic rollout capacity only
    reclaimed_until: float = 0.0  # the deadline its owner gave in an OwnerReclaim (0.0: not reclaimed)

    @property
    def free(self) -> int:
        return 0 if self.directive is not None else self.capacity - len(self.held)

    def serves(self, kind: str, name: str) -> bool:
        if kind not in self.accepting:
            return False
        if kind == "generate":
            return name == self.bucket
        names = self.capabilities.get(kind)
        return names is not None and (name in names or "*" in names)

    @property
    def state(self) -> str:
        if self.directive is not None:
            return "draining"
        return "busy" if self.held else "idle"


@dataclass(slots=True)
class ClientSession:
    peer: bytes
    client_id: str
    last_seen: float
    inflight: int = 0


class SessionRegistry:
    """Actor and client sessions by socket identity (see the module docstring)."""

    def __init__(self, heartbeat_s: float, liveness: int, client_idle_s: float,
                 idle_heartbeat_s: float | None = None) -> None:
        self.actors: dict[bytes, ActorSession] = {}
        self.clients: dict[bytes, ClientSession] = {}
        self._heartbeat_s = heartbeat_s
        self._dead_after = heartbeat_s * liveness
        # how long actors may take to (re-)register: notice a silent broker, back off, say hello (the same
        # bound as the adoption grace period, adoption.py)
        self.register_s = 2 * heartbeat_s * liveness + ACTOR_MAX_BACKOFF_S
        self.empty_since: float | None = None  # since when no actor is connected (None: no tick yet)
        self._client_idle_s = client_idle_s
        self._offered: dict[str, dict[str, int]] = {}  # kind -> name -> how many live actors offer it
        self._offers: dict[str, frozenset[str]] = {}  # kind -> names offered by live actors (from _offered)
        self._by_id: dict[str, ActorSession] = {}  # actor id -> its live session
        self._capacities: dict[int, int] = {}  # capacity -> how many live actors bid it (best_actor's bound)
        self._liveness = LivenessHeap(heartbeat_s, self._dead_after, idle_heartbeat_s)
        self._opened = itertools.count(1)
        self._sessions = itertools.count(1)
        self._directives = itertools.count(1)

    # ------------------------------------------------------------------ lookups
    def known(self, peer: bytes) -> bool:
        """Whether ``peer`` said hello (as an actor or a client)."""
        return peer in self.actors or peer in self.clients

    def actor_by_id(self, actor_id: str) -> ActorSession | None:
        return self._by_id.get(actor_id)

    def client_for(self, peer: bytes, client_id: str) -> ClientSession | None:
        """The client session at ``peer``, else any session of client ``client_id`` (it reconnected)."""
        return self.clients.get(peer) or next((c for c in self.clients.values() if c.client_id == client_id), None)

    def offers(self, kind: str) -> frozenset[str]:
        """The names live actors offer for ``kind`` (``*``: any)."""
        return self._offers.get(kind, frozenset())

    def refusal(self, kind: str, name: str, now: float, expecting: bool) -> str | None:
        """Why a request for ``kind`` ``name`` is answered ``unknown_tool`` at once, or None (it may wait).

        Actors are connected but none offers it: refused. No actor is connected at all: refused too, with
        "no actor is connected that offers ...", but only after a registration window: ``register_s`` (two
        liveness periods plus the actors' longest back-off, the time an actor needs to notice a restarted
        broker and say hello again) since the broker's first tick or since its last actor left. Within the
        window, or when ``expecting`` (the broker hosts a job or runs a planner: actors are on their way),
        it waits queued, as work submitted before the actors start does."""
        names = self.offers(kind)
        if self.actors:
            if names if kind == "generate" else name in names or "*" in names:
                return None
            return f"no actor offers {kind} {name!r}; offered: {', '.join(sorted(names)) or 'none'}"
        if expecting or self.empty_since is None or now - self.empty_since < self.register_s:
            return None
        return (f"no actor is connected that offers {kind} {name!r} (none has been for "
                f"{now - self.empty_since:.3g}s; start actors with 'libra actors --broker URL')")

    def conflict(self, old: ActorSession, msg: m.ActorHello, now: float) -> str | None:
        """Why ``msg`` is refused while live session ``old`` holds its actor id (another supervisor run's
        actor: two supervisors on one host would otherwise knock each other off for ever), or None."""
        theirs, ours = old.labels.get("instance"), msg.labels.get("instance")
        if theirs and ours and theirs != ours and not self.silent(old, now):
            return (f"actor id {msg.actor_id!r} is already live (pid {old.pid} on {old.host}, another "
                    "supervisor); start this one with --actor-id-prefix, or stop the other")
        return None

    def best_actor(self, key: tuple[str, str]) -> ActorSession | None:
        """The actor with the most free credit that serves ``key`` (the first such one on ties)."""
        best: ActorSession | None = None
        best_free = 0
        top = max(self._capacities, default=0)  # no actor has more free credit than the largest capacity
        for sess in self.actors.values():
            f = sess.free
            if f > best_free and sess.serves(*key):
                best, best_free = sess, f
                if f >= top:  # none after it can have more: the scan stops at the first fully free one
                    break
        return best

    def rollout_instances(self) -> list[tuple[str, str, int, int, str]]:
        """(actor id, bucket, active, queued for it, host) of every ready rollout instance."""
        return [(s.actor_id, s.bucket, len(s.held), s.targeted, s.host)
                for s in self.actors.values() if "generate" in s.accepting and s.directive is None]

    def served_buckets(self) -> set[str]:
        """Buckets that some ready rollout instance serves."""
        return {s.bucket for s in self.actors.values() if "generate" in s.accepting and s.directive is None}

    # ------------------------------------------------------------------ sessions
    def touch(self, peer: bytes, now: float) -> None:
        """Any frame from a peer is a heartbeat."""
        sess = self.actors.get(peer)
        if sess is not None:
            sess.last_seen = now
        else:
            cs = self.clients.get(peer)
            if cs is not None:
                cs.last_seen = now

    def new_session_id(self) -> str:
        return f"s{next(self._sessions)}"

    def open_actor(self, peer: bytes, msg: m.ActorHello, now: float) -> ActorSession:
        """Register the actor of ``msg`` at ``peer`` (the caller has checked the hello and dropped any old
        session of the same actor id). Its bucket is the caller's to set."""
        caps = {k: frozenset(v) for k, v in msg.capabilities.items()}
        sess = ActorSession(
            peer=peer, actor_id=msg.actor_id, host=msg.host, slot=msg.slot, pid=msg.pid,
            capabilities=caps, accepting=frozenset(k for k in msg.kinds if k in caps),
            capacity=msg.capacity, labels=dict(msg.labels), connected_at=now, last_seen=now, last_sent=now,
        )
        role = msg.labels.get("role")
        sess.directive_config = dict(role) if isinstance(role, dict) else {}
        cores = msg.labels.get("cores")
        sess.cores = cores if type(cores) is int and cores > 0 else max(1, msg.capacity)
        old = self.actors.get(peer)
        if old is not None:  # the caller drops it first; never leave a stale index entry behind
            self._forget(old)
        self.actors[peer] = sess
        self._by_id[sess.actor_id] = sess
        self._liveness.add(sess, next(self._opened))
        self._count_capacity(sess.capacity, 1)
        self._count_offers(caps, 1)
        return sess

    def close_actor(self, peer: bytes, now: float) -> ActorSession | None:
        """Forget the actor session at ``peer``; returns it (None if there was none). What it held is the
        caller's to take back. The last actor gone starts the registration window again (:meth:`refusal`)."""
        sess = self.actors.pop(peer, None)
        if sess is not None:
            self._forget(sess)
            if not self.actors:
                self.empty_since = now
        return sess

    def open_client(self, peer: bytes, client_id: str, now: float) -> ClientSession:
        cs = self.clients.get(peer)
        if cs is None:
            cs = self.clients[peer] = ClientSession(peer, client_id, now)
        else:
            cs.client_id = client_id
        return cs

    def close_client(self, peer: bytes) -> None:
        self.clients.pop(peer, None)

    def bid(self, sess: ActorSession, kinds: list[str], capacity: int) -> bool:
        """The actor bids for ``kinds`` with ``capacity``: it is open again. Returns whether it was
        switching (a directive drained)."""
        sess.accepting = frozenset(k for k in kinds if k in sess.capabilities)
        self._set_capacity(sess, capacity)
        switched = sess.directive is not None
        sess.directive = None
        return switched

    def rebid(self, sess: ActorSession, capacity: int) -> bool:
        """A ready actor's new capacity (``Bid.rebid``: its KV credit moved); ignored while a directive drains
        (the bid that ends the drain brings its own). Returns whether the credit changed."""
        if sess.directive is not None or capacity == sess.capacity:
            return False
        self._set_capacity(sess, capacity)
        return True

    def _set_capacity(self, sess: ActorSession, capacity: int) -> None:
        self._count_capacity(sess.capacity, -1)
        sess.capacity = max(0, capacity)
        self._count_capacity(sess.capacity, 1)

    def _count_capacity(self, capacity: int, delta: int) -> None:
        n = self._capacities.get(capacity, 0) + delta
        if n > 0:
            self._capacities[capacity] = n
        else:
            self._capacities.pop(capacity, None)

    def direct(self, actor_id: str, kinds: list[str] | tuple[str, ...], now: float, mode: str = "finish",
               config: dict[str, Any] | None = None) -> Send:
        """Tell actor ``actor_id`` to accept ``kinds`` from now on: it gets no new work until it has drained
        and bid again. Returns the Directive to send. Raises ValueError (bad mode or kind), KeyError (no
        such live actor)."""
        if mode not in ("finish", "handback"):
            raise ValueError(f"directive mode must be 'finish' or 'handback', got {mode!r}")
        bad = [k for k in kinds if k not in m.WORK_KINDS]
        if bad:
            raise ValueError(f"unknown work kind(s) {bad} (known: {', '.join(m.WORK_KINDS)})")
        sess = self.actor_by_id(actor_id)
        if sess is None:
            raise KeyError(f"no live actor with id {actor_id!r}")
        if sess.lent_owner and "train" in kinds:
            raise ValueError(f"actor {actor_id!r} is lent by {sess.lent_owner!r}: a borrowed GPU never trains")
        did = next(self._directives)
        sess.directive = did
        sess.directive_config = dict(config or {})
        sess.last_sent = now
        return Send(sess.peer, m.Directive(did, list(kinds), mode, dict(config or {})))

    # ------------------------------------------------------------------ timers
    def silent(self, sess: ActorSession, now: float) -> bool:
        """Whether ``sess`` has been silent for longer than ``liveness`` heartbeats (dead by 7/MDP)."""
        return now - sess.last_seen > self._dead_after

    def liveness(self, peer: bytes, now: float) -> str | None:
        """On the timer, for the actor at ``peer``: ``"dead"`` (silent too long: the caller drops it),
        ``"heartbeat"`` (a heartbeat is due: counted as sent now) or None."""
        sess = self.actors.get(peer)
        return None if sess is None else self._liveness.verdict(sess, now)

    def took_work(self, sess: ActorSession) -> None:
        """``sess`` was just given work (after ``held`` grew): with its first it is beaten at the busy interval."""
        if len(sess.held) == 1:
            self._liveness.rekey(sess)

    def due(self, now: float, spare_dead: bool = False) -> list[tuple[bytes, str]]:
        """On the timer: the actors with a verdict of :meth:`liveness` at ``now`` (``"dead"``: the caller
        drops them; ``"heartbeat"``: counted as sent now), in the order they connected. Costs the actors
        that are due, not all of them (``liveness.LivenessHeap``). ``spare_dead``: none is dead this time
        (unread frames may hold their heartbeats); they are checked again on the next call."""
        return self._liveness.due(self.actors, now, spare_dead)

    def on_tick(self, now: float) -> None:
        """On the timer: start the registration clock (:meth:`refusal`) at the first tick; forget silent
        clients that have nothing in flight."""
        if self.empty_since is None:
            self.empty_since = now
        for peer, cs in list(self.clients.items()):
            if cs.inflight <= 0 and now - cs.last_seen > self._client_idle_s:
                del self.clients[peer]

    def _forget(self, sess: ActorSession) -> None:
        """Take ``sess`` out of the actor id index, the liveness heap and the offers."""
        if self._by_id.get(sess.actor_id) is sess:
            del self._by_id[sess.actor_id]
        self._liveness.discard(sess.peer)
        self._count_offers(sess.capabilities, -1)
        self._count_capacity(sess.capacity, -1)

    def _count_offers(self, caps: dict[str, frozenset[str]], delta: int) -> None:
        """An actor offering ``caps`` came (``delta`` 1) or left (-1): the offers of its kinds change."""
        for kind, names in caps.items():
            counts = self._offered.setdefault(kind, {})
            for name in names:
                n = counts.get(name, 0) + delta
                if n > 0:
                    counts[name] = n
                else:
                    counts.pop(name, None)
            if counts:
                self._offers[kind] = frozenset(counts)
            else:
                del self._offered[kind]
                self._offers.pop(kind, None)
