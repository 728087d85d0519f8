"""The lent slot's half of the actor core: what a slot whose GPU belongs to an owner does when the owner
takes it back, and when the owner lends it again. Pure, like :class:`~libra.actors.state.ActorState`, whose
``handle`` calls into here (this module is its part, not a component of its own: it moves the core through
the core's own transitions).

A slot is lent when its identity's labels say so (``labels["lend"] = {"owner": NAME, ...}``: ``python -m
libra.actors --lend``). The shell polls the owner plug-in (``libra.actors.owners``) and posts
:class:`OwnerChanged` when its answer flips.

Reclaim (``OwnerChanged(allow=False, deadline_s=D)``), at ``now``:

1. ``OwnerReclaim(owner, D, reason)`` goes to the broker (or, without a session, after the next ``Welcome``):
   it sends no more work and moves the trajectories pinned here;
2. assignments waiting beyond capacity go back at once (``Handback``);
3. a local switch to no kinds starts (a directive of the slot's own, negative id, never reported to the
   broker; a broker directive draining at that moment keeps its id and becomes this switch, so the broker
   hears ``DirectiveDone(id, [])``). Running turns may finish until the hand-back point
   ``now + D - margin`` (``margin = min(1 s, D / 5)``: time for the hand-backs and the broker's re-routes
   to land before the deadline); what still runs then is cancelled and handed back (``Handback``, reason
   ``owner_reclaim``), and the broker runs it elsewhere;
4. the engine stays up, serving its contexts to the instances the trajectories moved to, until the
   hand-back point or the broker's ``ContextsMoved`` (every one of them has moved), whichever is first; then
   the switch releases it (``Reconfigure`` with no kinds: ``HybridRole.reconfigure`` closes the engine and
   frees its memory) and the slot bids for nothing. ``Note("owner_handback")`` says how long before the
   deadline the GPU was free (``slack_s``; negative: late).

While reclaimed the slot takes no broker directive (answered at once with ``DirectiveDone(id, [])``).

Lend again (``OwnerChanged(allow=True)``): once the release is done, a local switch back to the slot's lent
kinds rebuilds the engine and ends in an ordinary ``Bid`` (the broker counts the capacity back). An allow that
arrives before the release finished waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from libra.protocol import messages as m
from libra.protocol.payloads_lend import lend_label

from .commands import CancelWork, Note
from .phases import ActorPhase

__all__ = ["LendCore", "OwnerChanged"]


@dataclass(frozen=True, slots=True)
class OwnerChanged:
    """The owner's answer flipped (see the module docstring): ``allow``, or take the GPU back within
    ``deadline_s`` seconds for ``reason``."""

    allow: bool
    deadline_s: float = 0.0
    reason: str = ""


class LendCore:
    """A lent slot's state (``owner`` "" for a slot the job owns: every method then does nothing)."""

    def __init__(self, labels: dict[str, Any], kinds: list[str]) -> None:
        lend = lend_label(labels)  # the slot's own labels: a malformed one is a set-up error, raised here
        self.owner = lend.owner if lend is not None else ""
        self.kinds = list(kinds)  # what the slot bids for while lent
        self.reclaimed = False
        self.reason = ""
        self.deadline_at = 0.0
        self.handback_at = 0.0
        self.contexts_moved = False
        self.released = False  # the engine was released for the current reclaim
        self.allow_pending = False  # lent again before the release finished
        self.reported = True  # the broker heard of the current reclaim
        self.next_id = -1
        self.stats = {"reclaims": 0, "handed_back": 0, "lent_again": 0}

    def holding(self, now: float) -> bool:
        """Whether a reclaimed slot's switch must still wait (the contexts may still be fetched)."""
        return self.reclaimed and not self.released and not self.contexts_moved and now < self.handback_at

    def _local(self, kinds: list[str], role: str) -> m.Directive:
        d = m.Directive(self.next_id, list(kinds), "handback", {"role": role})
        self.next_id -= 1
        return d

    # ------------------------------------------------------------------ events
    def on_owner(self, a: Any, ev: OwnerChanged, now: float, out: list[Any]) -> None:
        if not self.owner:
            out.append(Note("owner_signal_ignored", {"why": "this slot is not lent"}, "warning"))
            return
        if not ev.allow:
            if self.reclaimed:
                self.deadline_at = min(self.deadline_at, now + ev.deadline_s)  # a second notice: the earlier holds
                self.handback_at = min(self.handback_at, self.deadline_at)
                return
            self._reclaim(a, ev, now, out)
            return
        if not self.reclaimed:
            return
        if not self.released:
            self.allow_pending = True
            return
        self._lend_again(a, now, out)

    def _reclaim(self, a: Any, ev: OwnerChanged, now: float, out: list[Any]) -> None:
        margin = min(1.0, ev.deadline_s / 5)
        self.reclaimed, self.released, self.contexts_moved, self.allow_pending = True, False, False, False
        self.reason = ev.reason
        self.deadline_at = now + ev.deadline_s
        self.handback_at = self.deadline_at - margin
        self.stats["reclaims"] += 1
        out.append(Note("owner_reclaim", {"owner": self.owner, "deadline_s": ev.deadline_s, "reason": ev.reason,
                                          "running": len(a.running)}))
        self.reported = a.phase is not ActorPhase.CONNECTING
        if self.reported:
            a._send(m.OwnerReclaim(self.owner, ev.deadline_s, ev.reason), now, out)
        for w in a.waiting:
            a._send(m.Handback(w.work_id, w.lease, "owner_reclaim"), now, out)
            self.stats["handed_back"] += 1
        a.waiting.clear()
        release = self._local([], "lent_out")
        if a.phase is ActorPhase.READY:
            a.directive = release
            a._go(ActorPhase.DRAINING)
        elif a.phase is ActorPhase.DRAINING and a.directive is not None:  # the broker's: it becomes the release
            a.directive = m.Directive(a.directive.directive_id, [], "handback", {"role": "lent_out"})
        elif a.phase is ActorPhase.SWITCHING:
            a.next_directive = release
        else:  # connecting: the release starts after the Welcome
            a.next_directive = release
        a._maybe_switch(now, out)

    def _lend_again(self, a: Any, now: float, out: list[Any], after_switch: bool = False) -> None:
        """The owner lends the slot again: a switch back to its lent kinds, now when the slot is ready, else (or
        ``after_switch``: the switch that just ended still has its bid to send) once the current switch ends."""
        self.reclaimed = self.released = self.allow_pending = False
        self.stats["lent_again"] += 1
        out.append(Note("owner_lends", {"owner": self.owner}))
        back = self._local(self.kinds, "rollout")
        if a.phase is ActorPhase.READY and not after_switch:
            a.directive = back
            a._go(ActorPhase.DRAINING)
            a._maybe_switch(now, out)
        else:
            a.next_directive = back

    def on_welcome(self, a: Any, now: float, out: list[Any]) -> None:
        """A new session (the slot just bid): a reclaim not yet released is told to this broker with what is
        left of its deadline, and its release starts again; a slot lent again while it had no session switches
        back to its lent kinds."""
        if self.reclaimed and not self.released:
            a._send(m.OwnerReclaim(self.owner, max(0.0, self.deadline_at - now), self.reason), now, out)
            self.reported = True
            a.directive = self._local([], "lent_out")
        elif not self.reclaimed and self.owner and not a.kinds and a.group[2] == 0:
            a.directive = self._local(self.kinds, "rollout")
        else:
            return
        a.next_directive = None
        a._go(ActorPhase.DRAINING)
        a._maybe_switch(now, out)

    def on_moved(self, a: Any, now: float, out: list[Any]) -> None:
        if self.reclaimed:
            self.contexts_moved = True
            a._maybe_switch(now, out)

    def on_tick(self, a: Any, now: float, out: list[Any]) -> None:
        """At the hand-back point: cancel and hand back what still runs, then let the release go on."""
        if not self.reclaimed or self.released or now < self.handback_at:
            return
        for wid, lease in list(a.running.items()):
            del a.running[wid]
            a.started.pop(wid, None)
            out.append(CancelWork(wid, "owner_reclaim"))
            a._send(m.Handback(wid, lease, "owner_reclaim"), now, out)
            self.stats["handed_back"] += 1
        a._maybe_switch(now, out)

    def on_released(self, a: Any, d: m.Directive, now: float, out: list[Any]) -> bool:
        """A switch ended: the release of a reclaim (say how it went against the deadline). Returns whether the
        switch was the slot's own (no ``DirectiveDone`` for the broker)."""
        if self.reclaimed and not d.kinds and not self.released:
            self.released = True
            out.append(Note("owner_handback", {"owner": self.owner, "slack_s": round(self.deadline_at - now, 4),
                                               "handed_back": self.stats["handed_back"],
                                               "contexts_moved": self.contexts_moved}))
            if self.allow_pending:
                self._lend_again(a, now, out, after_switch=True)
        return d.directive_id < 0
