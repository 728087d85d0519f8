"""Benchmark: ARL-Tangram action scheduling (docs/papers.md §5.2, §5.4).

Three parts, each against its baseline in the same run:

1. **Decision latency** of ``tangram`` vs a plain FCFS fixed-DoP decision (``fixed_dop``, DoP 4, the
   runtime's baseline in ``policies/actions/baselines.py``) on the same synthetic snapshot (the first
   implementation, once timed here too, was a near-copy kept beside the code and is gone, #29), for window n ∈ {8, 16, 32, 64, 128} and free units m ∈ {64, 256, 1024}: a queue of
   n+32 actions (half CPU-elastic builds up to 16 cores, half one-core edits) and 200 running actions.
   The variants are timed in interleaved rounds; reported: the best and the median round's mean µs per
   decision (wall clock of this process) and the best round's thread CPU time. The snapshot's specs are
   built once (their duration/gain tables, ``row`` columns and demand ``grant`` are computed at submission,
   ``ActionSpec`` construction, not per decision).
2. **AI-coding simulation** (15 × 256 cores): mean/p99 ACT, queueing, step time and cores used for
   ``tangram``, ``per_trajectory`` with the budget split evenly (cores // batch per sandbox) and sized for the
   peak DoP (16), and ``fixed_dop`` 4/16, at each batch; ratios are baseline ACT / tangram ACT.
3. **MOPD GPU pool**: the static SGLang-like deployment (9 teachers × 4 GPUs) vs the smallest ``tangram``
   evict-on-execution pool whose mean ACT is within ``--ratio`` of the baseline's, under the GPU memory
   model (``--gpu-mem-gb`` 80 per GPU, ``--gpu-workspace-gb`` 8 kept for activations: idle teachers stay
   resident side by side, a cell runs one call at a time; ``--gpu-mem-gb 0``: one replica per cell). For
   the chosen pool: ACT and its breakdown (execution / queueing / restore overhead), hits / restores /
   evictions, and the same pool with exclusive cells. Also reported: the compute bound at the target's
   pool size (no placement can do better), the time-averaged GPUs held by executing (and restoring) calls
   in both, and tangram's ACT on the full 36-GPU pool against the baseline's (the paper's "18.1× at batch
   2,048"). Each load calibration of ``--mopd-loads`` (``libra.sim.action_workloads.MOPD_LOADS``) gets its
   own rows; the first is also checked against the paper's ACT breakdown (tangram on its 10 GPUs at batch
   2,048 and 3,072).

Parts 2 and 3 run the **policy-level model** (``SimConfig.model = "policy"``: the policy over a modelled pool,
not the broker's placement; every table says so). ``--broker BATCH`` adds part 4, **through the broker**:
the AI-coding runs of ``tangram`` and ``fixed_dop(4)`` at that batch with every action submitted to the real
broker core (``libra.sim.actions_broker``) next to the same runs in the policy-level model, with the ratios.

``python -m libra.bench.actions_sched [--quick] [--skip-latency] [--skip-coding] [--mopd-loads L,...]
[--broker BATCH] [--json]``.
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

from libra.policies.actions.registry import (
    ActionQueue,
    ActionSpec,
    Amdahl,
    ElasticScheduler,
    ElasticSpec,
    FixedDoPScheduler,
    RunningSet,
    RunningView,
)
from libra.sim.action_workloads import MOPD_LOADS
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
    ``*_median_us`` the median round's, ``*_cpu_us`` the best round's thread CPU time."""
    rows = []
    for n in windows:
        for m in units:
            queue, free, running = _snapshot(n, m, seed=n * 7 + m)
            fifo = FixedDoPScheduler(dop=4, window=n)
            for depth in depths:
                tg = ElasticScheduler(window=n, depth=depth)
                grants = tg.schedule(queue, free, running, 0.0)
                t = _time_us({
                    "fixed": lambda: fifo.schedule(queue, free, running, 0.0),
                    "tangram": lambda: tg.schedule(queue, free, running, 0.0),
                }, repeat, number)
                row: dict[str, Any] = {"window": n, "units": m, "depth": depth}
                for key, name in (("tangram", "tangram"), ("fixed_dop", "fixed")):
                    row[f"{key}_us"] = t[name]["best"]
                    row[f"{key}_median_us"] = t[name]["median"]
                    row[f"{key}_cpu_us"] = t[name]["cpu"]
                row.update({
                    "ratio": t["tangram"]["best"] / t["fixed"]["best"], "grants": len(grants),
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


def broker_vs_policy(batch: int, seed: int, steps: int) -> list[dict[str, Any]]:
    """Part 4: AI coding at ``batch`` through the broker and in the policy-level model, same config, same run."""
    out = []
    base = SimConfig(workload="coding", batch=batch, seed=seed, steps=steps)
    for label, cfg in (("tangram", base), ("fixed_dop(4)", replace(base, scheduler="fixed_dop", dop=4))):
        b, p = run_sim(replace(cfg, model="broker")), run_sim(replace(cfg, model="policy"))
        out.append({"batch": batch, "policy": label, "broker_act_s": b["act_mean_s"], "policy_act_s": p["act_mean_s"],
                    "broker_queue_s": b["act_breakdown_s"]["queue"], "policy_queue_s": p["act_breakdown_s"]["queue"],
                    "broker_step_s": b["step_time_s"]["mean"], "policy_step_s": p["step_time_s"]["mean"],
                    "act_ratio_broker_over_policy": b["act_mean_s"] / p["act_mean_s"],
                    "broker_numa_split_fraction": b["numa_split_fraction"],
                    "policy_numa_split_fraction": p["numa_split_fraction"],
                    "broker_wall_s": b["sim_wall_s"], "policy_wall_s": p["sim_wall_s"],
                    "modelled_only": b["modelled_only"]})
    return out


MOPD_CANDIDATES = sorted({*range(4, 37, 4), 10})
"""Pool sizes tried for MOPD: every multiple of a TP-4 replica, plus 10 (a node of 8 and a partial node of 2,
as the simulator lays out pools; the 2 GPUs cannot host a TP-4 cell, so 10 behaves like 8)."""

MOPD_TARGET_FRACTION = 0.30
"""Issue #5: tangram within the ACT ratio on at most this fraction of the static baseline's GPUs."""


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    """ACT, its breakdown and the placement counters of one pooled run."""
    return {
        "gpus": r["gpus_used"], "act_mean_s": r["act_mean_s"], "breakdown_s": r["act_breakdown_s"],
        "gpus_busy_mean": r["gpus_busy_mean"], "hits": r.get("gpu_hits"), "restores": r.get("gpu_restores"),
        "evictions": r.get("gpu_evictions"), "restore_s": r.get("gpu_restore_s"),
    }


MOPD_PAPER_POOL = 10
"""GPUs of the paper's tangram MOPD deployment (docs/papers.md §2.6: 36 → 10)."""

MOPD_PAPER_BREAKDOWN = {2048: {"exec": 0.621, "queue": 0.081, "overhead": 0.201},
                        3072: {"exec": 0.705, "queue": 15.05, "overhead": 0.240}}
"""The paper's MOPD ACT breakdown in seconds, per batch (docs/papers.md §2.6 [W])."""


def mopd_calibration(seed: int, load: str = "breakdown") -> list[dict[str, Any]]:
    """Tangram on the paper's 10-GPU pool at batch 2,048 and 3,072 under the ``load`` calibration, next to the
    paper's ACT breakdown (:data:`MOPD_PAPER_BREAKDOWN`): the check behind
    :data:`libra.sim.action_workloads.MOPD_LOADS`."""
    rows = []
    for batch, paper in MOPD_PAPER_BREAKDOWN.items():
        r = run_sim(SimConfig(workload="mopd", batch=batch, seed=seed, gpu_pool=MOPD_PAPER_POOL,
                              workload_params={"think_mean_s": MOPD_LOADS[load]}))
        rows.append({"load": load, "batch": batch, "gpus": MOPD_PAPER_POOL, "act_mean_s": r["act_mean_s"],
                     "breakdown_s": r["act_breakdown_s"], "paper_breakdown_s": paper})
    return rows


def mopd(batch: int, seed: int, ratio: float, zipf: list[float], *, gpu_mem_gb: float | None = 80.0,
         gpu_workspace_gb: float = 8.0, reserve_gb: float = 0.0, load: str = "breakdown") -> list[dict[str, Any]]:
    """Static 36-GPU deployment vs the smallest tangram pool within ``ratio``, per Zipf exponent, under the
    ``load`` calibration (a key of :data:`libra.sim.action_workloads.MOPD_LOADS`).

    Pools are tried in :data:`MOPD_CANDIDATES` order under the GPU memory model (``gpu_mem_gb`` per GPU,
    ``gpu_workspace_gb`` kept for activations, ``reserve_gb`` more per GPU for every resident teacher;
    ``gpu_mem_gb=None``: exclusive cells). Per exponent it also
    runs: the chosen pool with exclusive cells (what co-residency buys), tangram on the baseline's 36 GPUs,
    and the *compute bound* at the largest candidate within :data:`MOPD_TARGET_FRACTION` of the baseline's
    GPUs: unlimited GPU memory and free restores (every teacher resident on every cell), so only the
    one-call-per-cell compute limit remains; no placement policy can beat it on that pool.
    """
    rows = []
    for s in zipf:
        params = {"zipf_s": s, "reserve_gb": reserve_gb, "think_mean_s": MOPD_LOADS[load]}
        cfg = SimConfig(workload="mopd", batch=batch, seed=seed, workload_params=params,
                        gpu_mem_gb=gpu_mem_gb, gpu_workspace_gb=gpu_workspace_gb)
        res = min_gpu_pool(cfg, ratio=ratio, candidates=MOPD_CANDIDATES)
        b, t = res["baseline"], res["tangram"]
        full = run_sim(replace(cfg, gpu_pool=b["gpus_used"]))
        target_pool = max(g for g in MOPD_CANDIDATES if g <= MOPD_TARGET_FRACTION * b["gpus_used"])
        bound = run_sim(replace(cfg, gpu_pool=target_pool, gpu_mem_gb=1e9, gpu_workspace_gb=0.0, h2d_gbps=1e15))
        exclusive = None
        if t is not None and gpu_mem_gb is not None:
            exclusive = _brief(run_sim(replace(cfg, gpu_pool=t["gpus_used"], gpu_mem_gb=None)))
        # the same search with every call placed by the broker's service pools (the same GPU memory model and
        # wait-or-restore rule, declared in the service tool's [broker.tools] entry)
        via = min_gpu_pool(replace(cfg, model="broker", cpu_nodes=1), ratio=ratio, candidates=MOPD_CANDIDATES)
        vb = via["tangram"]
        rows.append({
            "load": load, "think_mean_s": MOPD_LOADS[load], "zipf_s": s, "gpu_mem_gb": gpu_mem_gb, "gpu_workspace_gb": gpu_workspace_gb if gpu_mem_gb else None,
            "reserve_gb": reserve_gb if gpu_mem_gb else None,
            "baseline_gpus": b["gpus_used"], "baseline_act_s": b["act_mean_s"],
            "baseline_breakdown_s": b["act_breakdown_s"], "baseline_gpus_busy_mean": b["gpus_busy_mean"],
            "act_limit_s": ratio * b["act_mean_s"],
            "tangram": None if t is None else _brief(t),
            "tangram_gpus": None if t is None else t["gpus_used"],
            "tangram_act_s": None if t is None else t["act_mean_s"],
            "tangram_breakdown_s": None if t is None else t["act_breakdown_s"],
            "tangram_gpus_busy_mean": None if t is None else t["gpus_busy_mean"],
            "tangram_restores": None if t is None else t.get("gpu_restores"),
            "gpu_fraction": None if t is None else t["gpus_used"] / b["gpus_used"],
            "target_fraction": MOPD_TARGET_FRACTION,
            "meets_target": t is not None and t["gpus_used"] <= MOPD_TARGET_FRACTION * b["gpus_used"],
            "exclusive_same_pool": exclusive,
            "compute_bound": {"gpus": target_pool, "act_mean_s": bound["act_mean_s"],
                              "ratio": bound["act_mean_s"] / b["act_mean_s"]},
            "same_pool_act_s": full["act_mean_s"], "same_pool_breakdown_s": full["act_breakdown_s"],
            "same_pool_act_gain": b["act_mean_s"] / full["act_mean_s"],
            "tried": res["tried"],
            "broker": None if vb is None else {"gpus": vb["gpus_used"], "act_mean_s": vb["act_mean_s"],
                                               "breakdown_s": vb["act_breakdown_s"],
                                               "gpu_fraction": vb["gpus_used"] / b["gpus_used"],
                                               "restores": vb.get("gpu_restores"), "hits": vb.get("gpu_hits")},
            "broker_tried": via["tried"],
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
        if not args.skip_coding:
            out["coding"] = coding(batches, args.seed, args.steps)
        if args.broker:
            out["broker"] = broker_vs_policy(args.broker, args.seed, args.steps)
        loads = [x for x in args.mopd_loads.split(",") if x]
        out["mopd_calibration"] = mopd_calibration(args.seed, loads[0])
        out["mopd"] = [row for load in loads
                       for row in mopd(2048, args.seed, args.ratio, [1.0] if args.quick else [1.0, 1.5],
                                       gpu_mem_gb=args.gpu_mem_gb or None, gpu_workspace_gb=args.gpu_workspace_gb,
                                       reserve_gb=args.teacher_reserve_gb, load=load)]
    return out


def _print(res: dict[str, Any]) -> None:
    if "latency" in res:
        print("decision latency (µs per decision: best round / median round wall clock, [best round CPU]),"
              " tangram vs fixed_dop(4) FCFS")
        print(f"{'n':>4} {'m':>5} {'depth':>5} {'tangram':>19} {'fixed':>19} {'ratio':>6}"
              f" {'grants':>6} contended")

        def cell(r: dict[str, Any], k: str) -> str:
            return f"{r[k + '_us']:.1f}/{r[k + '_median_us']:.1f} [{r[k + '_cpu_us']:.1f}]"

        for r in res["latency"]:
            print(f"{r['window']:>4} {r['units']:>5} {r['depth']:>5} {cell(r, 'tangram'):>19}"
                  f" {cell(r, 'fixed_dop'):>19} {r['ratio']:>6.2f} {r['grants']:>6}"
                  f" {r['contended']}")
    if "coding" in res:
        print("\nAI coding (15 x 256 = 3,840 cores for every policy); ratio = policy ACT / tangram ACT;"
              " model policy (the policy over a modelled pool, not the broker's placement: see --broker)")
        print(f"{'batch':>5} {'policy':<24} {'ACT':>7} {'p99':>7} {'queue':>7} {'exec':>6} {'step':>7} {'cores':>6} {'ratio':>6} {'step x':>6}")
        for r in res["coding"]:
            print(f"{r['batch']:>5} {r['policy']:<24} {r['act_mean_s']:>7.3f} {r['act_p99_s']:>7.2f} {r['queue_s']:>7.3f}"
                  f" {r['exec_s']:>6.3f} {r['step_time_s']:>7.1f} {r['cores_used']:>6.0f} {r['act_ratio_vs_tangram']:>6.2f}"
                  f" {r['step_ratio_vs_tangram']:>6.2f}")
    if "broker" in res:
        print("\nAI coding through the broker (every action a Submit to BrokerState, placed by the broker) vs the"
              " policy-level model, same config")
        for r in res["broker"]:
            print(f"{r['batch']:>5} {r['policy']:<14} ACT broker {r['broker_act_s']:.3f} s / policy {r['policy_act_s']:.3f}"
                  f" s = {r['act_ratio_broker_over_policy']:.3f}x; queue {r['broker_queue_s']:.3f} / {r['policy_queue_s']:.3f}"
                  f" s; step {r['broker_step_s']:.1f} / {r['policy_step_s']:.1f} s; NUMA-split "
                  f"{r['broker_numa_split_fraction']:.3f} / {r['policy_numa_split_fraction']:.3f};"
                  f" wall {r['broker_wall_s']:.1f} / {r['policy_wall_s']:.1f} s")
        for line in res["broker"][0]["modelled_only"] if res["broker"] else []:
            print(f"modelled-only: {line}")
    if "mopd" in res:
        rows = res["mopd"]
        mem = rows[0]["gpu_mem_gb"] if rows else None
        model = ("exclusive cells (one replica per TP-4 cell)" if mem is None else
                 f"GPU memory model: {mem:g} GB per GPU, {rows[0]['gpu_workspace_gb']:g} GB kept for activations,"
                 f" {rows[0]['reserve_gb']:g} GB per GPU reserved by every resident teacher")
        print(f"\nMOPD batch 2048 (model policy): static deployments vs smallest tangram pool within the ACT ratio; {model}")
        for c in res.get("mopd_calibration", []):
            bd, pb = c["breakdown_s"], c["paper_breakdown_s"]
            print(f"  calibration ({c['load']} load), tangram on the paper's {c['gpus']} GPUs at batch {c['batch']}:"
                  f" exec {bd['exec']:.3f} / queue {bd['queue']:.3f} / overhead {bd['overhead']:.3f} s"
                  f" (paper {pb['exec']:.3f} / {pb['queue']:.3f} / {pb['overhead']:.3f})")
        for r in rows:
            t = r["tangram"]
            print(f"  {r['load']} load (think {r['think_mean_s']:g} s), zipf {r['zipf_s']}: baseline {r['baseline_gpus']} GPUs, ACT {r['baseline_act_s']:.3f} s"
                  f" (limit {r['act_limit_s']:.3f} s)")
            if t is None:
                print("    tangram: no pool within the ratio")
            else:
                bd = t["breakdown_s"]
                print(f"    tangram {t['gpus']} GPUs ({r['gpu_fraction']:.0%} of the baseline; target <= "
                      f"{r['target_fraction']:.0%}: {'met' if r['meets_target'] else 'NOT met'}): ACT {t['act_mean_s']:.3f} s"
                      f" = exec {bd['exec']:.3f} + queue {bd['queue']:.3f} + restore overhead {bd['overhead']:.3f};"
                      f" hits {t['hits']}, restores {t['restores']}, evictions {t['evictions']}")
                ex = r["exclusive_same_pool"]
                if ex is not None:
                    print(f"    same {ex['gpus']} GPUs, exclusive cells: ACT {ex['act_mean_s']:.3f} s, restore overhead"
                          f" {ex['breakdown_s']['overhead']:.3f} s, hits {ex['hits']}, restores {ex['restores']},"
                          f" evictions {ex['evictions']}")
            cb = r["compute_bound"]
            print(f"    compute bound on {cb['gpus']} GPUs (every teacher resident everywhere, free restores):"
                  f" ACT {cb['act_mean_s']:.3f} s ({cb['ratio']:.2f}x baseline)")
            busy = r["tangram_gpus_busy_mean"]
            print(f"    GPUs held by running calls (time average): baseline {r['baseline_gpus_busy_mean']:.2f}, tangram "
                  + ("-" if busy is None else f"{busy:.2f}")
                  + f"; tangram on all {r['baseline_gpus']} GPUs: ACT {r['same_pool_act_s']:.3f} s"
                  f" ({r['same_pool_act_gain']:.1f}x lower than the baseline)")
            print("    tried: " + ", ".join(f"{x['gpus']}:{x['ratio']:.2f}x" for x in r["tried"]))
            vb = r.get("broker")
            print("    through the broker (its service pools, same memory model and wait-or-restore rule): "
                  + ("no pool within the ratio" if vb is None else
                     f"smallest pool {vb['gpus']} GPUs ({vb['gpu_fraction']:.0%} of the baseline), ACT "
                     f"{vb['act_mean_s']:.3f} s, restores {vb['restores']}, hits {vb['hits']}")
                  + "; tried: " + ", ".join(f"{x['gpus']}:{x['ratio']:.2f}x" for x in r["broker_tried"]))


def main(argv: list[str] | None = None) -> int:
    """CLI: print tables, or one JSON object with ``--json``."""
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench actions_sched", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer batches, repeats and depths")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--skip-sim", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--skip-coding", action="store_true", help="simulator: run only the MOPD GPU-pool part")
    p.add_argument("--ratio", type=float, default=1.25, help="MOPD: allowed tangram/baseline mean-ACT ratio")
    p.add_argument("--gpu-mem-gb", type=float, default=80.0,
                   help="MOPD: memory per pooled GPU for teacher co-residency; 0 = one replica per cell (exclusive)")
    p.add_argument("--gpu-workspace-gb", type=float, default=8.0,
                   help="MOPD: GB per GPU kept free for the executing call's activations")
    p.add_argument("--teacher-reserve-gb", type=float, default=0.0,
                   help="MOPD: GB per GPU every resident teacher keeps beyond its 10 GB shard (e.g. a KV pool)")
    p.add_argument("--mopd-loads", default="breakdown,burst",
                   help="MOPD: comma-separated load calibrations to run, the first also checked against the paper's"
                        f" ACT breakdown (known: {', '.join(MOPD_LOADS)}; default %(default)s)")
    p.add_argument("--broker", type=int, default=0, metavar="BATCH",
                   help="also run AI coding at BATCH through the broker core next to the policy-level model")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    bad = [x for x in args.mopd_loads.split(",") if x and x not in MOPD_LOADS]
    if bad or not args.mopd_loads.strip(","):
        p.error(f"--mopd-loads: unknown or empty {bad or args.mopd_loads!r} (known: {', '.join(MOPD_LOADS)})")
    res = run(args)
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        _print(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
