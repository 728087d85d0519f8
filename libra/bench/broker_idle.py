"""What an idle actor costs the broker core: CPU per registration and per idle actor-second at N actors.

In process, core only (``BrokerState.handle``, no sockets, no codec): N actors each say hello and bid, then
for ``--seconds`` simulated seconds each sends one heartbeat a second while the core ticks four times a
second (the shell's tick at ``heartbeat_s`` = 1) and beats each idle actor every ``idle_heartbeat_s`` (3 s). CPU is the process's CPU time. The baseline is the same
run at 100 actors: a cost per actor that stays flat as N grows is O(1) per actor; one that grows with N
is a scan per event (registration was O(N) per hello and bid at af91053: 2.2 ms an actor at 10,000).
``expired`` must be 0 (no idle actor wrongly declared lost).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from libra.bench.output import emit
from libra.broker.events import PeerMessage, Tick
from libra.broker.state import BrokerState
from libra.protocol import messages as m

BASELINE = 100
TICKS_PER_S = 4


def point(n: int, seconds: int) -> dict[str, Any]:
    """One point: registration and steady idle CPU of ``n`` actors."""
    st = BrokerState()
    peers = [b"actor-%06d" % i for i in range(n)]
    t0 = time.process_time()
    for i, p in enumerate(peers):
        hello = m.ActorHello(f"a{i}", f"h{i // 40}", f"s{i % 40}", 1000 + i, {"action": ["echo"]}, ["action"], 1)
        st.handle(PeerMessage(p, hello), 0.0)
        st.handle(PeerMessage(p, m.Bid(["action"], 1)), 0.0)
    reg = time.process_time() - t0
    dt = 1.0 / TICKS_PER_S
    sends = 0
    t0 = time.process_time()
    for sec in range(seconds):
        for q in range(TICKS_PER_S):  # each quarter of the actors beats within its quarter second
            base = sec + q * dt
            chunk = peers[q * n // TICKS_PER_S:(q + 1) * n // TICKS_PER_S]
            for j, p in enumerate(chunk):
                st.handle(PeerMessage(p, m.Heartbeat()), base + j * dt / max(1, len(chunk)))
            sends += len(st.handle(Tick(), base + dt))
    cpu = time.process_time() - t0
    return {"actors": n, "register_us_per_actor": reg / n * 1e6, "idle_us_per_actor_s": cpu / seconds / n * 1e6,
            "broker_sends_per_s": sends / seconds, "expired": st.stats.get("actors_expired", 0),
            "live": len(st.actors)}


def run(counts: list[int], seconds: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    base = point(BASELINE, seconds)
    rows = [point(n, seconds) for n in counts]
    for r in rows:
        r["register_vs_baseline"] = r["register_us_per_actor"] / base["register_us_per_actor"]
        r["idle_vs_baseline"] = r["idle_us_per_actor_s"] / base["idle_us_per_actor_s"]
    return {"baseline": base, "points": rows, "seconds": seconds, "wall_s": round(time.perf_counter() - t0, 1)}


def _fmt(out: dict[str, Any]) -> str:
    b = out["baseline"]
    lines = [f"broker core, idle actors ({out['seconds']} simulated s a point; baseline {b['actors']} actors: "
             f"register {b['register_us_per_actor']:.1f} us/actor, idle {b['idle_us_per_actor_s']:.2f} us/actor-s)",
             f"{'actors':>8} {'register us/actor':>18} {'x base':>7} {'idle us/actor-s':>16} {'x base':>7} "
             f"{'sends/s':>8} {'expired':>8}"]
    for r in out["points"]:
        lines.append(f"{r['actors']:>8} {r['register_us_per_actor']:>18.1f} {r['register_vs_baseline']:>7.2f} "
                     f"{r['idle_us_per_actor_s']:>16.2f} {r['idle_vs_baseline']:>7.2f} "
                     f"{r['broker_sends_per_s']:>8.0f} {r['expired']:>8}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench broker_idle",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--actors", default="1000,5000,10000", help="idle actor counts, comma separated")
    p.add_argument("--seconds", type=int, default=10, help="simulated seconds of idle traffic a point")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    counts = [int(x) for x in a.actors.split(",") if x.strip()]
    if not counts or min(counts) < 1 or a.seconds < 1:
        p.error("--actors needs counts >= 1 and --seconds >= 1")
    emit(run(counts, a.seconds), a.json, _fmt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
