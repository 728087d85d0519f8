"""``python -m libra.bench broker``: Libra's call path against raw pyzmq, in one run.

1. Floor: a raw pyzmq DEALER ↔ ROUTER echo between two processes over loopback TCP (msgpack on both
   ends), one message in flight: round-trip p50/p99; then 100 in flight: messages/s.
2. Libra: ``Client.call_tool("echo")`` through a real broker process and a real actor process
   (``python -m libra.broker`` + ``python -m libra.actors``): p50/p99 with one call in flight, and
   calls/s with 100 in flight (sync client, sliding window).
Prints the ratios to the floor. Targets (issue #2): p50 within 3× of the floor, ≥ 15,000 calls/s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from collections import deque

import msgpack
import zmq

from libra.client import Client
from libra.local import LocalCluster, free_port


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


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def floor(n: int, window: int) -> dict:
    url = f"tcp://127.0.0.1:{free_port()}"
    ready, stop = mp.Event(), mp.Event()
    proc = mp.get_context("fork").Process(target=_echo_server, args=(url, ready, stop), daemon=True)
    proc.start()
    ready.wait(10)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(url)
    msg = {"request_id": "c:1", "tool": "echo", "args": {"i": 1}}
    for _ in range(200):
        s.send(msgpack.packb(msg))
        msgpack.unpackb(s.recv())
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        s.send(msgpack.packb(msg))
        msgpack.unpackb(s.recv())
        lat.append(time.perf_counter() - t0)
    total = n * 3
    t0 = time.perf_counter()
    inflight = 0
    done = 0
    sent = 0
    while done < total:
        while inflight < window and sent < total:
            s.send(msgpack.packb(msg))
            sent += 1
            inflight += 1
        msgpack.unpackb(s.recv())
        done += 1
        inflight -= 1
    tput = total / (time.perf_counter() - t0)
    stop.set()
    proc.join(5)
    s.close(0)
    ctx.term()
    return {"p50_us": _pct(lat, 0.5) * 1e6, "p99_us": _pct(lat, 0.99) * 1e6, "msgs_per_s": tput}


def libra_path(n: int, window: int, slots: int) -> dict:
    with LocalCluster(cpu_slots=slots, actor_args=["--no-sandbox", "--capacity", "64"]) as cluster:
        with Client(cluster.url) as c:
            for i in range(300):
                c.call_tool("echo", i)
            lat = []
            for i in range(n):
                t0 = time.perf_counter()
                c.call_tool("echo", {"i": i})
                lat.append(time.perf_counter() - t0)
            total = n * 3
            window_q: deque = deque()
            t0 = time.perf_counter()
            bad = 0
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
    return {"p50_us": _pct(lat, 0.5) * 1e6, "p99_us": _pct(lat, 0.99) * 1e6, "calls_per_s": tput,
            "actor_slots": slots}


def run(n: int = 3000, window: int = 100, slots: int = 1) -> dict:
    f = floor(n, window)
    lp = libra_path(n, window, slots)
    return {
        "floor": f, "libra": lp,
        "p50_ratio": lp["p50_us"] / f["p50_us"], "p99_ratio": lp["p99_us"] / f["p99_us"],
        "throughput_ratio": lp["calls_per_s"] / f["msgs_per_s"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m libra.bench broker", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=3000, help="round trips per latency measurement")
    p.add_argument("--window", type=int, default=100, help="calls in flight for the throughput run")
    p.add_argument("--slots", type=int, default=1, help="actor slots behind the broker")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    r = run(a.n, a.window, a.slots)
    if a.json:
        print(json.dumps(r))
        return 0
    f, lp = r["floor"], r["libra"]
    print(f"{'path':<44} {'p50 µs':>9} {'p99 µs':>9} {'per s (100 in flight)':>22}")
    print(f"{'raw pyzmq DEALER<->ROUTER (floor)':<44} {f['p50_us']:>9.0f} {f['p99_us']:>9.0f} {f['msgs_per_s']:>22.0f}")
    print(f"{'Client.call_tool(echo) via broker+actor':<44} {lp['p50_us']:>9.0f} {lp['p99_us']:>9.0f} "
          f"{lp['calls_per_s']:>22.0f}")
    print(f"ratio to floor: p50 {r['p50_ratio']:.2f}x  p99 {r['p99_ratio']:.2f}x  "
          f"throughput {r['throughput_ratio']:.2f}x  (targets: p50 <= 3x, >= 15000 calls/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
