"""Benchmark: how long a broker planning round stalls the broker loop, search off the loop vs inline.

With a ``[broker.planner]`` table the broker runs the Global Resource Planner every ``interval_s``
(``libra/broker/plan_decider.py``). Baseline: the whole round inline on the loop thread
(``PlannerLoop.decide``), which stalls the loop for the search. Libra (what ``BrokerServer`` does):
``PlannerLoop.start`` on the loop (snapshot the pressure, build the re-planner), the search
(``PlanJob.run``) on a worker thread while the loop keeps running, then ``PlannerLoop.finish`` on the
loop. The loop is modelled by the measuring thread (0.5 ms of sleeping work per iteration); the bench
reports its longest gap while the search runs, GIL sharing included. Each cluster size plans over a
4,096-trajectory R2E-like history (lognormal lengths capped at 40,960 tokens, 1-12 turns), A800 + Qwen3-14B,
``grp`` allocation, batch 256.

``python -m libra.bench planner_round [--gpus 48,128,512] [--repeat 3] [--json]``
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from libra.bench.loop_gap import loop_gaps_while
from libra.bench.output import emit
from libra.logging import configure

__all__ = ["main", "run"]


def _loop(gpus: int, seed: int) -> Any:
    from libra.broker.plan_decider import PlannerLoop, PlannerSettings

    loop = PlannerLoop(PlannerSettings.from_dict({"allocation": "grp", "interval_s": 1.0, "batch": 256}))
    rng = np.random.default_rng(seed)
    for _ in range(4096):
        total = min(40960.0, float(rng.lognormal(np.log(6000.0), 1.0)))
        prompt = min(float(rng.uniform(500, 2048)), total / 2)
        loop.observe(int(prompt), int(total - prompt), int(rng.integers(1, 13)))
    loop.due(0.0)
    return loop


def run(gpus: Sequence[int], repeat: int, seed: int = 0) -> dict[str, Any]:
    """Per cluster size: the inline round's stall, the offloaded round's loop pauses and longest gap."""
    rows = []
    for n in gpus:
        inline, start, finish, gaps, search = [], [], [], [], []
        for r in range(repeat):
            loop = _loop(n, seed)
            t0 = time.perf_counter()
            loop.decide(n, 2.0)  # baseline: the round on the loop thread
            inline.append(time.perf_counter() - t0)
            loop = _loop(n, seed)
            t0 = time.perf_counter()
            job = loop.start(n, 2.0)
            start.append(time.perf_counter() - t0)
            assert job is not None
            gaps.append(loop_gaps_while(threading.Thread(target=job.run, args=(time.perf_counter,))))  # as the server
            search.append(job.seconds)
            t0 = time.perf_counter()
            loop.finish(job, 3.0)
            finish.append(time.perf_counter() - t0)
        worst = max(min(start), min(finish), min(gaps))
        rows.append({"gpus": n, "inline_stall_ms": 1000 * min(inline), "start_pause_ms": 1000 * min(start),
                     "finish_pause_ms": 1000 * min(finish), "max_loop_gap_during_search_ms": 1000 * min(gaps),
                     "search_ms": 1000 * min(search), "stall_ratio": min(inline) / worst})
    return {"repeat": repeat, "rows": rows}


def _fmt(out: dict[str, Any]) -> str:
    lines = ["Broker planning round: longest broker-loop stall, search inline (baseline) vs on a worker thread",
             f"{'GPUs':>5} {'inline stall ms':>16} {'start ms':>9} {'finish ms':>10} {'loop gap ms':>12} "
             f"{'search ms':>10} {'inline / libra':>15}"]
    for r in out["rows"]:
        lines.append(f"{r['gpus']:>5} {r['inline_stall_ms']:>16.1f} {r['start_pause_ms']:>9.2f} "
                     f"{r['finish_pause_ms']:>10.2f} {r['max_loop_gap_during_search_ms']:>12.1f} "
                     f"{r['search_ms']:>10.0f} {r['stall_ratio']:>14.1f}x")
    lines.append("libra's stall = the largest of its start pause, finish pause and longest loop gap (best of "
                 f"{out['repeat']} each)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench planner_round", description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="48,128,512", help="comma-separated cluster sizes (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="rounds per size; the best of each figure is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        gpus = [int(x) for x in args.gpus.split(",") if x]
    except ValueError:
        p.error(f"--gpus wants comma-separated integers, got {args.gpus!r}")
    if not gpus or min(gpus) < 2 or args.repeat < 1:
        p.error("--gpus must be integers >= 2 and --repeat >= 1")
    configure("warning")  # keep the planner's per-round info lines out of the table / JSON
    t0 = time.perf_counter()
    out = run(gpus, args.repeat, args.seed)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(out, args.json, _fmt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
