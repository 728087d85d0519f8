"""The ablation ladder over several seeds (``python -m libra.bench ablation --seeds N``): one summary row per
rung from the per-seed results of :func:`libra.bench.ablation.run`.

Per rung: mean and min-max tokens/s, the mean ratios to static uniform and to colocated, the mean per-step
stage times the simulator measured (training seconds per step; the trainer's wait for data = step interval -
training seconds, which is rollout being the bottleneck), the planner's predicted rollout and training seconds
of the deployed plan, the plans deployed (seed by seed: initial rollout TPs and training GPUs, then the final
ones when a re-plan changed them), and the routing accuracy and migrated-token ratio (the C-MLFQ targets:
>= 91%, <= 8%; "n/a" when the C-MLFQ rung deployed a single TP degree, i.e. one bucket, where both hold
trivially), and per seed the measured reasons of the mixed-TP and EHP rungs (:mod:`libra.bench.ablation_why`).
Targets are checked on the means. Pure: formats what it is given.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

__all__ = ["LADDER", "LADDER_COST", "format_seeds", "summarize_seeds"]

#: The ladder's rung keys, bottom to top (:data:`libra.bench.ablation.RUNGS`).
LADDER = ("static_uniform", "homogeneous", "heterogeneous", "cmlfq", "ehp")
#: The same ladder with the distribution- and cost-based C-MLFQ (``cmlfq_cost``) on its top two rungs.
LADDER_COST = ("static_uniform", "homogeneous", "heterogeneous", "cmlfq_cost", "ehp_cost")


def _plan(p: dict[str, Any] | None) -> str:
    if not p:
        return "-"
    tps = Counter(p["rollout_tps"])
    return f"{p['n_train']}T+" + "+".join(f"{n}xTP{t}" for t, n in sorted(tps.items()))


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else math.nan


def summarize_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rung means and spreads over ``runs`` (one :func:`libra.bench.ablation.run` result per seed)."""
    keys = [r["key"] for r in runs[0]["rows"]]
    rows = []
    for i, key in enumerate(keys):
        per = [run["rows"][i] for run in runs]
        tps = [r["tokens_per_s"] for r in per]
        plans, degrees = [], set()
        for r in per:
            pl = r["planner"] or {}
            for p in (pl.get("initial_plan"), pl.get("final_plan")):
                degrees |= set(p["rollout_tps"]) if p else set()
            a, b = _plan(pl.get("initial_plan")), _plan(pl.get("final_plan"))
            plans.append(a if a == b else f"{a} -> {b}")
        rows.append({"key": key, "label": per[0]["label"], "allocation": per[0]["allocation"],
                     "router": per[0]["router"], "tokens_per_s_mean": _mean(tps), "tokens_per_s_min": min(tps),
                     "tokens_per_s_max": max(tps), "vs_static_uniform": _mean([r["vs_static_uniform"] for r in per]),
                     "vs_colocated": _mean([r["vs_colocated"] for r in per]),
                     "step_time_s": _mean([r["step_time_s"] for r in per]),
                     "sim_train_s": _mean([r["model_check"]["sim_train_s"] for r in per]),
                     "wait_for_data_s": _mean([r["step_time_s"] - r["model_check"]["sim_train_s"] for r in per]),
                     "pred_rollout_s": _mean([r["model_check"]["pred_rollout_s"] for r in per]),
                     "pred_train_s": _mean([r["model_check"]["pred_train_s"] for r in per]),
                     "routing_accuracy": _mean([r["routing_accuracy"] for r in per]),
                     "migrated_token_ratio": _mean([r.get("migrated_token_ratio") for r in per]),
                     "plans": plans, "one_bucket": len(degrees) <= 1})
    by = {r["key"]: r for r in rows}
    su, co = by["static_uniform"]["tokens_per_s_mean"], by["colocated"]["tokens_per_s_mean"]
    targets: dict[str, bool | None] = {}
    for suffix, ladder_keys, top in (("", LADDER, "cmlfq"), ("_cmlfq_cost", LADDER_COST, "cmlfq_cost")):
        ladder = [by[k]["tokens_per_s_mean"] for k in ladder_keys]
        targets["each_rung_at_least_previous" + suffix] = all(b >= a for a, b in zip(ladder, ladder[1:]))
        targets["libra_vs_static_uniform_ge_1.8" + suffix] = ladder[-1] / su >= 1.8
        targets["libra_vs_colocated_ge_3" + suffix] = ladder[-1] / co >= 3.0
        if by[top]["one_bucket"]:  # one TP degree deployed: every route is right and nothing moves, trivially
            targets["routing_accuracy_ge_0.91" + suffix] = None
            targets["migrated_tokens_le_0.08" + suffix] = None
        else:
            targets["routing_accuracy_ge_0.91" + suffix] = by[top]["routing_accuracy"] >= 0.91
            targets["migrated_tokens_le_0.08" + suffix] = by[top]["migrated_token_ratio"] <= 0.08
    first = runs[0]
    return {"seeds": [r["seed"] for r in runs], "gpus": first["gpus"], "steps": first["steps"],
            "prompts": first["prompts"], "rows": rows,
            "why": [{"seed": r["seed"], "tp": r["why"]["tp"]["verdict"], "ehp": r["why"]["ehp"]["line"]}
                    for r in runs if "why" in r],
            "libra_vs_static_uniform": by["ehp"]["tokens_per_s_mean"] / su,
            "libra_vs_colocated": by["ehp"]["tokens_per_s_mean"] / co, "targets": targets}


def _verdict(v: bool | None) -> str:
    return "n/a (one TP degree deployed: one bucket)" if v is None else ("met" if v else "MISSED")


def format_seeds(s: dict[str, Any]) -> str:
    """The summary as a table (see the module docstring)."""
    lines = [f"Ablation over seeds {s['seeds']}: {s['gpus']} GPUs, {s['steps']} steps, {s['prompts']} groups x 16 per "
             "step; means (tok/s min-max); per step: sim train s, trainer wait for data s (rollout-bound when > 0), "
             "the planner's predicted rollout and train s; routing accuracy; migrated tokens",
             f"{'rung':<30} {'tok/s':>7} {'min-max':>11} {'x unif':>6} {'x colo':>6} {'step s':>6} {'train':>6} "
             f"{'wait':>6} {'p.roll':>6} {'p.trn':>6} {'acc':>5} {'migr':>5}  plans (seed by seed)"]
    for r in s["rows"]:
        lines.append(f"{r['label']:<30} {r['tokens_per_s_mean']:>7.0f} "
                     f"{r['tokens_per_s_min']:>5.0f}-{r['tokens_per_s_max']:<5.0f} {r['vs_static_uniform']:>6.2f} "
                     f"{r['vs_colocated']:>6.2f} {r['step_time_s']:>6.1f} {r['sim_train_s']:>6.1f} "
                     f"{r['wait_for_data_s']:>6.1f} {r['pred_rollout_s']:>6.1f} {r['pred_train_s']:>6.1f} "
                     f"{r['routing_accuracy']:>5.2f} {r['migrated_token_ratio']:>5.3f}  {'; '.join(r['plans'])}")
    for w in s.get("why", []):
        lines.append(f"why, seed {w['seed']}: mixed TP: {w['tp']}; {w['ehp']}")
    lines += [f"Libra / static uniform = {s['libra_vs_static_uniform']:.3f}x (target >= 1.8); Libra / colocated = "
              f"{s['libra_vs_colocated']:.3f}x (target >= 3)",
              "targets (means): " + ", ".join(f"{k}={_verdict(v)}" for k, v in s["targets"].items())]
    return "\n".join(lines)
