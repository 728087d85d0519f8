"""Run-directory metrics: one JSON object per step in ``metrics.jsonl``, and PNG plots.

``metrics.jsonl`` holds step records and, with ``[eval]``, eval records (``"kind": "eval"``, one per eval
round: ``greedy_accuracy``, ``pass@1``, ``pass@k``; see ``libra.broker.job_eval_rounds``), and the broker's decision
records (``"kind": "decision"``: ``what`` is ``plan``, ``role_switch``, ``buckets``, ``ehp_join``,
``ehp_leave`` or ``oom_replan``; ``step``, ``t`` seconds since the job started, ``text``, ``detail``).
``read_metrics`` returns the step records (``kind="eval"``: the eval records; ``kind="decision"``: the
decisions; ``kind=None``: all), so every reader of steps (summaries, plots, ``--resume``) skips the others;
``eval.png`` plots the eval records against the step they followed. :func:`decision_summary` is what
``summary.json`` says of the decisions and of the broker's predicted step times (``prediction_error``: the
mean ``|log(predicted_step_s / step_time_s)|`` over the steps that had a prediction).

``MetricsWriter.write(record)`` appends and flushes a line (so a crashed run keeps its steps).
``plot_run(run_dir)`` reads ``metrics.jsonl`` and writes ``reward.png`` (reward per step: for a 0/1 reward
its mean with a Wilson 95 % interval and n, else median with a 10–90 % band and mean; accuracy, drawn once
where it equals the mean; tool use) and ``throughput.png`` (generated tokens/s, and each step's
rollout and training spans on one time axis, with every decision marked and each Elastic Hybrid Pool
borrow shaded from its join to its leave), with matplotlib's Agg backend (the ``train`` extra); the
figures are built in :mod:`libra.rl.plots`. ``summarize(records)`` gives the figures reported at the end
of a run; its ``quarters`` entry has, for the first and the last quarter of the steps, tool calls per
episode, tool success rate, accuracy and reward, each pooled over episodes as mean, spread (population
std) and n (:func:`quarter_stats`): the one place these figures are (no step-mean duplicates).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from libra.rl.plots import (ehp_bands, mark_decisions, plot_evals, reward_bands, reward_figure,
                             throughput_figure)

__all__ = ["MetricsWriter", "decision_summary", "ehp_bands", "mark_decisions", "plot_evals", "plot_run",
           "prediction_error", "quarter_stats", "read_metrics", "reward_bands", "summarize"]


class MetricsWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_metrics(run_dir: str | Path, kind: str | None = "step") -> list[dict[str, Any]]:
    """The records of ``RUN/metrics.jsonl`` of ``kind`` (``"step"``: those without a ``kind``; None: all)."""
    p = Path(run_dir) / "metrics.jsonl"
    if not p.exists():
        return []
    recs = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return recs if kind is None else [r for r in recs if r.get("kind", "step") == kind]


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": math.nan, "std": math.nan, "n": 0}
    return {"mean": statistics.fmean(xs), "std": statistics.pstdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def quarter_stats(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per-episode statistics (mean, population std, n) pooled over ``records`` (the steps of a quarter):
    ``tool_calls_per_episode``, ``accuracy`` (1 for a correct episode, else 0) and ``reward`` over all
    episodes; ``tool_success_rate`` over the episodes that called a tool (each episode's successful calls
    over its calls), so its n is the number of those episodes. Records from before the per-episode lists
    existed give n = 0 for what they lack."""
    calls = [int(c) for r in records for c in r.get("episode_tool_calls", [])]
    oks = [int(c) for r in records for c in r.get("episode_tool_ok", [])]
    return {
        "tool_calls_per_episode": _stats([float(c) for c in calls]),
        "tool_success_rate": _stats([ok / c for c, ok in zip(calls, oks) if c > 0]),
        "accuracy": _stats([float(x) for r in records for x in r.get("episode_correct", [])]),
        "reward": _stats([float(x) for r in records for x in r.get("rewards", [])]),
    }


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's figures: ``quarters`` (per-episode statistics of the first and the last quarter of the
    steps, each with its n: :func:`quarter_stats`), the steps, lag, throughput and wall time."""
    if not records:
        return {}
    q = max(1, len(records) // 4)
    return {
        "steps": len(records),
        "quarter_steps": q,
        "quarters": {"first": quarter_stats(records[:q]), "last": quarter_stats(records[-q:])},
        "max_policy_lag_seen": max(r["policy_lag_max"] for r in records),
        "tokens_per_s_mean": statistics.fmean(r["tokens_per_s"] for r in records),
        "gen_tokens_total": sum(r.get("gen_tokens", 0) for r in records),
        "wall_s": sum(r["step_time_s"] for r in records),
    }


def prediction_error(steps: list[dict[str, Any]]) -> float | None:
    """Mean ``|log(predicted_step_s / step_time_s)|`` over the step records with a positive prediction and
    measurement; None when no step had one."""
    errs = [abs(math.log(float(r["predicted_step_s"]) / float(r["step_time_s"]))) for r in steps
            if (r.get("predicted_step_s") or 0) > 0 and (r.get("step_time_s") or 0) > 0]
    return statistics.fmean(errs) if errs else None


def decision_summary(steps: list[dict[str, Any]], decisions: list[dict[str, Any]]) -> dict[str, Any]:
    """``summary.json``'s view of the broker's decisions: ``decisions`` ({what: count}),
    ``prediction_error`` (:func:`prediction_error`) and ``steps_predicted``."""
    counts: dict[str, int] = {}
    for d in decisions:
        counts[str(d.get("what"))] = counts.get(str(d.get("what")), 0) + 1
    return {"decisions": counts, "prediction_error": prediction_error(steps),
            "steps_predicted": sum(1 for r in steps if (r.get("predicted_step_s") or 0) > 0)}


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write ``reward.png`` and ``throughput.png`` (and ``eval.png`` with eval records) into ``run_dir``;
    returns the paths. The figures are :func:`libra.rl.plots.reward_figure` (per step the reward: for a 0/1
    reward its mean with a Wilson 95 % interval and n, else the median with its 10-90 % band and the mean;
    the accuracy; the share of groups with no signal; tool calls per episode and the tool success rate when
    the environment reports them) and :func:`libra.rl.plots.throughput_figure`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    recs = read_metrics(run)
    if not recs:
        return []
    out = []
    for name, fig in (("reward.png", reward_figure(recs, plt)),
                      ("throughput.png", throughput_figure(recs, read_metrics(run, "decision"), plt))):
        out.append(run / name)
        fig.savefig(out[-1], dpi=100)
        plt.close(fig)
    evals = read_metrics(run, "eval")
    if evals:
        out.append(plot_evals(evals, run / "eval.png", plt))
    return out
