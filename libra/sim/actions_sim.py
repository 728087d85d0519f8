"""Discrete-event simulator of action-level resource scheduling (ARL-Tangram, docs/papers.md §5.2).

Two models (``SimConfig.model``, ``--model``): ``broker`` (the command line's default) sends every action
through the real broker core, whose own placement decides where and with how many cores it runs
(:class:`~libra.sim.actions_broker.BrokerActionSim`); ``policy`` runs the scheduling policy alone over a
modelled pool (:class:`~libra.sim.actions_engine.ActionSim`, whose module describes the resource model and the
metrics), which also models mechanisms the broker lacks (API quotas, GPU memory co-residency, static
per-service deployments): its output is labelled ``model: policy`` with a ``modelled-only`` line, and a
broker run lists what it does not model the way the policy model does.

Entry points: :func:`run_sim` runs one simulation and returns its metrics; :func:`min_gpu_pool`
searches the smallest pooled GPU count within a ratio of the static baseline's mean ACT. The run's
configuration, :class:`~libra.sim.action_workloads.SimConfig`, sits with the workloads.

CLI: ``python -m libra.sim.actions_sim --workload coding|mopd|deepsearch --batch N [--model broker|policy]
--scheduler tangram|per_trajectory|fixed_dop --seed S [--gpu-mem-gb GB (0: exclusive cells)] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from libra.sim.action_workloads import MODELS, SCHEDULERS, SimConfig, SimError, make_workload
from libra.sim.actions_broker import BrokerActionSim
from libra.sim.actions_engine import ActionSim

__all__ = ["SimConfig", "SimError", "main", "min_gpu_pool", "run_sim"]


def run_sim(cfg: SimConfig) -> dict[str, Any]:
    """Run one simulation and return its metrics (see the module docstring). Raises :class:`SimError`."""
    if cfg.model == "broker":
        return BrokerActionSim(cfg).run()
    cfg.validate()
    out = {"model": "policy", **ActionSim(cfg).run()}
    out["modelled_only"] = [POLICY_MODEL]
    return out


#: The line a policy-level run carries: its figures are the policy's, not the broker's placement.
POLICY_MODEL = ("model policy: the scheduling policy over a modelled pool (per-node cores with NUMA domains, API "
                "quotas, GPU memory co-residency, static deployments); not the broker's placement (--model broker)")


def min_gpu_pool(
    cfg: SimConfig, *, ratio: float = 1.25, candidates: Sequence[int] | None = None
) -> dict[str, Any]:
    """Smallest pooled GPU count whose ``tangram`` mean ACT is ≤ ``ratio`` × the static baseline's.

    Runs ``cfg`` with ``per_trajectory`` (static deployments: a baseline, always the policy-level model, as the
    broker has no static deployments) once, then ``tangram`` (in ``cfg.model``) on each candidate pool
    in increasing order (default: multiples of the largest service size up to the baseline's GPUs; pools in
    between cannot host one more replica). Returns the baseline, the chosen run (``None`` if none
    qualifies) and every tried pool.
    """
    base = run_sim(replace(cfg, scheduler="per_trajectory", model="policy"))  # the static baseline, as modelled
    limit = base["gpus_used"]
    if candidates is None:
        services = make_workload(cfg.workload, 1, cfg.seed, **cfg.workload_params).services
        step = max((s.gpus for s in services), default=1)
        candidates = range(step, limit + 1, step)
    cands = list(candidates)
    tried = []
    chosen = None
    for g in cands:
        res = run_sim(replace(cfg, scheduler="tangram", gpu_pool=g))
        tried.append({"gpus": g, "act_mean_s": res["act_mean_s"], "ratio": res["act_mean_s"] / base["act_mean_s"]})
        if res["act_mean_s"] <= ratio * base["act_mean_s"]:
            chosen = res
            break
    return {"baseline": base, "tangram": chosen, "tried": tried, "ratio_limit": ratio}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.sim.actions_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("coding", "mopd", "deepsearch"), default="coding")
    p.add_argument("--batch", type=int, default=1280, help="concurrent trajectories per step")
    p.add_argument("--scheduler", choices=SCHEDULERS, default="tangram")
    p.add_argument("--model", choices=MODELS, default="broker",
                   help="broker (default): every action through the broker core and its placement; policy: the "
                        "policy alone over a modelled pool (models mechanisms the broker lacks: labelled so)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1, help="synchronous RL steps to simulate")
    p.add_argument("--dop", type=int, default=4, help="fixed_dop: units per elastic action")
    p.add_argument("--sandbox-cores", default="peak",
                   help="per_trajectory: cores per sandbox: 'peak' (largest DoP of the workload, default), 'even' (budget // batch) or N")
    p.add_argument("--gpu-pool", type=int, default=40, help="GPUs: the pool (tangram, fixed_dop) or the budget split over static deployments (per_trajectory)")
    p.add_argument("--gpu-mem-gb", type=float, default=80.0,
                   help="pooled GPUs: memory per GPU (GB) for the co-residency model; 0 = one replica per cell (exclusive)")
    p.add_argument("--gpu-workspace-gb", type=float, default=8.0,
                   help="pooled GPUs, memory model: GB per GPU kept for the executing call's activations")
    p.add_argument("--static-replicas", type=int, default=None, help="per_trajectory: replicas per GPU service (default: gpu-pool split evenly, at least 1)")
    p.add_argument("--cpu-nodes", type=int, default=15)
    p.add_argument("--cores-per-node", type=int, default=256)
    p.add_argument("--window", type=int, default=None, help="tangram: candidate window n")
    p.add_argument("--depth", type=int, default=None, help="tangram: eviction depth bound")
    p.add_argument("--min-gpu-pool", action="store_true", help="search the smallest tangram GPU pool within --ratio of the static baseline's mean ACT")
    p.add_argument("--ratio", type=float, default=1.25)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints a table or (``--json``) one JSON object. Returns the exit status."""
    args = _parser().parse_args(argv)
    if args.sandbox_cores not in ("peak", "even"):
        try:
            args.sandbox_cores = int(args.sandbox_cores)
        except ValueError:
            print(f"error: --sandbox-cores must be peak, even or an integer, got {args.sandbox_cores!r}", file=sys.stderr)
            return 2
    sp: dict[str, Any] = {}
    if args.scheduler == "tangram":
        if args.window is not None:
            sp["window"] = args.window
        if args.depth is not None:
            sp["depth"] = args.depth
    cfg = SimConfig(
        workload=args.workload, batch=args.batch, scheduler=args.scheduler, seed=args.seed, steps=args.steps,
        dop=args.dop, sandbox_cores=args.sandbox_cores, gpu_pool=args.gpu_pool, cpu_nodes=args.cpu_nodes,
        cores_per_node=args.cores_per_node, static_replicas=args.static_replicas, scheduler_params=sp,
        gpu_mem_gb=args.gpu_mem_gb or None, gpu_workspace_gb=args.gpu_workspace_gb, model=args.model,
    )
    try:
        res = min_gpu_pool(cfg, ratio=args.ratio) if args.min_gpu_pool else run_sim(cfg)
    except (SimError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, sort_keys=True))
        return 0
    if args.min_gpu_pool:
        b, t = res["baseline"], res["tangram"]
        print(f"static baseline: {b['gpus_used']} GPUs, mean ACT {b['act_mean_s']:.3f} s")
        for row in res["tried"]:
            print(f"  tangram {row['gpus']:3d} GPUs: mean ACT {row['act_mean_s']:.3f} s ({row['ratio']:.2f}x baseline)")
        if t is None:
            print(f"no pool within {args.ratio}x")
        else:
            print(f"smallest pool: {t['gpus_used']} GPUs = {t['gpus_used'] / b['gpus_used']:.1%} of the baseline")
        return 0
    for k, v in res.items():
        if k == "modelled_only":
            continue
        if isinstance(v, dict):
            v = ", ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in v.items())
        elif isinstance(v, float):
            v = f"{v:.4g}"
        print(f"{k:<22} {v}")
    for line in res.get("modelled_only", []):
        print(f"modelled-only: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
