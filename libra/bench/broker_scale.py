"""Broker throughput over actors × client processes (``python -m libra.bench broker --scale``).

For each actor count (2, 8, 32 actor slots, echo handlers) a real broker and actor processes are
started; then 1, 2, 4 and 8 client processes each keep ``window`` echo calls in flight over the
default transport (ipc on this host) for ``seconds``. Every result is checked. Reported: total calls/s,
and the broker process's CPU seconds per wall second over the run (≈ 1.0 means its one loop is the limit).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import deque

from libra.client import Client
from libra.local import LocalCluster

from .broker_drive import cpu_s


def _client_proc(url: str, window: int, seconds: float, go: mp.Event, out: mp.Queue) -> None:
    with Client(url, connect_timeout=30) as c:
        for i in range(50):
            c.call_tool("echo", i)
        go.wait(60)
        q: deque = deque()
        done = bad = 0
        t0 = time.perf_counter()
        end = t0 + seconds
        i = 0
        while time.perf_counter() < end:
            if len(q) >= window:
                j, fut = q.popleft()
                (r,) = c.gather([fut])
                bad += getattr(r, "output", None) != j
                done += 1
            q.append((i, c.submit_tool("echo", i)))
            i += 1
        for j, fut in q:
            (r,) = c.gather([fut])
            bad += getattr(r, "output", None) != j
            done += 1
        out.put((done, bad, time.perf_counter() - t0))


def measure(cluster: LocalCluster, clients: int, window: int, seconds: float) -> dict:
    ctx = mp.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client_proc, args=(cluster.url, window, seconds, go, out)) for _ in range(clients)]
    for p in procs:
        p.start()
    time.sleep(1.0 + 0.2 * clients)  # let them connect and warm up
    assert cluster.broker is not None
    cpu0, t0 = cpu_s(cluster.broker.pid), time.monotonic()
    go.set()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    cpu1, t1 = cpu_s(cluster.broker.pid), time.monotonic()
    for p in procs:
        p.join(10)
    done = sum(r[0] for r in results)
    bad = sum(r[1] for r in results)
    if bad:
        raise RuntimeError(f"{bad} calls returned a wrong result")
    wall = max(r[2] for r in results)
    return {"clients": clients, "calls_per_s": done / wall, "calls": done,
            "broker_cpu_per_s": (cpu1 - cpu0) / (t1 - t0)}


def sweep(actors: tuple[int, ...] = (2, 8, 32), clients: tuple[int, ...] = (1, 2, 4, 8), window: int = 100,
          seconds: float = 3.0) -> list[dict]:
    rows = []
    for n_actors in actors:
        with LocalCluster(cpu_slots=n_actors, actor_args=["--no-sandbox", "--capacity", "64"]) as cluster:
            for n_clients in clients:
                rows.append({"actors": n_actors, **measure(cluster, n_clients, window, seconds)})
    return rows


def print_sweep(rows: list[dict]) -> None:
    print("\nthroughput sweep (each client process keeps its window of echo calls in flight):")
    print(f"{'actors':>6} {'clients':>7} {'calls/s':>9} {'broker CPU s/s':>15}")
    for r in rows:
        print(f"{r['actors']:>6} {r['clients']:>7} {r['calls_per_s']:>9.0f} {r['broker_cpu_per_s']:>15.2f}")
