"""Direct calls, the client's side: which calls skip the broker hop, and what happens when a lease ends.

With ``direct=True`` a client asks the broker (``LeaseRequest``) for a lease on each tool it calls without a
trajectory or an explicit ``request_id``. The broker grants one only for a tool some actor runs inline
(constant-time on its socket thread, such as ``echo``; see ``libra.broker.direct_leases``); calls of that tool
then go to the actor's direct socket as ``DirectCall``\\s and the actor answers them itself: two socket hops a
call instead of four. Calls made while a lease is being asked for, calls of other tools, calls with a
trajectory (the rollout router and action placement learn from those) and calls with an explicit
``request_id`` (the broker's record makes those idempotent) go through the broker as before.

What stays true:
- nothing runs twice because of a lease: an actor that no longer holds a lease refuses calls on it
  (``lease_ended``) before running anything, and such a call is sent through the broker;
- a lost actor (the broker says ``LeaseEnd(lost=True)``) may have run the calls it had not answered: they are
  sent through the broker with ``prior_attempts=1``, so their ``attempts`` says 2 and the retry budget counts
  the loss, exactly as for brokered work an actor took with it;
- a lease unused for ``idle_s`` is returned, so its actor's credit goes back to the broker.

:class:`DirectRoutes` holds this bookkeeping for one client. It is pure: times come in as arguments; the client
core (``core.ClientCore``) drives it and turns its answers into actions, which the sync and asyncio shells carry out.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from libra.transport.endpoints import ipc_enabled
from libra.protocol import messages as m
from libra.protocol.errors import ErrorCode

__all__ = ["DirectLease", "DirectRoutes"]

LEASE_ENDED = ErrorCode.LEASE_ENDED.value


@dataclass(slots=True)
class DirectLease:
    lease_id: str
    tool: str
    actor_id: str
    endpoint: str
    last_used: float
    calls: set[str] = field(default_factory=set)  # request ids sent on it and not answered yet


class DirectRoutes:
    """One client's direct leases (see the module docstring)."""

    def __init__(self, idle_s: float = 10.0, retry_s: float = 10.0, host: str | None = None) -> None:
        self.idle_s = idle_s
        self.retry_s = retry_s  # how long a refused tool goes through the broker before asking again
        self.host = host or socket.gethostname()
        self.by_tool: dict[str, DirectLease] = {}
        self.by_id: dict[str, DirectLease] = {}
        self.calls: dict[str, DirectLease] = {}  # request id -> the lease it was sent on
        self.asking: dict[str, tuple[str, float]] = {}  # LeaseRequest id -> (tool, when asked)
        self._not_before: dict[str, float] = {}  # tool -> when it may be asked for again

    def route(self, kind: str, name: str, trajectory: str | None, explicit_id: bool,
              now: float) -> tuple[DirectLease | None, bool]:
        """``(lease to send this call on or None, whether to ask for a lease now)``."""
        if kind != "action" or trajectory or explicit_id:
            return None, False
        lease = self.by_tool.get(name)
        if lease is not None:
            lease.last_used = now
            return lease, False
        if now < self._not_before.get(name, 0.0):
            return None, False
        for rid, (tool, when) in list(self.asking.items()):
            if tool == name:
                if now - when < self.retry_s:
                    return None, False
                del self.asking[rid]  # no answer for that long (lost with a broker): ask again
        return None, True

    def asked(self, request_id: str, tool: str, now: float) -> None:
        self.asking[request_id] = (tool, now)

    def on_lease_reply(self, reply: m.Reply, now: float) -> tuple[bool, str | None]:
        """A Reply to one of our LeaseRequests? ``(consumed, a surplus lease id to return)``."""
        entry = self.asking.pop(reply.request_id, None)
        if entry is None:
            return False, None
        tool = entry[0]
        out = reply.output if reply.ok else None
        if not isinstance(out, dict) or not isinstance(out.get("lease"), str):
            self._not_before[tool] = now + self.retry_s
            return True, None
        if tool in self.by_tool:  # two threads asked at once: keep one
            return True, out["lease"]
        ipc = out.get("ipc") or ""
        endpoint = ipc if ipc and out.get("host") == self.host and ipc_enabled() else str(out.get("endpoint") or "")
        if not endpoint:
            self._not_before[tool] = now + self.retry_s
            return True, out["lease"]
        lease = DirectLease(out["lease"], tool, str(out.get("actor_id", "")), endpoint, now)
        self.by_tool[tool] = lease
        self.by_id[lease.lease_id] = lease
        return True, None

    def sent(self, request_id: str, lease: DirectLease) -> None:
        lease.calls.add(request_id)
        self.calls[request_id] = lease

    def answered(self, request_id: str) -> DirectLease | None:
        lease = self.calls.pop(request_id, None)
        if lease is not None:
            lease.calls.discard(request_id)
        return lease

    def refused(self, request_id: str, now: float) -> None:
        """The actor refused a call (``lease_ended``): the lease is over; ask again after a short pause."""
        lease = self.answered(request_id)
        if lease is not None:
            self._drop(lease)
            self._not_before[lease.tool] = now + min(1.0, self.retry_s)

    def ended(self, lease_id: str, lost: bool = False) -> list[str]:
        """The broker ended ``lease_id``: send no more on it. Returns the request ids to send again through the
        broker, oldest first: none when its actor only changes roles (the calls already sent are answered by
        the actor, or refused unrun: :meth:`refused`), every unanswered one when the actor is ``lost``."""
        lease = self.by_id.get(lease_id)
        if lease is None:
            return []
        self._drop(lease)
        if not lost:
            return []
        rids = sorted(lease.calls, key=_seq)
        for rid in rids:
            self.calls.pop(rid, None)
        lease.calls.clear()
        return rids

    def idle(self, now: float) -> list[str]:
        """Leases with nothing in flight, unused for ``idle_s``: forgotten here; return them to the broker."""
        out = [x for x in self.by_id.values() if not x.calls and now - x.last_used >= self.idle_s]
        for lease in out:
            self._drop(lease)
        return [x.lease_id for x in out]

    def reset(self) -> None:
        """The broker session was lost (it restarted): its leases and pending requests for leases are void.
        Calls already sent stay in :attr:`calls`: their actors still answer them."""
        self.asking.clear()
        for lease in list(self.by_id.values()):
            self._drop(lease)

    def _drop(self, lease: DirectLease) -> None:
        self.by_id.pop(lease.lease_id, None)
        if self.by_tool.get(lease.tool) is lease:
            del self.by_tool[lease.tool]


def _seq(request_id: str) -> Any:
    tail = request_id.rsplit(":", 1)[-1]
    return (0, int(tail)) if tail.isdigit() else (1, tail)
