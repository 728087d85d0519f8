"""Run-directory metrics: one JSON object per step in ``metrics.jsonl``, and PNG plots.

``metrics.jsonl`` holds step records and, with ``[eval]``, eval records (``"kind": "eval"``, one per eval
round: ``greedy_accuracy``, ``pass@1``, ``pass@k``; see ``libra.broker.job_eval``), and the broker's decision
records (``"kind": "decision"``: ``what`` is ``plan``, ``role_switch``, ``buckets``, ``ehp_join``,
``ehp_leave`` or ``oom_replan``; ``step``, ``t`` seconds since the job started, ``text``, ``detail``).
``read_metrics`` returns the step records (``kind="eval"``: the eval records; ``kind="decision"``: the
decisions; ``kind=None``: all), so every reader of steps (summaries, plots, ``--resume``) skips the others;
``eval.png`` plots the eval records against the step they followed. :func:`decision_summary` is what
``summary.json`` says of the decisions and of the broker's predicted step times (``prediction_error``: the
mean ``|log(predicted_step_s / step_time_s)|`` over the steps that had a prediction).

``MetricsWriter.write(record)`` appends and flushes a line (so a crashed run keeps its steps).
``plot_run(run_dir)`` reads ``metrics.jsonl`` and writes ``reward.png`` (reward per step: median with a
10–90 % band, mean, accuracy, tool use) and ``throughput.png`` (generated tokens/s, and each step's
rollout and training spans on one time axis, with every decision marked and each Elastic Hybrid Pool
borrow shaded from its join to its leave),
with matplotlib's Agg backend (the ``train`` extra). ``summarize(records)`` gives the first/last
quarter statistics reported at the end of a run; its ``quarters`` entry has, for the first and the last
quarter of the steps, tool calls per episode, tool success rate, accuracy and reward, each pooled over
episodes as mean, spread (population std) and n (:func:`quarter_stats`).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MetricsWriter", "decision_summary", "plot_evals", "plot_run", "prediction_error", "quarter_stats",
           "read_metrics", "reward_bands", "summarize"]


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
    """First- and last-quarter statistics over steps of per-trajectory rewards (and step means)."""
    if not records:
        return {}
    q = max(1, len(records) // 4)
    first, last = records[:q], records[-q:]

    def pooled(rs: list[dict[str, Any]], key: str) -> list[float]:
        return [x for r in rs for x in r.get(key, [])]

    return {
        "steps": len(records),
        "quarter_steps": q,
        "first_quarter_reward": _stats(pooled(first, "rewards")),
        "last_quarter_reward": _stats(pooled(last, "rewards")),
        "first_quarter_step_means": _stats([r["reward_mean"] for r in first]),
        "last_quarter_step_means": _stats([r["reward_mean"] for r in last]),
        "first_quarter_accuracy": _stats([r["accuracy"] for r in first]),
        "last_quarter_accuracy": _stats([r["accuracy"] for r in last]),
        "quarters": {"first": quarter_stats(first), "last": quarter_stats(last)},
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


_DECISION_COLOURS = {"plan": "tab:purple", "role_switch": "tab:red", "buckets": "tab:olive", "ehp_join": "tab:green",
                     "ehp_leave": "tab:brown", "oom_replan": "black"}


def mark_decisions(a1: Any, a2: Any, decisions: list[dict[str, Any]]) -> None:
    """Mark ``decisions`` on the throughput axes: a dotted line at each decision's step (``a1``) and a line at
    its time (``a2``, seconds since the job started); each ``ehp_join`` is shaded on ``a2`` until its
    ``ehp_leave`` (the same ``detail.actor`` when given) or the end of the axis."""
    seen: set[str] = set()
    for d in decisions:
        what = str(d.get("what"))
        colour = _DECISION_COLOURS.get(what, "tab:gray")
        label = what if what not in seen else None
        seen.add(what)
        if isinstance(d.get("step"), (int, float)):
            a1.axvline(d["step"], color=colour, linestyle=":", alpha=0.7, label=label)
        if isinstance(d.get("t"), (int, float)):
            a2.axvline(d["t"], color=colour, linestyle=":", alpha=0.7, label=label)
    for lo, hi in ehp_bands(decisions):
        a2.axvspan(lo, hi if hi is not None else a2.get_xlim()[1], color="tab:green", alpha=0.1)


def ehp_bands(decisions: list[dict[str, Any]]) -> list[tuple[float, float | None]]:
    """``(join t, leave t or None)`` of every Elastic Hybrid Pool borrow in ``decisions``."""
    open_: dict[Any, float] = {}
    out: list[tuple[float, float | None]] = []
    for d in decisions:
        key = (d.get("detail") or {}).get("actor")
        if d.get("what") == "ehp_join" and isinstance(d.get("t"), (int, float)):
            open_[key] = float(d["t"])
        elif d.get("what") == "ehp_leave" and isinstance(d.get("t"), (int, float)):
            if key not in open_ and open_:
                key = next(iter(open_))  # no actor named: the oldest borrow still open
            if key in open_:
                out.append((open_.pop(key), float(d["t"])))
    return out + [(t, None) for t in open_.values()]


def reward_bands(records: list[dict[str, Any]], lo: float = 0.1, hi: float = 0.9) -> list[tuple[float, float, float]]:
    """Per step ``(q_lo, median, q_hi)`` of the per-trajectory rewards: a band that stays inside the rewards
    that happened (a mean ± std band of rewards in [0, 1.5] dips below 0). A record without its rewards
    falls back to its mean."""
    out = []
    for r in records:
        xs = [float(x) for x in r.get("rewards") or []]
        if xs:
            q_lo, med, q_hi = (float(q) for q in np.quantile(xs, [lo, 0.5, hi]))  # linear interpolation
            out.append((q_lo, med, q_hi))
        else:
            m = float(r["reward_mean"])
            out.append((m, m, m))
    return out


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write ``reward.png`` and ``throughput.png`` into ``run_dir``; returns the paths.

    ``reward.png``: per step the median reward with its 10–90 % band, the mean, the accuracy and, when the
    environment reports them, tool calls per episode and the tool success rate. ``throughput.png``: the
    rollout throughput per step, and what each step spent when: its rollout span (first episode admitted
    to last episode back) and its training span on one time axis, so the overlap of the asynchronous
    pipeline shows instead of being stacked into a sum.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    recs = read_metrics(run)
    if not recs:
        return []
    steps = [r["step"] for r in recs]
    out = []
    tools = any("tool_calls_per_episode" in r for r in recs)
    fig, axes = plt.subplots(1, 2 if tools else 1, figsize=(11 if tools else 6, 4), squeeze=False)
    ax = axes[0][0]
    bands = reward_bands(recs)
    ax.fill_between(steps, [b[0] for b in bands], [b[2] for b in bands], alpha=0.2, label="reward p10-p90")
    ax.plot(steps, [b[1] for b in bands], marker="o", label="reward median")
    ax.plot(steps, [r["reward_mean"] for r in recs], linestyle=":", label="reward mean")
    ax.plot(steps, [r["accuracy"] for r in recs], marker=".", linestyle="--", label="accuracy")
    if any("batch_zero_variance_share" in r for r in recs):  # groups that carried no GRPO signal
        shares = [r.get("batch_zero_variance_share") for r in recs]
        ax.bar(steps, [0.0 if x is None else x for x in shares], alpha=0.15, color="grey",
               label="share of groups with no signal")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.legend(fontsize=8)
    ax.set_title("reward per step")
    if tools:
        tx = axes[0][1]
        tx.plot(steps, [r.get("tool_calls_per_episode", 0.0) for r in recs], marker="o", label="tool calls / episode")
        if any("tool_success_rate" in r for r in recs):
            rates = [r.get("tool_success_rate") for r in recs]  # None: no call that step
            tx.plot(steps, [math.nan if x is None else x for x in rates], marker=".", linestyle="--",
                    label="tool success rate")
        tx.set_xlabel("step")
        tx.set_title("tool use")
        tx.legend(fontsize=8)
    fig.tight_layout()
    out.append(run / "reward.png")
    fig.savefig(out[-1], dpi=100)
    plt.close(fig)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(steps, [r["tokens_per_s"] for r in recs], marker="o")
    a1.set_xlabel("step")
    a1.set_ylabel("generated tokens/s")
    a1.set_title("rollout throughput")
    for i, r in enumerate(recs):
        for key, colour, label in (("rollout_span_s", "tab:blue", "rollout"), ("train_span_s", "tab:orange", "train")):
            span = r.get(key)
            if span:
                a2.broken_barh([(span[0], max(span[1] - span[0], 1e-3))], (r["step"] - 0.35 + 0.35 * (key == "train_span_s"), 0.3),
                               color=colour, label=label if i == 0 else None)
    a2.set_xlabel("seconds since the job started")
    a2.set_ylabel("step")
    a2.set_title("when each step rolled out and trained")
    decisions = read_metrics(run, "decision")
    mark_decisions(a1, a2, decisions)
    if decisions:
        a1.legend(fontsize=7)
    if any(r.get("rollout_span_s") for r in recs) or decisions:
        a2.legend(fontsize=8)
    fig.tight_layout()
    out.append(run / "throughput.png")
    fig.savefig(out[-1], dpi=100)
    plt.close(fig)
    evals = read_metrics(run, "eval")
    if evals:
        out.append(plot_evals(evals, run / "eval.png", plt))
    return out


def plot_evals(evals: list[dict[str, Any]], path: Path, plt: Any) -> Path:
    """``eval.png``: greedy accuracy, pass@1 and pass@k of each eval round against its step."""
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["step"] for r in evals]
    keys = ["greedy_accuracy", "pass@1"] + sorted({k for r in evals for k in r if k.startswith("pass@")} - {"pass@1"})
    for key in keys:
        ys = [r.get(key) for r in evals]
        if any(y is not None for y in ys):
            ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("eval score")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"eval ({evals[-1].get('prompts', '?')} prompts)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
