"""``python -m libra plan --trace FILE --gpus N``: what the Global Resource Planner would deploy for a logged
workload, without a broker.

It reads trajectories in the trace format (``docs/trace-format.md``; ``python -m libra.sim.workloads``
writes them), takes the last ``--steps`` RL steps found there (default 1; all with ``--steps 0``) as the
planner's history, exactly as the broker's planner records finished trajectories (prompt and tool-payload
tokens, generated tokens, generate turns, tool seconds), and prints the plan of ``--allocation`` on ``--gpus``
GPUs: the training layout, the rollout instances with the length range each serves, the predicted
training and rollout seconds per step, and the objective. ``--compare`` adds the other allocators' plans on
the same history. The profiles are the cost model's (``libra/policies/cost/data``).

Exits 0 on success, 1 when the trace cannot be read or holds no trajectory, 2 on bad arguments or a plan
the planner cannot make (the message says why).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

__all__ = ["add_parser", "plan_trace"]


def plan_trace(trajs: list[Any], *, allocation: str, gpus: int, hardware: str, model: str, group_size: int,
               steps: int, overlap_steps: int, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The plan of ``allocation`` for the last ``steps`` steps of ``trajs`` (a JSON-ready dict). Raises
    ``ValueError`` (``PlannerError``, ``ProfileError``) for a plan that cannot be made."""
    from libra.policies.cost import RolloutCostModel, TrainingCostModel, load_hardware, load_model
    from libra.policies.planner.allocators import PlannerConfig, make_allocator
    from libra.traces import workload_of

    step_ids = sorted({t.step for t in trajs})
    keep = set(step_ids[-steps:]) if steps > 0 else set(step_ids)
    chosen = [t for t in trajs if t.step in keep]
    batch = max(group_size, len(chosen) // len(keep) // group_size * group_size)
    hw, mdl = load_hardware(hardware), load_model(model)
    cfg = PlannerConfig(n_gpus=gpus, global_batch=batch, group_size=group_size, overlap_steps=overlap_steps)
    alloc = make_allocator(allocation, rollout_model=RolloutCostModel(hw, mdl), train_model=TrainingCostModel(hw, mdl),
                           config=cfg, **(params or {}))
    plan = alloc.propose(workload_of(chosen))
    t = plan.train
    return {
        "allocation": allocation, "gpus": gpus, "hardware": hardware, "model": model,
        "trajectories": len(chosen), "steps": sorted(keep), "batch": batch,
        "n_train": plan.n_train,
        "train": None if t is None else {"tp": t.tp, "pp": t.pp, "dp": t.dp, "micro_batch": t.micro_batch},
        "rollout": [{"tp": i.tp, "min_len": _r(i.min_tokens), "max_len": _r(i.max_tokens),
                     "requests": round(i.n_requests, 1)} for i in plan.rollout],
        "t_train_s": plan.t_train, "t_rollout_s": plan.t_rollout, "objective_s": plan.objective,
    }


def _r(x: float) -> float | int:
    return round(x) if math.isfinite(x) else x


def _row(p: dict[str, Any]) -> str:
    t = p["train"]
    train = "none" if t is None else f"{p['n_train']} GPUs tp{t['tp']}/pp{t['pp']}/dp{t['dp']}/mb{t['micro_batch']}"
    tps: dict[int, int] = {}
    for i in p["rollout"]:
        tps[i["tp"]] = tps.get(i["tp"], 0) + 1
    roll = " + ".join(f"{n}xTP{tp}" for tp, n in sorted(tps.items())) or "none"
    return (f"{p['allocation']:<16} train {train:<26} rollout {roll:<24} train {p['t_train_s']:8.1f} s  "
            f"rollout {p['t_rollout_s']:8.1f} s  objective {p['objective_s']:8.1f} s")


def _plan(args: argparse.Namespace) -> int:
    from libra.policies.planner.allocators import ALLOCATORS
    from libra.traces import TraceError, read_trace

    try:
        trajs = read_trace(args.trace)
    except (OSError, TraceError) as exc:
        print(f"libra plan: cannot read trace {args.trace}: {exc}", file=sys.stderr)
        return 1
    if not trajs:
        print(f"libra plan: {args.trace} holds no trajectory", file=sys.stderr)
        return 1
    names = [args.allocation] + ([a for a in ALLOCATORS if a != args.allocation] if args.compare else [])
    plans = []
    for name in names:
        try:
            plans.append(plan_trace(trajs, allocation=name, gpus=args.gpus, hardware=args.hardware, model=args.model,
                                    group_size=args.group_size, steps=args.steps, overlap_steps=args.lag))
        except ValueError as exc:  # PlannerError, ProfileError, a bad allocator knob
            if name == args.allocation:
                print(f"libra plan: {exc}", file=sys.stderr)
                return 2
            plans.append({"allocation": name, "error": str(exc)})
    if args.json:
        from libra.strict_json import finite

        print(json.dumps(finite(plans[0] if not args.compare else plans)))  # strict JSON: inf -> null
        return 0
    p = plans[0]
    print(f"{args.trace}: {p['trajectories']} trajectories of step(s) {p['steps']}, batch {p['batch']}, "
          f"{args.gpus} GPUs, {args.hardware} + {args.model}, policy lag {args.lag}")
    print(_row(p))
    groups: list[list[Any]] = []  # identical instances (a pooled bucket) on one line
    for i in p["rollout"]:
        key = (i["tp"], i["min_len"], i["max_len"], i["requests"])
        if groups and groups[-1][0] == key:
            groups[-1][1] += 1
        else:
            groups.append([key, 1])
    for (tp, lo, hi, req), n in groups:
        print(f"  {n} x TP{tp}: requests of {lo}-{hi} tokens, {req} per instance per step")
    for q in plans[1:]:
        print(_row(q) if "error" not in q else f"{q['allocation']:<16} cannot plan: {q['error']}")
    return 0


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def add_parser(sub: Any) -> None:
    """Register ``plan`` on the ``python -m libra`` subparsers."""
    from libra.policies.planner.allocators import ALLOCATORS

    intro = " ".join(__doc__.split("\n\n")[0].split()).split(": ", 1)[1]  # the first paragraph, whole
    p = sub.add_parser("plan", help="what the Global Resource Planner would deploy for a logged workload",
                       description=intro[0].upper() + intro[1:], epilog=" ".join(__doc__.split("\n\n")[-1].split()))
    p.add_argument("--trace", required=True, help="trajectories in the trace format (JSON Lines)")
    p.add_argument("--gpus", type=_positive, required=True, help="GPUs in the cluster")
    p.add_argument("--allocation", default="grp", choices=ALLOCATORS, help="allocator (default %(default)s)")
    p.add_argument("--hardware", default="a800", help="hardware profile (default %(default)s)")
    p.add_argument("--model", default="qwen3-14b", help="model profile (default %(default)s)")
    p.add_argument("--group-size", type=_positive, default=16, help="GRPO group size (default %(default)s)")
    p.add_argument("--steps", type=int, default=1,
                   help="plan over the last N RL steps of the trace (0: all; default %(default)s)")
    p.add_argument("--lag", type=_positive, default=1,
                   help="policy lag: steps whose rollouts may overlap (default %(default)s: synchronous)")
    p.add_argument("--compare", action="store_true", help="also show every other allocator's plan")
    p.add_argument("--json", action="store_true", help="print the plan (with --compare: every plan) as JSON")
    p.set_defaults(fn=_plan)
