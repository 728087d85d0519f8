"""``python -m libra demo``: a local broker + actors and a demonstration workload through them.

Runs concurrent ``echo`` and ``sleep`` tool calls from an asyncio client, checks every answer, prints
throughput and latency, then the cluster status, and stops everything.
"""

from __future__ import annotations

import asyncio
import time

from tqdm import tqdm

from libra.commands.status import format_status
from libra.client.aio import AsyncClient
from libra.local import LocalCluster


async def _workload(url: str, calls: int) -> tuple[int, list[float]]:
    lat: list[float] = []
    ok = 0
    sem = asyncio.Semaphore(100)
    async with AsyncClient(url) as c:
        bar = tqdm(total=calls, desc="tool calls", unit="call")

        async def one(i: int) -> None:
            nonlocal ok
            async with sem:
                t0 = time.perf_counter()
                if i % 100 == 99:
                    r = await c.call_tool("sleep", {"seconds": 0.05}, trajectory=f"traj-{i % 16}")
                    good = r.output == {"slept": 0.05}
                else:
                    r = await c.call_tool("echo", {"i": i}, trajectory=f"traj-{i % 16}")
                    good = r.output == {"i": i}
                lat.append(time.perf_counter() - t0)
                ok += good
                bar.update()

        await asyncio.gather(*(one(i) for i in range(calls)))
        bar.close()
    return ok, lat


def run_demo(calls: int = 2000, cpu_slots: int = 2, port: int = 0) -> int:
    with LocalCluster(cpu_slots=cpu_slots, port=port, actor_args=["--no-sandbox"]) as cluster:
        print(f"broker at {cluster.url} with {cpu_slots} CPU actor slot(s)")
        t0 = time.perf_counter()
        ok, lat = asyncio.run(_workload(cluster.url, calls))
        wall = time.perf_counter() - t0
        lat.sort()
        print(f"{ok}/{calls} calls correct in {wall:.2f}s ({calls / wall:.0f} calls/s); "
              f"latency p50 {lat[len(lat) // 2] * 1e3:.2f} ms, p99 {lat[int(len(lat) * 0.99)] * 1e3:.2f} ms")
        snap = cluster.status()
        print(format_status(snap.actors, snap.queues, snap.stats))
    return 0 if ok == calls else 1
