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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Columns:
    """The per-trajectory numbers of a trace as arrays (lengths in tokens), and its sorted steps."""

    step: np.ndarray
    total: np.ndarray
    gen: np.ndarray
    payload: np.ndarray
    prompt: np.ndarray
    work: np.ndarray
    calls: np.ndarray
    fails: np.ndarray
    steps: list[int]


def _columns(trajs: Sequence[TrajectorySpec]) -> _Columns:
    def col(attr: str) -> np.ndarray:
        return np.array([getattr(t, attr) for t in trajs], dtype=float)

    return _Columns(step=np.array([t.step for t in trajs]), total=col("total_tokens"), gen=col("total_gen_tokens"),
                    payload=col("total_payload_tokens"), prompt=col("prompt_tokens"), work=col("decode_work"),
                    calls=col("num_tool_calls"), fails=col("num_failures"), steps=sorted({t.step for t in trajs}))


def _length_stats(c: _Columns, max_total: int) -> dict[str, Any]:
    """Means, length percentiles, the share at the cap, and the drift of the per-step mean length."""
    mean_by_step = [float(c.total[c.step == s].mean()) for s in c.steps]
    fit_start, fit_end, fit_r2 = _drift(c.steps, mean_by_step)
    return {
        "mean_total": float(c.total.mean()),
        "mean_gen": float(c.gen.mean()),
        "mean_payload": float(c.payload.mean()),
        "mean_prompt": float(c.prompt.mean()),
        "mean_tool_calls": float(c.calls.mean()),
        "failure_rate": float(c.fails.sum() / c.calls.sum()) if c.calls.sum() else 0.0,
        "p50_total": float(np.percentile(c.total, 50)),
        "p90_total": float(np.percentile(c.total, 90)),
        "p99_total": float(np.percentile(c.total, 99)),
        "max_total": float(c.total.max()),
        "frac_at_cap": float((c.total >= max_total).mean()),
        "mean_total_by_step": mean_by_step,
        "drift_fit_start": fit_start,
        "drift_fit_end": fit_end,
        "drift_fit_r2": fit_r2,
    }


def _concentration(c: _Columns) -> dict[str, float]:
    """The long tail: the top 10% (by generated tokens) share of decode work and of generated tokens."""
    by_step = [c.step == s for s in c.steps]
    return {
        "top10_share_decode_work": _top_share(c.gen, c.work),
        "top10_share_gen_tokens": _top_share(c.gen, c.gen),
        "top10_share_decode_work_per_step_mean": float(np.mean([_top_share(c.gen[m], c.work[m]) for m in by_step])),
        "top10_share_gen_tokens_per_step_mean": float(np.mean([_top_share(c.gen[m], c.gen[m]) for m in by_step])),
    }


def _tail_summaries(c: _Columns) -> dict[str, Any]:
    """Tool outcome → length: the final length of the trajectories by tool-returned tokens and failures."""

    def summary(mask: np.ndarray, prefix: str) -> dict[str, Any]:
        n = int(mask.sum())
        sel = c.total[mask]
        return {
            f"{prefix}_n": n,
            f"{prefix}_mean_total": float(sel.mean()) if n else None,
            f"{prefix}_p10_total": float(np.percentile(sel, 10)) if n else None,
            f"{prefix}_p90_total": float(np.percentile(sel, 90)) if n else None,
            f"{prefix}_frac_over_40k": float((sel > 40_000).mean()) if n else None,
        }

    over = c.total > 40_000
    return {
        **summary((c.payload >= 500) & (c.payload <= 1500), "tool_tokens_1k"),
        **summary((c.payload >= 11_000) & (c.payload <= 14_000), "tool_tokens_12k"),
        **summary(c.fails >= 4, "failures_4plus"),
        **summary(c.fails >= 8, "failures_8plus"),
        **summary(c.fails == 0, "failures_0"),
        "over_40k_min_failures": int(c.fails[over].min()) if over.any() else None,
    }


def _centred(c: _Columns) -> tuple[np.ndarray, np.ndarray]:
    """Generated tokens and log total length with each step's mean removed (the drift taken out)."""
    centred_gen = c.gen.copy()
    centred_log = np.log(c.total)
    for s in c.steps:
        mask = c.step == s
        centred_gen[mask] -= c.gen[mask].mean()
        centred_log[mask] -= centred_log[mask].mean()
    return centred_gen, centred_log


def _group_variance(trajs: Sequence[TrajectorySpec], centred_log: np.ndarray) -> tuple[int, float]:
    """The number of GRPO groups and the between-group share of the within-step variance of log length."""
    groups: dict[str, list[int]] = defaultdict(list)
    for idx, t in enumerate(trajs):
        groups[t.group].append(idx)
    between = sum(len(ix) * float(centred_log[ix].mean()) ** 2 for ix in groups.values())
    within = float((centred_log**2).sum())
    return len(groups), between / within if within > 0 else 0.0


def _correlations(c: _Columns, centred_gen: np.ndarray) -> dict[str, float]:
    """Pearson correlations of prompt tokens, failures and tool tokens with the step-centred generated tokens."""
    return {
        "corr_prompt_total": _corr(c.prompt, centred_gen),
        "corr_failures_total": _corr(c.fails, centred_gen),
        "corr_payload_total": _corr(c.payload, centred_gen),
    }


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
    c = _columns(trajs)
    centred_gen, centred_log = _centred(c)
    n_groups, group_share = _group_variance(trajs, centred_log)
    stats: dict[str, Any] = {
        "trajectories": len(trajs),
        "steps": len(c.steps),
        "groups": n_groups,
        **_length_stats(c, max_total),
        **_concentration(c),
        **_tail_summaries(c),
        **_cascade(trajs),
        **_correlations(c, centred_gen),
        "group_share_of_variance": group_share,
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
