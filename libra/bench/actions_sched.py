"""Benchmark: ARL-Tangram action scheduling (research-notes §5.2, §5.4).

Three parts, each against its baseline in the same run:

1. **Decision latency** of ``tangram`` vs a plain FCFS fixed-DoP decision (``fixed_dop``, DoP 4) and vs the
   pre-optimisation reference implementation (``ReferenceElasticScheduler``, same decisions) on the same
   synthetic snapshot, for window n ∈ {8, 16, 32, 64, 128} and free units m ∈ {64, 256, 1024}: a queue of
   n+32 actions (half CPU-elastic builds up to 16 cores, half one-core edits) and 200 running actions.
   The variants are timed in interleaved rounds; reported: the best and the median round's mean µs per
   decision (wall clock of this process) and the best round's thread CPU time. The snapshot's specs are
   built once (their duration/gain tables, ``row`` columns and demand ``grant`` are computed at submission,
   ``ActionSpec`` construction, not per decision).
2. **AI-coding simulation** (15 × 256 cores): mean/p99 ACT, queueing, step time and cores used for
   ``tangram``, ``per_trajectory`` with the budget split evenly (cores // batch per sandbox) and sized for the
   peak DoP (16), and ``fixed_dop`` 4/16, at each batch; ratios are baseline ACT / tangram ACT.
3. **MOPD GPU pool**: the static SGLang-like deployment (9 teachers × 4 GPUs) vs the smallest ``tangram``
   evict-on-execution pool whose mean ACT is within ``--ratio`` of the baseline's. Also reported: the
   time-averaged GPUs held by executing (and restoring) calls in both, and tangram's ACT on the full
   36-GPU pool against the baseline's (the paper's "18.1× at batch 2,048").

``python -m libra.bench.actions_sched [--quick] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from libra.policies.actions import (
    ActionQueue,
    ActionSpec,
    Amdahl,
    ElasticScheduler,
    ElasticSpec,
    FixedDoPScheduler,
    RunningSet,
    RunningView,
)
from libra.policies.actions_tangram_ref import ReferenceElasticScheduler
from libra.sim.actions_sim import SimConfig, min_gpu_pool, run_sim

__all__ = ["main", "run"]


def _snapshot(n: int, m: int, seed: int) -> tuple[ActionQueue, dict[str, int], RunningSet]:
    rng = random.Random(seed)
    specs = []
    for i in range(n + 32):
        if i % 2 == 0:
            specs.append(ActionSpec(f"q{i}", f"t{i}", "build", {"cpu": 1}, rng.lognormvariate(1.5, 1.0),
                                    ElasticSpec("cpu", 16, Amdahl(rng.uniform(0.6, 0.8)))))
        else:
            specs.append(ActionSpec(f"q{i}", f"t{i}", "edit", {"cpu": 1}, rng.lognormvariate(-1.0, 0.6)))
    running = RunningSet(RunningView(f"r{i}", f"rt{i}", {"cpu": 4}, rng.uniform(0.0, 3.0)) for i in range(200))
    return ActionQueue(specs), {"cpu": m}, running


def _time_us(fns: dict[str, Callable[[], Any]], repeat: int, number: int) -> dict[str, dict[str, float]]:
    """µs per call of each function, the functions timed in interleaved rounds of ``number`` calls (so a noisy
    neighbour slows every variant of a round alike). Per function: ``best`` and ``median`` round means of the
    wall clock, and ``cpu`` = the best round's mean thread CPU time (time the process was scheduled; on a
    shared machine it excludes the rounds' preemptions)."""
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            c0 = time.thread_time()
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            wall[name].append((time.perf_counter() - t0) / number * 1e6)
            cpu[name].append((time.thread_time() - c0) / number * 1e6)
    return {k: {"best": min(wall[k]), "median": statistics.median(wall[k]), "cpu": min(cpu[k])} for k in fns}


def latency(windows: list[int], units: list[int], depths: list[int], repeat: int, number: int) -> list[dict[str, Any]]:
    """Decision latency rows (see the module docstring). ``*_us`` is the best round's mean wall clock,
    ``*_median_us`` the median round's, ``*_cpu_us`` the best round's thread CPU time. Raises
    ``AssertionError`` if the optimised and the reference scheduler disagree on a snapshot."""
    rows = []
    for n in windows:
        for m in units:
            queue, free, running = _snapshot(n, m, seed=n * 7 + m)
            fifo = FixedDoPScheduler(dop=4, window=n)
            for depth in depths:
                tg = ElasticScheduler(window=n, depth=depth)
                ref = ReferenceElasticScheduler(window=n, depth=depth)
                grants = tg.schedule(queue, free, running, 0.0)
                assert grants == ref.schedule(queue, free, running, 0.0), "optimised tangram != reference"
                t = _time_us({
                    "fixed": lambda: fifo.schedule(queue, free, running, 0.0),
                    "tangram": lambda: tg.schedule(queue, free, running, 0.0),
                    "reference": lambda: ref.schedule(queue, free, running, 0.0),
                }, repeat, number)
                row: dict[str, Any] = {"window": n, "units": m, "depth": depth}
                for key, name in (("tangram", "tangram"), ("fixed_dop", "fixed"), ("reference", "reference")):
                    row[f"{key}_us"] = t[name]["best"]
                    row[f"{key}_median_us"] = t[name]["median"]
                    row[f"{key}_cpu_us"] = t[name]["cpu"]
                row.update({
                    "ratio": t["tangram"]["best"] / t["fixed"]["best"],
                    "speedup_vs_reference": t["reference"]["best"] / t["tangram"]["best"], "grants": len(grants),
                    "evicted": n - len(grants) if len(grants) < n else 0,
                    "contended": sum(g.units["cpu"] for g in grants) >= m,
                })
                rows.append(row)
    return rows


def coding(batches: list[int], seed: int, steps: int) -> list[dict[str, Any]]:
    """AI-coding comparison rows, one per (batch, policy), with ACT ratios against tangram."""
    out = []
    for batch in batches:
        base = SimConfig(workload="coding", batch=batch, seed=seed, steps=steps)
        variants = [
            ("tangram", base),
            ("per_trajectory(even)", replace(base, scheduler="per_trajectory", sandbox_cores="even")),
            ("per_trajectory(peak)", replace(base, scheduler="per_trajectory", sandbox_cores="peak")),
            ("fixed_dop(4)", replace(base, scheduler="fixed_dop", dop=4)),
            ("fixed_dop(16)", replace(base, scheduler="fixed_dop", dop=16)),
        ]
        ref = None
        for label, cfg in variants:
            r = run_sim(cfg)
            ref = ref or r
            out.append({
                "batch": batch, "policy": label, "sandbox_cores": r.get("sandbox_cores"),
                "act_mean_s": r["act_mean_s"], "act_p99_s": r["act_p99_s"],
                "queue_s": r["act_breakdown_s"]["queue"], "exec_s": r["act_breakdown_s"]["exec"],
                "overhead_s": r["act_breakdown_s"]["overhead"], "step_time_s": r["step_time_s"]["mean"],
                "cores_used": r["cores_used"], "core_budget": r["core_budget"],
                "act_ratio_vs_tangram": r["act_mean_s"] / ref["act_mean_s"],
                "step_ratio_vs_tangram": r["step_time_s"]["mean"] / ref["step_time_s"]["mean"],
                "sim_wall_s": r["sim_wall_s"],
            })
    return out


def mopd(batch: int, seed: int, ratio: float, zipf: list[float]) -> list[dict[str, Any]]:
    """Static 36-GPU deployment vs the smallest tangram pool within ``ratio``, per Zipf exponent."""
    rows = []
    for s in zipf:
        cfg = SimConfig(workload="mopd", batch=batch, seed=seed, workload_params={"zipf_s": s})
        res = min_gpu_pool(cfg, ratio=ratio, candidates=list(range(4, 37, 4)))
        b, t = res["baseline"], res["tangram"]
        full = run_sim(replace(cfg, gpu_pool=b["gpus_used"]))
        rows.append({
            "zipf_s": s, "baseline_gpus": b["gpus_used"], "baseline_act_s": b["act_mean_s"],
            "baseline_breakdown_s": b["act_breakdown_s"], "baseline_gpus_busy_mean": b["gpus_busy_mean"],
            "tangram_gpus": None if t is None else t["gpus_used"],
            "tangram_act_s": None if t is None else t["act_mean_s"],
            "tangram_breakdown_s": None if t is None else t["act_breakdown_s"],
            "tangram_gpus_busy_mean": None if t is None else t["gpus_busy_mean"],
            "tangram_restores": None if t is None else t.get("gpu_restores"),
            "gpu_fraction": None if t is None else t["gpus_used"] / b["gpus_used"],
            "same_pool_act_s": full["act_mean_s"], "same_pool_breakdown_s": full["act_breakdown_s"],
            "same_pool_act_gain": b["act_mean_s"] / full["act_mean_s"],
            "tried": res["tried"],
        })
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the selected parts and return one result object."""
    out: dict[str, Any] = {"quick": args.quick}
    if not args.skip_latency:
        windows = [8, 16, 32, 64, 128]
        out["latency"] = latency(windows, [64, 256, 1024], [0, 2] if args.quick else [0, 2, 4],
                                 repeat=3 if args.quick else 7, number=50 if args.quick else 200)
    if not args.skip_sim:
        batches = [256, 1280] if args.quick else [256, 1280, 1536]
        out["coding"] = coding(batches, args.seed, args.steps)
        out["mopd"] = mopd(2048, args.seed, args.ratio, [1.0] if args.quick else [1.0, 1.5])
    return out


def _print(res: dict[str, Any]) -> None:
    if "latency" in res:
        print("decision latency (µs per decision: best round / median round wall clock, [best round CPU]),"
              " tangram vs fixed_dop(4) FCFS and the reference")
        print(f"{'n':>4} {'m':>5} {'depth':>5} {'tangram':>19} {'reference':>19} {'fixed':>19} {'ratio':>6} {'speedup':>7}"
              f" {'grants':>6} contended")

        def cell(r: dict[str, Any], k: str) -> str:
            return f"{r[k + '_us']:.1f}/{r[k + '_median_us']:.1f} [{r[k + '_cpu_us']:.1f}]"

        for r in res["latency"]:
            print(f"{r['window']:>4} {r['units']:>5} {r['depth']:>5} {cell(r, 'tangram'):>19} {cell(r, 'reference'):>19}"
                  f" {cell(r, 'fixed_dop'):>19} {r['ratio']:>6.2f} {r['speedup_vs_reference']:>7.2f} {r['grants']:>6}"
                  f" {r['contended']}")
    if "coding" in res:
        print("\nAI coding (15 x 256 = 3,840 cores for every policy); ratio = policy ACT / tangram ACT")
        print(f"{'batch':>5} {'policy':<24} {'ACT':>7} {'p99':>7} {'queue':>7} {'exec':>6} {'step':>7} {'cores':>6} {'ratio':>6} {'step x':>6}")
        for r in res["coding"]:
            print(f"{r['batch']:>5} {r['policy']:<24} {r['act_mean_s']:>7.3f} {r['act_p99_s']:>7.2f} {r['queue_s']:>7.3f}"
                  f" {r['exec_s']:>6.3f} {r['step_time_s']:>7.1f} {r['cores_used']:>6.0f} {r['act_ratio_vs_tangram']:>6.2f}"
                  f" {r['step_ratio_vs_tangram']:>6.2f}")
    if "mopd" in res:
        print("\nMOPD batch 2048: static deployments vs smallest tangram pool within the ACT ratio")
        for r in res["mopd"]:
            tg = "none" if r["tangram_gpus"] is None else f"{r['tangram_gpus']} GPUs ({r['gpu_fraction']:.0%}), ACT {r['tangram_act_s']:.3f} s"
            print(f"  zipf {r['zipf_s']}: baseline {r['baseline_gpus']} GPUs, ACT {r['baseline_act_s']:.3f} s; tangram {tg}")
            busy = r["tangram_gpus_busy_mean"]
            print(f"    GPUs held by running calls (time average): baseline {r['baseline_gpus_busy_mean']:.2f}, tangram "
                  + ("-" if busy is None else f"{busy:.2f}")
                  + f"; tangram on all {r['baseline_gpus']} GPUs: ACT {r['same_pool_act_s']:.3f} s"
                  f" ({r['same_pool_act_gain']:.1f}x lower than the baseline)")
            print("    tried: " + ", ".join(f"{t['gpus']}:{t['ratio']:.2f}x" for t in r["tried"]))


def main(argv: list[str] | None = None) -> int:
    """CLI: print tables, or one JSON object with ``--json``."""
    p = argparse.ArgumentParser(prog="python -m libra.bench actions_sched", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer batches, repeats and depths")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--skip-sim", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--ratio", type=float, default=1.25, help="MOPD: allowed tangram/baseline mean-ACT ratio")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = run(args)
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        _print(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
