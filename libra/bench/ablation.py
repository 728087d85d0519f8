"""Benchmark: the Libra ablation ladder and the EARL parallelism selector, in the simulator, in one run.

Part 1, the ladder (docs/papers.md §1.5, R2E-Gym ablation; §5.1): one generated R2E-like trace (48 GPUs,
20 steps, ``gpus / 16`` GRPO groups of 16 per step by default, ~346K tokens per step as docs/papers.md §1.7 says) is replayed by the discrete-event simulator
(:mod:`libra.sim.engine`: the real ``BrokerState``, the real routers, the real planner and plan
application) under each rung, cumulatively:

1. ``static_uniform``: half the GPUs train, half serve as TP-2 instances; simple router (``least_loaded``);
2. ``+ homogeneous planner``: ``grp_homogeneous`` (GRP with one rollout TP, online re-planning);
3. ``+ heterogeneous TP``: ``grp`` (heterogeneous TP buckets);
4. ``+ C-MLFQ``: ``grp`` with the ``cmlfq`` router;
5. ``+ elastic pool (EHP)``: ``grp_ehp`` with ``cmlfq``: full Libra;

rungs 4 and 5 are run again with the distribution- and cost-based C-MLFQ (``cmlfq_cost``,
:mod:`libra.policies.routing.cmlfq_cost`), and the targets are checked for both ladders (suffix ``_cmlfq_cost``);

plus the baselines ``verl-colocated`` (``colocated``: all GPUs roll out, then all train, synchronously)
and ``static_best`` (AReaL-Static-Optimal: the GRP plan of the first 5 steps, frozen). Every rung sees the
same trace and seed. The table: tokens/s, mean step time, GPU idle fraction, and the ratios to
static uniform and to colocated; planner rungs add plans applied and the transition seconds charged.

Part 2, EARL (docs/papers.md §3.2.1, §5.3): a context-growth run (the mean context rises geometrically
from 1K to 32K tokens over ``--earl-points`` steps, at a fixed number of concurrent
responses: 32 and 64) on 16 H200 GPUs with Qwen3-14B. At each point the broker's own selector loop
(:class:`libra.broker.earl.EarlLoop`, default settings: cost-model profile table, OOM guard, hysteresis) sees a
window of generate turns at that context and decides the rollout TP from the TP it holds; every fixed TP is measured too. Throughput
(tokens per GPU per second) is measured by simulating the batch on :class:`~libra.sim.instance.SimInstance`
instances (continuous batching: prefill, then decode with growing KV; responses dealt round-robin); a TP
is OOM when its share of the responses does not fit the instance's KV cache at once. "Never OOM" counts
the points where some fixed TP fits (where none does, no choice avoids it).

``python -m libra.bench ablation [--steps 20] [--gpus 48] [--prompts N] [--seed 0] [--seeds 1]
[--base-router least_loaded] [--jobs 1] [--quick] [--json]``; ``--seeds 3`` prints each seed's tables and then
a summary over the seeds (:mod:`libra.bench.ablation_seeds`: per rung mean and min-max tokens/s, the deployed
plans, rollout vs training seconds per step, C-MLFQ routing accuracy and migrated tokens). ``--quick``: 16 GPUs, 3 steps, 2 groups per step, 6 EARL points (for tests).
Targets (issue #4): each rung at least as fast as the one below, full Libra >= 1.8x static uniform and
>= 3x colocated; the EARL selector at least as good as the best fixed TP at every point, never OOM. The
benchmark reports what it measures and whether each target holds; it does not assert them.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from libra.bench.ablation_seeds import LADDER, LADDER_COST, format_seeds, summarize_seeds
from libra.bench.ablation_why import ehp_why, ratio_why, tp_why
from libra.bench.output import emit
from libra.sim.config import default_prompts
from libra.sim.workload_profiles import MAX_MODEL_LEN

__all__ = ["RUNGS", "earl_run", "main", "measure_tgs", "run", "run_rung"]

#: (key, label, allocation, router or None for the base router); the ladder first, then the baselines.
RUNGS: tuple[tuple[str, str, str, str | None], ...] = (
    ("static_uniform", "static uniform", "static_uniform", None),
    ("homogeneous", "+ homogeneous planner", "grp_homogeneous", None),
    ("heterogeneous", "+ heterogeneous TP", "grp", None),
    ("cmlfq", "+ C-MLFQ", "grp", "cmlfq"),
    ("ehp", "+ elastic pool (EHP) = Libra", "grp_ehp", "cmlfq"),
    ("colocated", "verl-colocated", "colocated", None),
    ("static_best", "static_best (AReaL)", "static_best", None),
    ("cmlfq_cost", "+ C-MLFQ, cost-based", "grp", "cmlfq_cost"),
    ("ehp_cost", "+ EHP = Libra, cost-based", "grp_ehp", "cmlfq_cost"),
)
#: Every rung's router gets Libra's per-instance room rule (docs/papers.md §1.4.3: active + queued < 3), as in
#: ``python -m libra.bench routing`` and ``python -m libra.sim``.
ROUTER_PARAMS: dict[str, Any] = {"cap_metric": "load", "max_queue_length": 3}


def run_rung(job: tuple[str, str, str, int, int, int, int, dict[str, Any], str]) -> dict[str, Any]:
    """Simulate one rung: ``(key, allocation, router, steps, prompts, gpus, seed, allocation_params,
    batching)`` (``batching``: ``SimConfig.batching``)."""
    from libra.sim.engine import SimConfig, Simulator
    from libra.sim.workload_profiles import get_profile
    from libra.sim.workloads import generate

    key, allocation, router, steps, prompts, gpus, seed, params, batching = job
    prof = get_profile("r2e")
    trajs = generate("r2e", steps, prompts, 16, seed)
    cfg = SimConfig(router=router, allocation=allocation, gpus=gpus, seed=seed, batching=batching,
                    bucket_thresholds=prof.bucket_thresholds, size_thresholds=prof.size_thresholds,
                    router_params=dict(ROUTER_PARAMS),
                    allocation_params=dict(params) if allocation.startswith(("grp", "static_best")) else {})
    t0 = time.perf_counter()
    sim = Simulator(trajs, cfg)
    res = sim.run().to_dict()
    res["wall_s"] = round(time.perf_counter() - t0, 2)
    res["key"] = key
    res["model_check"] = model_check(sim, trajs, allocation)
    if sim.alloc is not None:
        rep = sim.alloc.report()
        res["planner"] = {k: rep[k] for k in ("initial_plan", "final_plan", "plans_applied", "switches",
                                               "transition_s", "search_s", "regroup_pauses", "core_swaps",
                                               "reconfig_costs", "step_errors", "ehp_joins")}
        res["planner"]["decisions"] = dict(rep["decisions"])
        res["planner"]["ehp_signals"] = dict(rep["ehp_signals"])
    return res


def model_check(sim: Any, trajs: Sequence[Any], allocation: str) -> dict[str, float]:
    """The planner's prediction of each step against the simulator's measurement (means over steps).

    For step ``k``: the plan deployed when its rollout started (static allocations: the plan their
    allocator gives that layout) re-scored by the planner on step ``k``'s own trajectories
    (``Allocator.evaluate``) gives ``pred_rollout_s`` (the rollout DP's per-step time), ``pred_chain_s``
    (the predicted release-to-last-end latency of the step's rollout: the layout's longest critical
    path ``Plan.t_chain`` with a policy lag > 1, else ``pred_rollout_s``), ``pred_train_s`` and
    ``pred_step_s`` (``Plan.objective``: ``max`` of the two and, under the ``pipeline`` planner objective
    with a lag ``L > 1``, the pipeline bound ``(chain + train) / L``; their sum when colocated); the simulator gives ``sim_rollout_s``
    (release to last trajectory end, which with a policy lag > 1 overlaps the previous step's rollout),
    ``sim_train_s`` and ``sim_step_s`` (mean interval between training-step ends).
    ``ratio_step`` = ``sim_step_s / pred_step_s``.
    """
    from libra.policies.cost import RolloutCostModel, TrainingCostModel, load_hardware, load_model
    from libra.policies.planner.allocators import PlannerConfig, make_allocator
    from libra.policies.planner.types import pipeline_objective
    from libra.sim.engine import COLOCATED_SWITCH
    from libra.traces import workload_of

    by_step: dict[int, list[Any]] = {}
    for t in trajs:
        by_step.setdefault(t.step, []).append(t)
    steps = sorted(by_step)
    if sim.alloc is not None:
        alloc, plan_at = sim.alloc.allocator, sim.alloc.plan_at

        def predict(k: int, wl: Any) -> tuple[float, float, float, float]:
            plan = alloc.evaluate(plan_at(sim.rollout_start[k]), wl)
            chain = plan.t_chain if plan.overlap_steps > 1 else plan.t_rollout
            return plan.t_rollout, plan.t_train, plan.objective, chain
    else:
        cfg = sim.cfg
        hw, model = load_hardware(cfg.hardware), load_model(cfg.model)
        first = by_step[steps[0]]
        pc = PlannerConfig(n_gpus=cfg.gpus, global_batch=len(first), group_size=16, overlap_steps=sim.lag)
        planner = make_allocator("static_uniform", rollout_model=RolloutCostModel(hw, model),
                                 train_model=TrainingCostModel(hw, model), config=pc).planner  # type: ignore[attr-defined]
        lay = sim.layout
        tps = tuple(i.tp for i in lay.instances)

        def predict(k: int, wl: Any) -> tuple[float, float, float, float]:
            # the simulated layout itself: its rollout instances, and its training GPUs with the
            # simulator's (padded-batch) training layout, scored by the same training cost model
            fixed = planner.plan_fixed(wl, 0, tps)
            t_roll = fixed.t_rollout
            t_train = sim.train_time([x.total_tokens for x in by_step[steps[k]]])
            chain = fixed.t_chain if fixed.overlap_steps > 1 else t_roll
            if lay.colocated:  # the simulator charges both role switches inside the training phase
                t_train += COLOCATED_SWITCH.round_trip_s
                return t_roll, t_train, t_roll + t_train, t_roll
            obj = (max(t_train, t_roll) if fixed.throughput  # PlannerConfig.objective (default throughput)
                   else pipeline_objective(t_train, t_roll, fixed.t_chain, fixed.overlap_steps))
            return t_roll, t_train, obj, chain
    pr, pt, ps, sr, st, pc_ = [], [], [], [], [], []
    for k, s in enumerate(steps):
        r, t, o, c = predict(k, workload_of(by_step[s]))
        pr.append(r)
        pc_.append(c)
        pt.append(t)
        ps.append(o)
        sr.append(sim.rollout_end[k] - sim.rollout_start[k])
        st.append(sim.train_end[k] - sim.train_start[k])
    sim_step = sim.train_end[len(steps) - 1] / len(steps)
    pred_step = float(np.mean(ps))
    return {"pred_rollout_s": float(np.mean(pr)), "pred_chain_s": float(np.mean(pc_)),
            "sim_rollout_s": float(np.mean(sr)),
            "pred_train_s": float(np.mean(pt)), "sim_train_s": float(np.mean(st)),
            "pred_step_s": pred_step, "sim_step_s": sim_step, "ratio_step": sim_step / pred_step}


# ---------------------------------------------------------------------------------------------- EARL
def measure_tgs(costs: Any, tp: int, context: float, load: int, n_gpus: int,
                prompt_fraction: float = 0.1) -> tuple[float, bool]:
    """Simulated ``(tokens per GPU per second, oom)`` of ``load`` responses of ``context`` tokens on
    ``n_gpus // tp`` TP-``tp`` instances (round-robin; each response prefills ``prompt_fraction`` of its
    context, then decodes the rest). OOM: an instance cannot hold its responses' KV at once."""
    from libra.sim.cluster import RolloutInstanceSpec
    from libra.sim.instance import Seq, SimInstance

    n_inst = n_gpus // tp
    if n_inst < 1:
        return 0.0, True
    per = math.ceil(load / n_inst)
    if per * context > costs.token_capacity(tp):
        return 0.0, True
    prompt = max(1, round(context * prompt_fraction))
    gen = max(1, round(context) - prompt)
    inst = SimInstance(RolloutInstanceSpec("earl", "n0", "all", tp), costs)  # the busiest instance
    for i in range(per):
        inst.charge(costs.request_overhead_s + costs.prefill(tp, prompt), prompt)
        inst.enqueue(Seq(f"s{i}", f"w{i}", 1, gen, float(gen), float(prompt)))
    inst.admit()
    now = 0.0
    while inst.load:
        t = inst.next_event_time(now)
        if t is None:
            break
        now = t
        inst.advance(now)
        inst.pop_finished()
        inst.admit()
    return (load * context / now / n_gpus if now > 0 else 0.0), False


def earl_run(points: int = 12, min_context: float = 1024.0, max_context: float = 32768.0,
             loads: Sequence[int] = (32, 64), n_gpus: int = 16, configs: Sequence[int] = (1, 2, 4, 8),
             hardware: str = "h200", model: str = "qwen3-14b") -> dict[str, Any]:
    """The EARL context-growth comparison (see the module docstring). One row per (load, point)."""
    from libra.policies.cost import RolloutCostModel, load_hardware, load_model
    from libra.broker.earl import EarlLoop, EarlSettings
    from libra.sim.cluster import InstanceCosts

    cm = RolloutCostModel(load_hardware(hardware), load_model(model))
    costs = InstanceCosts(cm)
    contexts = np.geomspace(min_context, max_context, points)
    rows = []
    for load in loads:
        loop = EarlLoop(EarlSettings(configs=list(configs)), cm)  # the broker's loop, as plan_rounds.Planning runs it
        tp = 0  # no rollout TP yet: the first decision places it
        for step, ctx in enumerate(contexts):
            for _ in range(loop.settings.window):
                loop.observe(int(ctx))
            tp = loop.decide(30.0 * (step + 1), n_gpus=n_gpus, load=load, max_tp=None, current_tp=tp) or tp
            pick = loop.decisions[-1]
            fixed = {tp: measure_tgs(costs, tp, float(ctx), load, n_gpus) for tp in configs}
            ok = {tp: v for tp, (v, oom) in fixed.items() if not oom}
            best_tp = max(ok, key=lambda t: (ok[t], -t)) if ok else None
            chosen, chosen_oom = fixed[tp]
            rows.append({"load": load, "step": step, "context": round(float(ctx)), "selected_tp": tp,
                         "reason": pick.get("why", pick["reason"]), "selected_tgs": chosen, "selected_oom": chosen_oom,
                         "best_fixed_tp": best_tp, "best_fixed_tgs": ok.get(best_tp, 0.0) if best_tp else 0.0,
                         "fixed": {str(tp): (None if oom else v) for tp, (v, oom) in fixed.items()}})
    never_oom = all(not r["selected_oom"] or r["best_fixed_tp"] is None for r in rows)
    as_good = all(r["selected_tgs"] >= r["best_fixed_tgs"] * (1 - 1e-9) for r in rows)
    worst = min((r["selected_tgs"] / r["best_fixed_tgs"] for r in rows if r["best_fixed_tgs"] > 0), default=1.0)
    return {"n_gpus": n_gpus, "hardware": hardware, "model": model, "selector": "broker EarlLoop",
            "configs": list(configs), "rows": rows, "never_oom": never_oom,
            "as_good_as_best_fixed": as_good, "worst_ratio_to_best_fixed": worst}


# ---------------------------------------------------------------------------------------------- run
def run(steps: int = 20, gpus: int = 48, prompts: int | None = None, seed: int = 0, base_router: str = "least_loaded",
        jobs: int = 1, earl_points: int = 12, allocation_params: dict[str, Any] | None = None,
        batching: str = "streaming", objective: str | None = None,
        max_seq_len: int | None = MAX_MODEL_LEN) -> dict[str, Any]:
    """Run both parts; returns the JSON-ready result (rows, ratios, target checks, EARL rows, and ``why``: the
    measured reasons the mixed-TP and EHP rungs move the number or not, :mod:`libra.bench.ablation_why`).
    ``batching``: the simulator's ``SimConfig.batching``; ``objective``: the planner rungs'
    ``PlannerConfig.objective`` (None: the allocation's default); ``max_seq_len``: the serving engine's
    ``max_model_len`` the planner is told (the generated trace's cap, 40,960 tokens, docs/papers.md; the
    training-layout headroom asks no margin past it; None: not told)."""
    prompts = prompts if prompts is not None else default_prompts(gpus)
    params = dict(allocation_params or {})
    if max_seq_len is not None:
        params.setdefault("max_seq_len", max_seq_len)
    if objective is not None:
        params["objective"] = objective
    jobs_list = [(key, alloc, router or base_router, steps, prompts, gpus, seed, params, batching)
                 for key, _, alloc, router in RUNGS]
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(run_rung, jobs_list))
    else:
        results = [run_rung(j) for j in jobs_list]
    by = {r["key"]: r for r in results}
    su, co = by["static_uniform"]["tokens_per_s"], by["colocated"]["tokens_per_s"]
    rows = []
    for (key, label, alloc, _), r in zip(RUNGS, results):
        rows.append({"key": key, "label": label, "allocation": alloc, "router": r["router"],
                     "tokens_per_s": r["tokens_per_s"], "step_time_s": r["step_time_s"]["mean"],
                     "gpu_idle_fraction": r["gpu_idle_fraction"],
                     "vs_static_uniform": r["tokens_per_s"] / su if su else math.nan,
                     "vs_colocated": r["tokens_per_s"] / co if co else math.nan,
                     "routing_accuracy": r["routing_accuracy"], "migrated_token_ratio": r["migrated_token_ratio"],
                     "rollout_time_s": r["rollout_time_s"], "train_time_s": r["train_time_s"],
                     "planner": r.get("planner"),
                     "model_check": r["model_check"], "wall_s": r["wall_s"]})
    targets: dict[str, bool] = {}
    for suffix, ladder_keys in (("", LADDER), ("_cmlfq_cost", LADDER_COST)):
        ladder = [by[k]["tokens_per_s"] for k in ladder_keys]
        top = ladder[-1]
        targets["each_rung_at_least_previous" + suffix] = all(b >= a for a, b in zip(ladder, ladder[1:]))
        targets["libra_vs_static_uniform_ge_1.8" + suffix] = top / su >= 1.8 if su else False
        targets["libra_vs_colocated_ge_3" + suffix] = top / co >= 3.0 if co else False
    libra, libra_cost = by["ehp"]["tokens_per_s"], by["ehp_cost"]["tokens_per_s"]
    earl = earl_run(points=earl_points)
    targets["earl_as_good_as_best_fixed"] = earl["as_good_as_best_fixed"]
    targets["earl_never_oom"] = earl["never_oom"]
    why = {"tp": tp_why(by, steps, prompts, seed), "ehp": ehp_why(by),
           "ehp_cost": ehp_why({"ehp": by["ehp_cost"], "cmlfq": by["cmlfq_cost"]}), "ratio": ratio_why(by)}
    return {"workload": "r2e", "gpus": gpus, "steps": steps, "prompts": prompts, "group_size": 16, "seed": seed,
            "max_seq_len": params.get("max_seq_len"), "why": why,
            "base_router": base_router, "batching": batching, "objective": objective or "throughput", "rows": rows, "libra_vs_static_uniform": libra / su if su else math.nan,
            "libra_vs_colocated": libra / co if co else math.nan,
            "libra_cost_vs_static_uniform": libra_cost / su if su else math.nan,
            "libra_cost_vs_colocated": libra_cost / co if co else math.nan, "targets": targets, "earl": earl}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench ablation", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="RL steps (default 20; --quick 3)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs, whole 8-GPU nodes (default 48; --quick 16)")
    p.add_argument("--prompts", type=int, default=None, help="GRPO groups of 16 per step (default gpus/16, 3 at 48 GPUs: ~346K tokens per step, docs/papers.md §1.7; --quick 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1,
                   help="run seeds SEED .. SEED+N-1 and print their summary (mean, min-max per rung; default 1)")
    p.add_argument("--base-router", default="least_loaded", help="router of the rungs below C-MLFQ (default %(default)s)")
    p.add_argument("--jobs", type=int, default=1, help="parallel simulations (default %(default)s)")
    p.add_argument("--earl-points", type=int, default=None, help="context-growth points (default 12; --quick 6)")
    p.add_argument("--batching", default="streaming", choices=("streaming", "barrier"),
                   help="simulator batch formation (docs/papers.md §1.7; default streaming)")
    p.add_argument("--objective", default=None, choices=("throughput", "pipeline"),
                   help="planner rungs' objective (default throughput; pipeline: the earlier chain-aware one)")
    p.add_argument("--max-seq-len", type=int, default=MAX_MODEL_LEN,
                   help="the serving max_model_len the planner is told (default %(default)s, the trace's cap; 0: not told)")
    p.add_argument("--quick", action="store_true", help="a tiny configuration (16 GPUs, 3 steps) for smoke tests")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _fmt(out: dict[str, Any]) -> str:
    lines = [f"Libra ablation, R2E-like trace: {out['gpus']} GPUs, {out['steps']} steps, {out['prompts']} groups x 16 "
             f"per step, seed {out['seed']} (base router {out['base_router']}; batching {out['batching']}, planner "
             f"objective {out['objective']}; planner told max_model_len {out.get('max_seq_len')})", "",
             f"{'rung':<32} {'allocation / router':<28} {'tok/s':>8} {'step s':>8} {'idle':>6} {'x uniform':>9} "
             f"{'x coloc':>8} {'plans':>5} {'switch s':>8}"]
    for r in out["rows"]:
        pl = r["planner"] or {}
        lines.append(f"{r['label']:<32} {r['allocation'] + ' / ' + r['router']:<28} {r['tokens_per_s']:>8.1f} "
                     f"{r['step_time_s']:>8.1f} {r['gpu_idle_fraction']:>6.3f} {r['vs_static_uniform']:>9.3f} "
                     f"{r['vs_colocated']:>8.3f} {pl.get('plans_applied', '-')!s:>5} {pl.get('transition_s', '-')!s:>8}")
    lines += ["", "Why (measured):"] + _why_lines(out["why"])
    lines += ["", "Planner prediction vs simulator (means over steps; the deployed plan re-scored on each step's "
                  "trajectories; pred chain = predicted release-to-last-end rollout latency, compare with sim roll; "
                  "sim rollout overlaps the previous step's when lag > 1):",
              f"{'rung':<32} {'pred roll':>9} {'pred chain':>10} {'sim roll':>9} {'pred train':>10} {'sim train':>9} "
              f"{'pred step':>9} {'sim step':>9} {'sim/pred':>8}"]
    for r in out["rows"]:
        c = r["model_check"]
        lines.append(f"{r['label']:<32} {c['pred_rollout_s']:>9.1f} {c['pred_chain_s']:>10.1f} {c['sim_rollout_s']:>9.1f} "
                     f"{c['pred_train_s']:>10.1f} "
                     f"{c['sim_train_s']:>9.1f} {c['pred_step_s']:>9.1f} {c['sim_step_s']:>9.1f} {c['ratio_step']:>8.2f}")
    e = out["earl"]
    lines += ["", f"EARL selector ({e.get('selector', 'EarlLoop')}), context growth on {e['n_gpus']} "
              f"{e.get('hardware', '?')} GPUs, {e.get('model', '?')} (tokens/GPU/s; OOM = does not fit):",
              f"{'load':>5} {'context':>8} {'pick':>5} {'pick TGS':>9} {'best fixed':>11} " +
              " ".join(f"{'TP' + str(t):>8}" for t in e["configs"])]
    for r in e["rows"]:
        fixed = " ".join(f"{'OOM' if r['fixed'][str(t)] is None else format(r['fixed'][str(t)], '.1f'):>8}"
                         for t in e["configs"])
        lines.append(f"{r['load']:>5} {r['context']:>8} {'TP' + str(r['selected_tp']):>5} "
                     f"{r['selected_tgs']:>9.1f} {'TP' + str(r['best_fixed_tp']):>11} {fixed}")
    lines += ["", f"Libra / static uniform = {out['libra_vs_static_uniform']:.3f}x (target >= 1.8); "
                  f"Libra / colocated = {out['libra_vs_colocated']:.3f}x (target >= 3)",
              f"Libra with cmlfq_cost / static uniform = {out['libra_cost_vs_static_uniform']:.3f}x; "
              f"/ colocated = {out['libra_cost_vs_colocated']:.3f}x",
              "targets: " + ", ".join(f"{k}={'met' if v else 'MISSED'}" for k, v in out["targets"].items())]
    return "\n".join(lines)


def _why_lines(why: dict[str, Any]) -> list[str]:
    tp = why["tp"]
    head = " ".join(f"{'TP' + str(t):>7}" for t in (1, 2, 4, 8))
    lines = [f"mixed TP: {tp['verdict']} (the cost model the planner scores with, per-GPU tok/s at "
             f"{tp['concurrency_per_8_gpus']} requests per 8 GPUs; the heterogeneous rung's router "
             f"{tp['heterogeneous_router']} is also scored length-blind); TPs deployed: "
             + ", ".join(f"{k} {v}" for k, v in tp["deployed_tps"].items()),
             f"  {'length bin':<14} {'tokens':>6} {head}"]
    for b in tp["bins"]:
        lines.append(f"  {str(b['lo']) + '-' + str(b['hi']):<14} {b['token_share']:>6.0%} "
                     + " ".join(f"{b['per_gpu'][t]:>7.0f}" for t in (1, 2, 4, 8)))
    return lines + [why["ehp"]["line"], "cost-based: " + why["ehp_cost"]["line"], why["ratio"]]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    steps = args.steps if args.steps is not None else (3 if args.quick else 20)
    gpus = args.gpus if args.gpus is not None else (16 if args.quick else 48)
    prompts = args.prompts if args.prompts is not None else (2 if args.quick else None)
    points = args.earl_points if args.earl_points is not None else (6 if args.quick else 12)
    if steps < 1 or gpus < 16 or gpus % 8:
        print("--steps must be >= 1 and --gpus a multiple of 8, at least 16")
        return 2
    if args.seeds < 1:
        print("--seeds must be >= 1")
        return 2
    t0 = time.perf_counter()
    runs = [run(steps, gpus, prompts, args.seed + i, args.base_router, args.jobs, points, batching=args.batching,
                objective=args.objective, max_seq_len=args.max_seq_len or None) for i in range(args.seeds)]
    if len(runs) == 1:
        out = runs[0]
        out["wall_s"] = round(time.perf_counter() - t0, 1)
        emit(out, args.json, _fmt)
        return 0
    summary = summarize_seeds(runs)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(summary, args.json, lambda o: "\n\n".join([_fmt(r) for r in runs] + [format_seeds(o)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
