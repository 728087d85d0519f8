"""``python -m libra.bench broker --dashboard``: what one live dashboard costs the broker's call path.

One cluster (a real broker and actor process, ``libra.local.LocalCluster``) and one client; echo calls through the
broker for ``--seconds`` at a time, alternately without and with a real ``libra dashboard`` process polling the
broker's status once a second (``--interval``; started before its segment, and its first poll awaited, stopped
after), ``--rounds`` times each, the order swapped every round so drift in the machine's load falls on both sides.
Each segment: sequential round trips (latency: p50, p99) then a window of 100 calls in flight (calls/s). Prints
both sides, their ratios and the polls the dashboard made while measured. Target (issue #30): p50 with the
dashboard within 5 % of p50 without.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from typing import Any

from libra.client import Client
from libra.local import LocalCluster, stop_process, wait_until

from .broker_drive import pct

WINDOW = 100


def _start_dashboard(url: str, interval: float) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "libra.dashboard", "--broker", url, "--port", "0",
                          "--interval", str(interval)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line.startswith("libra dashboard: http://"):
        stop_process(p)
        raise RuntimeError(f"libra dashboard did not start: {line!r}")
    return p, line.split()[2]


def _polls(page: str) -> int:
    with urllib.request.urlopen(page + "api/status", timeout=10) as r:
        return int(json.load(r)["polls"])


def _segment(c: Client, seconds: float) -> tuple[list[float], float]:
    """Sequential echo calls for ``seconds`` (their latencies), then ``WINDOW`` in flight for a third of that."""
    lat: list[float] = []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        r = c.call_tool("echo", {"i": i})
        lat.append(time.perf_counter() - t0)
        if r.output != {"i": i}:
            raise RuntimeError(f"echo {i} returned {r.output!r}")
        i += 1
    done, t0, futs = 0, time.perf_counter(), []
    end = t0 + seconds / 3
    while time.perf_counter() < end:
        futs += [c.submit_tool("echo", done + k) for k in range(WINDOW)]
        bad = sum(getattr(r, "output", None) != done + k for k, r in enumerate(c.gather(futs)))
        if bad:
            raise RuntimeError(f"{bad} pipelined calls returned a wrong result")
        done, futs = done + WINDOW, []
    return lat, done / (time.perf_counter() - t0)


def compare(seconds: float = 10.0, rounds: int = 3, slots: int = 1, interval: float = 1.0) -> dict[str, Any]:
    """Both sides on one cluster (see the module docstring)."""
    sides: dict[str, dict[str, Any]] = {k: {"lat": [], "per_s": [], "p50s": [], "polls": 0, "seconds": 0.0}
                                        for k in ("without", "with")}
    with LocalCluster(cpu_slots=slots, actor_args=["--no-sandbox", "--capacity", "64"]) as cluster, \
            Client(cluster.url) as c:
        for i in range(300):
            c.call_tool("echo", i)
        for r in range(rounds):
            for side in (("without", "with") if r % 2 == 0 else ("with", "without")):
                dash, page = _start_dashboard(cluster.url, interval) if side == "with" else (None, "")
                try:
                    if dash is not None:
                        wait_until(lambda: _polls(page) >= 1, 30.0, "the dashboard's first poll")
                        before = _polls(page)
                    t0 = time.perf_counter()
                    lat, per_s = _segment(c, seconds)
                    s = sides[side]
                    s["seconds"] += time.perf_counter() - t0
                    if dash is not None:
                        s["polls"] += _polls(page) - before
                finally:
                    stop_process(dash)
                    if dash is not None and dash.stdout is not None:
                        dash.stdout.close()
                s["lat"] += lat
                s["per_s"].append(per_s)
                s["p50s"].append(pct(lat, 0.5) * 1e6)
    out: dict[str, Any] = {"seconds": seconds, "rounds": rounds, "slots": slots, "interval_s": interval}
    for side, s in sides.items():
        out[side] = {"p50_us": pct(s["lat"], 0.5) * 1e6, "p99_us": pct(s["lat"], 0.99) * 1e6, "calls": len(s["lat"]),
                     "per_s": sorted(s["per_s"])[len(s["per_s"]) // 2], "round_p50s_us": s["p50s"],
                     "polls": s["polls"], "polls_per_s": s["polls"] / s["seconds"] if s["seconds"] else 0.0}
    w, wo = out["with"], out["without"]
    out["p50_ratio"], out["p99_ratio"] = w["p50_us"] / wo["p50_us"], w["p99_us"] / wo["p99_us"]
    out["per_s_ratio"] = w["per_s"] / wo["per_s"]
    return out


def print_compare(r: dict[str, Any]) -> None:
    print(f"echo through the broker ({r['slots']} actor slot(s)), {r['rounds']} rounds of {r['seconds']:g} s a side, "
          f"alternating; the dashboard polls every {r['interval_s']:g} s")
    print(f"{'':<26} {'p50 µs':>8} {'p99 µs':>8} {'calls':>8} {f'per s, {WINDOW} in flight':>22} {'polls':>6}")
    for side, label in (("without", "without a dashboard"), ("with", "with one dashboard")):
        s = r[side]
        print(f"{label:<26} {s['p50_us']:>8.0f} {s['p99_us']:>8.0f} {s['calls']:>8} {s['per_s']:>22.0f} "
              f"{s['polls']:>6}  (rounds' p50s: {', '.join(f'{x:.0f}' for x in s['round_p50s_us'])})")
    ok = r["p50_ratio"] <= 1.05
    print(f"with / without: p50 {r['p50_ratio']:.3f}x, p99 {r['p99_ratio']:.3f}x, calls/s {r['per_s_ratio']:.3f}x; "
          f"target p50 within 5 %: {'met' if ok else 'not met'} ({r['with']['polls_per_s']:.2f} polls/s measured)")
