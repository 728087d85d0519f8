"""Benchmark: Global Resource Planner search time with vs without rollout-DP memoisation.

What it runs (all in one process, same inputs): for each cluster size (default 16, 48, 128, 512 GPUs)
the GRP search on a 1,024-request long-tailed sample (R2E-like lognormal lengths capped at 40,960
tokens, A800 + Qwen3-14B profiles), once with the rollout DP memoised across the ``n_train`` loop
and once re-solving it per candidate (the baseline). It reports the best-of-``--repeat`` wall time of
each, their ratio, both plans' objectives (they must be equal: memoisation is exact), and the cost
models' calibration targets next to the model's values.

``--reference`` also times, in the same run, the search on the dense pooled-bucket DP the planner used
before issue #27 (a ``(budget - w) x (n + 1) x (n + 1)`` candidate array for every TP and instance
count; :class:`DenseBucketTable` below), prints the ratio and whether both searches return the same
plan (layout and objective; the fast table is bit-identical, ``tests/unit/test_planner_buckets_fast.py``).

``python -m libra.bench planner [--gpus 16,48,128,512] [--repeat 3] [--reference] [--json]``; with ``--json`` it
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
from libra.policies.planner.buckets import BucketTable, next_state

__all__ = ["DenseBucketTable", "build_parser", "long_tail_workload", "main", "run"]


class DenseBucketTable(BucketTable):
    """The pooled-bucket DP as computed before issue #27, for ``--reference``: for every TP, instance
    count ``k`` and state, the full ``(budget - w) x (n + 1) x (n + 1)`` candidate array."""

    def _solve(self) -> np.ndarray:
        S, G1, n1 = self.n_h * self.n_c, self.budget + 1, self.n + 1
        dp = np.full((S, G1, n1), np.inf)
        dp[0, :, 0] = 0.0
        for tp in self.tps:
            new = dp.copy()
            chs = [np.zeros((S, G1, n1), np.int32) for _ in range(3)]
            for k in range(1, self.budget // tp + 1):
                if self.cap is not None and k > self.cap:
                    break
                w, c = k * tp, self.costs.cost(tp, k)
                for s in range(S):
                    t = next_state(s, k, self.n_c, self.het, self.cap)
                    prev = dp[s, : G1 - w]
                    if t < 0 or not np.isfinite(prev).any():
                        continue
                    cand = np.maximum(prev[:, :, None], c[None, :, :])
                    arg = cand.argmin(axis=1)
                    val = np.take_along_axis(cand, arg[:, None, :], axis=1)[:, 0, :]
                    upd = val < new[t, w:]
                    new[t, w:][upd] = val[upd]
                    for ch, v in zip(chs, (np.full_like(arg, k), arg, np.full_like(arg, s))):
                        ch[t, w:][upd] = v[upd]
            self._layers.append((dp, *chs))
            dp = new
        return dp


class _ReferencePlanner(GlobalResourcePlanner):
    bucket_table = DenseBucketTable

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
    p.add_argument("--reference", action="store_true",
                   help="also time the search on the dense (pre-#27) bucket DP, same run, and compare the plans")
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
        ref: dict[str, Any] = {}
        if args.reference:
            t_ref, r_ref = _time_search(_ReferencePlanner(rollout, train, cfg, memoize=True), workload, args.repeat)
            ref = {"dense_s": t_ref, "dense_ratio": t_ref / t_memo,
                   "same_plan_as_dense": p_memo.layout_key() == r_ref.plan.layout_key()
                   and p_memo.objective == r_ref.plan.objective}
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
                **ref,
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
    if any("dense_s" in r for r in result["rows"]):
        print("\nmemoised search on the fast bucket DP vs the dense (pre-#27) bucket DP, same run:")
        for r in result["rows"]:
            same = "same plan" if r["same_plan_as_dense"] else "DIFFERENT PLAN"
            print(f"  {r['gpus']:>4} GPUs: dense {r['dense_s']:.3f} s -> fast {r['memo_s']:.3f} s "
                  f"({r['dense_ratio']:.1f}x), {same}")
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
