"""The work table of the broker core: every accepted request as a :class:`~libra.broker.work.Work`.

It holds the works by id, one FIFO queue per ``(kind, name)``, the request index (``(client id,
request id)`` -> the work in flight), the reply cache (finished requests remembered so a resubmitted
request id is answered from the record, never run twice), and the deadline and lease timers (heaps with
lazy deletion). It keeps the bookkeeping of each work's life: admission, queue positions, leases,
expiry, and forgetting it with its reply. Work restored from a journal may wait ``parked`` (queued, but in
no queue) until the actors that still run it have said hello again and adopted it. Which actor gets which work is the dispatcher's business
(``dispatch.Dispatcher``); the table only records it. Pure: no I/O, time comes in as ``now``.
"""

from __future__ import annotations

import heapq
import itertools
import re
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Any

from libra.protocol import messages as m

from .work import Work, WorkState

__all__ = ["WorkTable"]

_WORK_ID = re.compile(r"w(\d+)")


class WorkTable:
    """Works, queues, the request index, the reply cache, deadlines and leases (see the module docstring)."""

    def __init__(self, reply_cache: int) -> None:
        self.works: dict[str, Work] = {}
        self.queues: dict[tuple[str, str], deque[str]] = {}
        self._reply_cache = reply_cache
        self._by_request: dict[tuple[str, str], str] = {}
        self._replies: OrderedDict[tuple[str, str], m.Reply] = OrderedDict()
        self._deadlines: list[tuple[float, int, str]] = []  # lazy deletion; compacted when mostly stale
        self._leases: list[tuple[float, int, str]] = []
        self.parked: dict[str, None] = {}  # restored work waiting for its actor to come back (ordered)
        self._next_work = 1
        self._next_lease = 1
        self._seq = itertools.count(1)

    # ------------------------------------------------------------------ requests
    def in_flight(self, client_id: str, request_id: str) -> Work | None:
        """The work of an accepted request that has no reply yet."""
        wid = self._by_request.get((client_id, request_id))
        return self.works[wid] if wid is not None else None

    def cached_reply(self, client_id: str, request_id: str) -> m.Reply | None:
        """The remembered reply of a finished request."""
        return self._replies.get((client_id, request_id))

    def known_request(self, client_id: str, request_id: str) -> bool:
        rkey = (client_id, request_id)
        return rkey in self._replies or rkey in self._by_request

    def in_flight_count(self, client_id: str) -> int:
        """Requests of client ``client_id`` accepted and not answered yet."""
        return sum(1 for (cid, _), _ in self._by_request.items() if cid == client_id)

    def owned_by(self, client_id: str) -> list[Work]:
        """The live (queued or leased) works of ``client_id``."""
        return [w for w in self.works.values()
                if w.client_id == client_id and w.state in (WorkState.QUEUED, WorkState.LEASED)]

    def admit(self, client_id: str, request_id: str, peer: bytes, kind: str, name: str, args: Any,
              trajectory: str | None, timeout_s: float, now: float, why: str, work_id: str | None = None,
              pin: str = "", prior_attempts: int = 0) -> Work:
        """Create and index a new piece of work (not yet queued or assigned). ``work_id``: keep the id a
        journal recorded (restore); new ids continue above it. ``pin``: the only actor id that may take it.
        ``prior_attempts``: runs it had before it came here (a direct call whose actor was lost), each counted
        as an attempt and a loss."""
        if work_id is None or work_id in self.works:
            work_id = f"w{self._next_work}"
            self._next_work += 1
        else:
            mt = _WORK_ID.fullmatch(work_id)
            if mt is not None:
                self._next_work = max(self._next_work, int(mt.group(1)) + 1)
        wid = work_id
        w = Work(wid, request_id, peer, kind, name, args, trajectory, now, now + timeout_s, next(self._seq),
                 client_id=client_id, timeout_s=timeout_s, pin=pin)
        w.attempt = w.failures = max(0, prior_attempts)
        w.story.append(f"queued:{why}")
        self.works[wid] = w
        self._by_request[(client_id, request_id)] = wid
        heapq.heappush(self._deadlines, (w.deadline, w.seq, wid))
        if len(self._deadlines) > 2 * len(self.works) + 1024:  # bound memory: drop finished entries
            self._deadlines = [e for e in self._deadlines if e[2] in self.works]
            heapq.heapify(self._deadlines)
        return w

    # ------------------------------------------------------------------ queues
    def queue_len(self, key: tuple[str, str]) -> int | None:
        """How many wait in the queue of ``key`` (None: there never was one)."""
        q = self.queues.get(key)
        return None if q is None else len(q)

    def queued(self, kind: str) -> int:
        """How many works of ``kind`` wait, over all its queues."""
        return sum(len(q) for (k, _), q in self.queues.items() if k == kind)

    def push(self, w: Work) -> None:
        """Queue ``w`` at the back of its queue (new work: the youngest there is)."""
        self.queues.setdefault(w.key, deque()).append(w.work_id)

    def put_back(self, w: Work, front: bool = False) -> None:
        """Queue ``w`` again: at the front (``front``: handed back unstarted), else in its submission order."""
        q = self.queues.setdefault(w.key, deque())
        if front:
            q.appendleft(w.work_id)
        else:  # keep FCFS order by the original submission sequence
            q.append(w.work_id)
            if len(q) > 1 and self.works[q[-2]].seq > w.seq:
                items = sorted(q, key=lambda x: self.works[x].seq)
                q.clear()
                q.extend(items)

    def take(self, key: tuple[str, str], i: int = 0) -> Work:
        """Remove and return the ``i``-th work of the queue of ``key``."""
        q = self.queues[key]
        wid = q[i]
        del q[i]
        return self.works[wid]

    def park(self, w: Work) -> None:
        """Keep queued ``w`` out of every queue until :meth:`unpark` (restored work in its grace period)."""
        self.parked[w.work_id] = None

    def unpark(self, which: Callable[[Work], bool] | None = None) -> list[Work]:
        """Take parked works out of the parked set (``which``: those it accepts; None: all), oldest first
        (the caller queues or places them)."""
        ws = sorted((w for w in map(self.works.__getitem__, self.parked) if which is None or which(w)),
                    key=lambda w: w.seq)
        for w in ws:
            del self.parked[w.work_id]
        return ws

    def unqueue(self, w: Work) -> None:
        """Remove queued ``w`` from its queue or the parked set (if it is there)."""
        if w.work_id in self.parked:
            del self.parked[w.work_id]
            return
        q = self.queues.get(w.key)
        if q is not None:
            try:
                q.remove(w.work_id)
            except ValueError:
                pass

    def rename_generate(self, buckets: dict[str, str]) -> bool:
        """Move the queued generate turns of each bucket in ``buckets`` to the bucket it maps to, then
        restore submission order in every queue. Returns whether any moved."""
        moved = False
        for key in [k for k in self.queues if k[0] == "generate" and k[1] in buckets and self.queues[k]]:
            dst = buckets[key[1]]
            q = self.queues[key]
            for wid in list(q):
                w = self.works[wid]
                q.remove(wid)
                w.name = dst
                self.queues.setdefault(w.key, deque()).append(wid)
                moved = True
        if moved:
            for dq in self.queues.values():
                if len(dq) > 1:
                    items = sorted(dq, key=lambda x: self.works[x].seq)
                    dq.clear()
                    dq.extend(items)
        return moved

    # ------------------------------------------------------------------ leases and timers
    def lease(self, w: Work, peer: bytes, actor_id: str, now: float, lease_s: float) -> None:
        """Record that ``w`` (taken off its queue) now runs on the actor at ``peer``, under a new lease."""
        w.lease = self._next_lease
        self._next_lease += 1
        w.attempt += 1
        w.holder = actor_id
        self._hold(w, peer, f"assign:{actor_id}", now, lease_s)

    def adopt(self, w: Work, peer: bytes, actor_id: str, lease: int, attempt: int, now: float,
              lease_s: float) -> None:
        """Record that queued ``w`` (off its queue) runs on the actor at ``peer`` already, under the lease
        ``lease`` of an earlier session (which never comes again: the lease counter moves above it)."""
        w.lease = lease
        self._next_lease = max(self._next_lease, lease + 1)
        w.attempt = max(w.attempt, attempt)
        w.holder = actor_id
        self._hold(w, peer, f"adopt:{actor_id}", now, lease_s)

    def transfer(self, w: Work, peer: bytes, actor_id: str) -> None:
        """Leased ``w`` stays with the same actor on its new session at ``peer`` (same lease)."""
        w.actor = peer
        if len(w.story) < 32:
            w.story.append(f"leased:session:{actor_id}")

    def note_lease(self, lease: int) -> None:
        """A lease an earlier run of the broker gave out: new leases are all above it."""
        self._next_lease = max(self._next_lease, lease + 1)

    def _hold(self, w: Work, peer: bytes, why: str, now: float, lease_s: float) -> None:
        w.actor = peer
        w.move(WorkState.LEASED, why)
        w.lease_expires = min(w.deadline, now + lease_s)
        if w.lease_expires < w.deadline:
            heapq.heappush(self._leases, (w.lease_expires, w.lease, w.work_id))

    def current(self, work_id: str, lease: int, peer: bytes) -> Work | None:
        """The leased work a result or hand-back from ``peer`` names, if its lease is still the current one."""
        w = self.works.get(work_id)
        if w is None or w.state is not WorkState.LEASED or w.lease != lease or w.actor != peer:
            return None
        return w

    def due_deadlines(self, now: float) -> Iterator[Work]:
        """Live works whose deadline has passed, soonest first (each popped off the timer as it is yielded)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, wid = heapq.heappop(self._deadlines)
            w = self.works.get(wid)
            if w is not None and w.state in (WorkState.QUEUED, WorkState.LEASED):
                yield w

    def due_leases(self, now: float) -> Iterator[Work]:
        """Leased works whose current lease has expired, soonest first."""
        while self._leases and self._leases[0][0] <= now:
            _, lease, wid = heapq.heappop(self._leases)
            w = self.works.get(wid)
            if w is not None and w.state is WorkState.LEASED and w.lease == lease:
                yield w

    # ------------------------------------------------------------------ the end
    def remove(self, w: Work) -> None:
        """Forget finished ``w`` (its request stays indexed until :meth:`release` or :meth:`remember`)."""
        del self.works[w.work_id]

    def release(self, w: Work) -> None:
        """Forget the request of finished ``w`` without remembering a reply (work a job owns)."""
        self._by_request.pop((w.client_id, w.request_id), None)

    def remember(self, w: Work, reply: m.Reply) -> None:
        """Remember ``reply`` as the answer to the request of finished ``w`` (bounded: oldest forgotten)."""
        rkey = (w.client_id, w.request_id)
        if self._by_request.get(rkey) == w.work_id:
            del self._by_request[rkey]
            self._replies[rkey] = reply
            if len(self._replies) > self._reply_cache:
                self._replies.popitem(last=False)

    def restore_reply(self, client_id: str, request_id: str, reply: m.Reply) -> None:
        """A reply from the journal (restart): it answers resubmissions of its request id."""
        self._replies[(client_id, request_id)] = reply
