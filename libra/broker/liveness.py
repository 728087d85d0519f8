"""Liveness of actor sessions by a deadline heap: each tick costs the sessions that are due, not all of them.

An actor session has two clocks: ``last_seen`` (any frame from it is a heartbeat; it is dead once silent for
longer than ``dead_after``, 7/MDP) and ``last_sent`` (the broker owes it a heartbeat once it has sent it
nothing for ``heartbeat_s``). :class:`LivenessHeap` keeps one entry per session, keyed by the earlier of the
two deadlines as they stood when it was pushed. Both clocks only move forward, so an entry is never later
than the session's true deadline: a popped entry is checked against the clocks as they are now and pushed
again at its new deadline when nothing is due (lazy re-keying: a heartbeat or an assignment costs O(1), no
heap update). Pure: no I/O, time comes in as ``now``.
"""

from __future__ import annotations

import heapq
from typing import Protocol

__all__ = ["LivenessHeap"]


class _Clocked(Protocol):
    peer: bytes
    last_seen: float
    last_sent: float


class LivenessHeap:
    """Due-time order of the actor sessions' liveness checks (see the module docstring)."""

    def __init__(self, heartbeat_s: float, dead_after: float) -> None:
        self._heartbeat_s = heartbeat_s
        self._dead_after = dead_after
        self._heap: list[tuple[float, int, bytes]] = []
        self._order: dict[bytes, int] = {}  # peer -> the open order of its live session (its entry's tie key)

    def __len__(self) -> int:
        return len(self._order)

    def deadline(self, sess: _Clocked) -> float:
        """The earliest time a check of ``sess`` can find something due (a heartbeat or its death)."""
        return min(sess.last_sent + self._heartbeat_s, sess.last_seen + self._dead_after)

    def add(self, sess: _Clocked, order: int) -> None:
        """Watch ``sess`` (a new session at its peer; ``order``: increasing with each session opened)."""
        self._order[sess.peer] = order
        heapq.heappush(self._heap, (self.deadline(sess), order, sess.peer))

    def discard(self, peer: bytes) -> None:
        """Stop watching the session at ``peer`` (its heap entry is dropped when it comes up)."""
        self._order.pop(peer, None)

    def verdict(self, sess: _Clocked, now: float) -> str | None:
        """``"dead"`` (silent for longer than ``dead_after``), ``"heartbeat"`` (one is due: counted as sent
        now) or None."""
        if now - sess.last_seen > self._dead_after:
            return "dead"
        if now - sess.last_sent >= self._heartbeat_s:
            sess.last_sent = now
            return "heartbeat"
        return None

    def due(self, sessions: dict[bytes, _Clocked], now: float) -> list[tuple[bytes, str]]:
        """The sessions with something due at ``now``, in the order they were opened, with their verdicts
        (``"dead"`` or ``"heartbeat"``, as :meth:`verdict`). A dead one leaves the heap (the caller drops
        the session); every other one popped is pushed again at its next deadline."""
        heap, order = self._heap, self._order
        popped: list[tuple[int, bytes]] = []
        while heap and heap[0][0] <= now:
            _, seq, peer = heapq.heappop(heap)
            if order.get(peer) == seq and peer in sessions:  # else a stale entry: closed or replaced
                popped.append((seq, peer))
        popped.sort()
        out: list[tuple[bytes, str]] = []
        hb, dead_after, push = self._heartbeat_s, self._dead_after, heapq.heappush
        for seq, peer in popped:  # verdict() and deadline() inlined: this loop runs for every actor every second
            sess = sessions[peer]
            seen = sess.last_seen
            if now - seen > dead_after:
                del order[peer]
                out.append((peer, "dead"))
                continue
            if now - sess.last_sent >= hb:
                sess.last_sent = now
                out.append((peer, "heartbeat"))
            push(heap, (min(sess.last_sent + hb, seen + dead_after), seq, peer))
        return out
