"""``python -m libra.bench ablation --seeds N``: the summary over seeds (means, spreads, plans, targets)."""

from __future__ import annotations

import pytest

from libra.bench.ablation import RUNGS
from libra.bench.ablation_seeds import format_seeds, summarize_seeds


def _run(seed: int, scale: float, tps: list[int]) -> dict:
    rows = []
    for i, (key, label, alloc, _) in enumerate(RUNGS):
        tok = 100.0 * (1 + i) * scale if key != "colocated" else 50.0 * scale
        plan = {"n_train": 8, "rollout_tps": tps} if alloc not in ("static_uniform", "colocated") else None
        rows.append({"key": key, "label": label, "allocation": alloc, "router": "r", "tokens_per_s": tok,
                     "vs_static_uniform": tok / (100.0 * scale), "vs_colocated": tok / (50.0 * scale),
                     "step_time_s": 10.0, "routing_accuracy": 0.95, "migrated_token_ratio": 0.05,
                     "model_check": {"sim_train_s": 4.0, "pred_rollout_s": 6.0, "pred_train_s": 4.0},
                     "planner": {"initial_plan": plan, "final_plan": plan} if plan else None})
    return {"seed": seed, "gpus": 48, "steps": 20, "prompts": 3, "rows": rows}


def test_summary_means_spreads_and_targets() -> None:
    s = summarize_seeds([_run(0, 1.0, [1, 2, 4]), _run(1, 2.0, [1, 2, 4])])
    by = {r["key"]: r for r in s["rows"]}
    assert by["static_uniform"]["tokens_per_s_mean"] == pytest.approx(150.0)
    assert (by["static_uniform"]["tokens_per_s_min"], by["static_uniform"]["tokens_per_s_max"]) == (100.0, 200.0)
    assert by["ehp"]["wait_for_data_s"] == pytest.approx(6.0)
    assert by["ehp"]["plans"] == ["8T+1xTP1+1xTP2+1xTP4"] * 2
    assert s["libra_vs_static_uniform"] == pytest.approx(5.0)
    t = s["targets"]
    assert t["each_rung_at_least_previous"] and t["libra_vs_static_uniform_ge_1.8"] and t["libra_vs_colocated_ge_3"]
    assert t["routing_accuracy_ge_0.91"] and t["migrated_tokens_le_0.08"]
    assert "Libra / static uniform = 5.000x" in format_seeds(s)


def test_routing_targets_are_not_credited_when_one_tp_degree_is_deployed() -> None:
    s = summarize_seeds([_run(0, 1.0, [8, 8])])
    assert s["targets"]["routing_accuracy_ge_0.91"] is None and s["targets"]["migrated_tokens_le_0.08"] is None
    assert "n/a (one TP degree deployed" in format_seeds(s)
