"""The control plane at scale (``python -m libra.bench control_plane``): one broker holding many idle actors.

For each point (``--actors``, default 100,1000,3000; a 10-actor point is always run first as the baseline) a
fresh broker (``python -m libra.broker``, plain TCP on loopback, no ipc) and one real echo actor slot
(``LocalCluster``) are started; then synthetic idle actors (``control_plane_farm``: the real protocol, one DEALER
socket each, in ``--farms`` processes) register. Once every one is in ``libra status`` they are held for
``--seconds``: reported are the broker's CPU seconds per wall second and per actor-second (psutil), its RSS, the
gap between the broker's frames on an actor's socket (the broker does not answer heartbeats: it sends its own
when it sent an idle actor nothing for ``idle_heartbeat_s``, so a gap past that is the loop falling behind), heartbeats
sent and broker heartbeats received, and the actors the broker declared lost while they were alive (its
``actors_expired`` counter plus the ``Disconnect`` frames the farms got; ``ticks_behind``: timer ticks on which
the broker had unread frames, so declared no actor dead). Then, with the actors still connected:
``Client.status`` latency, and p50/p99 of real ``echo`` calls through the broker and by direct lease
(``Client(url, direct=True)``), with their ratio to the 10-actor baseline of the same run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from typing import Any

from libra.client import Client
from libra.local import LocalCluster

from .broker_drive import cpu_s, pct
from .control_plane_farm import run_farm
from .output import finite, run_and_emit

BASELINE = 10
ECHO_BUDGET_S = 60.0  # a saturated broker: give up measuring echo after this long (the row says so)


def _synthetic(status: Any) -> int:
    return sum(str(a.get("id", "")).startswith("synth-") for a in status.actors)


def _start_farms(url: str, n: int, farms: int, heartbeat_s: float) -> list[tuple[Any, Any]]:
    ctx = mp.get_context("spawn")
    out = []
    per = -(-n // farms)
    for f in range(farms):
        first, count = f * per, min(per, n - f * per)
        if count <= 0:
            break
        parent, child = ctx.Pipe()
        p = ctx.Process(target=run_farm, args=(url, first, count, heartbeat_s, child), daemon=True)
        p.start()
        out.append((p, parent))
    return out


def _ask(farms: list[tuple[Any, Any]], cmd: str, timeout: float = 60.0) -> list[Any]:
    for _, conn in farms:
        conn.send(cmd)
    res = []
    for p, conn in farms:
        if not conn.poll(timeout):
            raise RuntimeError(f"actor farm {p.pid} did not answer {cmd!r} within {timeout:g}s")
        res.append(conn.recv())
    return res


def _lat(fn: Any, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def _echo(url: str, n: int, direct: bool) -> dict[str, Any]:
    """p50/p99 of ``n`` echo calls (after 20 warm-up ones); a failure (a saturated broker) ends it, named."""
    try:
        with Client(url, connect_timeout=60, direct=direct) as c:
            return _echo_on(c, n)
    except Exception as exc:  # noqa: BLE001 - reported in the row, the sweep goes on
        return {"p50_ms": None, "p99_ms": None, "error": f"{type(exc).__name__}: {exc}"[:300]}


def _echo_on(c: Client, n: int) -> dict[str, Any]:
    def one(i: int) -> None:
        r = c.call_tool("echo", {"i": i}, timeout=30.0)
        if r.output != {"i": i}:
            raise RuntimeError(f"echo {i} returned {r.output!r}")
    end = time.monotonic() + ECHO_BUDGET_S  # the warm-up counts too: on a saturated broker it is what crawls
    for i in range(20):  # warm-up (and, direct, the lease)
        if time.monotonic() > end:
            raise RuntimeError(f"only {i} of 20 warm-up echo calls in {ECHO_BUDGET_S:g}s")
        one(i)
    xs = []
    for i in range(n):
        if time.monotonic() > end:
            raise RuntimeError(f"only {i} of {n} echo calls in {ECHO_BUDGET_S:g}s")
        xs += _lat(lambda _: one(i), 1)
    return {"p50_ms": pct(xs, 0.5) * 1e3, "p99_ms": pct(xs, 0.99) * 1e3}


def _status(url: str, n: int = 1) -> tuple[Any, list[float], str]:
    """The last of ``n`` status replies and their latencies; ``(None, [], error)`` if the broker did not answer."""
    try:
        with Client(url, connect_timeout=60) as c:
            lat = _lat(lambda i: c.status(timeout=60), n)
            return c.status(timeout=60), lat, ""
    except Exception as exc:  # noqa: BLE001 - an overloaded broker is a result here
        return None, [], f"{type(exc).__name__}: {exc}"[:300]


def _wait_registered(cl: LocalCluster, farms: list, n: int, timeout: float) -> tuple[float, int]:
    """Seconds until all ``n`` synthetic actors are in the broker's status, and the last count seen."""
    t0 = time.monotonic()
    seen = 0
    while time.monotonic() - t0 < timeout:
        if sum(_ask(farms, "count")) >= n:
            st, _, _ = _status(cl.url)
            seen = _synthetic(st) if st is not None else -1  # -1: the broker did not answer
            if seen >= n:
                break
        time.sleep(0.5)
    return time.monotonic() - t0, seen


def point(n: int, seconds: float, farms: int, calls: int, heartbeat_s: float,
          idle_heartbeat_s: float | None = None) -> dict[str, Any]:
    import psutil

    idle = ["--idle-heartbeat-s", str(idle_heartbeat_s)] if idle_heartbeat_s is not None else []
    with LocalCluster(cpu_slots=1, broker_args=["--no-ipc", "--heartbeat-s", str(heartbeat_s), *idle],
                      actor_args=["--no-sandbox"],
                      env={"LIBRA_IPC": "0"}) as cl:
        assert cl.broker is not None
        fs = _start_farms(cl.url, n, max(1, min(farms, n // 500 + 1)), heartbeat_s)
        try:
            reg_s, seen = _wait_registered(cl, fs, n, timeout=60 + n / 50)
            st0, _, _ = _status(cl.url)
            exp0 = st0.stats.get("actors_expired", 0) if st0 is not None else 0
            behind0 = st0.stats.get("ticks_behind", 0) if st0 is not None else 0
            _ask(fs, "measure")
            cpu0, t0 = cpu_s(cl.broker.pid), time.monotonic()
            time.sleep(seconds)
            cpu1, t1 = cpu_s(cl.broker.pid), time.monotonic()
            rep = _ask(fs, "report")
            rss = psutil.Process(cl.broker.pid).memory_info().rss
            st, st_lat, st_err = _status(cl.url, 10)
            broker, direct = _echo(cl.url, calls, False), _echo(cl.url, calls, True)
            exp1 = st.stats.get("actors_expired", 0) if st is not None else exp0
            behind1 = st.stats.get("ticks_behind", 0) if st is not None else behind0
            rep2 = _ask(fs, "report")  # the farms' Disconnects over the echo phase too
        finally:
            try:
                _ask(fs, "stop", 30)
            finally:
                for p, _ in fs:
                    p.join(5)
                    if p.is_alive():
                        p.kill()
    wall = t1 - t0
    gaps = [g for r in rep for g in r["gaps"]]
    return {
        "actors": n, "idle_heartbeat_s": idle_heartbeat_s if idle_heartbeat_s is not None else 3 * heartbeat_s,
        "farms": len(fs), "register_s": round(reg_s, 2), "seen_in_status": _synthetic(st) if st is not None else None,
        "status_error": st_err,
        "seen_before_hold": seen, "broker_cpu_per_s": (cpu1 - cpu0) / wall,
        "broker_cpu_us_per_actor_s": (cpu1 - cpu0) / wall / n * 1e6, "broker_rss_mb": rss / 2**20,
        "heartbeats_sent": sum(r["heartbeats_sent"] for r in rep),
        "broker_heartbeats_received": sum(r["broker_heartbeats"] for r in rep),
        "broker_gap_p50_s": pct(gaps, 0.5) if gaps else None, "broker_gap_p99_s": pct(gaps, 0.99) if gaps else None,
        "wrongly_lost": (exp1 - exp0) + sum(r["disconnects"] for r in rep) + sum(r["disconnects"] for r in rep2),
        "broker_actors_expired": exp1 - exp0, "broker_ticks_behind": behind1 - behind0, "unexpected_frames": sum(r["unexpected"] for r in rep2),
        "status_p50_ms": pct(st_lat, 0.5) * 1e3 if st_lat else None,
        "status_p99_ms": pct(st_lat, 0.99) * 1e3 if st_lat else None,
        "echo_broker": broker, "echo_direct": direct,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = [int(x) for x in str(args.actors).split(",") if x.strip()]
    if any(n <= 0 for n in counts):
        raise SystemExit(f"--actors: counts must be positive, got {args.actors!r}")
    idles: list[float | None] = [float(x) for x in str(args.idle_heartbeat_s).split(",") if x.strip()] or [None]
    rows = []
    for idle in idles:
        first = len(rows)
        for n in [BASELINE, *counts]:
            rows.append(point(n, args.seconds, args.farms, args.calls, args.heartbeat_s, idle))
            print(f"control_plane: {n} actors done: {json.dumps(finite(rows[-1]))[:400]}", file=sys.stderr, flush=True)
        base = rows[first]  # echo is compared with the 10-actor point of the same setting
        for r in rows[first:]:
            for via in ("echo_broker", "echo_direct"):
                ok = r[via]["p50_ms"] is not None and base[via]["p50_ms"]
                r[via]["p50_ratio"] = r[via]["p50_ms"] / base[via]["p50_ms"] if ok else None
    for r in rows:  # the broker's CPU against the first setting's at the same count (--idle-heartbeat-s 3,1)
        ref = next(x for x in rows if x["actors"] == r["actors"])
        r["cpu_vs_first_setting"] = (r["broker_cpu_per_s"] / ref["broker_cpu_per_s"]
                                     if ref["broker_cpu_per_s"] > 0 else None)
    res = {"bench": "control_plane", "seconds": args.seconds, "heartbeat_s": args.heartbeat_s,
           "calls": args.calls, "baseline_actors": BASELINE, "points": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(finite(res), f, indent=1)
    return res


def fmt(res: dict[str, Any]) -> str:
    head = (f"{'actors':>7} {'idle s':>6} {'cpu/s':>6} {'x 1st':>5} {'us/act-s':>8} {'RSS MB':>7} {'hb sent':>8} {'bk hb':>7} "
            f"{'gap p50/p99 s':>14} {'lost':>5} {'status':>7} {'st p50/p99 ms':>14} "
            f"{'echo bk p50/p99 ms (x10)':>25} {'echo direct p50/p99 ms (x10)':>29}")
    lines = [f"bench control_plane: {res['seconds']} s per point, heartbeat {res['heartbeat_s']} s (idle: per row), "
             f"{res['calls']} echo calls each way; x10 = echo p50 / p50 at {res['baseline_actors']} actors", head]
    for r in res["points"]:
        g50, g99 = r["broker_gap_p50_s"], r["broker_gap_p99_s"]
        gap = f"{g50:.2f}/{g99:.2f}" if g50 is not None else "-"
        eb, ed = r["echo_broker"], r["echo_direct"]
        lines.append(_row(r, gap, eb, ed))
    for r in res["points"]:
        for what, err in (("status", r["status_error"]), ("echo broker", r["echo_broker"].get("error")),
                          ("echo direct", r["echo_direct"].get("error"))):
            if err:
                lines.append(f"  {r['actors']} actors, {what} failed: {err}")
    return "\n".join(lines)


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _row(r: dict[str, Any], gap: str, eb: dict[str, Any], ed: dict[str, Any]) -> str:
    return (f"{r['actors']:>7} {r['idle_heartbeat_s']:>6.1f} {r['broker_cpu_per_s']:>6.3f} "
            f"{_f(r['cpu_vs_first_setting'], '.2f'):>5} "
            f"{r['broker_cpu_us_per_actor_s']:>8.1f} "
            f"{r['broker_rss_mb']:>7.1f} {r['heartbeats_sent']:>8} {r['broker_heartbeats_received']:>7} {gap:>14} "
            f"{r['wrongly_lost']:>5} {_f(r['seen_in_status'], 'd'):>7} "
            f"{_f(r['status_p50_ms'], '.1f'):>6}/{_f(r['status_p99_ms'], '.1f'):<7} "
            f"{_f(eb['p50_ms'], '.2f'):>8}/{_f(eb['p99_ms'], '.2f'):<7} ({_f(eb['p50_ratio'], '.2f')}x) "
            f"{_f(ed['p50_ms'], '.2f'):>11}/{_f(ed['p99_ms'], '.2f'):<7} ({_f(ed['p50_ratio'], '.2f')}x)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench control_plane",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--actors", default="100,1000,3000", help="idle actor counts, comma separated (up to 20,000)")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds each point is held after registration")
    p.add_argument("--farms", type=int, default=4, help="most actor-farm processes (one per 500 actors up to this)")
    p.add_argument("--calls", type=int, default=300, help="echo calls per point, through the broker and direct")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="the broker's heartbeat interval")
    p.add_argument("--idle-heartbeat-s", default="",
                   help="the broker's beat of idle actors, comma separated to compare settings in one run (e.g. "
                        "3,1: the default against beating every second); default: the broker's (3 x heartbeat)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="also write the JSON result to this file")
    a = p.parse_args(argv)
    return run_and_emit(run, a, fmt)


if __name__ == "__main__":
    sys.exit(main())
