"""Lent slots: rollout capacity whose GPU belongs to an owner, taken back by the owner with a deadline.

Pure: owned by :class:`~libra.broker.state.BrokerState`, no I/O. A slot is lent when its hello says so
(``labels["lend"] = {"owner": NAME, ...}``, ``python -m libra.actors --lend``); it bids for ``generate`` like any
rollout instance while its owner allows it, and never for ``train`` (its capabilities have none, and the plan
applier and the Elastic Hybrid Pool pass it over). When the owner wants the GPU back the slot sends
``OwnerReclaim(owner, deadline_s, reason)``, and here:

- the slot gets no more work at once (it accepts nothing), and the turns queued for it may run on any
  instance of their bucket;
- every trajectory pinned to it is unpinned: its next turn goes where the router puts it, and moves its KV
  from the slot (``Assign.route["mode"] = "kv"``, the existing migration path: the new instance fetches it
  from the slot's data-plane server) when ``context tokens × kv_move_s_per_token`` still fits before the
  deadline, else re-prefills from the session's token ids (``"reprefill"``). A KV fetch that fails falls back
  to the ids by itself (``libra.actors.rollout_context``), so a late move costs time, never tokens;
- the turns the slot cannot finish by the deadline come back as ``Handback`` (the actor core decides) and are
  re-queued at the front, not counted as a loss (``attempts`` counts the start on the slot: it did start);
- once each of those trajectories has run a turn elsewhere or ended, and the slot holds no work, the slot is
  told ``ContextsMoved``: nothing needs its contexts, it may free its engine before the deadline;
- work the slot still holds ``reclaim_grace_s`` after the deadline is revoked and re-queued (a backstop for
  an actor that did not hand back in time: the GPU is the owner's by then).

The planner sees the capacity go like any change in who accepts ``generate`` (the round after the reclaim
plans without it). The slot's ordinary ``Bid(["generate"], n)`` after its owner lends it again ends the
reclaim. Counters go to ``status()`` (``lending``) and each reclaim and return is a log line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from libra.protocol import messages as m
from libra.protocol.errors import ProtocolCode
from libra.protocol.payloads_lend import lend_label

from .events import Command, Log, Send

__all__ = ["Lending", "Reclaim"]


@dataclass(slots=True)
class Reclaim:
    """One slot being handed back to its owner."""

    owner: str
    reason: str
    at: float
    deadline: float
    pending: set[str] = field(default_factory=set)  # trajectories pinned here that have not moved yet
    moved_sent: bool = False
    released_at: float | None = None  # when the slot bid for nothing: its engine released, the GPU the owner's


class Lending:
    """See the module docstring. ``dispatch`` is the broker's :class:`~libra.broker.dispatch.Dispatcher`."""

    def __init__(self, config: Any, sessions: Any, rollout: Any, table: Any, dispatch: Any) -> None:
        self.config, self.sessions, self.rollout, self.table, self.dispatch = config, sessions, rollout, table, dispatch
        self.reclaims: dict[str, Reclaim] = {}  # actor id -> its reclaim in progress
        self.evicted: dict[str, str] = {}  # trajectory -> the reclaimed slot it was pinned to
        self.stats = dict.fromkeys(("reclaims", "lent_again", "moved_kv", "moved_reprefill", "takebacks",
                                    "contexts_moved"), 0)
        self.slack: list[float] = []  # the last reclaims' deadline minus release time (negative: late)

    # ------------------------------------------------------------------ sessions
    def hello(self, sess: Any) -> None:
        """A new session: mark a lent slot (a reconnect during a reclaim stays reclaimed)."""
        lend = lend_label(sess.labels)  # checked at the hello (BrokerState refuses a malformed one)
        sess.lent_owner = lend.owner if lend is not None else ""
        r = self.reclaims.get(sess.actor_id)
        if r is not None and sess.lent_owner:
            sess.reclaimed_until = r.deadline
            sess.accepting = frozenset()

    def gone(self, actor_id: str) -> None:
        """The slot's session ended: its trajectories are the router's to place (as for any lost instance)."""
        if self.reclaims.pop(actor_id, None) is not None:
            self.evicted = {t: a for t, a in self.evicted.items() if a != actor_id}

    def bid(self, sess: Any, now: float, out: list[Command]) -> bool:
        """An ordinary bid. A reclaimed slot's first bid for nothing says its engine is released: the hand-back
        is timed against the deadline (``slack``). A reclaimed slot that bids for ``generate`` was lent again
        (returns True then)."""
        if not sess.reclaimed_until:
            return False
        if "generate" not in sess.accepting:
            r = self.reclaims.get(sess.actor_id)
            if r is not None and r.released_at is None:
                self._handed_back(sess.actor_id, r, now, out)
            return False
        r = self.reclaims.pop(sess.actor_id, None)
        if r is not None and r.released_at is None:  # lent again before its empty bid: it released by now at latest
            self._handed_back(sess.actor_id, r, now, out, at_latest=True)
        sess.reclaimed_until = 0.0
        self.evicted = {t: a for t, a in self.evicted.items() if a != sess.actor_id}
        self.stats["lent_again"] += 1
        out.append(Log("capacity_lent", {"actor": sess.actor_id, "owner": sess.lent_owner,
                                         "away_s": round(now - r.at, 3) if r else None}))
        return True

    def _handed_back(self, actor_id: str, r: Reclaim, now: float, out: list[Command], at_latest: bool = False) -> None:
        """Time the release against the deadline (``at_latest``: the slot was lent again first, so ``now`` bounds
        its release and the slack is a lower bound)."""
        r.released_at = now
        self.slack = [*self.slack[-19:], round(r.deadline - now, 4)]
        out.append(Log("capacity_handed_back", {"actor": actor_id, "owner": r.owner, "slack_s": self.slack[-1],
                                                "after_s": round(now - r.at, 4), "at_latest": at_latest}))

    # ------------------------------------------------------------------ the reclaim
    def reclaim(self, sess: Any, msg: m.OwnerReclaim, now: float, out: list[Command]) -> bool:
        """The owner of ``sess`` wants its GPU back. Returns whether anything changed (False for a slot that is
        not lent, answered with an ``Error``)."""
        if not sess.lent_owner:
            out.append(Send(sess.peer, m.Error(ProtocolCode.BAD_TYPE.value,
                                               "OwnerReclaim from a slot that is not lent (no labels['lend'])")))
            return False
        deadline = now + max(0.0, float(msg.deadline_s))
        r = self.reclaims.get(sess.actor_id)
        if r is not None:  # a second notice: the earlier deadline holds
            r.deadline = min(r.deadline, deadline)
            sess.reclaimed_until = r.deadline
            return False
        pinned = {t for t, tr in self.rollout.trajs.items() if tr.instance == sess.actor_id}
        r = self.reclaims[sess.actor_id] = Reclaim(msg.owner or sess.lent_owner, msg.reason, now, deadline, pinned)
        self.stats["reclaims"] += 1
        sess.reclaimed_until = deadline
        sess.accepting = frozenset()
        for t in pinned:
            self.rollout.requeue_target_lost(t)
            self.evicted[t] = sess.actor_id
        self.dispatch.release_targets(sess.peer)
        self.dispatch.refill_others(sess, now, out)
        out.append(Log("capacity_reclaimed", {"actor": sess.actor_id, "owner": r.owner, "reason": msg.reason,
                                              "deadline_s": round(deadline - now, 3), "trajectories": len(pinned),
                                              "running": len(sess.held)}))
        self._maybe_moved(sess.actor_id, r, out)
        return True

    def route(self, traj: str, context_tokens: int, route: dict[str, Any], now: float) -> None:
        """The turn of ``traj`` just routed (``route``, the Assign's): a trajectory leaving a reclaimed slot moves
        its KV iff that fits before the deadline."""
        src = self.evicted.get(traj)
        r = self.reclaims.get(src) if src is not None else None
        if r is None:
            return
        fits = now + context_tokens * self.config.kv_move_s_per_token < r.deadline
        route["mode"] = "kv" if fits else "reprefill"
        route["reclaimed_from"] = src
        self.stats["moved_kv" if fits else "moved_reprefill"] += 1

    def turn_done(self, traj: str, actor_id: str, out: list[Command]) -> None:
        """A turn of ``traj`` finished on ``actor_id``: if it left a reclaimed slot, it no longer needs it."""
        src = self.evicted.get(traj)
        if src is not None and src != actor_id:
            self._moved(traj, src, out)

    def ended(self, traj: str, out: list[Command]) -> None:
        src = self.evicted.get(traj)
        if src is not None:
            self._moved(traj, src, out)

    def work_left(self, sess: Any, out: list[Command]) -> None:
        """``sess`` gave back or finished a piece of work: a reclaimed slot may now be told its contexts moved."""
        r = self.reclaims.get(sess.actor_id)
        if r is not None:
            self._maybe_moved(sess.actor_id, r, out)

    def _moved(self, traj: str, src: str, out: list[Command]) -> None:
        del self.evicted[traj]
        r = self.reclaims.get(src)
        if r is not None:
            r.pending.discard(traj)
            self._maybe_moved(src, r, out)

    def _maybe_moved(self, actor_id: str, r: Reclaim, out: list[Command]) -> None:
        sess = self.sessions.actor_by_id(actor_id)
        if r.moved_sent or r.pending or sess is None or sess.held:
            return
        r.moved_sent = True
        self.stats["contexts_moved"] += 1
        out.append(Send(sess.peer, m.ContextsMoved(r.owner)))

    def tick(self, now: float, out: list[Command]) -> None:
        """Past a deadline: trajectories that never came back need no context there; past the grace, work the
        slot still holds is revoked and re-queued."""
        for actor_id, r in list(self.reclaims.items()):
            if now < r.deadline:
                continue
            if r.pending:
                for t in r.pending:
                    self.evicted.pop(t, None)
                r.pending.clear()
                self._maybe_moved(actor_id, r, out)
            sess = self.sessions.actor_by_id(actor_id)
            if sess is None or not sess.held or now < r.deadline + self.config.reclaim_grace_s:
                continue
            for wid in sorted(sess.held, key=lambda x: self.table.works[x].seq):
                self.dispatch.take_back(self.table.works[wid], sess, now, out, "owner's deadline passed",
                                        count_failure=False, front=True)
                self.stats["takebacks"] += 1
            out.append(Log("reclaim_takeback", {"actor": actor_id, "owner": r.owner,
                                                "late_s": round(now - r.deadline, 3)}, "warning"))
            self._maybe_moved(actor_id, r, out)

    def summary(self) -> dict[str, Any]:
        """For status: the counters and each reclaim in progress."""
        return {**self.stats, "handback_slack_s": list(self.slack), "reclaimed": {a: {"owner": r.owner, "reason": r.reason, "deadline_at": r.deadline,
                                                "pending": len(r.pending)} for a, r in self.reclaims.items()}}
