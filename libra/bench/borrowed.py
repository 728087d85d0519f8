"""``python -m libra.bench borrowed``: RL throughput on borrowed serving GPUs vs none, and the SLO violations it causes.

One invocation, simulated (``libra.sim``): the R2E-like workload on ``--gpus`` owned GPUs (the ``hetero``
layout, the real broker and C-MLFQ router) without borrowing, then with the ``--serving-gpus`` of a serving
owner lent by the runtime's owner rule (:class:`~libra.policies.lending.HeadroomRule`) under a diurnal load
trace with bursts (:mod:`libra.sim.serving_trace`), at each spot-style revocation rate of ``--rates`` (per lent
GPU-hour). For each: RL tokens/s and the ratio to no borrowing, and the serving requests that missed their SLO
because of borrowing (violations with lending − without, same trace and seed, over the borrowing run's
window) as a % of the serving requests in it. The target is >= 1.3x at <= 1 %; the report says where it holds.
Seeds: the workload, the trace, its arrivals and the revocations all derive from ``--seed``.
``--quick``: a seconds-long smoke run (16 + 16 GPUs, 4 steps).

Every pair runs with each owned layout of ``--layouts`` (default all three, same seeds, same trace, same owner
schedule): ``hetero`` (the simulator's fixed layout in both runs) and ``grp`` (the runtime planner's: without
borrowing the broker PlannerLoop's owned-only plan, with borrowing the owned layout of ``plan_with_borrowed``'s
plan and the lent slots in its buckets; :mod:`libra.sim.borrowed_plan`; computed once before the run).

``online`` (both runs use the simulator's ``grp`` allocation: the broker's PlannerLoop re-plans every step and
``BrokerState.apply_plan`` deploys; with borrowing the lent slots join that BrokerState as GPU slots, its rounds
count them as borrowed capacity and direct them, :mod:`libra.sim.borrowed`; the loop prices them at the run's
measured take-backs per lent GPU-hour and places them by the row's placement).

Every rate runs with each placement of ``--placements`` (default both, in the same invocation, so neither was
tuned alone): ``proportional`` (borrowed TP-1 instances spread like the owned rollout GPUs) and ``smallest``
(all of them in the first C-MLFQ bucket; :func:`~libra.policies.planner.borrowed.place_borrowed`).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from dataclasses import replace
from typing import Any

from libra.policies.cost import RolloutCostModel, load_hardware, load_model
from libra.policies.planner.borrowed import BORROWED_PLACEMENTS, place_borrowed
from libra.sim.borrowed import BorrowedSimulator
from libra.sim.borrowed_plan import OwnedPlanner
from libra.sim.cluster import Layout
from libra.sim.config import SimConfig, default_prompts
from libra.sim.engine import Simulator
from libra.sim.serving_owner import ServingCapacity, ServingFleet, run_owner, slo_violations
from libra.sim.serving_trace import ServingTraceParams, serving_trace
from libra.sim.workloads import generate

TARGET_GAIN, TARGET_SLO = 1.3, 0.01
LAYOUTS = ("hetero", "grp", "online")
MODELLED_ONLY = (
    "the serving fleet (capacity from the roofline cost model at the TPOT target, a fluid FIFO queue, the owner's "
    "p99 reading = the fluid TPOT)",
    "a reclaimed GPU serves again after the whole deadline plus its serving engine's wake-up (weights from host "
    "memory); the runtime may give it back sooner (ContextsMoved)",
    "a lent slot's join time (serving engine asleep, policy weights loaded from the trainers) and its hand-back "
    "choice (turns that cannot finish by deadline - 1 s at the current decode rate)",
    "KV moves out of a reclaimed slot at the simulator's cross-node KV cost",
    "the hetero rows: the owned GPUs keep the simulator's fixed hetero layout and the lent slots a fixed bucket "
    "each; the broker's planner loop does not drive them",
)
MODELLED_ONLY_GRP = (
    "the grp rows: each owned layout is the broker PlannerLoop's profiled plan (owned only) or plan_with_borrowed's "
    "(its training on the owned GPUs, lent slots in its buckets by lent_roles), computed ONCE before the run for the "
    "first step's workload and the owner's mean lent GPUs and take-backs per lent GPU-hour over the no-borrowing "
    "run's window; the broker's planner loop does not re-plan during the run (no rounds as lent slots come and go "
    "or as the workload grows)",
    "the grp rows: the simulator picks the training TP/PP/DP for the plan's training GPUs itself (best layout), "
    "not the plan's",
)


MODELLED_ONLY_ONLINE = (
    "the online rows: the planner's rounds run at every training-step boundary (the live broker's on its "
    "interval_s timer); a change in the lent slots is priced at the next boundary, and a slot that joins or is lent "
    "again is placed under the deployed plan at once (PlaceLent, what a round that deploys nothing does)",
    "the online rows: a directed lent slot switches buckets at no cost once drained (its TP-1 engine stays up)",
)


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m libra.bench borrowed", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 16 + 16 GPUs, 4 steps")
    p.add_argument("--gpus", type=int, default=48, help="owned GPUs (default 48)")
    p.add_argument("--serving-gpus", type=int, default=48, help="the serving owner's GPUs (default 48)")
    p.add_argument("--steps", type=int, default=300, help="RL steps (default 300: ~5.3 h of the no-borrowing run)")
    p.add_argument("--start-hour", type=float, default=8.0, help="time of day the RL run starts (default 08:00)")
    p.add_argument("--rates", default="0,1,10", help="spot-style revocations per lent GPU-hour (default 0,1,10)")
    p.add_argument("--lend-below", type=float, default=0.7, help="owner rule: lend below this x target (0.7)")
    p.add_argument("--reclaim-above", type=float, default=0.85, help="owner rule: reclaim above this x target")
    p.add_argument("--placements", default=",".join(BORROWED_PLACEMENTS),
                   help=f"borrowed-GPU placements to run, comma-separated (default {','.join(BORROWED_PLACEMENTS)})")
    p.add_argument("--layouts", default="hetero,grp,online",
                   help="owned layouts to compare, comma-separated: hetero (the simulator's fixed layout), grp (the "
                        "GRP planner's plan, computed once), online (the broker's planner loop re-planning during the "
                        "run, lent slots counted and directed by its rounds); in both runs of a pair; default all")
    p.add_argument("--seed", type=int, default=0, help="seed of workload, trace, arrivals, revocations (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    if a.quick:
        a.gpus, a.serving_gpus, a.steps = 16, 16, 4
    try:
        a.rate_list = [float(x) for x in a.rates.split(",") if x.strip()]
    except ValueError:
        p.error(f"--rates must be comma-separated numbers, got {a.rates!r}")
    a.placement_list = [x.strip() for x in a.placements.split(",") if x.strip()]
    if not a.placement_list or any(x not in BORROWED_PLACEMENTS for x in a.placement_list):
        p.error(f"--placements must name some of {', '.join(BORROWED_PLACEMENTS)}, got {a.placements!r}")
    a.layout_list = [x.strip() for x in a.layouts.split(",") if x.strip()]
    if not a.layout_list or any(x not in LAYOUTS for x in a.layout_list):
        p.error(f"--layouts must name some of {', '.join(LAYOUTS)}, got {a.layouts!r}")
    if not a.rate_list or any(not (math.isfinite(r) and r >= 0) for r in a.rate_list):
        p.error(f"--rates must be numbers >= 0, got {a.rates!r}")
    return a


def _kinds(sim: Simulator, lent: set[bytes]) -> dict[str, dict[str, float]]:
    """Per instance kind (owned or lent, TP, bucket): instances, busy seconds each, decoded tokens per busy
    GPU-second (the diagnosis of where the step time goes)."""
    agg: dict[str, list[float]] = {}
    for peer, inst in sim.instances.items():
        k = f"{'lent' if peer in lent else 'owned'}/tp{inst.tp}/{inst.spec.bucket}"
        v = agg.setdefault(k, [0, 0.0, 0.0, inst.tp])
        v[0], v[1], v[2] = v[0] + 1, v[1] + inst.busy_s, v[2] + inst.decoded
    return {k: {"n": int(n), "busy_s_each": round(b / n, 1), "decode_tok_per_gpu_s": round(d / max(1e-9, b) / tp, 1)}
            for k, (n, b, d, tp) in sorted(agg.items())}


def _baseline(sim: Simulator) -> tuple[Any, dict[str, Any]]:
    r0 = sim.run()
    return r0, {"tokens_per_s": round(r0.tokens_per_s, 1), "makespan_s": round(r0.makespan_s, 1),
                "step_s": round(r0.step_time_s["mean"], 1), "kinds": _kinds(sim, set())}


def _owner_runs(a: argparse.Namespace, trace: Any, cm: RolloutCostModel) -> dict[float, dict[str, Any]]:
    """The serving owner's schedule at each rate (the same for every layout and placement)."""
    out = {}
    for rate in a.rate_list:
        fleet = ServingFleet(gpus=a.serving_gpus, lend_below=a.lend_below, reclaim_above=a.reclaim_above,
                             revocations_per_gpu_hour=rate)
        cap = ServingCapacity.from_cost_model(cm, fleet)
        arrivals = trace.arrivals(cap.per_gpu_rps * fleet.gpus, a.seed)
        own = run_owner(trace, arrivals, fleet, cap, a.seed)
        served = run_owner(trace, arrivals, fleet, cap, a.seed, lend=False)
        events = [type(e)(e.t - a.start_hour * 3600.0, e.gpu, e.kind, e.deadline_s, e.reason) for e in own.events]
        out[rate] = {"fleet": fleet, "cap": cap, "arrivals": arrivals, "own": own, "served": served, "events": events}
    return out


def _borrow_run(a: argparse.Namespace, trajs: Any, cfg: SimConfig, o: dict[str, Any], buckets: list[str],
                layout: Layout | None, join_s: float, r0: Any, bin_s: float) -> dict[str, Any]:
    """One borrowing run (owned ``layout``, lent slots in ``buckets``) against its no-borrowing run ``r0``."""
    own, arrivals, cap = o["own"], o["arrivals"], o["cap"]
    sim = BorrowedSimulator(trajs, cfg, o["events"], buckets, owner=o["fleet"].owner, join_s=join_s, layout=layout)
    r = sim.run()
    n = min(arrivals.size, max(1, math.ceil(r.makespan_s / bin_s)))
    v_with = slo_violations(arrivals[:n], own.serving[:n], cap, bin_s)
    v_without = slo_violations(arrivals[:n], o["served"].serving[:n], cap, bin_s)
    requests = int(arrivals[:n].sum())
    return {
        "tokens_per_s": round(r.tokens_per_s, 1),
        "ratio": round(r.tokens_per_s / r0.tokens_per_s, 3), "makespan_s": round(r.makespan_s, 1),
        "step_s": round(r.step_time_s["mean"], 1), "kinds": _kinds(sim, {sim._peer(g) for g in sim._joined}),
        "serving_requests": requests, "violations_with": v_with, "violations_without": v_without,
        "slo_impact_pct": round(100.0 * (v_with - v_without) / max(1, requests), 3),
        "mean_lent_gpus": round(float(own.lent[:n].mean()), 1), "owner_reclaims": own.reclaims,
        "spot_revocations": own.spot_revocations,
        "spot_per_lent_gpu_hour": round(own.spot_revocations / max(1e-9, own.lent_gpu_s / 3600.0), 2),
        "run_hours": round(r.makespan_s / 3600.0, 2), "slots": sim.lent_summary(),
        **({"online": _online_record(sim)} if sim.alloc is not None else {}),
    }


def _online_record(sim: BorrowedSimulator) -> dict[str, Any]:
    """What the broker's planner rounds did with the lent slots in an online run."""
    alloc = sim.alloc
    assert alloc is not None
    rounds = [d for d in alloc.decisions if "reason" in d and d["reason"] != "busy"]
    priced = [d["borrowed"] for d in rounds if d.get("borrowed") and "error" not in d["borrowed"]]
    lent = [b for b in priced if b["gpus"] > 0]
    return {"rounds": len(rounds), "busy_skips": sum(d["reason"] == "busy" for d in alloc.decisions),
            "rounds_with_lent": len(lent), "borrowing_pays": sum(bool(b["used"]) for b in lent),
            "mean_lent_counted": round(sum(b["gpus"] for b in lent) / max(1, len(lent)), 1),
            "mean_predicted_gain": round(sum(b["predicted_gain"] for b in lent) / max(1, len(lent)), 3),
            "plans_applied": len(alloc.applied),
            "applied_reasons": dict(Counter(x["reason"] for x in alloc.applied)),
            "final_plan": {"n_train": alloc.plan.n_train, "rollout_tps": list(alloc.plan.rollout_tps)}}


def _online_rows(a: argparse.Namespace, trajs: Any, cfg: SimConfig, base: tuple[Any, dict[str, Any], Simulator],
                 owners: dict[float, dict[str, Any]], join_s: float, bin_s: float) -> dict[str, Any]:
    """Both runs of each pair with the broker's planner loop re-planning during the run (the ``grp`` allocation);
    with borrowing, its rounds count and direct the lent slots (:mod:`libra.sim.borrowed`)."""
    r0, nb, sim0 = base
    alloc0 = sim0.alloc
    assert alloc0 is not None
    out: dict[str, Any] = {"no_borrowing": nb, "plans_applied": len(alloc0.applied), "runs": []}
    for rate, placement in [(r, pl) for r in a.rate_list for pl in a.placement_list]:
        o = owners[rate]
        own = o["own"]
        take_backs = (own.reclaims + own.spot_revocations) / max(1e-9, own.lent_gpu_s / 3600.0)
        params = {**cfg.allocation_params, "borrowed_placement": placement, "revocations_per_gpu_hour": take_backs}
        row = {"revocations_per_gpu_hour": rate, "placement": placement, "layout": "online",
               "priced_take_backs_per_gpu_hour": round(take_backs, 2)}
        row.update(_borrow_run(a, trajs, replace(cfg, allocation_params=params), o, [], None, join_s, r0, bin_s))
        out["runs"].append(row)
    return out


def _planner_rows(a: argparse.Namespace, trajs: Any, cfg: SimConfig, planned: tuple[OwnedPlanner, Any],
                  owners: dict[float, dict[str, Any]], cm: RolloutCostModel, join_s: float,
                  bin_s: float) -> dict[str, Any]:
    """The GRP planner's layouts in both runs of each pair (:mod:`libra.sim.borrowed_plan`)."""
    op, (r0, nb) = planned
    plan = op.owned_plan
    out: dict[str, Any] = {"no_borrowing": nb, "owned_plan": {"n_train": plan.n_train, "rollout_tps": list(plan.rollout_tps),
                                                              "predicted_step_s": round(op.predicted_step_s(), 1),
                                                              "first_step_s": round(plan.objective, 1)}, "runs": []}
    n0 = max(1, math.ceil(r0.makespan_s / bin_s))
    for rate, placement in [(r, pl) for r in a.rate_list for pl in a.placement_list]:
        o = owners[rate]
        own = o["own"]
        take_backs = (own.reclaims + own.spot_revocations) / max(1e-9, own.lent_gpu_s / 3600.0)
        cap = op.capacity(round(float(own.lent[:n0].mean())), take_backs, cm)
        pb = op.borrowed(cap, a.serving_gpus, placement)
        row = {"revocations_per_gpu_hour": rate, "placement": placement, "layout": "grp", "plan": pb.record(),
               "borrowed_buckets": {b.name: pb.buckets.count(b.name) for b in pb.layout.buckets}}
        row.update(_borrow_run(a, trajs, cfg, o, pb.buckets, pb.layout, join_s, r0, bin_s))
        out["runs"].append(row)
    return out


def run(a: argparse.Namespace) -> dict[str, Any]:
    cfg = SimConfig(gpus=a.gpus, seed=a.seed)
    trajs = generate("r2e", a.steps, default_prompts(a.gpus), 16, a.seed)
    base = Simulator(trajs, cfg)
    r0, nb = _baseline(base)
    owned = {b.name: sum(i.tp for i in base.layout.instances if i.bucket == b.name) for b in base.layout.buckets}
    placed = {pl: place_borrowed(owned, a.serving_gpus, pl) for pl in a.placement_list}
    hw, model = load_hardware(cfg.hardware), load_model(cfg.model)
    cm = RolloutCostModel(hw, model)
    out: dict[str, Any] = {"seed": a.seed, "gpus": a.gpus, "serving_gpus": a.serving_gpus, "steps": a.steps,
                           "start_hour": a.start_hour, "no_borrowing": nb,
                           "borrowed_buckets": {pl: {b: v.count(b) for b in owned} for pl, v in placed.items()},
                           "runs": []}
    planned = None
    if "grp" in a.layout_list:
        op = OwnedPlanner(trajs, cfg)
        planned = (op, _baseline(Simulator(trajs, cfg, op.layout)))
    online = None
    if "online" in a.layout_list:
        sim0 = Simulator(trajs, replace(cfg, allocation="grp"))
        online = (*_baseline(sim0), sim0)
    longest = max(r0.makespan_s, planned[1][0].makespan_s if planned else 0.0, online[0].makespan_s if online else 0.0)
    params = ServingTraceParams()
    trace = serving_trace(params, longest * 1.2 + 600.0, a.seed, a.start_hour * 3600.0)
    owners = _owner_runs(a, trace, cm)
    cap = owners[a.rate_list[0]]["cap"]
    join_s = cap.wake_s + cm.weight_bytes_per_gpu(1) / hw.bw_inter
    if "hetero" in a.layout_list:
        for rate, placement in [(r, pl) for r in a.rate_list for pl in a.placement_list]:
            row = {"revocations_per_gpu_hour": rate, "placement": placement, "layout": "hetero"}
            row.update(_borrow_run(a, trajs, cfg, owners[rate], placed[placement], None, join_s, r0, params.bin_s))
            out["runs"].append(row)
    if planned is not None:
        out["planner"] = _planner_rows(a, trajs, cfg, planned, owners, cm, join_s, params.bin_s)
    if online is not None:
        out["online"] = _online_rows(a, trajs, replace(cfg, allocation="grp"), online, owners, join_s, params.bin_s)
    out["capacity"] = {"per_gpu_rps": round(cap.per_gpu_rps, 2), "tpot_at_capacity_s": round(float(cap.tpot(cap.per_gpu_rps)), 4),
                       "wake_s": round(cap.wake_s, 2), "join_s": round(join_s, 2)}
    out["modelled_only"] = (list(MODELLED_ONLY) + (list(MODELLED_ONLY_GRP) if "grp" in a.layout_list else [])
                            + ([*MODELLED_ONLY_ONLINE, *online[2].alloc.modelled_only()] if online else []))
    return out


def _verdict(r: dict[str, Any]) -> str:
    ok_gain, ok_slo = r["ratio"] >= TARGET_GAIN, r["slo_impact_pct"] <= 100 * TARGET_SLO
    if ok_gain and ok_slo:
        return "holds"
    why = []
    if not ok_gain:
        why.append(f"gain {r['ratio']:.2f}x < {TARGET_GAIN}x")
    if not ok_slo:
        why.append(f"SLO impact {r['slo_impact_pct']:.2f}% > {100 * TARGET_SLO:.0f}%")
    return "breaks: " + ", ".join(why)


def _kinds_text(kinds: dict[str, dict[str, float]]) -> str:
    return "; ".join(f"{k} {v['n']}x {v['busy_s_each']} s {v['decode_tok_per_gpu_s']}" for k, v in kinds.items())


def _print_runs(nb: dict[str, Any], runs: list[dict[str, Any]], tag: str) -> None:
    print(f"[{tag}] no borrowing: {nb['tokens_per_s']} tok/s, makespan {nb['makespan_s']} s, mean step {nb['step_s']} s")
    print(f"  instances (n, busy s each, decoded tok per busy GPU-s): {_kinds_text(nb['kinds'])}")
    for r in runs:
        s = r["slots"]
        print(f"[{tag}] rate {r['revocations_per_gpu_hour']:>4}/GPU-h, {r['placement']:>12}: {r['tokens_per_s']} tok/s = "
              f"{r['ratio']:.3f}x; SLO impact {r['slo_impact_pct']:.3f}% ({r['violations_with']} - "
              f"{r['violations_without']} of {r['serving_requests']} requests); lent {r['mean_lent_gpus']} GPUs on "
              f"average; owner reclaims {r['owner_reclaims']}, spot {r['spot_revocations']}; slots: {s['lends']} lends, "
              f"{s['reclaims']} reclaims, {s['handbacks']} handbacks, {s['revoked']} taken back, {s['contexts_moved']} "
              f"contexts moved; mean step {r['step_s']} s -> {_verdict(r)}")
        if "plan" in r:
            p = r["plan"]
            print(f"  plan_with_borrowed: {p['capacity_gpus']} lent GPUs at {p['revocations_per_gpu_hour']} take-backs/"
                  f"GPU-h x {p['revocation_cost_s']} s: owned-only {p['owned_only_s']} s, expected {p['expected_s']} s "
                  f"(predicted gain {p['predicted_gain']}x, used {p['used']}); deployed train {p['n_train']} GPUs, "
                  f"rollout TPs {p['rollout_tps']}; lent buckets {r['borrowed_buckets']}")
        if "online" in r:
            q = r["online"]
            print(f"  planner rounds: {q['rounds']} ({q['busy_skips']} skipped busy), {q['rounds_with_lent']} counted "
                  f"lent slots (mean {q['mean_lent_counted']} GPUs, priced at {r['priced_take_backs_per_gpu_hour']} "
                  f"take-backs/GPU-h), borrowing paid in {q['borrowing_pays']} (mean predicted gain "
                  f"{q['mean_predicted_gain']}x); plans applied {q['plans_applied']} {q['applied_reasons']}; "
                  f"lent-slot directives {s['directives']}; final plan train {q['final_plan']['n_train']} GPUs, "
                  f"rollout TPs {q['final_plan']['rollout_tps']}; trajectories with a turn on a lent slot "
                  f"{s['trajectories_on_lent']} of {s['trajectories']}, steps whose last trajectory did "
                  f"{s['tail_on_lent_steps']} of {s['steps']}")
        print(f"  instances (n, busy s each, decoded tok per busy GPU-s): {_kinds_text(r['kinds'])}")


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    out = run(a)
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"borrowed GPUs, simulated: r2e, {a.gpus} owned + {a.serving_gpus} serving GPUs, {a.steps} steps "
          f"from {a.start_hour:04.1f} h, seed {a.seed}; owned layouts {', '.join(a.layout_list)}")
    c = out["capacity"]
    print(f"serving: {c['per_gpu_rps']} req/s per GPU at TPOT {c['tpot_at_capacity_s']} s (target 0.05), wake "
          f"{c['wake_s']} s, lent slot join {c['join_s']} s")
    if "hetero" in a.layout_list:
        print(f"[hetero] fixed layout; borrowed buckets {out['borrowed_buckets']}")
        _print_runs(out["no_borrowing"], out["runs"], "hetero")
    if "planner" in out:
        pl = out["planner"]
        op = pl["owned_plan"]
        print(f"[grp] owned-only plan: train {op['n_train']} GPUs, rollout TPs {op['rollout_tps']}, predicted step "
              f"{op['predicted_step_s']} s over the run's steps (first step's workload alone: {op['first_step_s']} s)")
        _print_runs(pl["no_borrowing"], pl["runs"], "grp")
    if "online" in out:
        on = out["online"]
        print(f"[online] the broker's PlannerLoop re-plans every step in both runs (no borrowing: "
              f"{on['plans_applied']} plans applied); with borrowing its rounds count and direct the lent slots")
        _print_runs(on["no_borrowing"], on["runs"], "online")
    for line in out["modelled_only"]:
        print(f"modelled-only: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
