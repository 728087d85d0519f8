"""``python -m libra plan``: the planner's plan for a logged workload, without a broker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libra.cli import main as cli_main
from libra.policies.cost import RolloutCostModel, TrainingCostModel, load_hardware, load_model
from libra.policies.planner.allocators import PlannerConfig, make_allocator
from libra.traces import workload_of
from libra.traces import write_trace
from libra.sim.workloads import generate


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    trajs = generate("r2e", 4, 4, 16, 3)
    path = tmp_path_factory.mktemp("plan") / "r2e.jsonl"
    write_trace(path, trajs)
    return path, trajs


def test_plan_is_the_allocators_plan_for_the_last_steps(trace, capsys: pytest.CaptureFixture[str]) -> None:
    path, trajs = trace
    assert cli_main(["plan", "--trace", str(path), "--gpus", "16", "--steps", "2", "--lag", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["steps"] == [2, 3] and got["trajectories"] == 128 and got["batch"] == 64
    hw, model = load_hardware("a800"), load_model("qwen3-14b")
    alloc = make_allocator("grp", rollout_model=RolloutCostModel(hw, model), train_model=TrainingCostModel(hw, model),
                           config=PlannerConfig(n_gpus=16, global_batch=64, group_size=16, overlap_steps=2))
    want = alloc.propose(workload_of([t for t in trajs if t.step in (2, 3)]))
    assert got["n_train"] == want.n_train and [r["tp"] for r in got["rollout"]] == list(want.rollout_tps)
    assert got["objective_s"] == pytest.approx(want.objective)
    assert got["n_train"] + sum(r["tp"] for r in got["rollout"]) <= 16


def test_plan_compare_prints_every_allocator(trace, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = trace
    assert cli_main(["plan", "--trace", str(path), "--gpus", "16", "--compare"]) == 0
    out = capsys.readouterr().out
    for name in ("grp", "grp_homogeneous", "static_uniform", "static_best", "greedy", "colocated"):
        assert any(line.startswith(name + " ") for line in out.splitlines()), name
    assert " x TP" in out and "objective" in out


def test_plan_reports_bad_inputs(tmp_path: Path, trace, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = trace
    assert cli_main(["plan", "--trace", str(tmp_path / "missing.jsonl"), "--gpus", "8"]) == 1
    assert "cannot read trace" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli_main(["plan", "--trace", str(empty), "--gpus", "8"]) == 1
    assert "holds no trajectory" in capsys.readouterr().err
    assert cli_main(["plan", "--trace", str(path), "--gpus", "1"]) == 2
    assert "exceeds n_gpus=1" in capsys.readouterr().err
    assert cli_main(["plan", "--trace", str(path), "--gpus", "8", "--hardware", "tpu9"]) == 2
    assert "tpu9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["plan", "--trace", str(path), "--gpus", "0"])
