"""The run directory's plots show what happened: a reward band inside the rewards, overlapping stage spans."""

from __future__ import annotations

import json
import statistics

from libra.rl.metrics import plot_run, reward_bands


def _records() -> list[dict]:
    recs = []
    for step in range(1, 7):
        rewards = [0.0] * 6 + [1.5] * (step - 1)  # most episodes score 0, a growing few score 1.5
        recs.append({"step": step, "rewards": rewards, "reward_mean": statistics.fmean(rewards),
                     "reward_std": statistics.pstdev(rewards), "accuracy": (step - 1) / len(rewards), "tokens_per_s": 40.0 + step,
                     "tool_calls_per_episode": step / 6, "tool_success_rate": 0.9,
                     # step k rolls out while step k-1 trains: the spans overlap
                     "rollout_span_s": [10.0 * (step - 1), 10.0 * step + 5], "train_span_s": [10.0 * step + 5, 10.0 * step + 9]})
    return recs


def test_reward_band_stays_inside_the_rewards_that_happened() -> None:
    recs = _records()
    for r, (lo, med, hi) in zip(recs, reward_bands(recs)):
        assert min(r["rewards"]) <= lo <= med <= hi <= max(r["rewards"])
        assert 0 <= lo
    assert any(r["reward_mean"] - r["reward_std"] < 0 for r in recs)  # where a mean - std band dips below 0
    assert reward_bands([{"reward_mean": 0.4}]) == [(0.4, 0.4, 0.4)]  # an old record without its rewards


def test_plot_run_writes_both_pictures(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["reward.png", "throughput.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_plot_run_draws_steps_without_tool_calls(tmp_path) -> None:
    recs = _records()
    recs[0]["tool_success_rate"] = None  # no call that step: the job records None, not 0
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert [p.name for p in plot_run(tmp_path)] == ["reward.png", "throughput.png"]


def test_plot_run_shows_the_share_of_groups_without_signal(tmp_path, monkeypatch) -> None:
    import matplotlib.axes

    bars: list[list[float]] = []
    real = matplotlib.axes.Axes.bar

    def spy(self, x, height, *a, **kw):  # noqa: ANN001, ANN202
        if kw.get("label") == "share of groups with no signal":
            bars.append(list(height))
        return real(self, x, height, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", spy)
    recs = _records()
    for r, share in zip(recs, [1.0, 0.5, None, 0.0, 0.0, 0.25]):
        r["batch_zero_variance_share"] = share
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    plot_run(tmp_path)
    assert bars == [[1.0, 0.5, 0.0, 0.0, 0.0, 0.25]]
