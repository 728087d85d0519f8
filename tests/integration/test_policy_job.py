"""``libra run``'s default policy on a job whose workload shifts (``examples/arith_shift.toml``: 1-token turns
for six steps, the trainer the bottleneck; then turns growing to 512 tokens, rollout the bottleneck), end to end
on real processes through ``run_job``:

- under the default ``[broker] policy = "libra"`` the Elastic Hybrid Pool, on its own (no forced schedule),
  moves a hybrid slot from rollout to training mid-job (an ``ehp_join`` and a ``role_switch`` decision, the
  slot's switches in ``RUN/actors/<slot>.json``); no turn is lost or trained twice, every trainer rank holds the
  same weights after every step, and the reward is in line with a ``static`` run of the same seed;
- with a forced schedule (``[broker.planner.ehp] force``) the borrowed slot joins, trains with real data and
  leaves at the steps the schedule names.

The Elastic Hybrid Pool's own decision depends on the step times it measures (``ehp_signal`` and the measured-
cost gate in ``libra.broker.ehp``); each step's times, the pool's signal and prediction are printed for the
record (never asserted)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Any

import pytest

from libra.rl.config import load_job
from libra.rl.driver import run_job
from libra.rl.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap (bwrap) is not installed: sudo apt-get install bubblewrap")]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith_shift.toml"


def _run(run: Path, policy: str, *, steps: int | None = None, planner: dict[str, Any] | None = None) -> tuple[dict, Path]:
    cfg = load_job(EXAMPLE).with_run_dir(str(run))
    b = dataclasses.replace(cfg.broker, policy=policy, **({"planner": planner} if planner is not None else {}))
    cfg = dataclasses.replace(cfg, broker=b, actors=dataclasses.replace(cfg.actors, allow_unisolated=False),
                              job=dataclasses.replace(cfg.job, steps=steps or cfg.job.steps))
    return run_job(cfg, progress=False), run


def _print_steps(recs: list[dict[str, Any]]) -> None:
    for r in recs:  # for the record: what the pool measured and decided (never asserted)
        ehp = r.get("ehp") or {}
        print("step", r["step"], "step_s", round(r["step_time_s"], 3), "rollout_s", round(r["rollout_time_s"], 3),
              "train_s", round(r["train_time_s"], 3), "members", r.get("members"), "signal", ehp.get("signal"),
              "prediction", ehp.get("prediction"))


def _check_every_step(recs: list[dict[str, Any]], per_step: int) -> None:
    """Every trajectory trained exactly once by the step's members, no train work started twice, and every
    member holding the same weights after the step (as tests/integration/test_ehp_job.py checks)."""
    for r in recs:
        ranks = len(r["members"]) if "members" in r else r["ranks"]  # a static job's group never changes
        assert r.get("trained_by", r.get("members")) == r.get("members"), r["step"]
        assert len(r["checksums"]) == ranks, r["step"]
        assert len(set(r["checksums"])) == 1 and None not in r["checksums"], r["step"]  # identical weights
        assert sum(r["shard_sequences"]) == r["sequences"] == per_step, r["step"]  # every trajectory once
        assert r["train_attempts"] == [1] * ranks, r["step"]
    assert len({r["checksums"][0] for r in recs}) == len(recs)  # the weights moved every step


@pytest.fixture(scope="module")
def shift_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, Path]]:
    base = tmp_path_factory.mktemp("policy_job")
    return {p: _run(base / p, p) for p in ("libra", "static")}


@pytest.mark.timeout(1200)
def test_the_default_policy_moves_a_slot_mid_job_on_its_own(shift_runs: dict[str, tuple[dict, Path]]) -> None:
    summary, run = shift_runs["libra"]
    cfg = load_job(EXAMPLE)
    recs = read_metrics(run)
    decisions = read_metrics(run, "decision")
    _print_steps(recs)
    print("decisions", [(d["step"], d["what"], d["text"]) for d in decisions])
    assert cfg.broker.policy == "libra" and "force" not in (cfg.broker.planner.get("ehp") or {})
    assert [r["step"] for r in recs] == list(range(1, cfg.job.steps + 1)) and summary["final_version"] == cfg.job.steps
    assert summary["episodes_failed"] == 0 and recs[-1]["dropped_groups"] == 0
    _check_every_step(recs, cfg.job.prompts_per_step * cfg.grpo.group_size)
    joins = [d for d in decisions if d["what"] == "ehp_join"]
    switches = [d for d in decisions if d["what"] == "role_switch"]
    assert joins and switches, "the pool never borrowed a hybrid slot on the shifting job (see the printed steps)"
    assert 1 < joins[0]["step"] < cfg.job.steps  # mid-job: after a measured step, before the last
    moved = joins[0]["detail"].get("actor") if isinstance(joins[0].get("detail"), dict) else None
    slots = {f.stem: f for f in (run / "actors").glob("*.json")}
    switched = {s: json.loads(f.read_text()).get("switches", 0) for s, f in slots.items()}
    assert any(n > 0 for n in switched.values()), switched  # the actor's own record says it switched roles
    print("moved", moved, "slot switches", switched, "members", [r["members"] for r in recs])


@pytest.mark.timeout(1200)
def test_the_reward_is_in_line_with_a_static_run_of_the_same_seed(shift_runs: dict[str, tuple[dict, Path]]) -> None:
    cfg = load_job(EXAMPLE)
    static = read_metrics(shift_runs["static"][1])
    libra = read_metrics(shift_runs["libra"][1])
    _check_every_step(static, cfg.job.prompts_per_step * cfg.grpo.group_size)
    assert all(r["ranks"] == 1 and "members" not in r for r in static)
    assert not read_metrics(shift_runs["static"][1], "decision")
    a = [x for r in libra for x in r["rewards"]]
    b = [x for r in static for x in r["rewards"]]
    # within noise: the difference of the mean episode rewards within 4 standard errors (plus a hair for ties)
    se = math.sqrt(statistics.pvariance(a) / len(a) + statistics.pvariance(b) / len(b))
    print("mean reward libra", statistics.fmean(a), "static", statistics.fmean(b), "standard error", se)
    assert abs(statistics.fmean(a) - statistics.fmean(b)) <= 4 * se + 1e-6


@pytest.mark.timeout(900)
def test_a_forced_borrow_joins_trains_and_leaves_on_the_shifting_job(tmp_path: Path) -> None:
    planner = {"ehp": {"force": [[1, 1], [4, 0]]}}  # borrowed at step 1 (it switches while the core trains)
    summary, run = _run(tmp_path / "forced", "libra", steps=5, planner=planner)
    cfg = load_job(EXAMPLE)
    recs = read_metrics(run)
    _print_steps(recs)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5] and summary["final_version"] == 5
    _check_every_step(recs, cfg.job.prompts_per_step * cfg.grpo.group_size)
    assert [len(r["members"]) for r in recs] == [1, 2, 2, 1, 1]
    hybrid = recs[1]["members"][1]
    assert recs[1]["zero_members"] == [hybrid] and recs[1]["shard_sequences"][1] == 0  # joins with zeros
    assert recs[2]["zero_members"] == [] and recs[2]["shard_sequences"][1] > 0  # then trains real data
    whats = [d["what"] for d in read_metrics(run, "decision")]
    assert whats.count("ehp_join") == 1 and whats.count("ehp_leave") == 1 and whats.count("role_switch") == 2
