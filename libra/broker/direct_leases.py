"""Direct leases of the broker core: calls of constant-time tools that skip the broker hop.

A tool an actor runs inline (constant-time, on its socket thread: ``echo``) gains nothing from the broker's
queueing and placement, yet a brokered call costs it four socket hops instead of two. A client may ask
(``LeaseRequest``) for a **direct lease** on such a tool: this component picks, among the actors that serve
it, list it under ``labels["direct_tools"]`` and are not switching roles, the one holding the fewest leases
(at most ``direct_leases_per_actor``; 0 turns direct calls off), tells it (``LeaseGrant``), and answers the
client with the actor's direct endpoint once the actor said ``LeaseReady``. The client then sends
``DirectCall`` messages to the actor and the actor answers them itself; it reports what it answered
(``LeaseReport``) for the counters. A lease takes none of the actor's credit: inline calls never occupy its
worker pool, so brokered work is not starved by clients that hold leases.

A lease ends when the client returns it (``LeaseEnd`` from the client), when the client's session ends, when
the actor is told to change roles or stops offering the tool, or when the actor is gone. In the last case the
client is told ``lost=True`` and sends its unanswered calls again through the broker with
``prior_attempts=1``, so ``attempts`` tells the truth; in every other case the actor still answers what it
received, and refuses (``lease_ended``, nothing run) what comes after. Pure: no I/O, time comes in as ``now``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from libra.protocol import messages as m
from libra.protocol.errors import ErrorCode

from .events import Command, Send
from .sessions import ActorSession, SessionRegistry

__all__ = ["DirectLeases", "Lease"]


@dataclass(slots=True)
class Lease:
    lease_id: str
    client: bytes
    client_id: str
    actor: bytes
    actor_id: str
    kind: str
    name: str
    request_id: str
    ready: bool = False
    done: int = 0
    failed: int = 0


class DirectLeases:
    """The live direct leases (see the module docstring). ``counters`` is the core's stats dict."""

    def __init__(self, sessions: SessionRegistry, counters: dict[str, int], per_actor: int = 256) -> None:
        self.sessions = sessions
        self.per_actor = per_actor
        self.stats = counters
        self.leases: dict[str, Lease] = {}
        self._ids = itertools.count(1)
        for k in ("leases_granted", "leases_refused", "leases_lost", "direct_completed", "direct_failed"):
            counters.setdefault(k, 0)

    @property
    def handlers(self) -> dict[type, Any]:
        """The core's handlers for the lease messages, ``(peer, msg, now, out)`` like its own."""
        return {m.LeaseRequest: self.on_request, m.LeaseReady: self.on_ready, m.LeaseReport: self.on_report,
                m.LeaseEnd: self.on_return}

    # ------------------------------------------------------------------ client side
    def on_request(self, peer: bytes, msg: m.LeaseRequest, now: float, out: list[Command]) -> None:
        cs = self.sessions.clients[peer]
        sess = self._best(msg.kind, msg.name)
        if sess is None:
            self.stats["leases_refused"] += 1
            out.append(_no_lease(peer, msg.request_id, f"no actor runs {msg.kind} {msg.name!r} inline with a lease "
                                 "to spare" if self.per_actor > 0 else "direct calls are off on this broker"))
            return
        lease = Lease(f"L{next(self._ids)}", peer, cs.client_id, sess.peer, sess.actor_id, msg.kind, msg.name,
                      msg.request_id)
        self.leases[lease.lease_id] = lease
        sess.leased += 1
        out.append(Send(sess.peer, m.LeaseGrant(lease.lease_id, cs.client_id, msg.kind, msg.name)))

    def on_return(self, peer: bytes, msg: m.LeaseEnd, now: float, out: list[Command]) -> None:
        lease = self.leases.get(msg.lease_id)
        if lease is not None and lease.client == peer:
            self._end(lease, out, f"returned by the client: {msg.reason}", tell_client=False)

    def _best(self, kind: str, name: str) -> ActorSession | None:
        best: ActorSession | None = None
        for sess in self.sessions.actors.values():
            if (sess.leased < self.per_actor and sess.directive is None and sess.serves(kind, name)
                    and self._direct(sess, name)
                    and (best is None or (sess.leased, -sess.free) < (best.leased, -best.free))):
                best = sess
        return best

    @staticmethod
    def _direct(sess: ActorSession, name: str) -> bool:
        tools = sess.labels.get("direct_tools")
        return bool(sess.labels.get("direct")) and isinstance(tools, list) and name in tools

    # ------------------------------------------------------------------ actor side
    def on_ready(self, peer: bytes, msg: m.LeaseReady, now: float, out: list[Command]) -> None:
        lease = self.leases.get(msg.lease_id)
        sess = self.sessions.actors.get(peer)
        if lease is None or lease.actor != peer or sess is None or lease.ready:
            return
        if not msg.ok:
            self.stats["leases_refused"] += 1
            self._forget(lease)
            out.append(_no_lease(lease.client, lease.request_id, f"actor {sess.actor_id} refused the lease: {msg.error}"))
            return
        lease.ready = True
        self.stats["leases_granted"] += 1
        labels = sess.labels
        out.append(Send(lease.client, m.Reply(lease.request_id, True, {
            "lease": lease.lease_id, "actor_id": sess.actor_id, "host": sess.host,
            "endpoint": str(labels.get("direct", "")), "ipc": str(labels.get("direct_ipc", ""))},
            actor_id=sess.actor_id)))

    def on_report(self, peer: bytes, msg: m.LeaseReport, now: float, out: list[Command]) -> None:
        if peer not in self.sessions.actors:
            return
        done, failed = max(0, msg.done), max(0, msg.failed)
        self.stats["direct_completed"] += done  # a report after the lease ended counts too: the calls ran
        self.stats["direct_failed"] += failed
        lease = self.leases.get(msg.lease_id)
        if lease is not None and lease.actor == peer:
            lease.done += done
            lease.failed += failed

    def actor_gone(self, sess: ActorSession, out: list[Command], why: str) -> None:
        """``sess`` was closed: its leases are lost (their clients resend unanswered calls via the broker)."""
        for lease in [x for x in self.leases.values() if x.actor == sess.peer]:
            self._forget(lease)
            if not lease.ready:
                out.append(_no_lease(lease.client, lease.request_id, f"actor {sess.actor_id} left: {why}"))
                continue
            self.stats["leases_lost"] += 1
            out.append(Send(lease.client, m.LeaseEnd(lease.lease_id, f"actor {sess.actor_id} left: {why}", True)))

    # ------------------------------------------------------------------ timer
    def tick(self, now: float, out: list[Command]) -> None:
        """End leases whose client left or whose actor is switching roles or no longer offers the tool."""
        for lease in list(self.leases.values()):
            sess = self.sessions.actors.get(lease.actor)
            if lease.client not in self.sessions.clients:
                self._end(lease, out, "the client left", tell_client=False)
            elif sess is not None and (sess.directive is not None or not sess.serves(lease.kind, lease.name)):
                self._end(lease, out, "the actor changes roles", tell_client=True)

    def summary(self) -> list[dict[str, Any]]:
        return [{"lease": x.lease_id, "client": x.client_id, "actor": x.actor_id, "tool": x.name,
                 "ready": x.ready, "done": x.done, "failed": x.failed} for x in self.leases.values()]

    # ------------------------------------------------------------------ internals
    def _end(self, lease: Lease, out: list[Command], why: str, tell_client: bool) -> None:
        self._forget(lease)
        out.append(Send(lease.actor, m.LeaseEnd(lease.lease_id, why)))
        if tell_client and lease.ready:
            out.append(Send(lease.client, m.LeaseEnd(lease.lease_id, why)))
        elif tell_client:
            out.append(_no_lease(lease.client, lease.request_id, why))

    def _forget(self, lease: Lease) -> None:
        del self.leases[lease.lease_id]
        sess = self.sessions.actors.get(lease.actor)
        if sess is not None:
            sess.leased = max(0, sess.leased - 1)


def _no_lease(client: bytes, request_id: str, why: str) -> Send:
    """The answer to a lease request that gets no lease: the client calls through the broker."""
    return Send(client, m.Reply(request_id, False, None, ErrorCode.NO_LEASE.value, why))
