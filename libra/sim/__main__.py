"""``python -m libra.sim``: run the discrete-event simulator on a generated workload or a trace file.

``python -m libra.sim --workload r2e|search_r1|dapo_math | --trace FILE --gpus 48 --steps N --router NAME
--allocation NAME --seed S [--per-step] [--json]`` prints tokens/s, trajectories/s, step time (mean, p50, p99), rollout
and training time, GPU idle fraction, routing accuracy and migrated-token ratio (``--json``: one object, see
:mod:`libra.sim.metrics`). Action workloads (``--workload coding|mopd|deepsearch``) are delegated to
:func:`libra.sim.actions_sim.main` with ``--steps``, ``--seed``, ``--json`` and any options it accepts.
Allocations: static ``static_uniform``, ``hetero``, ``colocated``; planner-driven (initial plan from the
first steps, online re-planning, transitions charged in virtual time; :mod:`libra.sim.planner`)
``grp_homogeneous``, ``grp``, ``grp_ehp`` (+ Elastic Hybrid Pool), ``static_best``, ``greedy``; these add a
``planner`` object (plans applied, decisions, switches, seconds charged) to ``--json``.
Exit status 2 on bad arguments or an unreadable trace.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence

from libra.sim.engine import SIM_ROUTERS, SimConfig, Simulator
from libra.sim.cluster import ALLOCATIONS, PLANNER_ALLOCATIONS, SimConfigError
from libra.sim.config import default_prompts
from libra.traces import TraceError, read_trace
from libra.sim.workload_profiles import PROFILES, get_profile
from libra.sim.workloads import generate

ACTION_WORKLOADS = ("coding", "mopd", "deepsearch")


def build_parser(prog: str = "python -m libra.sim") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog=prog, description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload", choices=sorted(PROFILES) + list(ACTION_WORKLOADS), help="generated workload")
    src.add_argument("--trace", help="replay a JSON Lines trace (docs/trace-format.md format)")
    p.add_argument("--profile", default="r2e", choices=sorted(PROFILES),
                   help="with --trace: the workload whose bucket and tool-size thresholds to use (default r2e)")
    p.add_argument("--gpus", type=int, default=48, help="GPUs in the cluster (default 48)")
    p.add_argument("--steps", type=int, default=20, help="RL steps (default 20; with --trace: at most this many)")
    p.add_argument("--prompts", type=int, default=None, help="GRPO groups per step (default gpus/16: ~346K tokens per step on r2e)")
    p.add_argument("--group-size", type=int, default=16, help="samples per prompt (default 16)")
    p.add_argument("--router", default="cmlfq", choices=SIM_ROUTERS,
                   help="rollout router that places generate turns on instances (default cmlfq: Libra's C-MLFQ; "
                        "cmlfq_cost: its distribution- and cost-based variant; baselines: round_robin, "
                        "least_loaded, length_aware (by input length), la_mlfq (length-threshold MLFQ), predictor "
                        "(a learned length guess), oracle (the true length), noisy_predictor (a noisy guess); "
                        "libra/policies/routing)")
    p.add_argument("--allocation", default="hetero", choices=ALLOCATIONS,
                   help="static: static_uniform, hetero, colocated; planner-driven: grp_homogeneous, grp, "
                        "grp_ehp (GRP + Elastic Hybrid Pool), static_best, greedy (default hetero)")
    p.add_argument("--plan-search", default="fixed", choices=("fixed", "measured"),
                   help="planner allocations: charge each planner search a fixed time (reproducible) or its "
                        "measured wall time (default fixed)")
    p.add_argument("--plan-search-s", type=float, default=2.0,
                   help="planner allocations: the fixed search charge in virtual seconds (default 2.0)")
    p.add_argument("--plan-interval", type=int, default=5,
                   help="planner allocations: re-plan every N steps besides the pressure triggers (default 5)")
    p.add_argument("--lag", type=int, default=2, help="--batching barrier: rollout of step s+lag waits for training "
                                                       "of step s (1 = synchronous; default 2); also the planner's "
                                                       "overlap steps")
    p.add_argument("--batching", default="streaming", choices=("streaming", "barrier"),
                   help="streaming: groups start under the staleness budget and each step trains the first complete "
                        "groups (docs/papers.md §1.7; default); barrier: each step waits for all of its own trajectories")
    p.add_argument("--eta", type=int, default=2, help="streaming: max head off-policyness (default 2)")
    p.add_argument("--max-concurrent", type=int, default=None,
                   help="streaming: running GRPO groups at most this (default 2 x groups per step)")
    p.add_argument("--predictor-noise", type=float, default=2.0,
                   help="noisy_predictor: sigma of the log-normal error of its T=0 length guess (default 2.0: about 65%% bucket accuracy)")
    p.add_argument("--cap-metric", default="load", choices=("queued", "load"),
                   help="router's per-instance room test: queued turns, or active + queued (default load: Libra's rule, active + queued < cap, as in `python -m libra.bench routing`)")
    p.add_argument("--max-queue-length", type=int, default=3, help="router's per-instance cap (default 3)")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed of the generated workload and the simulator (default 0): the same seed "
                        "gives the same result")
    p.add_argument("--per-step", action="store_true",
                   help="also report each step: mean trajectory length, rollout and training seconds and their "
                        "ratio (which stage is the bottleneck as lengths drift)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _delegate(args: argparse.Namespace, extra: list[str]) -> int:
    from libra.sim import actions_sim

    argv = ["--workload", args.workload, "--steps", str(args.steps), "--seed", str(args.seed), *extra]
    if args.json:
        argv.append("--json")
    return int(actions_sim.main(argv) or 0)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``prog``: how the usage line names the command (``libra sim`` when run through ``libra``)."""
    p = build_parser(*([prog] if prog else []))
    args, extra = p.parse_known_args(argv)
    if args.workload in ACTION_WORKLOADS:
        return _delegate(args, extra)
    if extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.steps < 1 or args.group_size < 1:
        p.error("--steps and --group-size must be >= 1")
    prof = get_profile(args.workload or args.profile)
    try:
        if args.trace:
            trajs = read_trace(args.trace)
            keep = sorted({t.step for t in trajs})[: args.steps]
            trajs = [t for t in trajs if t.step in set(keep)]
        else:
            prompts = args.prompts if args.prompts is not None else default_prompts(args.gpus)
            trajs = generate(args.workload, args.steps, prompts, args.group_size, args.seed)
        cfg = SimConfig(router=args.router, allocation=args.allocation, gpus=args.gpus, lag=args.lag, seed=args.seed,
                        bucket_thresholds=prof.bucket_thresholds, size_thresholds=prof.size_thresholds,
                        predictor_noise=args.predictor_noise, batching=args.batching, eta=args.eta,
                        max_concurrent=args.max_concurrent,
                        router_params={"cap_metric": args.cap_metric, "max_queue_length": args.max_queue_length},
                        allocation_params=({"search": args.plan_search, "search_s": args.plan_search_s,
                                            "plan_interval": args.plan_interval}
                                           if args.allocation in PLANNER_ALLOCATIONS else {}))
        t0 = time.perf_counter()
        sim = Simulator(trajs, cfg)
        res = sim.run()
        wall = time.perf_counter() - t0
    except (OSError, TraceError, SimConfigError, ValueError) as exc:
        print(f"libra.sim: {exc}", file=sys.stderr)
        return 2
    out = res.to_dict()
    if args.per_step:
        out["per_step"] = per_step(sim)
    report = sim.alloc.report() if sim.alloc is not None else None
    if report is not None:
        out["planner"] = report
    if args.json:
        print(json.dumps(out))
        return 0
    st = res.step_time_s
    rows = [
        ("workload", args.trace or args.workload), ("router / allocation", f"{res.router} / {res.allocation}"),
        ("GPUs (rollout + train)", f"{res.gpus} ({res.rollout_gpus} + {res.train_gpus})"),
        ("steps / trajectories", f"{res.steps} / {res.trajectories}"),
        ("tokens/s", f"{res.tokens_per_s:.1f}"), ("trajectories/s", f"{res.trajectories_per_s:.4f}"),
        ("step time s (mean/p50/p99)", f"{st['mean']:.1f} / {st['p50']:.1f} / {st['p99']:.1f}"),
        ("rollout time s (mean/step)", f"{res.rollout_time_s:.1f}"), ("train time s (mean/step)", f"{res.train_time_s:.1f}"),
        ("GPU idle fraction", f"{res.gpu_idle_fraction:.3f}"),
        ("batching / staleness", f"{res.batching} / mean {res.staleness['mean']:.2f}, max {res.staleness['max']:.0f}"),
        ("routing accuracy", f"{res.routing_accuracy:.3f} ({res.routing_decisions} decisions)"),
        ("migrated-token ratio", (f"{res.migrated_token_ratio:.3f} ({res.migrations} moves: {res.kv_migrations} kv, "
                                  f"{res.reprefill_migrations} re-prefill)")),
        ("simulated / wall", f"{res.makespan_s:.0f} s virtual in {wall:.1f} s"),
    ]
    if report is not None:
        fp = report["final_plan"]
        rows += [("plans applied / switches", f"{report['plans_applied']} / {sum(report['switches'].values())}"),
                 ("final plan", f"train {fp['n_train']} GPUs {fp['train']}, rollout TP {fp['rollout_tps']}"),
                 ("charged s (switch / search)", f"{report['transition_s']:.1f} / {report['search_s']:.1f}"),
                 ("planner", f"{report['runtime']}, {report['loop_rounds']} rounds")]
    for k, v in rows:
        print(f"{k:<28} {v}")
    for line in (report or {}).get("modelled_only", []):
        print(f"modelled-only: {line}")
    if args.per_step:
        print(f"\n{'step':>4} {'trajs':>6} {'mean len':>9} {'rollout s':>10} {'train s':>8} {'roll/train':>10}")
        for r in out["per_step"]:
            print(f"{r['step']:>4} {r['trajectories']:>6} {r['mean_tokens']:>9.0f} {r['rollout_s']:>10.1f}"
                  f" {r['train_s']:>8.1f} {r['rollout_over_train']:>10.2f}")
    return 0


def per_step(sim: Simulator) -> list[dict[str, float]]:
    """Per RL step: trajectories, their mean total tokens, rollout seconds (release to last end), training
    seconds and rollout / training, and the maximum staleness of what the step trained."""
    rows = []
    stale = sim.former.step_staleness()
    for k, trajs in enumerate(sim.by_step):
        roll = sim.rollout_end[k] - sim.rollout_start[k]
        train = sim.train_end[k] - sim.train_start[k]
        rows.append({"step": k, "trajectories": len(trajs),
                     "mean_tokens": sum(t.total_tokens for t in trajs) / max(1, len(trajs)),
                     "rollout_s": roll, "train_s": train, "rollout_over_train": roll / train if train > 0 else math.inf,
                     "staleness_max": stale[k]["max"] if k < len(stale) else math.nan})
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
