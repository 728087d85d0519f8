"""What ``libra run`` shows of the broker's decisions, from synthetic records (no cluster): each decision is a
terminal line, a ``metrics.jsonl`` row that step readers skip, a mark on ``throughput.png`` and a count in the
summary with the predicted-vs-measured step error; and the loopback cluster it starts runs Libra by default."""

from __future__ import annotations

import json
import math
import statistics
import tomllib
from pathlib import Path
from typing import Any

import pytest

from libra.rl.evals import decision_line, handle_record
from libra.rl.metrics import (MetricsWriter, decision_summary, ehp_bands, mark_decisions, plot_run, prediction_error,
                              read_metrics, summarize)


def _step(step: int, predicted: float | None, measured: float) -> dict[str, Any]:
    rewards = [0.0, 0.5, 1.0, 0.5]
    return {"step": step, "rewards": rewards, "reward_mean": statistics.fmean(rewards), "accuracy": 0.25,
            "policy_lag_max": 1, "tokens_per_s": 50.0, "step_time_s": measured, "predicted_step_s": predicted,
            "predicted_rollout_s": None if predicted is None else predicted / 2, "oom_retries": 0,
            "rollout_tok_s_per_instance": 30.0, "train_tok_s_per_rank": 90.0,
            "rollout_span_s": [10.0 * (step - 1), 10.0 * step], "train_span_s": [10.0 * step, 10.0 * step + 4]}


def _decision(what: str, step: int, t: float, actor: str = "h/cpu1") -> dict[str, Any]:
    return {"kind": "decision", "what": what, "step": step, "t": t,
            "text": f"EHP: hybrid actor {actor} {'joins training' if what == 'ehp_join' else 'goes back'}",
            "detail": {"actor": actor, "reason": "training_bottleneck"}}


RECORDS = [_step(1, None, 10.0), _decision("ehp_join", 2, 11.0), _decision("role_switch", 2, 11.5),
           _step(2, 8.0, 10.0), _decision("ehp_leave", 3, 25.0), _step(3, 12.0, 12.0)]


class _Data:
    def cursor(self, *a: Any) -> Any:
        raise AssertionError("no checkpoint in these records")


def _handle(run: Path, records: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """What the driver's poll loop does with each record: handled ones are written and said; the rest are steps."""
    said: list[str] = []
    steps = []
    m = MetricsWriter(run / "metrics.jsonl")
    for rec in records:
        if not handle_record(dict(rec), run, _Data(), m, said.append):
            steps.append(rec)
            m.write(rec)
    m.close()
    return said, steps


def test_each_decision_is_a_terminal_line_and_a_metrics_row(tmp_path: Path) -> None:
    said, steps = _handle(tmp_path, RECORDS)
    assert [s["step"] for s in steps] == [1, 2, 3]  # the driver's step bookkeeping never sees a decision
    assert said == [decision_line(r) for r in RECORDS if r.get("kind") == "decision"]
    assert said[0] == "[libra] step 2, 11.0 s: EHP: hybrid actor h/cpu1 joins training"
    rows = read_metrics(tmp_path, "decision")
    assert [r["what"] for r in rows] == ["ehp_join", "role_switch", "ehp_leave"]
    assert rows[0]["detail"] == {"actor": "h/cpu1", "reason": "training_bottleneck"}


def test_step_readers_skip_decision_rows(tmp_path: Path) -> None:
    _handle(tmp_path, RECORDS + [{"kind": "something_new", "step": 3}])
    steps = read_metrics(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3] and all("kind" not in r for r in steps)
    assert summarize(steps)["steps"] == 3 and summarize(steps)["wall_s"] == 32.0
    assert len(read_metrics(tmp_path, None)) == len(RECORDS) + 1  # an unknown kind is kept, not taken for a step


def test_the_summary_counts_decisions_and_the_prediction_error(tmp_path: Path) -> None:
    steps = [r for r in RECORDS if "kind" not in r]
    decisions = [r for r in RECORDS if r.get("kind") == "decision"]
    out = decision_summary(steps, decisions)
    assert out["decisions"] == {"ehp_join": 1, "role_switch": 1, "ehp_leave": 1}
    assert out["steps_predicted"] == 2
    assert out["prediction_error"] == pytest.approx((abs(math.log(8 / 10)) + 0.0) / 2)
    assert prediction_error([_step(1, None, 3.0)]) is None
    assert decision_summary([], []) == {"decisions": {}, "prediction_error": None, "steps_predicted": 0}


class _Axes:
    def __init__(self) -> None:
        self.lines: list[tuple[float, str | None]] = []
        self.spans: list[tuple[float, float]] = []

    def axvline(self, x: float, **kw: Any) -> None:
        self.lines.append((x, kw.get("label")))

    def axvspan(self, lo: float, hi: float, **kw: Any) -> None:
        self.spans.append((lo, hi))

    def get_xlim(self) -> tuple[float, float]:
        return (0.0, 40.0)


def test_throughput_marks_every_decision_and_shades_each_borrow() -> None:
    decisions = [r for r in RECORDS if r.get("kind") == "decision"]
    a1, a2 = _Axes(), _Axes()
    mark_decisions(a1, a2, decisions + [_decision("ehp_join", 3, 30.0, "h/cpu2")])
    assert [x for x, _ in a1.lines] == pytest.approx([2, 2.1, 3, 3.1]) and [x for x, _ in a2.lines] == [11.0, 11.5, 25.0, 30.0]
    assert [lab for _, lab in a2.lines] == ["ehp_join", "role_switch", "ehp_leave", None]  # one legend entry each
    assert a2.spans == [(11.0, 25.0), (30.0, 40.0)]  # a borrow still held at the end runs to the axis' end
    assert ehp_bands([_decision("ehp_leave", 2, 5.0)]) == []


def test_plot_run_draws_a_run_with_decisions(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["reward.png", "throughput.png"]
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broker: dict[str, Any]) -> Any:
    """The LocalCluster ``run_job`` would start for a job with ``[broker]`` = ``broker`` (never started)."""
    import libra.local
    from libra.rl import driver
    from libra.rl.config import job_from_mapping

    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    class FakeCluster:
        def __init__(self, **kw: Any) -> None:
            seen.update(kw)

        def start(self, **kw: Any) -> None:
            raise Stop

    monkeypatch.setattr(libra.local, "LocalCluster", FakeCluster)
    monkeypatch.setattr(driver, "host_gpus", lambda: (0, "no GPU"))
    monkeypatch.setattr(driver, "resolve_model", lambda name: tmp_path)
    cfg = job_from_mapping({"job": {"run_dir": str(tmp_path / "run")}, "actors": {"rollout": 2, "trainer": 1},
                            "broker": broker})
    with pytest.raises(Stop):
        driver.run_job(cfg, progress=False)
    roles = seen["actor_args"][seen["actor_args"].index("--roles") + 1]
    conf = Path(seen["broker_args"][seen["broker_args"].index("--config") + 1])
    return roles, tomllib.loads(conf.read_text())["broker"], conf


def test_libra_run_starts_libra_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    roles, broker, conf = _started(tmp_path, monkeypatch, {})
    assert roles == "hybrid=2,train=1,action=1,episode=1"  # the rollout slots are hybrid: the pool may borrow them
    assert broker["planner"]["allocation"] == "grp_ehp" and broker["planner"]["hardware"] == "cpu"
    assert broker["router"] == "cmlfq" and broker["action_scheduler"] == "tangram"
    assert conf == tmp_path / "run" / "broker.toml"


def test_static_starts_todays_fixed_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    roles, broker, _ = _started(tmp_path, monkeypatch, {"policy": "static"})
    assert roles == "rollout=2,train=1,action=1,episode=1"
    assert "planner" not in broker and broker["action_scheduler"] == ""  # "": first come first served


@pytest.mark.timeout(60)
def test_the_end_of_run_wait_skips_hybrid_slots_the_pool_moved(tmp_path: Path) -> None:
    """A hybrid slot held in training is no rollout instance now; one released back to rollout without a version
    builds its engine with its next turn: neither is waited for (the wait would run out its whole timeout)."""
    import asyncio
    from types import SimpleNamespace

    from libra.rl.driver import _Driver

    (tmp_path / "actors").mkdir()
    for slot, rec in (("cpu0", {"role": "train", "switches": 1}), ("cpu1", {"role": "rollout", "switches": 2}),
                      ("cpu2", {"role": "rollout", "weights_version": 3, "knows_publisher": True})):
        (tmp_path / "actors" / f"{slot}.json").write_text(json.dumps({"slot": slot, **rec}))
    fake = SimpleNamespace(run_dir=tmp_path, expected_rollouts=3)
    seen = asyncio.run(_Driver._await_rollout_sync(fake, 3, timeout=3600.0))  # type: ignore[arg-type]
    assert seen == {"cpu1": None, "cpu2": 3}
