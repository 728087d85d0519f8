"""The sandbox benchmark runs all three modes in one run and reports consistent statistics (no timing
thresholds: only structure and arithmetic are checked). Skipped only when bwrap is not installed."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator

import pytest
import structlog

from libra.bench import sandbox as bench

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap")


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """bench.main configures logging like any entry point; undo it for the rest of the session."""
    import libra.logging as libra_logging

    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level, configured = list(root.handlers), root.level, libra_logging._configured
    yield
    structlog.configure(**saved)
    root.handlers[:] = handlers
    root.setLevel(level)
    libra_logging._configured = configured


def test_bench_reports_warm_bare_and_cold(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--iterations", "3", "--cpu-iterations", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["isolation"]["mode"] == "bwrap" and set(out["workloads"]) == {"noop"}
    noop = out["workloads"]["noop"]
    assert set(noop) == {"bare", "warm", "cold"}
    for mode in ("warm", "cold"):
        stats = noop[mode]
        assert stats["n"] == 3 and stats["p90_ms"] >= stats["median_ms"] > 0
        assert stats["minus_bare_ms"] == pytest.approx(stats["median_ms"] - noop["bare"]["median_ms"])
        assert stats["ratio_to_bare"] == pytest.approx(stats["median_ms"] / noop["bare"]["median_ms"])


def test_bench_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--iterations", "2", "--cpu-iterations", "0", "--no-cold"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("sandbox: bwrap") and "median ms" in lines[1]
    assert [ln.split()[:2] for ln in lines[2:]] == [["noop", "bare"], ["noop", "warm"]]
