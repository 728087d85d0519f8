"""Benchmark: Global Resource Planner search time with vs without rollout-DP memoisation.

What it runs (all in one process, same inputs): for each cluster size (default 16, 48, 128, 512 GPUs)
the GRP search on a 1,024-request long-tailed sample (R2E-like lognormal lengths capped at 40,960
tokens, A800 + Qwen3-14B profiles), once with the rollout DP memoised across the ``n_train`` loop
and once re-solving it per candidate (the baseline). It reports the best-of-``--repeat`` wall time of
each, their ratio, both plans' objectives (they must be equal: memoisation is exact), and the cost
models' calibration targets next to the model's values.

``python -m libra.bench planner [--gpus 16,48,128,512] [--repeat 3] [--json]``; with ``--json`` it
prints one JSON object. The paper reports 12.3 s -> 1.9 s at 128 GPUs; the target here is <= 0.2 s
memoised at 128 GPUs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from libra.policies.cost import (
    RolloutCostModel,
    TrainingCostModel,
    calibration_report,
    load_hardware,
    load_model,
    training_time_ratio,
)
from libra.policies.planner.allocators import GlobalResourcePlanner, PlannerConfig, Workload

__all__ = ["build_parser", "long_tail_workload", "main", "run"]

MAX_TOKENS = 40960


def long_tail_workload(n: int = 1024, median: float = 6000.0, sigma: float = 1.0, seed: int = 0) -> Workload:
    """An R2E-like sample: lognormal total lengths capped at 40,960, prompts of 0.5-2K tokens."""
    rng = np.random.default_rng(seed)
    total = np.minimum(rng.lognormal(np.log(median), sigma, n), MAX_TOKENS)
    prompt = np.minimum(rng.uniform(500, 2048, n), total * 0.5)
    gen = np.maximum(total - prompt, 1.0)
    return Workload.from_pairs(zip(prompt.round(), gen.round()))


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of this benchmark."""
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench planner", description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="16,48,128,512", help="comma-separated cluster sizes (default: %(default)s)")
    p.add_argument("--requests", type=int, default=1024, help="requests in the sample (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1024, help="GRPO global batch (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="best-of repeats per timing (default: %(default)s)")
    p.add_argument("--hardware", default="a800")
    p.add_argument("--model", default="qwen3-14b")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def _time_search(planner: GlobalResourcePlanner, workload: Workload, repeat: int) -> tuple[float, Any]:
    planner.search_detailed(workload)  # warm-up, untimed
    best, result = float("inf"), None
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        result = planner.search_detailed(workload)
        best = min(best, time.perf_counter() - t0)
    return best, result


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns ``{"rows": [...], "calibration": {...}, ...}``."""
    hw, model = load_hardware(args.hardware), load_model(args.model)
    rollout, train = RolloutCostModel(hw, model), TrainingCostModel(hw, model)
    workload = long_tail_workload(args.requests, seed=args.seed)
    rows = []
    for n_gpus in [int(x) for x in str(args.gpus).split(",") if x.strip()]:
        cfg = PlannerConfig(n_gpus=n_gpus, global_batch=args.batch, group_size=16)
        t_memo, r_memo = _time_search(GlobalResourcePlanner(rollout, train, cfg, memoize=True), workload, args.repeat)
        t_base, r_base = _time_search(GlobalResourcePlanner(rollout, train, cfg, memoize=False), workload, args.repeat)
        p_memo, p_base = r_memo.plan, r_base.plan
        rows.append(
            {
                "gpus": n_gpus,
                "memo_s": t_memo,
                "no_memo_s": t_base,
                "speedup": t_base / t_memo,
                "objective_memo_s": p_memo.objective,
                "objective_no_memo_s": p_base.objective,
                "same_plan": p_memo.layout_key() == p_base.layout_key(),
                "n_train": p_memo.n_train,
                "train": f"tp{p_memo.train.tp}/pp{p_memo.train.pp}/dp{p_memo.train.dp}/mb{p_memo.train.micro_batch}"
                if p_memo.train
                else None,
                "rollout_tps": list(p_memo.rollout_tps),
                "rollout_layout": " + ".join(
                    f"{p_memo.rollout_tps.count(t)}xTP{t}" for t in sorted(set(p_memo.rollout_tps))
                ),
                "dp_solves_memo": r_memo.stats.rollout_dp_solves,
                "dp_solves_no_memo": r_base.stats.rollout_dp_solves,
                "train_leaves": r_memo.stats.train_leaves,
            }
        )
    cal = calibration_report(rollout)
    cal["training_time_ratio_1k_32k"] = {"target": 3.9, "model": training_time_ratio(hw, model)}
    cal["training_time_ratio_1k_32k"]["ratio"] = cal["training_time_ratio_1k_32k"]["model"] / 3.9
    return {
        "benchmark": "planner",
        "hardware": hw.name,
        "model": model.name,
        "requests": args.requests,
        "global_batch": args.batch,
        "repeat": args.repeat,
        "rows": rows,
        "calibration": cal,
        "paper_128_gpus_s": {"no_memo": 12.3, "memo": 1.9},
    }


def _print_table(result: dict[str, Any]) -> None:
    print(
        f"GRP search, {result['requests']} long-tailed requests, batch {result['global_batch']}, "
        f"{result['hardware']} + {result['model']} (best of {result['repeat']})"
    )
    head = f"{'GPUs':>5} {'memo s':>9} {'no-memo s':>10} {'ratio':>7} {'obj memo':>10} {'obj no-memo':>12}  plan"
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        plan = f"train {r['n_train']} ({r['train']}), rollout {r['rollout_layout']}"
        print(
            f"{r['gpus']:>5} {r['memo_s']:>9.3f} {r['no_memo_s']:>10.3f} {r['speedup']:>6.1f}x "
            f"{r['objective_memo_s']:>10.1f} {r['objective_no_memo_s']:>12.1f}  {plan}"
        )
    print("\ncost-model calibration (target vs model):")
    for key, v in result["calibration"].items():
        print(f"  {key:<28} target {v['target']:>8.1f}  model {v['model']:>8.1f}  ({v['ratio']:.2f}x)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv``, run, print a table (or one JSON object with ``--json``)."""
    args = build_parser().parse_args(argv)
    result = run(args)
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        _print_table(result)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
