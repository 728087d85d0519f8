"""The run's figures cannot be misread: read from the figure's artists, no line lies hidden under an equal
one, every rate/count axis starts at 0, every legend sits outside the axes' data area, and a 0/1 reward is
shown as a proportion (its mean with a Wilson band, n named) rather than a median that jumps 0 <-> 1."""

from __future__ import annotations

import math
import statistics

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from libra.rl.plots import reward_figure, throughput_figure, wilson_interval  # noqa: E402

CORRECT = [[0, 0, 1, 0, 0], [0, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 0, 1], [1, 1, 1, 1, 1], [1, 1, 0, 1, 1]]


def binary_records() -> list[dict]:
    """A 0/1-reward run like the README job's: reward = correct, so the mean equals the accuracy."""
    recs = []
    for step, correct in enumerate(CORRECT, start=1):
        rewards = [float(c) for c in correct]
        recs.append({"step": step, "rewards": rewards, "reward_mean": statistics.fmean(rewards),
                     "accuracy": statistics.fmean(correct), "episode_correct": correct, "tokens_per_s": 40.0 + step,
                     "tool_calls_per_episode": 0.8 + 0.04 * step, "tool_success_rate": 1.0,
                     "batch_zero_variance_share": 0.5 if step == 5 else 0.0,
                     "rollout_span_s": [10.0 * (step - 1), 10.0 * step + 5], "train_span_s": [10.0 * step + 5, 10.0 * step + 9]})
    return recs


def graded_records() -> list[dict]:
    """Rewards that are not 0/1 (partial credit): the median and its band mean something."""
    recs = binary_records()
    for r in recs:
        r["rewards"] = [0.5 * x + 0.25 * (i % 2) for i, x in enumerate(r["rewards"])]
        r["reward_mean"] = statistics.fmean(r["rewards"])
    return recs


DECISIONS = [{"kind": "decision", "what": "plan", "step": 1, "t": 0.5},
             {"kind": "decision", "what": "buckets", "step": 1, "t": 0.7}]


def _data_lines(ax) -> list[tuple[tuple, tuple]]:
    return [(tuple(map(float, line.get_xdata())), tuple(map(float, line.get_ydata()))) for line in ax.get_lines()]


def _check_readable(fig) -> None:
    fig.canvas.draw()  # lay out (constrained layout places the legends)
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        lines = _data_lines(ax)
        assert len(lines) == len(set(lines)), f"{ax.get_title()!r}: a line drawn exactly under another"
        assert ax.get_ylim()[0] == 0.0, f"{ax.get_title()!r}: the y axis starts at {ax.get_ylim()[0]}, not 0"
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(renderer)
        for other in fig.axes:  # outside its own axes' data area and every other's
            assert not box.overlaps(other.get_window_extent(renderer)), (ax.get_title(), other.get_title())


def test_binary_reward_plot_is_readable() -> None:
    fig = reward_figure(binary_records(), plt)
    try:
        _check_readable(fig)
        reward_ax, tool_ax = fig.axes
        labels = reward_ax.get_legend_handles_labels()[1]
        assert "reward mean = accuracy" in labels  # one line, both names
        assert not any("median" in x or "p10" in x for x in labels)  # meaningless for 0/1 rewards
        (band,) = [x for x in labels if "Wilson" in x]
        assert "n = 5 per step" in band
        assert "share of groups with no signal" in labels  # the zero-variance bars stay
        assert tool_ax.get_ylim()[0] == 0.0 and tool_ax.get_ylim()[1] >= 1.0
    finally:
        plt.close(fig)


def test_graded_reward_keeps_median_band_and_mean() -> None:
    fig = reward_figure(graded_records(), plt)
    try:
        _check_readable(fig)
        labels = fig.axes[0].get_legend_handles_labels()[1]
        assert {"reward median", "reward mean", "accuracy", "reward p10-p90"} <= set(labels)
    finally:
        plt.close(fig)


def test_throughput_plot_is_readable() -> None:
    fig = throughput_figure(binary_records(), DECISIONS, plt)
    try:
        _check_readable(fig)
    finally:
        plt.close(fig)


def test_the_checks_catch_an_unreadable_figure() -> None:
    """The old layout (legend inside, axis from 0.5, a line under an equal one) fails each check."""
    for bad in ("hidden", "axis", "legend"):
        fig, ax = plt.subplots(layout="constrained")
        ax.plot([1, 2, 3], [0.6, 0.8, 1.0], label="accuracy")
        ax.plot([1, 2, 3], [0.6, 0.8, 1.0] if bad == "hidden" else [0.7, 0.9, 1.0], label="reward mean")
        ax.set_ylim(0.5 if bad == "axis" else 0.0, 1.05)
        ax.legend(loc="upper left") if bad == "legend" else ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0))
        with pytest.raises(AssertionError):
            _check_readable(fig)
        plt.close(fig)


def test_wilson_interval() -> None:
    lo, hi = wilson_interval(0, 20)
    assert lo == 0.0 and 0.1 < hi < 0.2  # not empty at 0 successes
    lo, hi = wilson_interval(14, 20)
    assert lo == pytest.approx(0.4810, abs=1e-3) and hi == pytest.approx(0.8545, abs=1e-3)
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


def test_one_step_still_shows_its_interval_and_whole_steps() -> None:
    fig = reward_figure(binary_records()[:1], plt)
    try:
        _check_readable(fig)
        reward_ax = fig.axes[0]
        assert reward_ax.containers, "the one step's Wilson interval is drawn as an error bar"
        assert all(float(t).is_integer() for t in reward_ax.get_xticks())
    finally:
        plt.close(fig)
