"""Adoption, in the broker core: work that outlived an actor's session goes back to the actor that runs it.

An actor that loses its session (the broker restarted, or a network blip made the broker drop it) keeps
running its work and says, in its next ``ActorHello``, what it still holds: ``[work_id, lease, attempt]``
entries, for work still running and for results it has not delivered. For each entry the broker either

- *adopts* it: the work is queued here (restored from the journal, or taken back when the old session
  was dropped) and its last lease went to this actor id and is the lease the actor names; the work
  becomes leased to the new session under that lease, and the result that follows is accepted; or
- *revokes* it (``Revoke``): the work is unknown, already answered, running elsewhere, or given out
  again since (a broker restarted without a journal reuses work ids, never this actor's id and lease
  together with a queued state); the actor drops its copy.

Work restored from a journal is *parked* (queued, in no queue) until the actors that may still run it are
back. The journal's ``start`` records say which actor (``holder``) was given each started piece. When a
holder says hello again, it lists everything it holds, so whatever of its restored work it does not claim
is queued at once, and the journaled start it does not claim is taken back from the work's ``attempt`` (the
hello lists everything the actor runs and every result it may not have delivered, so that start never reached
it); once every holder is back, the work that never started is queued too (no actor can be running it). The grace period (long enough for every surviving actor to notice the restart, back off and
say hello again) is only the upper bound, for holders that never come back (they died with the broker):
what is still parked then is queued and runs again, and its ``attempt`` counts that new start. So a broker
restart never runs a piece of work twice while its actor lives, and waits for no one it has heard from.

Pure: no I/O; what to send comes out as commands.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from libra.protocol import messages as m

from .config import BrokerConfig
from .dispatch import Dispatcher
from .events import Command, Log, Send
from .journal import start_record
from .sessions import ACTOR_MAX_BACKOFF_S, ActorSession, SessionRegistry
from .work import Work, WorkState
from .work_table import WorkTable

__all__ = ["ACTOR_MAX_BACKOFF_S", "Adoption", "parse_held"]

#: The most ``held`` entries one hello may carry (the rest are ignored: their work is re-queued).
MAX_HELD = 100_000


def parse_held(held: Any) -> list[tuple[str, int, int]]:
    """The well-formed ``[work_id, lease, attempt]`` entries of a hello (peer input: never raises)."""
    out: list[tuple[str, int, int]] = []
    if type(held) is not list:
        return out
    for e in held[:MAX_HELD]:
        if type(e) is list and len(e) >= 2 and type(e[0]) is str and type(e[1]) is int and e[1] > 0:
            attempt = e[2] if len(e) > 2 and type(e[2]) is int else 1
            out.append((e[0], e[1], max(1, attempt)))
    return out


class Adoption:
    """The grace period of restored work and the adoption of held work at hello (module docstring)."""

    def __init__(self, config: BrokerConfig, counters: dict[str, int], sessions: SessionRegistry,
                 table: WorkTable, dispatch: Dispatcher) -> None:
        self.config = config
        self.stats = counters
        self.sessions = sessions
        self.table = table
        self.dispatch = dispatch
        self.grace_s = 2 * config.heartbeat_s * config.liveness + ACTOR_MAX_BACKOFF_S
        self.grace_until: float | None = None
        self.awaited: set[str] = set()  # holders of parked work that have not said hello since the restore

    def restored(self, now: float) -> None:
        """Work was restored from a journal (parked): start the grace period and await its holders."""
        if self.table.parked:
            self.grace_until = now + self.grace_s
            self.awaited = {h for h in (self.table.works[wid].holder for wid in self.table.parked) if h}

    def returned(self, actor_id: str, now: float, out: list[Command]) -> None:
        """Actor ``actor_id`` said hello (after :meth:`adopt`, after its Welcome): the parked work it was given
        and did not claim is queued now; once every holder is back, so is the work that never started."""
        if self.grace_until is None or actor_id not in self.awaited:
            return
        self.awaited.discard(actor_id)
        for wid in self.table.parked:  # its hello lists all it runs and every result not surely delivered: a
            w = self.table.works[wid]  # start of its that it does not claim never reached it, so it is no attempt
            if w.holder == actor_id and w.attempt > 0:
                w.attempt -= 1
        self._release(now, out, f"{actor_id} is back",
                      lambda w: w.holder == actor_id or (not w.holder and not self.awaited))

    def _release(self, now: float, out: list[Command], why: str, which: Callable[[Work], bool] | None = None) -> None:
        """Queue the parked work ``which`` accepts (None: all of it)."""
        left = self.table.unpark(which)
        if not self.table.parked:
            self.grace_until = None
            self.awaited = set()
        if not left:
            return
        scheduled = self.dispatch.actions is not None
        for w in left:
            if w.kind == "generate" and w.trajectory:
                self.dispatch.route_generate(w, now, out)
            elif w.kind == "action" and scheduled:
                self.table.push(w)  # the action policy starts it (below)
            else:
                self.dispatch.offer(w, now, out)
        if scheduled:
            self.dispatch.schedule_actions(now, out)
        out.append(Log("restored_work_queued", {"queued": len(left), "adopted": self.stats.get("adopted", 0),
                                                "why": why,
                                                "still_parked": len(self.table.parked)}))

    def keep(self, old: ActorSession, held: list[tuple[str, int, int]]) -> list[Work]:
        """A reconnecting actor's old session is about to be dropped: take out of it the work its new hello
        still holds under the same lease (so dropping the old session does not queue that work again)."""
        kept: list[Work] = []
        works = self.table.works
        for wid, lease, _ in held:
            if wid in old.held and works[wid].lease == lease:
                w = works[wid]
                old.held.discard(wid)
                self.dispatch.release_cores(w, old)
                kept.append(w)
        return kept

    def adopt(self, sess: ActorSession, held: list[tuple[str, int, int]], kept: list[Work], now: float,
              out: list[Command]) -> None:
        """Adopt what new session ``sess`` holds, or revoke it (``kept``: from :meth:`keep`)."""
        kept_ids = set()
        for w in kept:
            self.table.transfer(w, sess.peer, sess.actor_id)
            self._hold(w, sess, now)
            kept_ids.add(w.work_id)
        adopted, revoked = len(kept), 0
        for wid, lease, attempt in held:
            if wid in kept_ids:
                continue
            w = self.table.works.get(wid)
            if w is not None and w.state is WorkState.QUEUED and lease == w.lease and w.holder == sess.actor_id:
                if w.target is not None:  # a generate turn that waited for an instance: it has one
                    t = self.sessions.actors.get(w.target)
                    if t is not None:
                        t.targeted -= 1
                    w.target = None
                self.table.unqueue(w)
                self.table.adopt(w, sess.peer, sess.actor_id, lease, attempt, now, self.config.lease_s)
                self._hold(w, sess, now)
                if self.dispatch.journaling and not self.dispatch.jobs.owns(w.client_id):
                    out.append(start_record(w))
                adopted += 1
                continue
            if w is None:
                why = "unknown or already answered"
            elif w.state is WorkState.LEASED:
                why = "running elsewhere"
            else:
                why = "superseded"
            out.append(Send(sess.peer, m.Revoke(wid, lease, why)))
            revoked += 1
        if adopted or revoked:
            self.stats["adopted"] = self.stats.get("adopted", 0) + adopted
            self.stats["revoked_at_hello"] = self.stats.get("revoked_at_hello", 0) + revoked
            out.append(Log("actor_work_adopted", {"actor": sess.actor_id, "adopted": adopted, "revoked": revoked}))

    def _hold(self, w: Work, sess: ActorSession, now: float) -> None:
        sess.held.add(w.work_id)
        self.sessions.took_work(sess)
        actions = self.dispatch.actions
        if w.kind == "action" and actions is not None:
            actions.hold(w, sess, now)

    def tick(self, now: float, out: list[Command]) -> None:
        """Queue the parked work that awaits no one (no restored work had a holder), and, at the end of the
        grace period, all the restored work no actor adopted (its actor is gone)."""
        if self.grace_until is None:
            return
        if now >= self.grace_until:
            self._release(now, out, "grace period over")
        elif not self.awaited:
            self._release(now, out, "no restored work had started")
