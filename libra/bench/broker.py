"""``python -m libra.bench broker``: Libra's call path against raw pyzmq (and Ray, when installed), in one run.

1. Floor: a raw pyzmq DEALER ↔ ROUTER echo between two processes (msgpack on both ends), over loopback
   TCP and over ipc: round-trip p50/p99 with one message in flight, messages/s with 100 in flight.
2. Libra: ``Client.call_tool("echo")`` with a real broker process and a real actor process
   (``python -m libra.broker`` + ``python -m libra.actors``), once with every peer on loopback TCP
   (``LIBRA_IPC=0``) and once with the default (peers on the broker's host switch to its ipc path), and on
   each cluster two ways: through the broker (four socket hops a call), and ``direct=True`` (the client holds a
   direct lease on ``echo``, which the actor runs inline, and sends its calls to the actor: two hops; see
   ``libra.client.direct``). Each row: p50/p99 with one call in flight, calls/s with 100 in flight twice: the
   sync client's sliding window of futures, and 100 asyncio tasks sharing one ``AsyncClient`` (how agent loops
   call tools).
3. Ray, when ``ray`` is importable (never a dependency): a Ray actor's ``echo`` method, the same two measures.

Prints every path's ratio to the TCP floor. Targets (issue #20): Libra over TCP p50 ≤ 3× the floor,
≥ 20,000 calls/s with 100 in flight, p50 ≥ 5× lower than the Ray call; each is checked for the direct path
and, separately, for the brokered one. ``--scale`` adds the throughput
sweep over actors × client processes (``libra.bench.broker_scale``); ``--dashboard`` instead measures what one
live dashboard polling the broker costs its call path (``libra.bench.broker_dashboard``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections import deque

import msgpack
import zmq

from libra.client import Client
from libra.client.aio import AsyncClient
from libra.local import LocalCluster, free_port

from .broker_drive import cpu_per_call, drive, pct

MSG = {"request_id": "c:1", "tool": "echo", "args": {"i": 1}}
ASYNC_CALLS = 20_000  # the asyncio throughput run's least number of calls


def _echo_server(url: str, ready: mp.Event, stop: mp.Event) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(url)
    ready.set()
    while not stop.is_set():
        if s.poll(100):
            while True:
                try:
                    ident, payload = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                s.send_multipart([ident, msgpack.packb(msgpack.unpackb(payload))])
    s.close(0)
    ctx.term()


def summary(lat: list[float], per_s: float, **extra: object) -> dict:
    return {"p50_us": pct(lat, 0.5) * 1e6, "p99_us": pct(lat, 0.99) * 1e6, "per_s": per_s, **extra}


def floor(n: int, window: int, transport: str = "tcp") -> dict:
    """Raw pyzmq round trips between two processes: the least any brokered call could cost."""
    if transport == "ipc":
        url = f"ipc://{tempfile.mkdtemp(prefix='libra-floor-')}/echo.sock"
    else:
        url = f"tcp://127.0.0.1:{free_port()}"
    ready, stop = mp.Event(), mp.Event()
    proc = mp.get_context("fork").Process(target=_echo_server, args=(url, ready, stop), daemon=True)
    proc.start()
    ready.wait(10)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(url)
    for _ in range(200):
        s.send(msgpack.packb(MSG))
        msgpack.unpackb(s.recv())
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        s.send(msgpack.packb(MSG))
        msgpack.unpackb(s.recv())
        lat.append(time.perf_counter() - t0)
    total = n * 3
    cpu0 = cpu_per_call({"server": proc.pid}, total)
    t0 = time.perf_counter()
    inflight = done = sent = 0
    while done < total:
        while inflight < window and sent < total:
            s.send(msgpack.packb(MSG))
            sent += 1
            inflight += 1
        msgpack.unpackb(s.recv())
        done += 1
        inflight -= 1
    tput = total / (time.perf_counter() - t0)
    cpu = cpu_per_call({"server": proc.pid}, total, cpu0)
    stop.set()
    proc.join(5)
    s.close(0)
    ctx.term()
    return summary(lat, tput, transport=transport, cpu_us=cpu)


async def _async_tput(url: str, total: int, window: int, pids: dict[str, int],
                      direct: bool = False) -> tuple[float, dict[str, float]]:
    """``total`` echo calls from ``window`` asyncio tasks sharing one AsyncClient; every result checked."""
    import asyncio

    async with AsyncClient(url, direct=direct) as c:
        for i in range(200):
            await c.call_tool("echo", i)
        if direct:
            await _until_leased(c)
        counter = iter(range(total))
        bad = 0

        async def worker() -> None:
            nonlocal bad
            for i in counter:
                r = await c.call_tool("echo", i)
                bad += r.output != i

        cpu0 = cpu_per_call(pids, total)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(window)))
        tput = total / (time.perf_counter() - t0)
        cpu = cpu_per_call(pids, total, cpu0)
    if bad:
        raise RuntimeError(f"{bad} asyncio calls returned a wrong result")
    return tput, cpu


async def _until_leased(c: AsyncClient) -> None:
    import asyncio

    for _ in range(100):  # the lease is asked for on the first call; its grant takes a broker round trip
        if c._direct is not None and c._direct.by_tool:
            return
        await asyncio.sleep(0.01)
        await c.call_tool("echo", 0)
    raise RuntimeError("direct=True, but the broker granted no lease on echo")


def _leased(c: Client) -> None:
    for _ in range(100):
        if c._direct is not None and c._direct.by_tool:
            return
        time.sleep(0.01)
        c.call_tool("echo", 0)
    raise RuntimeError("direct=True, but the broker granted no lease on echo")


def libra_path(n: int, window: int, transport: str, slots: int = 1) -> dict[str, dict]:
    """Libra's echo call with a real broker and actor, every peer on ``transport`` (tcp or ipc): through the
    broker and direct, on the same cluster. Returns both rows."""
    env = {"LIBRA_IPC": "0"} if transport == "tcp" else {}
    saved = os.environ.get("LIBRA_IPC")
    if transport == "tcp":
        os.environ["LIBRA_IPC"] = "0"  # this process's client too
    rows: dict[str, dict] = {}
    try:
        with LocalCluster(cpu_slots=slots, actor_args=["--no-sandbox", "--capacity", "64"], env=env) as cluster:
            assert cluster.broker is not None and cluster.actors is not None
            pids = {"broker": cluster.broker.pid, "actors": cluster.actors.pid}
            for direct in (False, True):
                with Client(cluster.url, direct=direct) as c:
                    used = c.endpoint.split("://", 1)[0]
                    if used != transport:
                        raise RuntimeError(f"asked for {transport}, the client connected over {used} ({c.endpoint})")
                    if direct:
                        _leased(c)
                        lease = next(iter(c._direct.by_tool.values()))  # type: ignore[union-attr]
                        if not lease.endpoint.startswith(transport):
                            raise RuntimeError(f"asked for {transport}, the direct calls go to {lease.endpoint}")
                    lat, tput = drive(c, n, window)
                    if direct and c.status().stats.get("direct_completed", 0) == 0:
                        raise RuntimeError("direct=True, but the actor reported no direct call")
                import asyncio

                # at least 20,000 calls: at 20-30k calls/s a shorter run is mostly timer and GC noise
                atput, cpu = asyncio.run(_async_tput(cluster.url, max(n * 3, ASYNC_CALLS), window, pids, direct))
                key = f"libra_{'direct_' if direct else ''}{transport}"
                rows[key] = summary(lat, tput, transport=transport, actor_slots=slots, async_per_s=atput,
                                    cpu_us=cpu, direct=direct)
    finally:
        if saved is None:
            os.environ.pop("LIBRA_IPC", None)
        else:
            os.environ["LIBRA_IPC"] = saved
    return rows


def ray_path(n: int, window: int) -> dict | None:
    """A Ray actor's echo method: ``ray.get(actor.echo.remote(x))``; None when ray is not installed."""
    try:
        import ray
    except ImportError:
        return None
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        @ray.remote
        class Echo:
            def echo(self, x):
                return x

        a = Echo.remote()
        for i in range(300):
            ray.get(a.echo.remote(i))
        lat = []
        for i in range(n):
            t0 = time.perf_counter()
            if ray.get(a.echo.remote({"i": i})) != {"i": i}:
                raise RuntimeError("ray echo returned a wrong result")
            lat.append(time.perf_counter() - t0)
        total = n * 3
        refs: deque = deque()
        t0 = time.perf_counter()
        for i in range(total):
            if len(refs) >= window:
                ray.get(refs.popleft())
            refs.append(a.echo.remote(i))
        ray.get(list(refs))
        tput = total / (time.perf_counter() - t0)
        return summary(lat, tput, version=ray.__version__)
    finally:
        ray.shutdown()


def run(n: int = 3000, window: int = 100, slots: int = 1, with_ray: bool = True) -> dict:
    rows = {
        "floor_tcp": floor(n, window, "tcp"),
        "floor_ipc": floor(n, window, "ipc"),
        **libra_path(n, window, "tcp", slots),
        **libra_path(n, window, "ipc", slots),
    }
    r = ray_path(n, window) if with_ray else None
    if r is not None:
        rows["ray"] = r
    f = rows["floor_tcp"]
    out: dict = {"rows": rows, "load_1m": os.getloadavg()[0]}
    for way in ("", "direct_"):
        out[f"{way}p50_ratio_tcp"] = rows[f"libra_{way}tcp"]["p50_us"] / f["p50_us"]
        out[f"{way}p50_ratio_ipc"] = rows[f"libra_{way}ipc"]["p50_us"] / f["p50_us"]
        if r is not None:
            out[f"{way}ray_over_libra_p50"] = r["p50_us"] / min(rows[f"libra_{way}tcp"]["p50_us"],
                                                                rows[f"libra_{way}ipc"]["p50_us"])
    return out


LABELS = {
    "floor_tcp": "raw pyzmq DEALER<->ROUTER, tcp (floor)",
    "floor_ipc": "raw pyzmq DEALER<->ROUTER, ipc",
    "libra_tcp": "Libra call_tool(echo) via broker, tcp",
    "libra_ipc": "Libra call_tool(echo) via broker, ipc",
    "libra_direct_tcp": "Libra call_tool(echo) direct lease, tcp",
    "libra_direct_ipc": "Libra call_tool(echo) direct lease, ipc",
    "ray": "Ray actor echo.remote()",
}


def print_table(r: dict, window: int) -> None:
    rows = r["rows"]
    f = rows["floor_tcp"]
    print(f"load (1 min) at the end: {r['load_1m']:.2f}")
    print(f"{'':<44} {'1 in flight':>17} {f'per s, {window} in flight':>25}")
    print(f"{'path':<44} {'p50 µs':>8} {'p99 µs':>8} {'window':>8} {'asyncio':>8} {'/floor':>7} "
          f"{'p50/floor':>10}")
    for key, row in rows.items():
        best = max(row["per_s"], row.get("async_per_s", 0.0))
        asy = f"{row['async_per_s']:>8.0f}" if "async_per_s" in row else f"{'-':>8}"
        print(f"{LABELS[key]:<44} {row['p50_us']:>8.0f} {row['p99_us']:>8.0f} {row['per_s']:>8.0f} {asy} "
              f"{best / f['per_s']:>6.2f}x {row['p50_us'] / f['p50_us']:>9.2f}x")
    cores = os.cpu_count() or 1
    for key, row in rows.items():
        if "cpu_us" in row:
            c = row["cpu_us"]
            tot = sum(c.values())
            print(f"CPU per call, {window} in flight ({'asyncio' if key.startswith('libra') else 'window'}), "
                  f"{key}: " + ", ".join(f"{k} {v:.0f} µs" for k, v in c.items())
                  + f"; total {tot:.0f} µs: at most {cores * 1e6 / tot:.0f} calls/s on this machine's {cores} cores")
    for way, what in (("direct_", "direct lease"), ("", "via broker")):
        best = {t: max(rows[f"libra_{way}{t}"]["per_s"], rows[f"libra_{way}{t}"]["async_per_s"]) for t in ("tcp", "ipc")}
        ratio = r[f"{way}p50_ratio_tcp"]
        tput = max(best.values())
        line = (f"targets, {what}: tcp p50 <= 3x floor: {ratio:.2f}x ({'met' if ratio <= 3 else 'not met'}; ipc "
                f"{r[f'{way}p50_ratio_ipc']:.2f}x); >= 20000 calls/s with {window} in flight: {tput:.0f} "
                f"({'met' if tput >= 20000 else 'not met'}; tcp {best['tcp']:.0f}, ipc {best['ipc']:.0f})")
        if f"{way}ray_over_libra_p50" in r:
            x = r[f"{way}ray_over_libra_p50"]
            line += f"; p50 >= 5x lower than Ray: {x:.2f}x ({'met' if x >= 5 else 'not met'})"
        else:
            line += "; ray not installed: no Ray row"
        print(line)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench broker", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=3000, help="round trips per latency measurement")
    p.add_argument("--window", type=int, default=100, help="calls in flight for the throughput run")
    p.add_argument("--slots", type=int, default=1, help="actor slots behind the broker")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray row even when ray is installed")
    p.add_argument("--scale", action="store_true",
                   help="also sweep throughput over 2/8/32 actors x 1/2/4/8 client processes")
    p.add_argument("--trace-hops", action="store_true",
                   help="instead: stamp one call's every hop (client, broker, actor) and print per-segment medians, "
                        "of the current hot path (libra.bench.broker_hops)")
    p.add_argument("--dashboard", action="store_true",
                   help="instead: echo latency and calls/s with and without one `libra dashboard` polling the "
                        "broker every second, alternating on one cluster (libra.bench.broker_dashboard)")
    p.add_argument("--seconds", type=float, default=10.0, help="--dashboard: seconds a side per round")
    p.add_argument("--rounds", type=int, default=3, help="--trace-hops, --dashboard: rounds (medians reported)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.dashboard:
        from .broker_dashboard import compare as dashboard_cost, print_compare

        print(f"load (1 min) at the start: {os.getloadavg()[0]:.2f}")
        d = dashboard_cost(a.seconds, a.rounds, a.slots)
        if a.json:
            print(json.dumps(d))
        else:
            print_compare(d)
        return 0
    if a.trace_hops:
        from .broker_hops import compare, print_trace

        print(f"load (1 min) at the start: {os.getloadavg()[0]:.2f}")
        rows = compare(a.n, a.rounds, a.window)
        print(json.dumps(rows) if a.json else "", end="\n" if a.json else "")
        if not a.json:
            print_trace(rows)
        return 0
    r = run(a.n, a.window, a.slots, with_ray=not a.no_ray)
    if a.scale:
        from .broker_scale import sweep

        r["scale"] = sweep()
    if a.json:
        print(json.dumps(r))
        return 0
    print_table(r, a.window)
    if a.scale:
        from .broker_scale import print_sweep

        print_sweep(r["scale"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
