"""``python -m libra.bench.metrics [--requests N] [--json]``: cost of the broker's Prometheus hook.

Runs the pure broker core (``BrokerState``) through submit → assign → result cycles exactly as the
server loop does, once without metrics (the baseline) and once with :class:`BrokerMetrics` observing
every event and ticking every 0.25 s of virtual time, and prints both rates (per CPU second of this
process, so other load on the host does not skew them) and their ratio. No sockets:
this is the worst case for the hook's relative cost, since real I/O would dilute it. It also times one
snapshot build and one scrape with many actors and queues, and (``--e2e-calls``) echo calls/s through a
real broker and actor process started with and without ``--metrics-port`` (wall clock, alternating).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from libra.broker.events import PeerMessage, Tick
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m


def _cycle(n: int, with_metrics: bool, actors: int = 8, capacity: int = 32) -> float:
    """Return requests per second through the core (plus the hook when ``with_metrics``)."""
    from libra.broker.metrics import BrokerMetrics

    st = BrokerState(BrokerConfig())
    met = BrokerMetrics(st) if with_metrics else None
    now = 0.0
    client = b"client"

    def handle(ev: Any) -> list:
        cmds = st.handle(ev, now)
        if met is not None:
            met.observe(ev, cmds, now)
        return cmds

    handle(PeerMessage(client, m.ClientHello("c", 1)))
    peers = [f"a{i}".encode() for i in range(actors)]
    for p in peers:
        handle(PeerMessage(p, m.ActorHello(p.decode(), "h", p.decode(), 1, {"action": ["echo"]}, ["action"],
                                           capacity)))
        handle(PeerMessage(p, m.Bid(["action"], capacity)))
    window = actors * capacity
    assigned: list[tuple[bytes, m.Assign]] = []
    next_tick = 0.25
    t0 = time.process_time()  # CPU time of this process: other load on the host does not count
    for i in range(n):
        now += 1e-5
        for c in handle(PeerMessage(client, m.Submit(f"r{i}", "action", "echo", i, None, 60.0))):
            if type(getattr(c, "msg", None)) is m.Assign:
                assigned.append((c.peer, c.msg))
        if len(assigned) >= window or i == n - 1:
            for peer, a in assigned:
                handle(PeerMessage(peer, m.WorkResult(a.work_id, a.lease, True, a.args, duration_s=1e-4)))
            assigned.clear()
        if now >= next_tick:
            handle(Tick())
            if met is not None:
                met.tick(now)
            next_tick = now + 0.25
    return n / (time.process_time() - t0)


def _scrape_cost(actors: int, queues: int) -> dict[str, float]:
    from prometheus_client import generate_latest

    from libra.broker.metrics import BrokerMetrics

    st = BrokerState(BrokerConfig())
    for i in range(actors):
        p = f"a{i}".encode()
        st.handle(PeerMessage(p, m.ActorHello(p.decode(), "h", p.decode(), 1,
                                              {"action": [f"t{j}" for j in range(queues)]}, ["action"], 0)), 0.0)
    st.handle(PeerMessage(b"c", m.ClientHello("c", 1)), 0.0)
    for j in range(queues):
        st.handle(PeerMessage(b"c", m.Submit(f"r{j}", "action", f"t{j}", None, None, 60.0)), 0.0)
    met = BrokerMetrics(st, snapshot_s=0.0)
    reps = 50
    t0 = time.perf_counter()
    for k in range(reps):
        met.tick(float(k + 1))
    build = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        body = generate_latest(met.registry)
    scrape = (time.perf_counter() - t0) / reps
    return {"actors": actors, "queues": queues, "snapshot_ms": build * 1e3, "scrape_ms": scrape * 1e3,
            "scrape_bytes": len(body)}


def _e2e(calls: int, with_metrics: bool) -> tuple[float, float]:
    """Echo calls through a real broker process (+ one actor process), with or without ``--metrics-port``.

    Returns (calls per wall second, broker CPU microseconds per call). The CPU figure is what the hook
    costs; the wall figure also depends on whatever else the host runs."""
    import asyncio

    import psutil

    from libra.client.aio import AsyncClient
    from libra.local import LocalCluster, free_port

    extra = ["--metrics-port", str(free_port()), "--metrics-host", "127.0.0.1"] if with_metrics else []
    with LocalCluster(cpu_slots=1, broker_args=extra, actor_args=["--no-sandbox", "--capacity", "64"]) as c:
        assert c.broker is not None
        proc = psutil.Process(c.broker.pid)

        async def go() -> tuple[float, float]:
            async with AsyncClient(c.url) as cl:
                await asyncio.gather(*(cl.call_tool("echo", i) for i in range(1000)))  # warm up
                cpu0, t0 = sum(proc.cpu_times()[:2]), time.perf_counter()
                await asyncio.gather(*(cl.call_tool("echo", i) for i in range(calls)))
                wall, cpu = time.perf_counter() - t0, sum(proc.cpu_times()[:2]) - cpu0
                return calls / wall, cpu / calls * 1e6

        return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench.metrics", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=100_000, help="requests per run (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each variant; the best is kept")
    p.add_argument("--e2e-calls", type=int, default=20_000,
                   help="echo calls through real broker+actor processes per variant (0: skip; default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    base = max(_cycle(args.requests, False) for _ in range(args.repeats))
    hooked = max(_cycle(args.requests, True) for _ in range(args.repeats))
    out = {
        "requests": args.requests,
        "baseline_req_per_s": round(base),
        "with_metrics_req_per_s": round(hooked),
        "ratio": round(hooked / base, 3),
        "overhead_us_per_request": round((1 / hooked - 1 / base) * 1e6, 3),
        "scrape": _scrape_cost(actors=1000, queues=200),
    }
    if args.e2e_calls > 0:  # alternate the variants so drifting host load hits both alike; keep the best
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.repeats):
            for flag in (False, True):
                runs[flag].append(_e2e(args.e2e_calls, flag))
        (w0, c0), (w1, c1) = (min(runs[f], key=lambda r: r[1]) for f in (False, True))
        out["e2e"] = {"calls": args.e2e_calls, "baseline_calls_per_s": round(w0), "with_metrics_calls_per_s": round(w1),
                      "baseline_broker_cpu_us_per_call": round(c0, 2),
                      "with_metrics_broker_cpu_us_per_call": round(c1, 2), "cpu_ratio": round(c1 / c0, 3)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"broker core without metrics: {out['baseline_req_per_s']:>9,} req/s")
        print(f"broker core with metrics:    {out['with_metrics_req_per_s']:>9,} req/s   "
              f"ratio {out['ratio']:.3f} ({out['overhead_us_per_request']:.2f} us/request)")
        s = out["scrape"]
        print(f"snapshot with {s['actors']} actors, {s['queues']} queues: {s['snapshot_ms']:.2f} ms; "
              f"scrape: {s['scrape_ms']:.2f} ms, {s['scrape_bytes']} bytes")
        if "e2e" in out:
            e = out["e2e"]
            print(f"real broker+actor, echo: broker CPU {e['baseline_broker_cpu_us_per_call']} us/call without "
                  f"metrics, {e['with_metrics_broker_cpu_us_per_call']} with (ratio {e['cpu_ratio']:.3f}); "
                  f"wall {e['baseline_calls_per_s']:,} vs {e['with_metrics_calls_per_s']:,} calls/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
