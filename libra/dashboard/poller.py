"""The dashboard's one client of the broker: a status request every ``interval_s`` seconds, and a ``JobPoll``
for a job whose summary changed since its last poll (its new step and decision records, from its cursor, a page of
``page_size`` records at a time until the broker says none is left). Read
only: it sends nothing else (no cancel, no directive). Each poll's view is serialised once and handed to every
``/api/events`` subscriber; a subscriber that falls behind loses old events, never the newest."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from libra import strict_json
from libra.client.errors import LibraError
from libra.protocol.messages import JOB_POLL_LIMIT

from .history import History

__all__ = ["Poller"]

SUBSCRIBER_QUEUE = 4  # events a slow page may have waiting before the oldest is dropped
MAX_PAGES = 20  # JobPoll pages one job may take in one poll; the rest waits for the next


def _job_mark(summary: Any) -> str:
    """What in a job's status summary says it has new records (steps, decisions, state)."""
    if not isinstance(summary, dict):
        return ""
    return json.dumps([summary.get(k) for k in ("state", "steps_done", "decisions", "error")], default=str)


class Poller:
    """Polls through ``client`` (an :class:`~libra.client.aio.AsyncClient`, or anything with its ``status`` and
    ``job_poll``) into ``history``; ``clock``: the wall clock the history's times are on."""

    def __init__(self, client: Any, history: History, interval_s: float = 1.0, timeout_s: float | None = None,
                 clock: Any = time.time, page_size: int = JOB_POLL_LIMIT) -> None:
        self.client, self.history, self.interval_s = client, history, interval_s
        self.page_size = page_size  # records per JobPoll reply
        self.timeout_s = timeout_s if timeout_s is not None else max(2.0, 3 * interval_s)
        self.clock = clock
        self.latest = strict_json.dumps(history.view())
        self._subscribers: set[asyncio.Queue[str | None]] = set()
        self._job_marks: dict[str, str] = {}

    async def poll_once(self) -> None:
        """One status request (and the job polls it calls for); the history records an unanswered one."""
        try:
            snap = await self.client.status(timeout=self.timeout_s)
        except LibraError as exc:
            self.history.failed(self.clock(), f"{type(exc).__name__}: {exc}")
        else:
            now = self.clock()
            self.history.add(now, list(snap.actors), dict(snap.queues), dict(snap.stats))
            for name, summary in (snap.stats.get("jobs") or {}).items():
                mark = _job_mark(summary)
                if self._job_marks.get(name) == mark:
                    continue
                if await self._poll_job(name):
                    self._job_marks[name] = mark
        self.publish()

    async def _poll_job(self, name: str) -> bool:
        """Job ``name``'s new records into the history, a page (``JobPoll.limit``) at a time until the broker
        says none is left (``more``); False when a poll is refused or unanswered (asked again at its next
        change, from the cursor the pages already read reached)."""
        for _ in range(MAX_PAGES):
            try:
                reply = await self.client.job_poll(name, self.history.job_cursor(name), timeout=self.timeout_s,
                                                   limit=self.page_size)
            except LibraError:
                return False  # gone meanwhile, or refused
            if not isinstance(reply, dict):
                return True
            self.history.add_job(name, self.clock(), reply)
            if not reply.get("more"):
                return True
        return False  # still more after MAX_PAGES: the rest at the next poll (the mark is left unset)

    def publish(self) -> None:
        self.latest = strict_json.dumps(self.history.view())
        for q in self._subscribers:
            if q.full():
                q.get_nowait()
            q.put_nowait(self.latest)

    def close(self) -> None:
        """End every event stream (the server is stopping): each subscriber gets ``None``."""
        for q in self._subscribers:
            if q.full():
                q.get_nowait()
            q.put_nowait(None)

    def subscribe(self) -> asyncio.Queue[str | None]:
        q: asyncio.Queue[str | None] = asyncio.Queue(SUBSCRIBER_QUEUE)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[str | None]) -> None:
        self._subscribers.discard(q)

    async def run(self) -> None:
        """Poll every ``interval_s`` seconds (from the start of one poll to the next) until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await self.poll_once()
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - t0)))
