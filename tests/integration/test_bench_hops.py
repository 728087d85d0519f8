"""``python -m libra.bench broker --trace-hops`` on real processes: every call's four messages are found by
their tag in the three processes' stamps."""

from __future__ import annotations

from libra.bench.broker_hops import SEGMENTS, SEGMENTS_NO_ACTOR, trace


def test_trace_hops_finds_every_segment_of_every_call() -> None:
    r = trace(20, window=10)
    assert r["calls"] == 20
    assert len(r["echo_segments_us"]) == len(SEGMENTS)
    assert len(r["no_actor_segments_us"]) == len(SEGMENTS_NO_ACTOR)
    # stamps are in causal order on one clock (CLOCK_MONOTONIC is shared by the processes of a host)
    assert all(v > 0 for v in r["echo_segments_us"].values()), r
    assert all(v > 0 for v in r["no_actor_segments_us"].values()), r
    assert r["per_s"] > 0 and r["p50_us"] > 0
