"""Run-directory metrics: one JSON object per step in ``metrics.jsonl``, and PNG plots.

``MetricsWriter.write(record)`` appends and flushes a line (so a crashed run keeps its steps).
``plot_run(run_dir)`` reads ``metrics.jsonl`` and writes ``reward.png`` (mean reward per step with a
±std band, and accuracy) and ``throughput.png`` (generated tokens/s and the step-time breakdown),
with matplotlib's Agg backend (the ``train`` extra). ``summarize(records)`` gives the first/last
quarter reward statistics reported at the end of a run.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

__all__ = ["MetricsWriter", "plot_run", "read_metrics", "summarize"]


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


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    p = Path(run_dir) / "metrics.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": math.nan, "std": math.nan, "n": 0}
    return {"mean": statistics.fmean(xs), "std": statistics.pstdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


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
        "max_policy_lag_seen": max(r["policy_lag_max"] for r in records),
        "tokens_per_s_mean": statistics.fmean(r["tokens_per_s"] for r in records),
        "gen_tokens_total": sum(r.get("gen_tokens", 0) for r in records),
        "wall_s": sum(r["step_time_s"] for r in records),
    }


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write ``reward.png`` and ``throughput.png`` into ``run_dir``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    recs = read_metrics(run)
    if not recs:
        return []
    steps = [r["step"] for r in recs]
    out = []
    fig, ax = plt.subplots(figsize=(6, 4))
    mean = [r["reward_mean"] for r in recs]
    std = [r["reward_std"] for r in recs]
    ax.plot(steps, mean, marker="o", label="reward mean")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    ax.plot(steps, [r["accuracy"] for r in recs], marker=".", linestyle="--", label="accuracy")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.legend()
    ax.set_title("reward per step")
    fig.tight_layout()
    out.append(run / "reward.png")
    fig.savefig(out[-1], dpi=100)
    plt.close(fig)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(steps, [r["tokens_per_s"] for r in recs], marker="o")
    a1.set_xlabel("step")
    a1.set_ylabel("generated tokens/s")
    a1.set_title("rollout throughput")
    bottoms = [0.0] * len(recs)
    for key in ("rollout_time_s", "train_time_s", "sync_time_s"):
        vals = [r.get(key, 0.0) for r in recs]
        a2.bar(steps, vals, bottom=bottoms, label=key.removesuffix("_time_s"))
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    a2.set_xlabel("step")
    a2.set_ylabel("seconds")
    a2.set_title("step time breakdown")
    a2.legend()
    fig.tight_layout()
    out.append(run / "throughput.png")
    fig.savefig(out[-1], dpi=100)
    plt.close(fig)
    return out
