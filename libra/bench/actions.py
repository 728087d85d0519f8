"""Benchmark: action-level orchestration end to end (issue #5), every number against its baseline.

``python -m libra.bench actions [--quick] [--json] [--skip-sandbox] [--skip-sim] [--real [--real-only] [--burst N] [--rounds R]]``

1. **On this machine, real sandboxes** (reuses :mod:`libra.bench.sandbox`): per-action overhead of a warm
   bubblewrap sandbox dispatch (``SandboxPool.run``) vs a plain ``subprocess.run`` of the same code, run
   interleaved in the same process. Target: warm − bare ≤ 5 ms (median, ``noop`` workload).
2. **Scheduling decision latency** (reuses :mod:`libra.bench.actions_sched`): ``tangram`` (window 64, depth
   2, the defaults) vs the FCFS ``fixed_dop(4)`` decision on the same snapshot (queue of 96 actions, 200
   running), at 64 / 256 / 1,024 free cores, timed in interleaved rounds. Target: ≤ 100 µs per decision at window 64.
3. **Simulator at paper scale** (15 × 256 = 3,840 cores, 40 GPUs): AI-coding at batch 1,280, mean ACT and
   cores used for ``tangram`` vs ``per_trajectory`` (peak-sized and evenly split sandboxes) vs
   ``fixed_dop`` 4/16, ratio = baseline ACT / tangram ACT (target ≥ 4.3× vs ``per_trajectory``); MOPD at
   batch 2,048 (the ``breakdown`` load calibration, ``libra.sim.action_workloads.MOPD_LOADS``): GPUs of the
   static deployment vs the smallest evict-on-execution pool (80 GB GPUs, idle teachers co-resident in GPU
   memory) whose mean ACT is within ``--ratio`` of it (target ≤ 30 %).

4. **Real cluster** (``--real``, :mod:`libra.bench.actions_real`): a broker and action actors as real
   processes on loopback; the mean ACT (submit → reply) of a burst of ``--burst`` ``pytest`` actions (one
   trajectory each, real bubblewrap sandboxes) under the broker's ``tangram`` placement vs ``fifo`` (no action
   scheduler: first come first served by credit, one core each), alternated ``--rounds`` times on the same
   actor processes (the broker restarts between them); ratio = fifo ACT / tangram ACT. ``pytest`` is declared
   elastic (up to all cores) only when ``pytest-xdist`` is importable, since only then can it use more cores.
   The load average is printed with it: on a shared machine other processes take part of the cores.

``--quick`` trims iterations (sandbox 20/4, latency 3 × 50) so the whole run stays well under a minute or
two; the full run stays under about three minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from typing import Any

from libra.bench import actions_sched
from libra.logging import configure as configure_logging
from libra.sim.action_workloads import MOPD_LOADS

__all__ = ["main", "run"]


def sandbox_part(quick: bool) -> dict[str, Any]:
    """Warm sandbox vs bare subprocess (noop and a ~0.2 s CPU loop)."""
    from libra.bench import sandbox

    if shutil.which("bwrap") is None:
        return {"skipped": "bubblewrap (bwrap) is not installed"}
    ns = argparse.Namespace(iterations=20 if quick else 60, cpu_iterations=4 if quick else 8, no_cold=True, python=None)
    res = sandbox.run(ns)
    noop = res["workloads"]["noop"]
    return {"isolation": res["isolation"], "workloads": res["workloads"],
            "warm_minus_bare_ms": noop["warm"]["minus_bare_ms"], "warm_ratio_to_bare": noop["warm"]["ratio_to_bare"],
            "target_ms": 5.0, "meets_target": noop["warm"]["minus_bare_ms"] <= 5.0}


def latency_part(quick: bool) -> dict[str, Any]:
    """Tangram vs fixed_dop decision latency at window 64."""
    rows = actions_sched.latency([64], [64, 256, 1024], [2], repeat=3 if quick else 7, number=50 if quick else 300)
    worst = max(r["tangram_us"] for r in rows)
    return {"rows": rows, "worst_tangram_us": worst, "target_us": 100.0, "meets_target": worst <= 100.0}


def sim_part(seed: int, ratio: float) -> dict[str, Any]:
    """AI coding at batch 1,280 and MOPD at batch 2,048 in the simulator."""
    rows = actions_sched.coding([1280], seed, steps=1)
    by = {r["policy"]: r for r in rows}
    tg = by["tangram"]
    mopd = actions_sched.mopd(2048, seed, ratio, [1.0])[0]
    return {
        "coding": rows,
        "act_ratio_per_trajectory_peak": by["per_trajectory(peak)"]["act_mean_s"] / tg["act_mean_s"],
        "act_ratio_per_trajectory_even": by["per_trajectory(even)"]["act_mean_s"] / tg["act_mean_s"],
        "act_ratio_fixed_dop4": by["fixed_dop(4)"]["act_mean_s"] / tg["act_mean_s"],
        "act_ratio_fixed_dop16": by["fixed_dop(16)"]["act_mean_s"] / tg["act_mean_s"],
        "mopd": mopd,
        "mopd_gpu_fraction": mopd["gpu_fraction"],
        "model": "policy",  # SimConfig.model: the policy over a modelled pool, not the broker's placement
        "mopd_think_s": MOPD_LOADS["breakdown"],
        "mopd_think_fitted": True,  # fitted to the paper's own ACT breakdown (action_workloads.MOPD_LOADS)
    }


def real_part(burst: int, rounds: int) -> dict[str, Any]:
    """Tangram vs fifo on a real loopback cluster: one CPU action actor over this host's cores."""
    import importlib.util
    import os

    from libra.bench import actions_real

    if shutil.which("bwrap") is None:
        return {"skipped": "bubblewrap (bwrap) is not installed"}
    cores = len(os.sched_getaffinity(0))
    xdist = importlib.util.find_spec("xdist") is not None
    decl = {"cpu": 1, "max_cpu": cores if xdist else 1, "parallel_fraction": 0.6, "duration_s": 1.0}
    load_before = os.getloadavg()[0]
    res = actions_real.compare(burst, rounds, cpu_slots=1, capacity=4, tools={"pytest": decl})
    res["xdist"] = xdist
    res["load_avg_1m"] = (load_before, os.getloadavg()[0])
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"quick": args.quick}
    t0 = time.perf_counter()
    if args.real:
        out["real"] = real_part(args.burst, args.rounds)
        if args.real_only:
            out["wall_s"] = time.perf_counter() - t0
            return out
    if not args.skip_sandbox:
        out["sandbox"] = sandbox_part(args.quick)
    out["latency"] = latency_part(args.quick)
    if not args.skip_sim:
        out["sim"] = sim_part(args.seed, args.ratio)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _print_real(r: dict[str, Any]) -> None:
    if "skipped" in r:
        print(f"4. real cluster skipped: {r['skipped']}")
        return
    print(f"4. real cluster: burst of {r['n']} pytest actions x {r['rounds']} rounds, {r['cpu_slots']} action actor"
          f" (capacity {r['capacity']}) on {r['cores']} cores, pytest-xdist {'yes' if r['xdist'] else 'no'},"
          f" load average {r['load_avg_1m'][0]:.1f} -> {r['load_avg_1m'][1]:.1f}")
    for name in ("tangram", "fifo"):
        x = r[name]
        print(f"   {name:<8} mean ACT {x['act_mean_s']:6.2f} s  p50 {x['act_p50_s']:6.2f}  max {x['act_max_s']:6.2f}"
              f"  mean execution {x['exec_mean_s']:6.2f} s"
              f"  (n={x['actions']}, tests passed {x['tests_passed']})")
    print(f"   ratio fifo / tangram mean ACT: {r['ratio_fifo_over_tangram']:.2f}")


def _print(res: dict[str, Any]) -> None:
    if "real" in res:
        _print_real(res["real"])
    if "latency" not in res:
        print(f"total {res['wall_s']:.1f} s")
        return
    sb = res.get("sandbox")
    if sb and "skipped" not in sb:
        iso = sb["isolation"]
        print(f"1. sandbox dispatch ({iso['mode']}, cpu control: {iso['cpu_control']}): median ms, warm pool vs bare subprocess.run")
        for name, stats in sb["workloads"].items():
            b, w = stats["bare"], stats["warm"]
            print(f"   {name:<5} bare {b['median_ms']:8.2f}  warm {w['median_ms']:8.2f}  warm-bare {w['minus_bare_ms']:+7.2f} ms"
                  f"  ratio {w['ratio_to_bare']:.3f}  (n={w['n']})")
        print(f"   overhead {sb['warm_minus_bare_ms']:+.2f} ms (target <= 5 ms): {'met' if sb['meets_target'] else 'NOT met'}")
    elif sb:
        print(f"1. sandbox dispatch skipped: {sb['skipped']}")
    lat = res["latency"]
    print("2. decision latency at window 64 (µs per decision, best of repeats)")
    for r in lat["rows"]:
        print(f"   free {r['units']:>5}: tangram {r['tangram_us']:7.1f}"
              f"  fixed_dop(4) {r['fixed_dop_us']:7.1f}  ratio {r['ratio']:.2f}  grants {r['grants']}")
    print(f"   worst {lat['worst_tangram_us']:.1f} µs (target <= 100 µs): {'met' if lat['meets_target'] else 'NOT met'}")
    sim = res.get("sim")
    if sim:
        print(f"3. simulator ({sim.get('model', 'policy')}-level model: the policy over a modelled pool, not the broker's"
              " placement), AI coding batch 1,280 on 3,840 cores: mean ACT (s), cores used, ratio = policy ACT / tangram ACT")
        for r in sim["coding"]:
            print(f"   {r['policy']:<22} ACT {r['act_mean_s']:7.3f}  p99 {r['act_p99_s']:7.2f}  cores {r['cores_used']:6.0f}"
                  f"  ratio {r['act_ratio_vs_tangram']:5.2f}")
        print(f"   tangram vs both per-trajectory baselines: {sim['act_ratio_per_trajectory_peak']:.2f}x peak-sized pods,"
              f" {sim['act_ratio_per_trajectory_even']:.2f}x evenly split sandboxes")
        m = sim["mopd"]
        print(f"   MOPD think time {sim.get('mopd_think_s', MOPD_LOADS['breakdown']):g} s per trajectory: FITTED to the paper's"
              " own ACT breakdown (docs/papers.md §2.6; libra.sim.action_workloads.MOPD_LOADS), not measured")
        frac = "none" if m["gpu_fraction"] is None else f"{m['tangram_gpus']} GPUs = {m['gpu_fraction']:.0%}"
        print(f"   MOPD batch 2,048: static {m['baseline_gpus']} GPUs (ACT {m['baseline_act_s']:.3f} s) vs tangram {frac}"
              + ("" if m["tangram_act_s"] is None else f" (ACT {m['tangram_act_s']:.3f} s)")
              + f", target <= {m['target_fraction']:.0%}: {'met' if m['meets_target'] else 'NOT met'}")
        t = m["tangram"]
        if t is not None:
            bd = t["breakdown_s"]
            model = "exclusive cells" if m["gpu_mem_gb"] is None else f"teachers co-resident in {m['gpu_mem_gb']:g} GB GPUs"
            print(f"     {model}: exec {bd['exec']:.3f} + queue {bd['queue']:.3f}"
                  f" + restore {bd['overhead']:.3f} s; hits {t['hits']}, restores {t['restores']}, evictions {t['evictions']};"
                  f" compute bound on {m['compute_bound']['gpus']} GPUs {m['compute_bound']['act_mean_s']:.1f} s")
    print(f"total {res['wall_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench actions", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer iterations and repeats")
    p.add_argument("--skip-sandbox", action="store_true", help="skip the real-sandbox part")
    p.add_argument("--skip-sim", action="store_true", help="skip the simulator part")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ratio", type=float, default=1.25, help="MOPD: allowed tangram/baseline mean-ACT ratio")
    p.add_argument("--real", action="store_true", help="also run tangram vs fifo on a real loopback cluster")
    p.add_argument("--real-only", action="store_true", help="with --real: skip the other parts")
    p.add_argument("--burst", type=int, default=16, help="--real: pytest actions per burst (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="--real: bursts per scheduler, alternated (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    configure_logging(level="warning")
    res = run(args)
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        _print(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
