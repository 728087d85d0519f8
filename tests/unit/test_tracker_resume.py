"""``libra run --resume`` continues the tracker runs the interrupted run started (``RUN/trackers.json``): its
metrics land in the same MLflow run and the same W&B run, read back with each package's own reader; TensorBoard
appends to its directory and hides the steps logged after the checkpoint (trained again by the resumed run).
Before, a resumed run opened a new MLflow run and a new W&B run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libra.rl.driver import clear_driver_files
from libra.rl.loggers.fanout import open_run_loggers
from tracking_readers import mlflow_metric, mlflow_run, tensorboard_scalars, wandb_offline_runs

TRACKERS = ["jsonl", "tensorboard", "mlflow", "wandb"]


@pytest.fixture(autouse=True)
def _offline_trackers(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_DISABLED", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path_factory.mktemp("wandb-cache")))


def _run(run: Path, steps: list[int], job_steps: int, resume_step: int | None = None) -> None:
    loggers = open_run_loggers(TRACKERS, run, "unit", {"job": {"name": "unit", "steps": job_steps}},
                               resume_step=resume_step)
    for s in steps:
        loggers.write({"step": s, "reward_mean": 0.1 * s, "step_time_s": 1.0})
    loggers.close()


def test_a_resumed_run_continues_the_same_mlflow_and_wandb_runs(tmp_path: Path) -> None:
    _run(tmp_path, [1, 2, 3], job_steps=3)  # checkpoint at step 2; step 3 logged, then the run stopped
    ids = json.loads((tmp_path / "trackers.json").read_text())
    _run(tmp_path, [3, 4, 5], job_steps=5, resume_step=2)  # --resume with [job] steps raised to 5
    # MLflow: one run (mlflow_run unpacks exactly one) holding both parts, finished, its params as first logged
    client, run_id = mlflow_run(tmp_path, "unit")
    assert run_id == ids["mlflow"]["run_id"]
    assert sorted({s for s, _ in mlflow_metric(tmp_path, "unit", "reward/mean")}) == [1, 2, 3, 4, 5]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["job.steps"] == "3"
    # W&B: the resumed part is the same run (same id), its history carrying on
    runs = wandb_offline_runs(tmp_path)
    assert [rid for rid, _ in runs] == [ids["wandb"]["id"]] * 2
    assert [steps for _, steps in runs] == [[1, 2, 3], [3, 4, 5]]
    # TensorBoard: one series, step 3 once (the resumed run's), no gap
    assert [s for s, _ in tensorboard_scalars(tmp_path)["reward/mean"]] == [1, 2, 3, 4, 5]


def test_a_fresh_run_in_the_same_directory_starts_new_tracker_runs(tmp_path: Path) -> None:
    _run(tmp_path, [1, 2], job_steps=2)
    first = json.loads((tmp_path / "trackers.json").read_text())
    clear_driver_files(tmp_path, resume=False)  # what libra run (without --resume) does first
    assert not (tmp_path / "trackers.json").exists()
    _run(tmp_path, [1, 2], job_steps=2)
    second = json.loads((tmp_path / "trackers.json").read_text())
    assert second["mlflow"]["run_id"] != first["mlflow"]["run_id"] and second["wandb"]["id"] != first["wandb"]["id"]
