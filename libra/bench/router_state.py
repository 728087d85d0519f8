"""Benchmark: how long a router-state save stalls the broker loop, frozen snapshot vs building it on the loop.

The broker saves C-MLFQ's prefix tree every minute (``--router-state``). Baseline: build the snapshot
(``CausalPrefixTree.to_dict``) on the loop thread, which stalls the loop for the whole tree walk. Libra:
``freeze`` on the loop (copies two lists), then a writer thread streams the snapshot as JSON text
(``Snapshot.iter_json``) while the loop keeps running. The loop is modelled by the measuring thread: it does 0.5 ms of sleeping work per
iteration, and the bench reports its longest gap between iterations while the writer runs (GIL sharing
included). The tree is profiled from a generated R2E trace (``--steps`` × ``--prompts`` × 16).

``python -m libra.bench router_state [--steps 20] [--prompts 64] [--repeat 3] [--json]``
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

from libra.bench.loop_gap import loop_gaps_while

__all__ = ["main", "run"]


def run(steps: int, prompts: int, repeat: int) -> dict[str, Any]:
    from libra.policies.routing.tool_state import R2E_THRESHOLDS
    from libra.commands.tree_profile import profile_tree
    from libra.sim.workloads import generate

    tree = profile_tree(generate("r2e", steps, prompts, 16, 0), R2E_THRESHOLDS, rebuild_interval=0)
    naive, pause, gaps, build = [], [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        tree.to_dict()  # the baseline builds the snapshot on the loop (encoding it could move off the loop)
        naive.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        snap = tree.freeze()
        pause.append(time.perf_counter() - t0)
        spent: list[float] = []

        def write(snap: Any = snap, spent: list[float] = spent) -> None:
            t = time.perf_counter()
            sum(map(len, snap.iter_json()))  # what the broker's writer thread streams to the file
            spent.append(time.perf_counter() - t)

        gaps.append(loop_gaps_while(threading.Thread(target=write)))
        tree.thaw()
        build.append(spent[0])
    best = min(naive)
    return {"trajectories": tree.global_tree.root.stats.count, "prompts": tree.num_prompts,
            "global_nodes": tree.global_tree.node_count,
            "naive_loop_stall_ms": 1000 * best, "freeze_pause_ms": 1000 * min(pause),
            "max_loop_gap_during_write_ms": 1000 * min(gaps), "background_write_ms": 1000 * min(build),
            "stall_ratio": best / min(gaps)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench router_state", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=64, help="GRPO groups per step (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="rounds; the best of each figure is reported")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.steps < 1 or args.prompts < 1 or args.repeat < 1:
        p.error("--steps, --prompts and --repeat must be >= 1")
    res = run(args.steps, args.prompts, args.repeat)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"tree: {res['trajectories']} trajectories, {res['prompts']} prompts, {res['global_nodes']} global nodes")
    print(f"baseline, snapshot built on the loop:   loop stalled {res['naive_loop_stall_ms']:8.1f} ms")
    print(f"libra, frozen + background writer:      loop paused  {res['freeze_pause_ms']:8.2f} ms, longest loop gap "
          f"{res['max_loop_gap_during_write_ms']:.1f} ms while the writer took {res['background_write_ms']:.0f} ms")
    print(f"longest stall, baseline / libra: {res['stall_ratio']:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
