"""bench broker_idle at a tiny size: idle actors are never declared lost, each gets one broker heartbeat every
idle heartbeat (3 s by default), and the report carries the 100-actor baseline of the same run."""

from __future__ import annotations

from libra.bench.broker_idle import BASELINE, run


def test_idle_actors_stay_and_the_baseline_is_in_the_same_run() -> None:
    out = run([300], seconds=6)
    assert out["baseline"]["actors"] == BASELINE
    (row,) = out["points"]
    assert row["actors"] == row["live"] == 300
    assert row["expired"] == 0
    assert row["broker_sends_per_s"] == 300 / 3  # one heartbeat per idle actor every 3 s, no more
    assert row["register_vs_baseline"] > 0 and row["idle_vs_baseline"] > 0
