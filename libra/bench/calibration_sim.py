"""The simulator-side validation facts of ``python -m libra.bench calibration`` (docs/papers.md §1.7): checked
before any ablation is looked at, and never tuned to make a policy win.

- :func:`stage_ratio`: rollout vs training time of one step at the first and at the last step of an R2E-like
  run (Fig. 2b: rollout is the faster stage at the start and the bottleneck after the length drift), on the
  static uniform split. Two readings: the cost models' ``T_rollout / T_train`` for that step's trajectories (the
  planner's throughput terms, §1.3.3: rollout DP over the layout's TP-2 instances, training on the other half),
  and the simulator's share of the step interval the trainer spent waiting for data.
- :func:`oracle_sanity`: every simulation router on every workload on the fixed mixed-TP layout (``hetero``):
  the oracle router (true remaining lengths, ``cmlfq_cost``'s placement rule) should be at least as fast as
  every non-oracle router; where one is faster the check prints the measured reason. The same
  runs give each router's routing accuracy and migrated-token ratio on a layout with three buckets (TP-1/2/4),
  where the C-MLFQ targets (>= 91%, <= 8%, docs/papers.md §1.4.5) mean something.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["ROUTER_PARAMS", "format_oracle", "oracle_sanity", "stage_ratio"]

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


def _run_stats(sim: Any, res: Any) -> dict[str, float]:
    """What explains a router's tokens/s: its throughput before the last step, the last step's drain (the
    wait for its data after the previous step), and the GPU-weighted busy share of the rollout GPUs."""
    ends, starts = sim.train_end, sim.train_start
    n = len(ends)
    before = sum(sum(t.total_tokens for t in sim.former.batch_specs(k)) for k in range(n - 1))
    busy = sum(i.busy_s * i.tp for i in sim.instances.values())
    return {"tokens_per_s_before_last": before / ends[n - 2] if n > 1 and ends[n - 2] > 0 else math.nan,
            "last_step_wait_s": starts[n - 1] - (ends[n - 2] if n > 1 else 0.0),
            "rollout_busy": busy / (sim.layout.rollout_gpus * res.makespan_s) if res.makespan_s > 0 else math.nan}


def _why(w: dict[str, Any]) -> str:
    """The measured reason a non-oracle router beat the oracle on one workload (see :func:`oracle_sanity`)."""
    best, st = w["best_other"], w["stats"]
    o, b = st["oracle"], st[best]
    head = ("the oracle knows each trajectory's length, not the load to come: it places each one where its true "
            "length finishes soonest at the load it sees then (greedy, and a context moves only into an instance "
            "with room), which bounds no makespan of a streaming run. Measured: ")
    if o["tokens_per_s_before_last"] >= b["tokens_per_s_before_last"]:
        return head + (f"ahead of {best} until the last step ({o['tokens_per_s_before_last']:.0f} vs "
                       f"{b['tokens_per_s_before_last']:.0f} tok/s), behind in the last step's drain (trainer waited "
                       f"{o['last_step_wait_s']:.0f} s vs {b['last_step_wait_s']:.0f} s): the trajectories still "
                       f"running then, placed while the cluster was loaded, set the makespan with nothing left to "
                       f"overlap them")
    return head + (f"behind {best} before the last step too ({o['tokens_per_s_before_last']:.0f} vs "
                   f"{b['tokens_per_s_before_last']:.0f} tok/s; rollout GPUs busy {o['rollout_busy']:.2f} vs "
                   f"{b['rollout_busy']:.2f} of the makespan)")


def oracle_sanity(gpus: int, steps: int, prompts: int, seed: int,
                  workloads: tuple[str, ...] = ("r2e", "search_r1", "dapo_math"), hardware: str = "a800") -> dict[str, Any]:
    """Tokens/s of every simulation router on each workload (``hetero`` layout); ``ok`` per workload is
    whether the oracle is at least as fast as every other router, ``best_other_over_oracle`` the fastest
    non-oracle router's margin over it (> 1: that router beat the oracle), ``why`` the measured reason when it
    did. ``oracle`` is the length oracle of ``cmlfq_cost``'s placement rule (:mod:`libra.policies.routing.oracle`);
    ``oracle_bucket`` (the oracle before issue #17: the bucket of the true total length, sticky) runs beside it
    for reference and is not one of the routers the check compares. ``stats`` per router: tokens/s before the
    last step, the last step's wait for data, the rollout GPUs' busy share (:func:`_run_stats`)."""
    from libra.sim.engine import SIM_ROUTERS, Simulator
    from libra.sim.workloads import generate

    out: dict[str, Any] = {"gpus": gpus, "steps": steps, "prompts": prompts, "seed": seed, "allocation": "hetero",
                           "workloads": {}}
    runs = [(r, r, {}) for r in SIM_ROUTERS] + [("oracle_bucket", "oracle", {"placement": "bucket"})]
    for wl in workloads:
        trajs = generate(wl, steps, prompts, 16, seed)
        res, stats = {}, {}
        for label, router, params in runs:
            cfg = _config(wl, "hetero", router, gpus, seed, hardware)
            cfg.router_params.update(params)
            sim = Simulator(trajs, cfg)
            res[label] = sim.run()
            stats[label] = _run_stats(sim, res[label])
        tps = {r: x.tokens_per_s for r, x in res.items()}
        oracle = tps["oracle"]
        others = [r for r in SIM_ROUTERS if r != "oracle"]
        best = max(others, key=tps.__getitem__)
        w = {"tokens_per_s": tps, "best_other": best,
             "best_other_over_oracle": tps[best] / oracle if oracle else math.nan,
             "ok": all(oracle >= tps[r] for r in others),
             "routing_accuracy": {r: x.routing_accuracy for r, x in res.items()},
             "migrated_token_ratio": {r: x.migrated_token_ratio for r, x in res.items()}, "stats": stats}
        w["why"] = "" if w["ok"] else _why(w)
        out["workloads"][wl] = w
    out["ok"] = all(w["ok"] for w in out["workloads"].values())
    return out


def format_oracle(o: dict[str, Any]) -> list[str]:
    """The oracle check's lines of ``python -m libra.bench calibration``."""
    lines = ["", f"Oracle sanity ({o['allocation']} layout, {o['gpus']} GPUs, {o['steps']} steps, {o['prompts']} "
             f"groups x 16, seed {o['seed']}): oracle >= every other router on every workload: "
             f"{'yes' if o['ok'] else 'NO'}",
             "  (oracle: cmlfq_cost's placement given the true remaining length; oracle_bucket, for reference: the "
             "true total length's bucket, sticky, the oracle before issue #17)"]
    for wl, w in o["workloads"].items():
        tps, st = w["tokens_per_s"], w["stats"]
        others = ", ".join(f"{r} {v:.0f}" for r, v in tps.items() if r != "oracle")
        lines.append(f"  {wl:<10} oracle {tps['oracle']:.0f} tok/s; best other {w['best_other']} "
                     f"x{w['best_other_over_oracle']:.3f} of it; {others}")
        lines.append(f"  {'':<10} before the last step / last step's wait / rollout busy: " + ", ".join(
            f"{r} {st[r]['tokens_per_s_before_last']:.0f} / {st[r]['last_step_wait_s']:.0f} s / "
            f"{st[r]['rollout_busy']:.2f}" for r in dict.fromkeys(("oracle", w["best_other"], "oracle_bucket"))))
        acc, mig = w["routing_accuracy"], w["migrated_token_ratio"]
        lines.append(f"  {'':<10} routing accuracy / migrated tokens: " + ", ".join(
            f"{r} {acc[r]:.2f}/{mig[r]:.3f}" for r in ("cmlfq", "cmlfq_cost", "la_mlfq", "predictor", "oracle",
                                                      "oracle_bucket") if r in acc)
                     + " (C-MLFQ targets: >= 0.91 / <= 0.08; the oracle places by cost, so its accuracy is only "
                       "its agreement with the length buckets)")
        if w["why"]:
            lines.append(f"  {'':<10} why: {w['why']}")
    return lines
