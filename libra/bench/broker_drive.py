"""The sync client's two call-path measures, shared by ``libra.bench.broker`` and its ``--trace-hops`` mode, and
the CPU accounting of the broker benches (``broker``, ``broker --scale``)."""

from __future__ import annotations

import time
from collections import deque

from libra.client import Client


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its live descendants so far (0 if it is gone)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            total += sum(p.cpu_times()[:2])
        except psutil.Error:  # exited meanwhile
            continue
    return total


def cpu_per_call(pids: dict[str, int], calls: int, before: dict[str, float] | None = None) -> dict[str, float]:
    """CPU seconds so far of each named process tree (and this process, ``client``); with ``before``, the µs
    per call since then."""
    now = {name: cpu_s(pid) for name, pid in pids.items()} | {"client": time.process_time()}
    if before is None:
        return now
    return {name: (now[name] - before[name]) / calls * 1e6 for name in now}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]



def drive(c: Client, n: int, window: int) -> tuple[list[float], float]:
    """``n`` sequential echo calls (latencies), then ``3 n`` calls with ``window`` in flight (calls/s).
    Every result is checked: a wrong or missing one raises."""
    for i in range(300):
        c.call_tool("echo", i)
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        r = c.call_tool("echo", {"i": i})
        lat.append(time.perf_counter() - t0)
        if r.output != {"i": i}:
            raise RuntimeError(f"echo {i} returned {r.output!r}")
    total = n * 3
    window_q: deque = deque()
    bad = 0
    t0 = time.perf_counter()
    for i in range(total):
        if len(window_q) >= window:
            j, fut = window_q.popleft()
            (r,) = c.gather([fut])
            bad += getattr(r, "output", None) != j
        window_q.append((i, c.submit_tool("echo", i)))
    for j, fut in window_q:
        (r,) = c.gather([fut])
        bad += getattr(r, "output", None) != j
    tput = total / (time.perf_counter() - t0)
    if bad:
        raise RuntimeError(f"{bad} pipelined calls returned a wrong result")
    return lat, tput
