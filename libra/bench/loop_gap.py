"""The longest gap of a simulated event loop while a worker thread runs (GIL sharing included)."""

from __future__ import annotations

import threading
import time

__all__ = ["loop_gaps_while"]


def loop_gaps_while(worker: threading.Thread) -> float:
    """Start ``worker``; return the longest gap (s) between iterations of a loop doing 0.5 ms sleeps
    (the broker loop's stand-in) until it ends. At least one iteration, so the gap is never 0."""
    worker.start()
    last = time.perf_counter()
    worst = 0.0
    while True:
        time.sleep(0.0005)
        now = time.perf_counter()
        worst = max(worst, now - last)
        last = now
        if not worker.is_alive():
            break
    worker.join()
    return worst
