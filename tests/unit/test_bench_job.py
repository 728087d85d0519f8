"""``python -m libra bench job``'s pure parts: the figures of a policy's records, the union of spans behind
the idle shares, the libra/static ratios, the per-policy job config, and the table."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from libra.bench import job as bench
from libra.config import ConfigError
from libra.rl.config import load_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _step(step: int, t: float, train: list[float], rollout: list[float], **kw: object) -> dict:
    return {"step": step, "step_time_s": t, "gen_tokens": 100, "reward_mean": 0.1 * step, "train_span_s": train,
            "rollout_span_s": rollout, "rollout_time_s": rollout[1] - rollout[0], "train_time_s": train[1] - train[0],
            **kw}


def test_covered_is_the_union_of_the_spans_within_the_window() -> None:
    assert bench.covered([[0, 2], [1, 3], [5, 6]], 0, 10) == pytest.approx(4.0)
    assert bench.covered([[4, 6], [0, 1]], 0, 5) == pytest.approx(2.0)  # clipped at the window's end, any order
    assert bench.covered([None, [2, 2], "x"], 0, 5) == 0.0


def test_figures_of_a_policy() -> None:
    steps = [_step(1, 4.0, [2.0, 4.0], [0.0, 2.0], members=["a"]),
             _step(2, 2.0, [4.0, 6.0], [0.0, 4.5], members=["a", "b"], predicted_step_s=1.0),
             _step(3, 2.0, [6.0, 8.0], [4.0, 7.0], members=["a", "b"], predicted_step_s=4.0)]
    decisions = [{"kind": "decision", "what": "ehp_join"}, {"kind": "decision", "what": "role_switch"},
                 {"kind": "decision", "what": "role_switch"}]
    slots = {"vm/cpu1": {"switches": 2}, "vm/cpu2": {"switches": 0}}
    f = bench.figures(steps, decisions, slots, {"episodes_failed": 0, "dropped_groups": 0})
    assert f["steps"] == 3 and f["steps_wall_s"] == 8.0
    assert f["step_s_mean"] == pytest.approx(8 / 3) and f["step_s_mean_2n"] == pytest.approx(2.0)
    assert f["gen_tokens_per_s"] == pytest.approx(300 / 8)
    # training from 2 s to 8 s: idle 2 of 8 s; an episode in flight from 0 to 7 s: idle 1 of 8 s
    assert f["idle_share"] == {"train": 0.25, "rollout": 0.125}
    assert [r["wall_s"] for r in f["reward_vs_wall"]] == [4.0, 6.0, 8.0]
    assert f["reward_vs_wall"][2]["reward_mean"] == pytest.approx(0.3)
    assert f["decisions"] == {"ehp_join": 1, "role_switch": 2} and f["role_switches"] == {"vm/cpu1": 2}
    assert f["members"] == [1, 2, 2] and f["steps_predicted"] == 2
    assert f["prediction_error"] == pytest.approx((math.log(2) + math.log(2)) / 2)


def test_idle_share_is_not_made_up_without_spans() -> None:
    steps = [{"step": 1, "step_time_s": 1.0, "reward_mean": 0.0, "ranks": 2}]
    f = bench.figures(steps, [], {}, {})
    assert f["idle_share"] == {"train": None, "rollout": None} and f["members"] == [2]
    assert f["prediction_error"] is None and f["decisions"] == {}


def test_ratios_are_libra_over_static() -> None:
    q = bench.ratios({"step_s_mean": 4.0, "step_s_mean_2n": 2.0, "gen_tokens_per_s": 10.0},
                     {"step_s_mean": 3.0, "step_s_mean_2n": 1.0, "gen_tokens_per_s": 20.0})
    assert q == {"step_s": 0.75, "step_s_2n": 0.5, "gen_tokens_per_s": 2.0}
    assert bench.ratios({"step_s_mean": None}, {"step_s_mean": 1.0})["step_s"] is None


def test_policy_config_sets_the_policy_seed_steps_and_run_dir(tmp_path: Path) -> None:
    cfg = load_job(EXAMPLES / "arith_shift.toml")
    s = bench.policy_config(cfg, "static", tmp_path / "s", seed=7, steps=2)
    assert (s.broker.policy, s.job.seed, s.job.steps, s.job.run_dir) == ("static", 7, 2, str(tmp_path / "s"))
    lib = bench.policy_config(cfg, "libra", tmp_path / "l")
    assert lib.broker.policy == "libra" and lib.job.seed == cfg.job.seed and lib.job.steps == cfg.job.steps
    assert s.env == lib.env == cfg.env and s.grpo == cfg.grpo  # the same job otherwise
    with pytest.raises(ConfigError, match="policy"):
        bench.policy_config(cfg, "fast", tmp_path / "x")


def test_the_table_prints_both_policies_and_the_ratio() -> None:
    steps = [_step(1, 2.0, [1.0, 2.0], [0.0, 1.0])]
    pol = {p: {"policy": p, "total_wall_s": 9.0, **bench.figures(steps, [], {}, {})} for p in bench.POLICIES}
    out = {"job": "j.toml", "steps": 1, "seed": 0, "cpus": 2, "load_before": [0.1], "load_after": [0.2],
           "policies": pol, "ratios": bench.ratios(pol["static"], pol["libra"])}
    text = bench.table(out)
    assert "libra/static time per step: 1.000" in text and "idle share: training" in text
    assert text.count("static") >= 2 and "not measured" in text
    other = {"order": ["libra", "static"], "ratios": {"step_s": 0.5, "step_s_2n": 0.25, "gen_tokens_per_s": 2.0},
             "policies": pol}
    out.update(pairs=[{"order": list(bench.POLICIES), "ratios": out["ratios"], "policies": pol}, other],
               ratios_median={"step_s": 0.75, "step_s_2n": 0.625, "gen_tokens_per_s": 1.5})
    text = bench.table(out)
    assert "pair 2 (libra, static): libra/static time per step 0.500" in text
    assert "median over 2 pairs: libra/static time per step 0.750" in text and "the first of 2 pairs" in text


def test_cpu_seconds_within_a_window_from_samples() -> None:
    from libra.bench.job_cpu import process_name, window_cpu

    assert process_name(["python", "-m", "libra.actors.runtime", "--slot", "cpu1", "--role", "hybrid"]) == "cpu1:hybrid"
    assert process_name(["python", "-m", "libra.actors.runtime", "--slot", "cpu3"]) == "cpu3:action"
    assert process_name(["python", "-m", "libra.broker", "--config", "x"]) == "broker"
    assert process_name(["python", "-m", "libra.actors", "--roles", "x"]) is None
    samples = {1: [(0.0, 0.0), (10.0, 5.0)], 2: [(4.0, 0.0), (6.0, 2.0)], 3: [(0.0, 1.0), (10.0, 3.0)]}
    names = {1: "cpu0:rollout", 2: "cpu0:rollout", 3: "broker"}  # pid 2: cpu0's restarted process
    got = window_cpu(samples, names, 2.0, 8.0)
    assert got["cpu0:rollout"] == pytest.approx(3.0 + 2.0) and got["broker"] == pytest.approx(1.2)


def test_cpu_figures_by_slot_role_and_host() -> None:
    f = bench.cpu_figures({"cpu0:hybrid": 4.0, "cpu1:rollout": 2.0, "cpu2:train": 8.0, "broker": 1.0}, 10.0, 2)
    assert f["role_share"] == {"broker": 0.1, "rollout": 0.3, "train": 0.8}
    assert f["slot_share"]["cpu0:hybrid"] == 0.4 and f["host_share"] == 0.75
    assert bench.cpu_figures({}, 10.0, 2)["host_share"] is None
