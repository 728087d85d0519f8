"""The simulator-side validation facts of ``python -m libra.bench calibration`` (docs/papers.md §1.7): checked
before any ablation is looked at, and never tuned to make a policy win.

- :func:`stage_ratio`: rollout vs training time of one step at the first and at the last step of an R2E-like
  run (Fig. 2b: rollout is the faster stage at the start and the bottleneck after the length drift), on the
  static uniform split. Two readings: the cost models' ``T_rollout / T_train`` for that step's trajectories (the
  planner's throughput terms, §1.3.3: rollout DP over the layout's TP-2 instances, training on the other half),
  and the simulator's share of the step interval the trainer spent waiting for data.
- :func:`oracle_sanity`: every simulation router on every workload on the fixed mixed-TP layout (``hetero``):
  the oracle router (true remaining lengths) should be at least as fast as every non-oracle router. The same
  runs give each router's routing accuracy and migrated-token ratio on a layout with three buckets (TP-1/2/4),
  where the C-MLFQ targets (>= 91%, <= 8%, docs/papers.md §1.4.5) mean something.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["ROUTER_PARAMS", "oracle_sanity", "stage_ratio"]

#: Libra's per-instance room rule for every router (docs/papers.md §1.4.3: active + queued < 3).
ROUTER_PARAMS: dict[str, Any] = {"cap_metric": "load", "max_queue_length": 3}


def _config(workload: str, allocation: str, router: str, gpus: int, seed: int, hardware: str = "a800") -> Any:
    from libra.sim.engine import SimConfig
    from libra.sim.workload_profiles import get_profile

    prof = get_profile(workload)
    return SimConfig(router=router, allocation=allocation, gpus=gpus, seed=seed, hardware=hardware,
                     bucket_thresholds=prof.bucket_thresholds, size_thresholds=prof.size_thresholds,
                     router_params=dict(ROUTER_PARAMS))


def stage_ratio(gpus: int, steps: int, prompts: int, seed: int, hardware: str = "a800") -> dict[str, Any]:
    """Rollout / training time at the first and last steps on the static uniform split (see the module doc)."""
    from libra.policies.planner.allocators import PlannerConfig, make_allocator
    from libra.sim.engine import Simulator
    from libra.sim.workloads import generate
    from libra.traces import workload_of

    trajs = generate("r2e", steps, prompts, 16, seed)
    sim = Simulator(trajs, _config("r2e", "static_uniform", "least_loaded", gpus, seed, hardware))
    res = sim.run()
    by_step = sim.by_step
    pc = PlannerConfig(n_gpus=gpus, global_batch=len(by_step[0]), group_size=16, overlap_steps=sim.lag)
    cm = sim.costs.cm
    planner = make_allocator("static_uniform", rollout_model=cm, train_model=sim.train_model,
                             config=pc).planner  # type: ignore[attr-defined]
    tps = tuple(i.tp for i in sim.layout.instances)
    rows: dict[str, Any] = {}
    for name, k in (("first", 0), ("last", len(by_step) - 1)):
        batch = by_step[k]
        t_roll = float(planner.plan_fixed(workload_of(batch), 0, tps).t_rollout)
        t_train = sim.train_time([t.total_tokens for t in batch])
        prev_end = sim.train_end[k - 1] if k else 0.0
        interval = sim.train_end[k] - prev_end
        wait = sim.train_start[k] - prev_end
        rows[name] = {"step": k, "mean_tokens": sum(t.total_tokens for t in batch) / len(batch),
                      "model_rollout_s": t_roll, "model_train_s": t_train,
                      "model_rollout_over_train": t_roll / t_train if t_train else math.nan,
                      "sim_step_s": interval, "sim_train_s": sim.train_end[k] - sim.train_start[k],
                      "sim_wait_fraction": wait / interval if interval > 0 else math.nan}
    return {"gpus": gpus, "steps": steps, "prompts": prompts, "seed": seed, "tokens_per_s": res.tokens_per_s,
            "rollout_gpus": sim.layout.rollout_gpus, "train_gpus": sim.layout.train_gpus, **rows}


def oracle_sanity(gpus: int, steps: int, prompts: int, seed: int,
                  workloads: tuple[str, ...] = ("r2e", "search_r1", "dapo_math"), hardware: str = "a800") -> dict[str, Any]:
    """Tokens/s of every simulation router on each workload (``hetero`` layout); ``ok`` per workload is
    whether the oracle is at least as fast as every other router, ``worst`` the fastest non-oracle router's
    margin over it (> 1: that router beat the oracle)."""
    from libra.sim.engine import SIM_ROUTERS, Simulator
    from libra.sim.workloads import generate

    out: dict[str, Any] = {"gpus": gpus, "steps": steps, "prompts": prompts, "seed": seed, "allocation": "hetero",
                           "workloads": {}}
    for wl in workloads:
        trajs = generate(wl, steps, prompts, 16, seed)
        res = {r: Simulator(trajs, _config(wl, "hetero", r, gpus, seed, hardware)).run() for r in SIM_ROUTERS}
        tps = {r: x.tokens_per_s for r, x in res.items()}
        oracle = tps["oracle"]
        best = max((r for r in tps if r != "oracle"), key=tps.__getitem__)
        out["workloads"][wl] = {"tokens_per_s": tps, "best_other": best,
                                "best_other_over_oracle": tps[best] / oracle if oracle else math.nan,
                                "ok": all(oracle >= v for v in tps.values()),
                                "routing_accuracy": {r: x.routing_accuracy for r, x in res.items()},
                                "migrated_token_ratio": {r: x.migrated_token_ratio for r, x in res.items()}}
    out["ok"] = all(w["ok"] for w in out["workloads"].values())
    return out
