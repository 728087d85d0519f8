"""``python -m libra.bench overload``: a burst far beyond capacity against a small real cluster.

Starts a broker with tight bounds (per-kind queue and per-client in-flight limits from ``--queue-bound``)
and ``--slots`` CPU actors, then fires ``--calls`` ``echo``/``sleep`` calls from several asyncio clients
at once, all in flight together. Every call must end as exactly one of: completed with the right output,
``Busy`` (with a retry hint), or another typed failure; ``lost`` = calls with no outcome and must be 0.
Samples the broker's resident memory throughout and reports the peak, against its idle memory (the
baseline in the same run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from libra.client import Busy, LibraError
from libra.client.aio import AsyncClient
from libra.local import LocalCluster


async def _burst(url: str, calls: int, clients: int, sleep_every: int) -> dict[str, int]:
    counts = {"completed": 0, "busy": 0, "failed": 0, "wrong": 0}
    per = calls // clients

    async def one(c: AsyncClient, i: int) -> None:
        try:
            if sleep_every and i % sleep_every == 0:
                r = await c.call_tool("sleep", {"seconds": 0.01}, timeout=300)
                ok = r.output == {"slept": 0.01}
            else:
                r = await c.call_tool("echo", i, timeout=300)
                ok = r.output == i
            counts["completed" if ok else "wrong"] += 1
        except Busy:
            counts["busy"] += 1
        except LibraError:
            counts["failed"] += 1

    async def client(k: int) -> None:
        async with AsyncClient(url) as c:
            await asyncio.gather(*(one(c, k * per + i) for i in range(per)))

    await asyncio.gather(*(client(k) for k in range(clients)))
    return counts


def run(calls: int = 100_000, clients: int = 4, slots: int = 2, queue_bound: int = 5_000,
        sleep_every: int = 100) -> dict:
    cfg = Path(tempfile.mkdtemp()) / "broker.toml"
    cfg.write_text(f"[broker]\nmax_queued_per_key = {queue_bound}\nmax_inflight_per_client = {queue_bound}\n")
    with LocalCluster(cpu_slots=slots, broker_args=["--config", str(cfg)],
                      actor_args=["--no-sandbox", "--capacity", "16"]) as cluster:
        proc = psutil.Process(cluster.broker.pid)
        idle = proc.memory_info().rss
        peak = idle
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.wait(0.05):
                peak = max(peak, proc.memory_info().rss)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        t0 = time.perf_counter()
        counts = asyncio.run(_burst(cluster.url, calls, clients, sleep_every))
        wall = time.perf_counter() - t0
        stop.set()
        t.join()
        stats = cluster.status().stats
    total = (calls // clients) * clients
    lost = total - sum(counts.values())
    return {"calls": total, **counts, "lost": lost, "wall_s": wall, "broker_rss_idle_mb": idle / 2**20,
            "broker_rss_peak_mb": peak / 2**20, "peak_over_idle": peak / idle,
            "broker_busy": stats.get("busy", 0), "broker_completed": stats.get("completed", 0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench overload", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=100_000)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--queue-bound", type=int, default=5_000)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    r = run(a.calls, a.clients, a.slots, a.queue_bound)
    if a.json:
        print(json.dumps(r))
    else:
        print(f"{r['calls']} calls in {r['wall_s']:.1f}s: completed {r['completed']}, Busy {r['busy']}, "
              f"other failures {r['failed']}, wrong output {r['wrong']}, LOST {r['lost']}")
        print(f"broker RSS: idle {r['broker_rss_idle_mb']:.1f} MB, peak {r['broker_rss_peak_mb']:.1f} MB "
              f"({r['peak_over_idle']:.2f}x idle)")
    return 0 if r["lost"] == 0 and r["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
