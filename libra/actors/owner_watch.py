"""The lent slot's owner watch: a daemon thread that polls the slot's owner plug-in (``libra.actors.owners``)
every ``every_s`` seconds and posts :class:`~libra.actors.lending.OwnerChanged` to the actor core when the
owner's answer flips (allow to reclaim, or back). The first reading is posted only when it is a reclaim: a
slot starts lent and bidding. A plug-in that raises is logged and read as a reclaim with its owner's usual
deadline (the safe side: the GPU is the owner's). I/O shell only; the decisions are the core's."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from libra.logging import get_logger

from .lending import OwnerChanged

__all__ = ["OwnerWatch"]

log = get_logger("libra.actor.owner")


class OwnerWatch:
    def __init__(self, owner: Any, post: Callable[[Any], None], *, every_s: float = 0.2,
                 clock: Callable[[], float] = time.time) -> None:
        self.owner, self.post, self.every_s, self.clock = owner, post, every_s, clock
        self.allow = True
        self.flips = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="owner-watch", daemon=True)

    def start(self) -> OwnerWatch:
        self._thread.start()
        return self

    def poll_once(self) -> OwnerChanged | None:
        """Read the owner once; the event to post when its answer flipped (else None)."""
        try:
            sig = self.owner.poll(self.clock())
            allow, deadline_s, reason = sig.allow, sig.deadline_s, sig.reason
        except Exception as exc:  # noqa: BLE001 -- a plug-in's failure must not kill the slot
            log.warning("owner_poll_failed", owner=getattr(self.owner, "name", "?"), error=f"{type(exc).__name__}: {exc}")
            allow, deadline_s, reason = False, 5.0, "owner_unreadable"
        if allow == self.allow:
            return None
        self.allow = allow
        self.flips += 1
        log.info("owner_changed", owner=getattr(self.owner, "name", "?"), allow=allow, deadline_s=deadline_s,
                 reason=reason)
        return OwnerChanged(allow, deadline_s, reason)

    def _run(self) -> None:
        while not self._stop.is_set():
            ev = self.poll_once()
            if ev is not None:
                self.post(ev)
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        close = getattr(self.owner, "close", None)
        if close is not None:
            close()
