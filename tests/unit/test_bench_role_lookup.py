"""bench role_lookup at a tiny size: both readers drain every CURVE message and the result carries the ratio."""

from __future__ import annotations

import argparse

from libra.bench import role_lookup


def test_role_lookup_bench_runs_both_readers_in_one_run() -> None:
    res = role_lookup.run(argparse.Namespace(messages=300, rounds=1))
    assert res["bytes_us_per_msg"] > 0 and res["with_role_us_per_msg"] > 0
    assert res["ratio"] == res["with_role_us_per_msg"] / res["bytes_us_per_msg"]
    assert res["core_scoped_us_per_msg"] > 0 and res["core_unchecked_us_per_msg"] > 0
    assert res["core_ratio"] == res["core_scoped_us_per_msg"] / res["core_unchecked_us_per_msg"]
    assert "us/message" in role_lookup.fmt(res) and "job-scoped" in role_lookup.fmt(res)
