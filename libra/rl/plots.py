"""The run directory's figures, drawn so that a reader does not misread them.

:func:`reward_figure` builds ``reward.png``'s figure from the step records, :func:`throughput_figure`
``throughput.png``'s (with the broker's decision records) and :func:`plot_evals` writes ``eval.png``;
``libra.rl.metrics.plot_run`` reads ``metrics.jsonl`` and saves them. What every figure keeps to:

- **One line per quantity.** Two series that are equal at every step (a 0/1 reward's mean is the
  accuracy) are drawn once, with the second named in the first's legend entry (``reward mean = accuracy``),
  instead of one line hidden exactly under another.
- **A binary reward is a proportion.** When every reward is 0 or 1, a step's median jumps between 0 and 1
  and its 10-90 % band spans 0-1, which says nothing; the figure shows the mean with its Wilson 95 %
  interval (:func:`wilson_interval`) and the number of episodes per step (n). Other rewards keep the median
  with its 10-90 % band (:func:`reward_bands`) and the mean.
- **Rates and counts start at 0** (accuracy, reward in [0, ...], tool calls per episode, success rates,
  tokens/s, steps): an axis that starts at 0.5 makes 0.8 -> 1.0 look large.
- **Legends sit outside the axes** (right of each), so no legend covers a data point; figures use
  matplotlib's constrained layout so the legends stay inside the saved picture.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["binary_rewards", "draw_distinct", "ehp_bands", "mark_decisions", "plot_evals", "reward_bands",
           "reward_figure", "throughput_figure", "wilson_interval"]

_LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.02, 1.0), "borderaxespad": 0.0, "fontsize": 8}


def wilson_interval(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95 % for ``z`` = 1.96) of a proportion of ``k`` successes in ``n`` trials;
    ``(nan, nan)`` for ``n`` = 0. It stays inside [0, 1] and is not empty at 0 or n successes."""
    if n <= 0:
        return (math.nan, math.nan)
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return (max(0.0, centre - half), min(1.0, centre + half))


def binary_rewards(records: list[dict[str, Any]]) -> bool:
    """Whether every step record carries its rewards and every reward is 0 or 1."""
    return bool(records) and all(r.get("rewards") for r in records) and all(
        float(x) in (0.0, 1.0) for r in records for x in r["rewards"])


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


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or abs(x - y) <= 1e-12 for x, y in zip(a, b))


def draw_distinct(ax: Any, xs: list[Any], series: list[tuple[str, list[float], dict[str, Any]]]) -> list[str]:
    """Plot each ``(label, ys, style)`` of ``series`` on ``ax`` unless its ``ys`` equal (at every x) those of
    a series drawn before it: that one's legend label then says ``= label`` instead. Returns the labels
    drawn."""
    drawn: list[tuple[list[float], list[str], dict[str, Any]]] = []
    for label, ys, style in series:
        ys = [math.nan if y is None else float(y) for y in ys]
        twin = next((d for d in drawn if _same(d[0], ys)), None)
        if twin is not None:
            twin[1].append(label)
        else:
            drawn.append((ys, [label], style))
    for ys, labels, style in drawn:
        ax.plot(xs, ys, label=" = ".join(labels), **style)
    return [" = ".join(labels) for _, labels, _ in drawn]


def _step_axis(ax: Any, steps: list[Any]) -> None:
    """An x axis of ``steps``: whole numbers only (with one or two steps, exactly those)."""
    from matplotlib.ticker import FixedLocator, MaxNLocator

    few = sorted({int(x) for x in steps})
    ax.xaxis.set_major_locator(FixedLocator(few) if len(few) <= 2 else MaxNLocator(integer=True))
    ax.set_xlabel("step")


def _n_label(ns: list[int]) -> str:
    lo, hi = min(ns), max(ns)
    return f"n = {lo} per step" if lo == hi else f"n = {lo}-{hi} per step"


def _reward_axes(ax: Any, recs: list[dict[str, Any]], steps: list[Any]) -> None:
    """The reward axes: a binary reward's mean with its Wilson band and n, else median, 10-90 % band and mean;
    the accuracy; each step's share of groups with no GRPO signal as grey bars."""
    if binary_rewards(recs):
        ns = [len(r["rewards"]) for r in recs]
        band = [wilson_interval(sum(float(x) for x in r["rewards"]), n) for r, n in zip(recs, ns)]
        ax.fill_between(steps, [b[0] for b in band], [b[1] for b in band], alpha=0.2,
                        label=f"reward mean: Wilson 95 % interval ({_n_label(ns)})")
        means = [sum(float(x) for x in r["rewards"]) / n for r, n in zip(recs, ns)]
        if len(steps) == 1:  # a band over one step has no width: the interval as an error bar
            ax.errorbar(steps, means, yerr=[[means[0] - band[0][0]], [band[0][1] - means[0]]], fmt="none",
                        capsize=8, color="tab:blue", alpha=0.5)
        series = [("reward mean", means, {"marker": "o"})]
    else:
        bands = reward_bands(recs)
        ax.fill_between(steps, [b[0] for b in bands], [b[2] for b in bands], alpha=0.2, label="reward p10-p90")
        series = [("reward median", [b[1] for b in bands], {"marker": "o"}),
                  ("reward mean", [r["reward_mean"] for r in recs], {"linestyle": ":"})]
    series.append(("accuracy", [r["accuracy"] for r in recs], {"marker": ".", "linestyle": "--"}))
    draw_distinct(ax, steps, series)
    if any("batch_zero_variance_share" in r for r in recs):  # groups that carried no GRPO signal
        shares = [r.get("batch_zero_variance_share") for r in recs]
        ax.bar(steps, [0.0 if x is None else x for x in shares], alpha=0.15, color="grey",
               label="share of groups with no signal")
    low = min([0.0] + [float(x) for r in recs for x in (r.get("rewards") or [r["reward_mean"]])])
    ax.set_ylim(bottom=low)  # 0 unless a reward was negative
    if low == 0.0 and binary_rewards(recs):
        ax.set_ylim(0.0, 1.05)
    _step_axis(ax, steps)
    ax.set_ylabel("reward / accuracy")
    ax.legend(**_LEGEND)
    ax.set_title("reward per step")


def reward_figure(recs: list[dict[str, Any]], plt: Any) -> Any:
    """``reward.png``'s figure (see the module docstring): the reward axes and, when the environment
    reports them, a tool-use axes (tool calls per episode, tool success rate), both from 0."""
    tools = any("tool_calls_per_episode" in r for r in recs)
    fig, axes = plt.subplots(2 if tools else 1, 1, figsize=(9, 7 if tools else 4), squeeze=False, layout="constrained")
    steps = [r["step"] for r in recs]
    _reward_axes(axes[0][0], recs, steps)
    if tools:
        tx = axes[1][0]
        series = [("tool calls / episode", [r.get("tool_calls_per_episode", 0.0) for r in recs], {"marker": "o"})]
        if any("tool_success_rate" in r for r in recs):  # None: no call that step
            series.append(("tool success rate", [r.get("tool_success_rate") for r in recs],
                           {"marker": ".", "linestyle": "--"}))
        draw_distinct(tx, steps, series)
        top = max([1.0] + [float(y) for _, ys, _ in series for y in ys if y is not None and not math.isnan(y)])
        tx.set_ylim(0.0, top * 1.05)
        _step_axis(tx, steps)
        tx.set_title("tool use")
        tx.legend(**_LEGEND)
    return fig


def throughput_figure(recs: list[dict[str, Any]], decisions: list[dict[str, Any]], plt: Any) -> Any:
    """``throughput.png``'s figure: the rollout throughput per step (from 0), and each step's rollout span
    (first episode admitted to last episode back) and training span on one time axis, so the overlap of the
    asynchronous pipeline shows instead of being stacked into a sum; every decision is marked."""
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 7), layout="constrained")
    steps = [r["step"] for r in recs]
    a1.plot(steps, [r["tokens_per_s"] for r in recs], marker="o", label="generated tokens/s")
    _step_axis(a1, steps)
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
    mark_decisions(a1, a2, decisions)
    a1.set_ylim(0.0, 1.1 * max([1e-9] + [float(r["tokens_per_s"]) for r in recs]))
    a2.set_ylim(bottom=0.0)
    a2.set_xlim(left=0.0)
    if decisions:
        a1.legend(**_LEGEND)
    if any(r.get("rollout_span_s") for r in recs) or decisions:
        a2.legend(**_LEGEND)
    return fig


_DECISION_COLOURS = {"plan": "tab:purple", "role_switch": "tab:red", "buckets": "tab:olive", "ehp_join": "tab:green",
                     "ehp_leave": "tab:brown", "oom_replan": "black"}


def mark_decisions(a1: Any, a2: Any, decisions: list[dict[str, Any]]) -> None:
    """Mark ``decisions`` on the throughput axes: a dotted line at each decision's step (``a1``) and a line at
    its time (``a2``, seconds since the job started); each ``ehp_join`` is shaded on ``a2`` until its
    ``ehp_leave`` (the same ``detail.actor`` when given) or the end of the axis. Decisions of one step are
    drawn a tenth of a step apart on ``a1`` (the k-th at step + 0.1 k), so none hides under another."""
    seen: set[str] = set()
    at_step: dict[float, int] = {}
    for d in decisions:
        what = str(d.get("what"))
        colour = _DECISION_COLOURS.get(what, "tab:gray")
        label = what if what not in seen else None
        seen.add(what)
        if isinstance(d.get("step"), (int, float)):
            k = at_step[d["step"]] = at_step.get(d["step"], -1) + 1
            a1.axvline(d["step"] + 0.1 * k, color=colour, linestyle=":", alpha=0.7, label=label)
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


def plot_evals(evals: list[dict[str, Any]], path: Path, plt: Any) -> Path:
    """``eval.png``: greedy accuracy, pass@1 and pass@k of each eval round against its step (from 0)."""
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    xs = [r["step"] for r in evals]
    keys = ["greedy_accuracy", "pass@1"] + sorted({k for r in evals for k in r if k.startswith("pass@")} - {"pass@1"})
    draw_distinct(ax, xs, [(key, [r.get(key) for r in evals], {"marker": "o"}) for key in keys
                           if any(r.get(key) is not None for r in evals)])
    ax.set_xlabel("step")
    ax.set_ylabel("eval score")
    ax.set_ylim(0.0, 1.05)
    ax.set_title(f"eval ({evals[-1].get('prompts', '?')} prompts)")
    ax.legend(**_LEGEND)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
