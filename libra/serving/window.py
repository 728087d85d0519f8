"""The serving process's load reading over a sliding window of finished requests (pure: no clock, no I/O).

A finished request counts ``ttft_s`` (arrival to its first token) and, when it produced two tokens or more,
``tpot_s``: the time per output token after the first, ``(finish - first token) / (n - 1)``. A reading
(:meth:`LoadWindow.reading`) covers the requests that finished in the last ``window_s`` seconds before
``now``; percentiles are nearest-rank (the p99 of fewer than 100 requests is their maximum) and ``None``
when the window holds no request with that figure.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["Finished", "LoadWindow", "percentile"]


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (``0 < q <= 1``) of ``values``; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


@dataclass(frozen=True, slots=True)
class Finished:
    """One finished request: when it finished, its time to first token and time per output token."""

    at: float
    ttft_s: float
    tpot_s: float | None


class LoadWindow:
    """Finished requests of the last ``window_s`` seconds (times are the caller's clock, e.g. monotonic)."""

    def __init__(self, window_s: float = 10.0) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"LoadWindow.window_s must be > 0, got {window_s!r}")
        self.window_s = float(window_s)
        self._done: deque[Finished] = deque()

    def add(self, at: float, first_at: float, arrived_at: float, tokens: int) -> Finished:
        """Count a request that arrived at ``arrived_at``, got its first token at ``first_at`` and its last
        (its ``tokens``-th) at ``at``."""
        if tokens < 1 or not arrived_at <= first_at <= at:
            raise ValueError(f"LoadWindow.add: need arrived <= first <= finish and tokens >= 1, got "
                             f"{arrived_at}, {first_at}, {at}, {tokens}")
        f = Finished(at, first_at - arrived_at, (at - first_at) / (tokens - 1) if tokens > 1 else None)
        self._done.append(f)
        return f

    def _trim(self, now: float) -> None:
        while self._done and self._done[0].at < now - self.window_s:
            self._done.popleft()

    def reading(self, now: float, running: int = 0, queued: int = 0,
                step_tpot_s: float | None = None) -> dict[str, float | int | None]:
        """The ``GET /load`` body (see ``docs/lending.md``): p50/p99 time per output token, p99 time to first
        token, finished requests in the window, the window, the requests running and queued now, and the
        running batch's time per token over its last decode steps (``step_tpot_s``, the batcher's)."""
        self._trim(now)
        tpot = [f.tpot_s for f in self._done if f.tpot_s is not None]
        ttft = [f.ttft_s for f in self._done]
        return {"p99_tpot_s": percentile(tpot, 0.99), "p50_tpot_s": percentile(tpot, 0.5),
                "p99_ttft_s": percentile(ttft, 0.99), "requests": len(self._done), "window_s": self.window_s,
                "running": running, "queued": queued, "step_tpot_s": step_tpot_s}
