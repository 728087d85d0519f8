"""``python -m libra.bench weights_delta --quick``: a real (tiny) training run's consecutive versions synced by
delta and whole over a loopback data plane, in the exported dtype and in bf16; the report's structure, and a
delta smaller than the full object wherever something was unchanged (no timing thresholds)."""

from __future__ import annotations

import json

import pytest

from libra.bench import weights_delta


def test_the_quick_bench_reports_every_pair_in_both_dtypes(capsys: pytest.CaptureFixture[str]) -> None:
    assert weights_delta.main(["--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model"] == "tiny" and out["exported_dtype"] == "float32" and out["optimizer"] == "AdamW"
    assert out["lr"] == weights_delta.job_settings()["lr"] and out["steps"] == 2
    rows = out["rows"]
    assert [(r["pair"], r["dtype"]) for r in rows] == [("v0->v1", "float32"), ("v0->v1", "bfloat16"),
                                                        ("v1->v2", "float32"), ("v1->v2", "bfloat16")]
    for r in rows:
        for share in ("unchanged_tensors", "unchanged_elements", "unchanged_blocks"):
            assert 0.0 <= r[share] <= 1.0
        assert r["full_bytes"] > 0 and r["delta_bytes"] > 0 and r["full_s"] > 0 and r["delta_s"] > 0
        assert r["bytes_ratio"] == pytest.approx(r["delta_bytes"] / r["full_bytes"])
        assert sum(r["encodings"].values()) > 0
        if r["unchanged_elements"] > 0.05:  # something unchanged: the delta must pay in bytes
            assert r["delta_bytes"] < r["full_bytes"]
    bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
    assert all(r["unchanged_elements"] > 0 for r in bf16)  # a step of lr 1e-4 leaves many bf16 weights as they were
    assert bf16[0]["full_bytes"] * 2 == pytest.approx(rows[0]["full_bytes"], rel=0.05)


def test_the_bench_is_registered_and_refuses_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    from libra.bench.__main__ import BENCHMARKS

    assert BENCHMARKS["weights_delta"][0] == "libra.bench.weights_delta"
    with pytest.raises(SystemExit):
        weights_delta.main(["--block-bytes", "0"])
