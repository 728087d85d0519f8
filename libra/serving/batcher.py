"""The engine thread: batches waiting requests into the HF engine and times every token.

Batching is what :class:`~libra.engines.hf_rollout.HFRolloutEngine` allows: one ``generate`` call decodes a
batch together and drops finished rows as they end, but a call cannot take new rows. So the thread takes
every request waiting (up to ``max_batch_size``) as one batch, runs it, and takes the next batch the moment
it returns: requests that arrive during a batch wait for it (their TTFT grows with load) and larger batches
decode each token more slowly (their TPOT grows with load), which is what the owner's SLO reading sees.

Tokens reach the asyncio side once per decode step (``loop.call_soon_threadsafe``): each request's stream
queue (when it streams), and at the end its future and the :class:`~.window.LoadWindow` (touched only on the
loop's thread).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from libra.engines.rollout_base import GenRequest, GenResult
from libra.logging import get_logger

from .window import LoadWindow

__all__ = ["STEP_WINDOW", "Batcher", "Pending"]

STEP_WINDOW = 8  # decode steps of the running batch that ``step_tpot_s`` averages

log = get_logger(__name__)


@dataclass(eq=False)
class Pending:
    """One request in the batcher: its tokens stream into ``tokens`` (when given), its result into ``done``."""

    request: GenRequest
    done: asyncio.Future
    tokens: asyncio.Queue | None = None
    arrived: float = field(default_factory=time.monotonic)
    first: float | None = None
    last: float | None = None
    n: int = 0


class Batcher:
    """Runs ``engine`` (an :class:`~libra.engines.hf_rollout.HFRolloutEngine`) on a thread of its own."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, window: LoadWindow,
                 max_batch_size: int = 16) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.engine, self.loop, self.window, self.max_batch_size = engine, loop, window, max_batch_size
        self._waiting: queue.Queue[Pending | None] = queue.Queue()
        self.running = 0
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW + 1)  # the running batch's last step times
        self._thread = threading.Thread(target=self._run, name="libra-serving-engine", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return self._waiting.qsize()

    def submit(self, request: GenRequest, stream: bool = False) -> Pending:
        """Queue ``request`` (call on the loop's thread); await ``Pending.done`` for its :class:`GenResult`."""
        p = Pending(request, self.loop.create_future(), asyncio.Queue() if stream else None)
        self._waiting.put(p)
        return p

    @property
    def step_tpot_s(self) -> float | None:
        """The running batch's time per token over its last ``STEP_WINDOW`` decode steps (None: idle, or fewer
        than two steps taken); a step still running counts up to now once it is longer than the mean."""
        steps = list(self._steps)
        if not self.running or len(steps) < 2:
            return None
        mean = (steps[-1] - steps[0]) / (len(steps) - 1)
        now = time.monotonic()
        return (now - steps[0]) / len(steps) if now - steps[-1] > mean else mean  # (then above the mean)

    def reading(self) -> dict[str, float | int | None]:
        """The ``/load`` reading now (call on the loop's thread)."""
        return self.window.reading(time.monotonic(), self.running, self.queued, self.step_tpot_s)

    def close(self) -> None:
        self._waiting.put(None)
        self._thread.join(30.0)

    def _take(self) -> list[Pending] | None:
        first = self._waiting.get()
        if first is None:
            return None
        batch = [first]
        while len(batch) < self.max_batch_size:
            try:
                nxt = self._waiting.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._waiting.put(None)  # stop after this batch
                break
            batch.append(nxt)
        return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            self._steps.clear()
            self.running = len(batch)

            def on_tokens(got: list[tuple[int, int]], batch: list[Pending] = batch) -> None:
                now = time.monotonic()
                self._steps.append(now)
                out = []
                for i, tok in got:
                    p = batch[i]
                    p.first = now if p.first is None else p.first
                    p.last, p.n = now, p.n + 1
                    if p.tokens is not None:
                        out.append((p.tokens, tok))
                if out:
                    self.loop.call_soon_threadsafe(_deliver_tokens, out)

            try:
                results: list[GenResult] | BaseException = self.engine.generate(
                    [p.request for p in batch], on_tokens=on_tokens)
            except Exception as exc:  # a bad batch fails its requests, never the thread
                log.exception("serving_batch_failed", size=len(batch))
                results = exc
            self.running = 0
            self.loop.call_soon_threadsafe(self._finish, batch, results)

    def _finish(self, batch: list[Pending], results: list[GenResult] | BaseException) -> None:
        if isinstance(results, BaseException):
            for p in batch:
                _settle(p, exc=results)
            return
        for p, res in sorted(zip(batch, results), key=lambda pr: pr[0].last or 0.0):
            if p.first is not None and p.last is not None:
                self.window.add(p.last, p.first, min(p.arrived, p.first), p.n)
            _settle(p, result=res)


def _deliver_tokens(out: list[tuple[asyncio.Queue, int]]) -> None:
    for q, tok in out:
        q.put_nowait(tok)


def _settle(p: Pending, result: GenResult | None = None, exc: BaseException | None = None) -> None:
    if p.tokens is not None:
        p.tokens.put_nowait(None)  # end of stream
    if p.done.done():  # the client went away
        return
    if exc is not None:
        p.done.set_exception(exc)
    else:
        p.done.set_result(result)
