"""Workload generators: determinism, trace validity, and the calibration facts of docs/papers.md §1.2/§5.1.

Calibration tests run on fixed seeds. R2E facts use 10 steps × 60 prompts × 4 samples (2,400 trajectories)
so that per-step means are not dominated by a handful of GRPO groups; the group-size-16 default is
exercised separately.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from libra.traces import TrajectorySpec, read_trace
from libra.sim.workload_profiles import R2E, WorkloadProfile, get_profile
from libra.sim.workload_routing import routing_accuracy
from libra.sim.workload_stats import workload_stats
from libra.sim.workloads import generate, generate_group, main


@pytest.fixture(scope="module")
def r2e() -> list[TrajectorySpec]:
    return generate("r2e", steps=10, prompts_per_step=60, group_size=4, seed=7)


@pytest.fixture(scope="module")
def r2e_stats(r2e: list[TrajectorySpec]) -> dict:
    return workload_stats(r2e, bucket_thresholds=R2E.bucket_thresholds, size_thresholds=R2E.size_thresholds)


# -- shape, determinism, validity -------------------------------------------------------------------


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    a = generate("search_r1", 3, 2, group_size=4, seed=1)
    assert a == generate("search_r1", 3, 2, group_size=4, seed=1)
    assert a != generate("search_r1", 3, 2, group_size=4, seed=2)


def test_a_group_does_not_depend_on_what_else_is_generated() -> None:
    full = generate("r2e", steps=4, prompts_per_step=3, group_size=5, seed=3)
    alone = generate_group(R2E, step=2, steps=4, prompt_index=2 * 3 + 1, group_size=5, seed=3, first_id=35)
    assert full[35:40] == alone


@pytest.mark.parametrize("name", ["r2e", "search_r1", "dapo_math"])
def test_every_workload_writes_valid_trace_lines(name: str) -> None:
    trajs = generate(name, steps=3, prompts_per_step=4, group_size=16, seed=0)
    assert len(trajs) == 3 * 4 * 16
    assert len({t.id for t in trajs}) == len(trajs)
    assert [t.step for t in trajs] == sorted(t.step for t in trajs)  # submission order
    for t in trajs:
        assert TrajectorySpec.from_dict(json.loads(json.dumps(t.to_dict()))) == t
        assert t.group == f"{t.prompt_id}@{t.step}"
        assert t.total_tokens <= 40_960
        assert all(turn.gen_tokens >= 1 for turn in t.turns)
    by_group: dict[str, set[int]] = {}
    for t in trajs:
        by_group.setdefault(t.group, set()).add(t.prompt_tokens)
    assert len(by_group) == 12 and all(len(v) == 1 for v in by_group.values())


def test_r2e_tools_times_demands_and_elastic(r2e: list[TrajectorySpec]) -> None:
    calls = [turn for t in r2e for turn in t.tool_turns]
    assert {c.tool for c in calls} == {"bash", "python"}
    assert all(0.5 <= (c.tool_seconds or 0) <= 10.0 for c in calls)
    assert all(c.demand == {"cpu": 1} for c in calls)
    elastic = [c for c in calls if c.elastic is not None]
    plain = [c for c in calls if c.elastic is None]
    assert 0.2 < len(elastic) / len(calls) < 0.9
    assert all(e.elastic.resource == "cpu" and e.elastic.max_units == 8 for e in elastic)  # type: ignore[union-attr]
    assert all(0.6 <= e.elastic.parallel_fraction <= 0.8 for e in elastic)  # type: ignore[union-attr]
    # Build/test-like calls are the slow ones.
    assert np.median([c.tool_seconds for c in elastic]) > 2 * np.median([c.tool_seconds for c in plain])
    assert max(t.prompt_tokens for t in r2e) <= 2048


def test_search_and_math_tools() -> None:
    search = [c for t in generate("search_r1", 4, 4, seed=0) for c in t.tool_turns]
    assert {c.tool for c in search} == {"search"} and all(0.5 <= (c.tool_seconds or 0) <= 2.0 for c in search)
    math_trajs = generate("dapo_math", 4, 8, seed=0)
    checks = [c for t in math_trajs for c in t.tool_turns]
    assert {c.tool for c in checks} == {"python"} and all(0.1 <= (c.tool_seconds or 0) <= 1.0 for c in checks)
    assert np.mean([t.num_tool_calls for t in math_trajs]) < 1.5
    assert np.mean([t.num_tool_calls == 0 for t in math_trajs]) > 0.4
    # Math is one long reasoning turn: the first turn dominates the generated tokens.
    assert np.mean([t.turns[0].gen_tokens / t.total_gen_tokens for t in math_trajs]) > 0.6


def test_dataset_size_revisits_prompts_with_the_same_prompt() -> None:
    trajs = generate("r2e", steps=4, prompts_per_step=3, group_size=2, seed=0, dataset_size=5)
    seen: dict[str, int] = {}
    for t in trajs:
        assert seen.setdefault(t.prompt_id, t.prompt_tokens) == t.prompt_tokens
    assert len(seen) == 5 and len({t.group for t in trajs}) == 12


def test_bad_arguments_raise_value_errors_naming_them() -> None:
    with pytest.raises(ValueError, match=r"unknown workload: 'swe' \(known: dapo_math, r2e, search_r1\)"):
        generate("swe", 1, 1)
    with pytest.raises(ValueError, match="prompts_per_step must be a positive integer, got 0"):
        generate("r2e", 1, 0)
    with pytest.raises(ValueError, match="dataset_size"):
        generate("r2e", 1, 1, dataset_size=0)
    with pytest.raises(ValueError, match="at least one trajectory"):
        workload_stats([])


# -- calibration (a): long tail ----------------------------------------------------------------------


def test_top_decile_takes_most_of_the_decode_work(r2e_stats: dict) -> None:
    assert r2e_stats["top10_share_decode_work"] > 0.5
    assert r2e_stats["top10_share_decode_work_per_step_mean"] > 0.5
    # By tokens the tail is lighter: decode work grows faster than linearly with length.
    assert 0.2 < r2e_stats["top10_share_gen_tokens"] < r2e_stats["top10_share_decode_work"]


# -- calibration (b): tool outcomes drive the final length --------------------------------------------


def test_tool_outcome_examples(r2e: list[TrajectorySpec], r2e_stats: dict) -> None:
    # ~1K tool tokens -> well under 8K; 12.5K tool tokens -> about 21K.
    assert r2e_stats["tool_tokens_1k_n"] > 100 and r2e_stats["tool_tokens_1k_p90_total"] < 8000
    assert r2e_stats["tool_tokens_12k_n"] > 20 and 17_000 < r2e_stats["tool_tokens_12k_mean_total"] < 25_000
    # Repeated failures -> past 40K (the cap), and nothing gets there without repeated failures.
    assert r2e_stats["failures_8plus_mean_total"] > 30_000
    assert r2e_stats["failures_8plus_frac_over_40k"] > 0.25
    assert r2e_stats["over_40k_min_failures"] >= 2
    assert max(t.total_tokens for t in r2e) == 40_960
    assert r2e_stats["failures_0_frac_over_40k"] == 0.0


# -- calibration (c): drift --------------------------------------------------------------------------


def test_mean_length_drifts_linearly_from_2_5k_to_11_5k(r2e_stats: dict) -> None:
    assert 2000 < r2e_stats["drift_fit_start"] < 3000
    assert 10_000 < r2e_stats["drift_fit_end"] < 13_000
    assert r2e_stats["drift_fit_r2"] > 0.9
    means = r2e_stats["mean_total_by_step"]
    assert means[-1] > 3 * means[0]


# -- (d): causality ------------------------------------------------------------------------------------


def _means(profile: WorkloadProfile, **changes: Any) -> tuple[float, float]:
    """(mean generated tokens, mean total tokens) of a small trace of ``profile`` with ``changes``."""
    prof = dataclasses.replace(profile, **changes)
    trajs = generate(prof.name, 2, 40, group_size=4, seed=11, profile=prof)
    return float(np.mean([t.total_gen_tokens for t in trajs])), float(np.mean([t.total_tokens for t in trajs]))


def test_intervening_on_tool_outcomes_changes_the_length() -> None:
    """Forcing the tool-return states (same seeds otherwise) moves the length: causal, not correlated."""
    always_pass, _ = _means(R2E, p_check_fail=(0.0, 0.0), p_explore_fail=(0.0, 0.0), p_timeout=0.0)
    always_fail_first, _ = _means(R2E, p_check_fail=(1.0, 1.0))
    assert always_fail_first > 2 * always_pass
    never, always = (0.0, 0.0), (1.0, 1.0)
    # The size of the error output is its severity: more fix rounds and more generated tokens ...
    small_gen, small_total = _means(R2E, p_check_fail=always, payload_failure=(always, never, never))
    medium_gen, _ = _means(R2E, p_check_fail=always, payload_failure=(never, always, never))
    assert medium_gen > 1.5 * small_gen
    # ... and a large payload fills the context.
    _, large_total = _means(R2E, p_check_fail=always, payload_failure=(never, never, always))
    assert large_total > 3 * small_total


def test_cascade_and_prompt_correlation(r2e_stats: dict) -> None:
    assert r2e_stats["p_fail_after_failure"] > r2e_stats["p_fail_after_success"] + 0.08
    assert r2e_stats["remaining_after_failure_mean"] > 1.5 * r2e_stats["remaining_after_success_mean"]
    assert abs(r2e_stats["corr_prompt_total"]) < 0.2


def test_grpo_group_shares_latent_difficulty() -> None:
    """The group explains far more length variance than a random regrouping within each step does."""
    trajs = generate("r2e", steps=4, prompts_per_step=16, group_size=16, seed=2)
    rng = np.random.default_rng(0)
    shuffled = []
    for step in range(4):
        batch = [t for t in trajs if t.step == step]
        groups = [t.group for t in batch]
        rng.shuffle(groups)
        shuffled += [dataclasses.replace(t, group=g) for t, g in zip(batch, groups)]
    real = workload_stats(trajs, routing=False)["group_share_of_variance"]
    baseline = workload_stats(shuffled, routing=False)["group_share_of_variance"]
    assert real > 2 * baseline


def test_tool_state_prefix_routes_better_than_prompt_features(r2e_stats: dict) -> None:
    ss_prefix, ss_prompt = r2e_stats["routing_prefix_single_shot"], r2e_stats["routing_prompt_single_shot"]
    late_prefix, late_prompt = (
        r2e_stats["routing_prefix_single_shot_late"],
        r2e_stats["routing_prompt_single_shot_late"],
    )
    # Scored on remaining *response* tokens (tool payloads included), the unit of the bucket thresholds.
    assert 0.75 < ss_prefix < 0.97  # informative, not perfect
    assert ss_prefix > ss_prompt + 0.03
    assert late_prefix > late_prompt + 0.05
    assert late_prefix > r2e_stats["routing_depth_single_shot_late"] + 0.05  # the states, not the depth


def test_search_r1_prefix_beats_prompt_too() -> None:
    prof = get_profile("search_r1")
    trajs = generate("search_r1", steps=10, prompts_per_step=40, group_size=4, seed=5)
    acc = routing_accuracy(trajs, prof.bucket_thresholds, prof.size_thresholds)
    assert acc["prefix_single_shot_late"] > acc["prompt_single_shot_late"] + 0.03
    assert acc["decisions"] > acc["single_shots"] > 0


def test_routing_accuracy_on_a_hand_built_trace() -> None:
    """States fully determine the remaining length; prompt tokens do not: prefix 100%, prompt 50%."""

    def traj(idx: int, step: int, status: str) -> TrajectorySpec:
        first = {"gen_tokens": 100, "tool": "bash", "tool_seconds": 1.0, "payload_tokens": 10, "status": status}
        last_gen = 9000 if status == "failure" else 50
        data = {"id": f"t{idx}", "prompt_id": f"p{idx}", "step": step, "group": f"g{idx}", "prompt_tokens": 300}
        return TrajectorySpec.from_dict({**data, "turns": [first, {"gen_tokens": last_gen}]})

    trajs = [traj(i, i // 4, "failure" if i % 2 else "success") for i in range(8)]
    acc = routing_accuracy(trajs, bucket_thresholds=(4000, 12000, 30000))
    assert acc["single_shots"] == 4 and acc["decisions"] == 4
    assert acc["prefix_single_shot"] == 1.0
    assert acc["prompt_single_shot"] == 0.5


# -- CLI ----------------------------------------------------------------------------------------------


def test_cli_writes_a_trace_and_prints_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "w.jsonl"
    argv = ["--workload", "search_r1", "--steps", "2", "--prompts", "3", "--group-size", "4", "--seed", "1"]
    assert main([*argv, "--out", str(out), "--stats", "--json"]) == 0
    trajs = read_trace(out)
    assert trajs == generate("search_r1", 2, 3, group_size=4, seed=1)
    stats = json.loads(capsys.readouterr().out)
    assert stats["trajectories"] == 24 and "routing_prefix_single_shot" in stats
    assert main([*argv, "--stats"]) == 0
    assert "top10_share_decode_work" in capsys.readouterr().out


def test_cli_rejects_bad_invocations(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--workload", "nope", "--stats"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["--workload", "r2e"])
    assert exc.value.code == 2 and "nothing to do" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--workload", "r2e", "--steps", "0", "--stats"])
