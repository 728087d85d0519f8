"""A steady stream of requests from a background thread, for tests that change the cluster under load."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any


class SteadyLoad:
    """Submits ``one(i)`` for i = 0, 1, ... to ``pool`` every ``period_s`` until :meth:`stop`, which waits for
    every submitted call: ``results`` holds their return values, ``errors`` what any of them raised."""

    def __init__(self, pool: Executor, one: Callable[[int], Any], period_s: float = 0.02) -> None:
        self.pool, self.one, self.period_s = pool, one, period_s
        self.submitted = 0
        self.results: list[Any] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def start(self) -> SteadyLoad:
        self._thread.start()
        return self

    def stop(self, timeout: float = 300) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        futs = []
        while not self._stop.is_set():
            futs.append(self.pool.submit(self.one, self.submitted))
            self.submitted += 1
            time.sleep(self.period_s)
        for f in futs:
            try:
                self.results.append(f.result())
            except Exception as exc:  # recorded: the test's assertion names it
                self.errors.append(repr(exc))
