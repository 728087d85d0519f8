"""Benchmark: how well the GRP planner's rollout model predicts the simulator, with and without residency.

What it runs (one process, same inputs for both models): for each case ``(groups per step, step)`` it
generates the R2E-like trace (:func:`libra.sim.workloads.generate`, seed ``--seed``) and takes that
step's trajectories (``groups x 16``; the drift makes later steps longer). For every homogeneous rollout
layout of the rollout budget (``--gpus`` minus ``--train``: all TP-1, all TP-2, all TP-4, all TP-8) it

- simulates the step alone, synchronously (:class:`libra.sim.engine.Simulator`, policy lag 1, the
  ``least_loaded`` router): the measured rollout time (release to last trajectory end);
- asks the planner for the same layout's rollout time (``GlobalResourcePlanner.plan_fixed`` with the
  ``length_blind`` routing that models ``least_loaded``), once with the **residency** model (the
  default: each instance's running batch and KV sized by the generation-weighted context of its
  requests, ``RolloutCostModel.resident_context``) and once with the **mean-request** model (the
  baseline, ``PlannerConfig(residency=False)``: sized by ``avg_prompt + avg_gen / 2``).

Per model it prints the prediction/simulation ratio of every layout, the mean absolute log error, and
whether the layout it ranks fastest is the simulator's fastest (``regret``: the simulated time of its
pick over the best simulated time). The summary line gives both models' mean errors and their ratio.

``python -m libra.bench planner_accuracy [--cases 16:2,16:10,64:3,64:10] [--gpus 48] [--train 16]
[--seed 0] [--trace FILE] [--json]`` (``--trace``: a held-out trace file instead of the generated one). All times are virtual seconds: the numbers do not depend on the machine.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from typing import Any

from libra.bench.output import emit

__all__ = ["build_parser", "main", "run", "run_case"]

TPS = (1, 2, 4, 8)
MODELS = ("residency", "mean")


def run_case(groups: int, step: int, gpus: int, train: int, seed: int, trace: str | None = None) -> dict[str, Any]:
    """One case: per homogeneous layout, the simulated and both predicted rollout times (``trace``: the
    step's first ``groups`` groups of a trace file, docs/trace-format.md, instead of the generated trace)."""
    from dataclasses import replace

    from libra.policies.cost import RolloutCostModel, TrainingCostModel, load_hardware, load_model
    from libra.policies.planner.allocators import GlobalResourcePlanner, PlannerConfig
    from libra.sim.engine import SimConfig, Simulator
    from libra.sim.cluster import homogeneous_layout
    from libra.traces import workload_of
    from libra.sim.workload_profiles import get_profile
    from libra.sim.workloads import generate

    prof = get_profile("r2e")
    if trace is not None:
        from libra.traces import read_trace
        at = [t for t in read_trace(trace) if t.step == step]
        keep = list(dict.fromkeys(t.group for t in at))[:groups]
        trajs = [t for t in at if t.group in set(keep)]
    else:
        trajs = [t for t in generate("r2e", step + 1, groups, 16, seed) if t.step == step]
    if not trajs:
        raise ValueError(f"no trajectories at step {step}")
    hw, model = load_hardware("a800"), load_model("qwen3-14b")
    rm, tm = RolloutCostModel(hw, model), TrainingCostModel(hw, model)
    base = PlannerConfig(n_gpus=gpus, global_batch=len(trajs), group_size=16, overlap_steps=1, routing="length_blind")
    planners = {name: GlobalResourcePlanner(rm, tm, replace(base, residency=name == "residency")) for name in MODELS}
    wl = workload_of(trajs)
    cfg = SimConfig(router="least_loaded", allocation="static_uniform", gpus=gpus, seed=seed, lag=1,
                    bucket_thresholds=prof.bucket_thresholds, size_thresholds=prof.size_thresholds,
                    router_params={"cap_metric": "load", "max_queue_length": 3})
    rollout = gpus - train
    rows = []
    for tp in TPS:
        k = rollout // tp
        if k < 1:
            continue
        layout = homogeneous_layout(f"tp{tp}", gpus, rollout, tp, train)
        sim = Simulator(trajs, cfg, layout=layout).run()
        row: dict[str, Any] = {"layout": f"{k}xTP{tp}", "sim_s": round(sim.rollout_time_s, 1)}
        for name, planner in planners.items():
            row[f"{name}_s"] = round(planner.plan_fixed(wl, train, (tp,) * k).t_rollout, 1)
        rows.append(row)
    return {"groups": groups, "step": step, "trajectories": len(trajs), "rows": rows, **_score(rows)}


def _score(rows: list[dict[str, Any]]) -> dict[str, Any]:
    best_sim = min(r["sim_s"] for r in rows)
    out: dict[str, Any] = {}
    for name in MODELS:
        errs = [abs(math.log(r[f"{name}_s"] / r["sim_s"])) for r in rows if math.isfinite(r[f"{name}_s"])]
        pick = min(rows, key=lambda r: r[f"{name}_s"])
        out[name] = {"mean_abs_log_error": round(sum(errs) / len(errs), 4) if errs else math.inf,
                     "pick": pick["layout"], "regret": round(pick["sim_s"] / best_sim, 3)}
    return out


def run(cases: Sequence[tuple[int, int]], gpus: int, train: int, seed: int, trace: str | None = None) -> dict[str, Any]:
    """Every case, then the summary over all layouts of all cases."""
    results = [run_case(g, s, gpus, train, seed, trace) for g, s in cases]
    summary: dict[str, Any] = {}
    for name in MODELS:
        errs = [abs(math.log(r[f"{name}_s"] / r["sim_s"])) for c in results for r in c["rows"]
                if math.isfinite(r[f"{name}_s"])]
        summary[name] = {"mean_abs_log_error": round(sum(errs) / len(errs), 4),
                         "best_picked": sum(c[name]["regret"] == 1.0 for c in results),
                         "worst_regret": max(c[name]["regret"] for c in results)}
    summary["error_ratio_mean_over_residency"] = round(
        summary["mean"]["mean_abs_log_error"] / max(summary["residency"]["mean_abs_log_error"], 1e-12), 3)
    return {"gpus": gpus, "train_gpus": train, "seed": seed, "trace": trace, "cases": results, "summary": summary}


def _fmt(out: dict[str, Any]) -> str:
    lines = [f"Planner rollout model vs simulator, {out.get('trace') or 'R2E-like'} trace: {out['gpus']} GPUs, {out['train_gpus']} training, "
             f"one step alone (policy lag 1, least_loaded), seed {out['seed']}",
             "pred / sim per layout; residency = the default model, mean = sized by the mean request (baseline)", ""]
    lines.append(f"{'case':<16}{'layout':<10}{'sim s':>9}{'resid s':>10}{'x sim':>7}{'mean s':>10}{'x sim':>7}")
    for c in out["cases"]:
        label = f"{c['groups']}x16 step {c['step']}"
        for r in c["rows"]:
            lines.append(f"{label:<16}{r['layout']:<10}{r['sim_s']:>9.0f}{r['residency_s']:>10.0f}"
                         f"{r['residency_s'] / r['sim_s']:>7.2f}{r['mean_s']:>10.0f}{r['mean_s'] / r['sim_s']:>7.2f}")
            label = ""
        lines.append(f"{'':<16}picks: residency {c['residency']['pick']} (regret {c['residency']['regret']:.2f}), "
                     f"mean {c['mean']['pick']} (regret {c['mean']['regret']:.2f})")
    s = out["summary"]
    lines += ["", f"mean |log(pred/sim)|: residency {s['residency']['mean_abs_log_error']:.3f}, "
                  f"mean request {s['mean']['mean_abs_log_error']:.3f} "
                  f"(mean / residency = {s['error_ratio_mean_over_residency']:.2f}x)",
              f"fastest layout picked: residency {s['residency']['best_picked']}/{len(out['cases'])} "
              f"(worst regret {s['residency']['worst_regret']:.2f}), mean request {s['mean']['best_picked']}/"
              f"{len(out['cases'])} (worst regret {s['mean']['worst_regret']:.2f})"]
    return "\n".join(lines)


def _cases(text: str) -> list[tuple[int, int]]:
    try:
        out = [(int(a), int(b)) for a, b in (part.split(":") for part in text.split(",") if part)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--cases wants GROUPS:STEP[,GROUPS:STEP...], got {text!r}") from exc
    if not out or any(g < 1 or s < 0 for g, s in out):
        raise argparse.ArgumentTypeError(f"--cases wants GROUPS >= 1 and STEP >= 0, got {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench planner_accuracy",
                                description="Benchmark: the planner's rollout predictions vs the simulator, "
                                            "residency model vs mean-request model, in one run.")
    p.add_argument("--cases", type=_cases, default=_cases("16:2,16:10,64:3,64:10"),
                   help="GROUPS:STEP pairs (GRPO groups of 16 per step, which step of the drifting trace; "
                        "default 16:2,16:10,64:3,64:10)")
    p.add_argument("--gpus", type=int, default=48, help="cluster GPUs (default 48)")
    p.add_argument("--train", type=int, default=16, help="training GPUs; the rest roll out (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", help="score a trace file (docs/trace-format.md; a held-out workload) instead of the "
                                   "generated R2E-like one: each case takes GROUPS groups of step STEP")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.train < 1 or args.gpus - args.train < 1:
        print("--train must leave at least one rollout GPU and be >= 1")
        return 2
    t0 = time.perf_counter()
    out = run(args.cases, args.gpus, args.train, args.seed, args.trace)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(out, args.json, _fmt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
