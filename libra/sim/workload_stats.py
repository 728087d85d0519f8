"""Calibration statistics of a workload trace: the facts the generators are tuned to reproduce.

:func:`workload_stats` summarises any list of :class:`~libra.traces.TrajectorySpec` (generated or
recorded) into one JSON-able dict; :func:`format_stats` renders it as a two-column table. Pure
functions: no I/O, no randomness.

The facts (docs/papers.md §1.2, §5.1):

- long tail: the share of total decode work (Σ over turns of generated tokens × context, the
  rollout-time proxy ``TrajectorySpec.decode_work``) and of generated tokens taken by the top 10% of
  trajectories ranked by generated tokens;
- tool outcome → length: final length by total tool-returned tokens and by number of failed calls;
- drift: mean total length per step and a least-squares line over the step fraction;
- causality: cascade probabilities, correlations, the GRPO-group share of variance, and the
  routing-accuracy estimates of :mod:`libra.sim.workload_routing`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from libra.traces import TrajectorySpec
from libra.sim.workload_routing import routing_accuracy

__all__ = ["format_stats", "routing_accuracy", "workload_stats"]


def _top_share(rank_by: np.ndarray, values: np.ndarray, top: float = 0.1) -> float:
    """Share of Σ ``values`` held by the ``top`` fraction (at least one) of items ranked by ``rank_by``."""
    if len(values) == 0 or values.sum() <= 0:
        return 0.0
    k = max(1, round(len(values) * top))
    order = np.argsort(-rank_by, kind="stable")
    return float(values[order[:k]].sum() / values.sum())


def _corr(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return 0.0
    return float(np.corrcoef(x, y)[0, 1])


def _cascade(trajs: Sequence[TrajectorySpec]) -> dict[str, float]:
    """P(next call fails | this call failed) vs (| succeeded), and the mean remaining generated
    tokens after a failed vs a successful call (both over all tool returns but the last)."""
    counts = np.zeros((2, 2))  # [previous failed?][next failed?]
    remaining: dict[bool, list[int]] = {False: [], True: []}
    for traj in trajs:
        failed = [t.status != "success" for t in traj.tool_turns]
        for prev, nxt in pairwise(failed):
            counts[int(prev), int(nxt)] += 1
        for f, r in zip(failed, traj.remaining_gen_after_returns):
            remaining[f].append(r)
    rows = counts.sum(axis=1)
    return {
        "p_fail_after_failure": float(counts[1, 1] / rows[1]) if rows[1] else 0.0,
        "p_fail_after_success": float(counts[0, 1] / rows[0]) if rows[0] else 0.0,
        "remaining_after_failure_mean": float(np.mean(remaining[True])) if remaining[True] else 0.0,
        "remaining_after_success_mean": float(np.mean(remaining[False])) if remaining[False] else 0.0,
    }


def _drift(steps: list[int], means: list[float]) -> tuple[float, float, float]:
    """(fitted mean at the first step, fitted mean at the last step, R²) of a line over step fraction."""
    if len(steps) < 2:
        return means[0], means[0], 1.0
    frac = np.array([(s - steps[0]) / (steps[-1] - steps[0]) for s in steps])
    y = np.array(means)
    slope, intercept = np.polyfit(frac, y, 1)
    resid = float(((y - (intercept + slope * frac)) ** 2).sum())
    spread = float(((y - y.mean()) ** 2).sum())
    return float(intercept), float(intercept + slope), 1.0 - resid / spread if spread > 0 else 1.0


def workload_stats(
    trajs: Sequence[TrajectorySpec],
    *,
    bucket_thresholds: Sequence[int] = (4000, 12000, 30000),
    size_thresholds: tuple[int, int] = (1000, 12000),
    max_total: int = 40_960,
    routing: bool = True,
) -> dict[str, Any]:
    """Calibration facts of ``trajs`` as a JSON-able dict (see the module docstring).

    Lengths are tokens. Notable keys:

    - ``mean_total_by_step`` (over sorted steps) and ``drift_fit_start`` / ``drift_fit_end`` /
      ``drift_fit_r2``: a least-squares line of the per-step means over the step fraction;
    - ``top10_share_decode_work`` / ``top10_share_gen_tokens`` (whole trace) and their
      ``*_per_step_mean``;
    - ``tool_tokens_1k_*`` (500-1500 tool tokens), ``tool_tokens_12k_*`` (11K-14K), ``failures_4plus_*``
      and ``failures_8plus_*`` (>= 4 / >= 8 failed calls): ``_n``, ``_mean_total``, ``_p10_total``,
      ``_p90_total``, ``_frac_over_40k`` (None when empty); ``over_40k_min_failures``;
    - ``p_fail_after_failure`` / ``p_fail_after_success`` (the cascade) and
      ``remaining_after_failure_mean`` / ``remaining_after_success_mean``;
    - ``corr_prompt_total`` (Pearson of prompt tokens with generated tokens, each step's mean removed)
      and ``group_share_of_variance`` (between-group share of the within-step variance of log length);
    - ``routing_*``: :func:`routing_accuracy` with ``bucket_thresholds`` (left out when ``routing`` is
      false).

    Raises ValueError on an empty list.
    """
    if not trajs:
        raise ValueError("workload_stats needs at least one trajectory")
    steps = sorted({t.step for t in trajs})
    step_arr = np.array([t.step for t in trajs])
    total = np.array([t.total_tokens for t in trajs], dtype=float)
    gen = np.array([t.total_gen_tokens for t in trajs], dtype=float)
    payload = np.array([t.total_payload_tokens for t in trajs], dtype=float)
    prompt = np.array([t.prompt_tokens for t in trajs], dtype=float)
    work = np.array([t.decode_work for t in trajs], dtype=float)
    calls = np.array([t.num_tool_calls for t in trajs], dtype=float)
    fails = np.array([t.num_failures for t in trajs], dtype=float)

    mean_by_step = [float(total[step_arr == s].mean()) for s in steps]
    fit_start, fit_end, fit_r2 = _drift(steps, mean_by_step)

    # Remove the drift before correlating, and measure how much of the rest the GRPO group explains.
    centred_gen = gen.copy()
    centred_log = np.log(total)
    for s in steps:
        mask = step_arr == s
        centred_gen[mask] -= gen[mask].mean()
        centred_log[mask] -= centred_log[mask].mean()
    groups: dict[str, list[int]] = defaultdict(list)
    for idx, t in enumerate(trajs):
        groups[t.group].append(idx)
    between = sum(len(ix) * float(centred_log[ix].mean()) ** 2 for ix in groups.values())
    within = float((centred_log**2).sum())

    def summary(mask: np.ndarray, prefix: str) -> dict[str, Any]:
        n = int(mask.sum())
        sel = total[mask]
        return {
            f"{prefix}_n": n,
            f"{prefix}_mean_total": float(sel.mean()) if n else None,
            f"{prefix}_p10_total": float(np.percentile(sel, 10)) if n else None,
            f"{prefix}_p90_total": float(np.percentile(sel, 90)) if n else None,
            f"{prefix}_frac_over_40k": float((sel > 40_000).mean()) if n else None,
        }

    stats: dict[str, Any] = {
        "trajectories": len(trajs),
        "steps": len(steps),
        "groups": len(groups),
        "mean_total": float(total.mean()),
        "mean_gen": float(gen.mean()),
        "mean_payload": float(payload.mean()),
        "mean_prompt": float(prompt.mean()),
        "mean_tool_calls": float(calls.mean()),
        "failure_rate": float(fails.sum() / calls.sum()) if calls.sum() else 0.0,
        "p50_total": float(np.percentile(total, 50)),
        "p90_total": float(np.percentile(total, 90)),
        "p99_total": float(np.percentile(total, 99)),
        "max_total": float(total.max()),
        "frac_at_cap": float((total >= max_total).mean()),
        "mean_total_by_step": mean_by_step,
        "drift_fit_start": fit_start,
        "drift_fit_end": fit_end,
        "drift_fit_r2": fit_r2,
        "top10_share_decode_work": _top_share(gen, work),
        "top10_share_gen_tokens": _top_share(gen, gen),
        "top10_share_decode_work_per_step_mean": float(
            np.mean([_top_share(gen[step_arr == s], work[step_arr == s]) for s in steps])
        ),
        "top10_share_gen_tokens_per_step_mean": float(
            np.mean([_top_share(gen[step_arr == s], gen[step_arr == s]) for s in steps])
        ),
        **summary((payload >= 500) & (payload <= 1500), "tool_tokens_1k"),
        **summary((payload >= 11_000) & (payload <= 14_000), "tool_tokens_12k"),
        **summary(fails >= 4, "failures_4plus"),
        **summary(fails >= 8, "failures_8plus"),
        **summary(fails == 0, "failures_0"),
        "over_40k_min_failures": int(fails[total > 40_000].min()) if (total > 40_000).any() else None,
        **_cascade(trajs),
        "corr_prompt_total": _corr(prompt, centred_gen),
        "corr_failures_total": _corr(fails, centred_gen),
        "corr_payload_total": _corr(payload, centred_gen),
        "group_share_of_variance": between / within if within > 0 else 0.0,
    }
    if routing:
        for key, value in routing_accuracy(trajs, bucket_thresholds, size_thresholds).items():
            stats[f"routing_{key}"] = value
    return stats


def format_stats(stats: dict[str, Any]) -> str:
    """``stats`` as a two-column text table (lists compact, floats to 3 significant digits)."""
    width = max(len(k) for k in stats)
    lines = []
    for key, value in stats.items():
        if isinstance(value, list):
            text = "[" + ", ".join(f"{v:.0f}" if isinstance(v, float) else str(v) for v in value) + "]"
        elif isinstance(value, float):
            text = f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        else:
            text = str(value)
        lines.append(f"{key:<{width}}  {text}")
    return "\n".join(lines)
