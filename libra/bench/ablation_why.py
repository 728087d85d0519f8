"""Why a rung of the ablation ladder (:mod:`libra.bench.ablation`) does or does not move the number, from what
the run measured (issue #27: "the heterogeneous, C-MLFQ and EHP rungs each move the number or print why not").

- :func:`tp_why`: the cost model's per-GPU tokens/s of each rollout TP degree in each length bin of the trace
  (the same :class:`~libra.policies.cost.RolloutCostModel` the planner scores plans with; Fig. 3's setup,
  :func:`~libra.policies.cost.rollout.bucket_throughput`) at the run's concurrency, with each bin's share of
  the trace's tokens, and the TP degrees the planner rungs deployed;
- :func:`ehp_why`: what the elastic pool did (borrows and releases, the signals it saw) and what its joins cost
  (zero-gradient steps, the core seconds beyond the same steps with the joiners active, the regroup pauses
  the joins avoided), beside the difference to the C-MLFQ rung;
- :func:`ratio_why`: where full Libra's step time goes against static uniform's (training seconds, the trainer's
  wait for rollout data) and the step time the 1.8x target needs.

Pure apart from :func:`tp_why` regenerating the trace (deterministic for the seed).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

__all__ = ["ehp_why", "ratio_why", "tp_why"]

TPS = (1, 2, 4, 8)


def tp_why(rows: dict[str, dict[str, Any]], steps: int, prompts: int, seed: int, hardware: str = "a800",
           model: str = "qwen3-14b") -> dict[str, Any]:
    """Per length bin (the trace profile's bucket thresholds): its share of the tokens and each TP's per-GPU
    tokens/s at ``concurrency`` requests per 8 GPUs (one step's trajectories over the heterogeneous rung's
    first rollout pool); plus the TPs each planner rung deployed and a one-line verdict."""
    from libra.policies.cost import RolloutCostModel, load_hardware, load_model
    from libra.policies.cost.rollout import bucket_throughput
    from libra.sim.workload_profiles import get_profile
    from libra.sim.workloads import generate

    cm = RolloutCostModel(load_hardware(hardware), load_model(model))
    lengths = [t.total_tokens for t in generate("r2e", steps, prompts, 16, seed)]
    edges = [0, *get_profile("r2e").bucket_thresholds]
    if edges[-1] < max(lengths):  # the last bucket is open-ended: up to the longest sequence
        edges.append(max(lengths))
    plan = (rows["heterogeneous"].get("planner") or {}).get("initial_plan") or {}
    n_roll = max(8, sum(plan.get("rollout_tps", [])))
    conc = max(1, math.ceil(prompts * 16 * 8 / n_roll))
    bins = []
    for lo, hi in zip(edges, edges[1:]):
        share = sum(x for x in lengths if lo < x <= hi) / max(1, sum(lengths))
        per_gpu = {tp: bucket_throughput(cm, tp, lo, hi, n_gpus=8, n_requests=conc) / 8 for tp in TPS}
        bins.append({"lo": lo, "hi": hi, "token_share": share, "per_gpu": per_gpu,
                     "best_tp": max(per_gpu, key=lambda t: (per_gpu[t], -t))})
    deployed = {}
    for key in ("homogeneous", "heterogeneous", "cmlfq", "ehp"):
        pl = rows[key].get("planner") or {}
        deployed[key] = sorted({tp for p in (pl.get("initial_plan"), pl.get("final_plan")) if p
                                for tp in p["rollout_tps"]})
    best = {b["best_tp"] for b in bins}
    verdict = (f"TP-{best.pop()} is the fastest per GPU in every length bin, so no mixed layout beats it"
               if len(best) == 1 else "the fastest TP differs by length: a mixed layout can gain")
    return {"concurrency_per_8_gpus": conc, "bins": bins, "deployed_tps": deployed, "verdict": verdict,
            "heterogeneous_router": rows["heterogeneous"]["router"]}


def ehp_why(rows: dict[str, dict[str, Any]], regroup_s: float = 4.4) -> dict[str, Any]:
    """What the EHP rung's pool did and cost against the C-MLFQ rung below it (see the module docstring)."""
    pl = rows["ehp"].get("planner") or {}
    joins = pl.get("ehp_joins") or {}
    signals = Counter(pl.get("ehp_signals") or {})
    delta = rows["ehp"]["tokens_per_s"] - rows["cmlfq"]["tokens_per_s"]
    parts = [f"EHP vs C-MLFQ {delta:+.0f} tok/s: borrowed {joins.get('borrows', 0)}x, released "
             f"{joins.get('releases', 0)}x (signals: " + ", ".join(f"{k} {v}" for k, v in sorted(signals.items())) + ")"]
    if not joins.get("borrows"):
        parts.append("nothing borrowed: rollout is the bottleneck (train/rollout below the borrow ratio) or no "
                     "rollout GPUs to spare")
    parts.append(f"re-plans joined through the hybrid protocol: {joins.get('zero_steps', 0)} zero-gradient step(s) "
                 f"({joins.get('zero_gpu_steps', 0)} GPU-steps) took {joins.get('extra_core_s', 0.0):.1f} s of core "
                 f"time beyond the same steps with the joiners active, against {joins.get('regroups_avoided', 0)} "
                 f"regroup pause(s) avoided ({joins.get('regroup_s_avoided', 0.0):.1f} s at {regroup_s:g} s each)")
    return {"delta_tokens_per_s": delta, "joins": joins, "signals": dict(signals), "line": "; ".join(parts)}


def ratio_why(rows: dict[str, dict[str, Any]], target: float = 1.8) -> str:
    """Full Libra (the EHP rung) against static uniform: each one's mean step split into training and the
    trainer's wait for data (rollout-bound when > 0), and the step the ``target`` ratio would need."""
    def split(key: str) -> tuple[float, float, float]:
        step = float(rows[key]["step_time_s"]["mean"] if isinstance(rows[key]["step_time_s"], dict)
                     else rows[key]["step_time_s"])
        train = float(rows[key]["model_check"]["sim_train_s"])
        return step, train, step - train

    su, libra = rows["static_uniform"]["tokens_per_s"], rows["ehp"]["tokens_per_s"]
    (s_step, s_train, s_wait), (l_step, l_train, l_wait) = split("static_uniform"), split("ehp")
    ratio = libra / su if su else math.nan
    verdict = "met" if ratio >= target else f"missed; {target:g}x needs a {l_step * ratio / target:.1f} s step"
    return (f"Libra / static uniform {ratio:.3f}x ({verdict}): Libra's step {l_step:.1f} s = train {l_train:.1f} s + "
            f"waiting for rollout data {l_wait:.1f} s; static uniform {s_step:.1f} s = {s_train:.1f} + {s_wait:.1f} s")
