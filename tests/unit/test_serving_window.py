"""The serving process's /load reading (libra.serving.window): TPOT = (finish - first token) / (n - 1), TTFT
from arrival, nearest-rank percentiles over the requests finished inside the sliding window."""

from __future__ import annotations

import pytest

from libra.serving.window import LoadWindow, percentile


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.99) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 201)], 0.99) == 198.0
    assert percentile([float(i) for i in range(1, 11)], 0.99) == 10.0  # fewer than 100: the maximum


def test_reading_covers_the_window_only() -> None:
    w = LoadWindow(window_s=10.0)
    empty = w.reading(0.0)
    assert empty == {"p99_tpot_s": None, "p50_tpot_s": None, "p99_ttft_s": None, "requests": 0,
                     "window_s": 10.0, "running": 0, "queued": 0, "step_tpot_s": None}
    f = w.add(at=5.0, first_at=1.0, arrived_at=0.5, tokens=9)  # 8 gaps over 4 s
    assert (f.ttft_s, f.tpot_s) == (0.5, 0.5)
    w.add(at=12.0, first_at=11.0, arrived_at=10.0, tokens=11)  # 0.1 s per token
    w.add(at=12.5, first_at=12.5, arrived_at=12.0, tokens=1)  # one token: a TTFT, no TPOT
    r = w.reading(14.0, running=3, queued=2)
    assert (r["requests"], r["running"], r["queued"]) == (3, 3, 2)
    assert (r["p50_tpot_s"], r["p99_tpot_s"], r["p99_ttft_s"]) == (0.1, 0.5, 1.0)
    r = w.reading(15.5)  # the first request finished more than 10 s ago
    assert (r["requests"], r["p99_tpot_s"]) == (2, pytest.approx(0.1))


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="window_s"):
        LoadWindow(0)
    with pytest.raises(ValueError, match="arrived <= first <= finish"):
        LoadWindow().add(at=1.0, first_at=2.0, arrived_at=0.0, tokens=3)
    with pytest.raises(ValueError, match="tokens >= 1"):
        LoadWindow().add(at=1.0, first_at=1.0, arrived_at=0.0, tokens=0)
