"""Benchmark output: strict JSON (no Infinity/NaN) or the table with its wall time."""

from __future__ import annotations

import json
import math

import pytest

from libra.bench.output import emit, finite


def _strict(text: str) -> object:
    def reject(name: str) -> object:
        raise ValueError(f"non-strict JSON constant {name}")

    return json.loads(text, parse_constant=reject)


def test_finite_replaces_every_non_finite_float_with_none() -> None:
    got = finite({"a": math.inf, "b": [1.0, math.nan, (2, -math.inf)], "c": {"d": 0.5, "e": "x"}})
    assert got == {"a": None, "b": [1.0, None, [2, None]], "c": {"d": 0.5, "e": "x"}}


def test_emit_prints_strict_json_or_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    out = {"wall_s": 1.5, "t": math.inf, "rows": [{"x": math.nan}]}
    emit(out, True, lambda o: "unused")
    assert _strict(capsys.readouterr().out) == {"wall_s": 1.5, "t": None, "rows": [{"x": None}]}
    with pytest.raises(ValueError, match="Infinity"):
        _strict(json.dumps(out))  # what a plain dump would have printed
    emit(out, False, lambda o: f"table with {len(o['rows'])} row")
    assert capsys.readouterr().out == "table with 1 row\n(wall 1.5 s)\n"
