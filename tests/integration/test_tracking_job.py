"""The bundled tiny job with ``[job] loggers = ["jsonl", "tensorboard", "mlflow", "wandb"]`` on real processes
(broker, rollout, trainer, tool and episode slots on loopback): each tracker's files are read back with its
package's own reader (TensorBoard's event files, MLflow's run metrics, W&B's offline run) and hold the reward
of every step that ``metrics.jsonl`` holds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from libra.rl.config import load_job
from libra.rl.driver import run_job
from libra.rl.metrics import read_metrics
from tracking_readers import mlflow_metric, tensorboard_scalars, tensorboard_texts, wandb_history, wandb_records

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap (bwrap) is not installed: sudo apt-get install bubblewrap")]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith_tiny.toml"
LOGGERS = '["jsonl", "tensorboard", "mlflow", "wandb"]'


def test_the_tiny_job_logs_every_step_to_each_tracker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_DISABLED", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)  # the defaults: W&B offline, MLflow in the run directory
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    job = tmp_path / "job.toml"
    text = EXAMPLE.read_text()
    assert "\n[job]\n" in text
    job.write_text(text.replace("\n[job]\n", f"\n[job]\nloggers = {LOGGERS}\n", 1))
    run = tmp_path / "run"
    cfg = load_job(job).with_run_dir(str(run))
    assert cfg.job.loggers == ["jsonl", "tensorboard", "mlflow", "wandb"]

    summary = run_job(cfg, progress=False)

    steps = read_metrics(run)
    assert [r["step"] for r in steps] == [1, 2, 3]
    want = [(r["step"], r["reward_mean"]) for r in steps]
    assert sorted(summary["loggers"]) == ["mlflow", "tensorboard", "wandb"]
    tb = tensorboard_scalars(run)
    assert [(s, pytest.approx(v, rel=1e-6)) for s, v in tb["reward/mean"]] == want  # float32 in event files
    assert [s for s, _ in tb["time/rollout_s"]] == [1, 2, 3] and [s for s, _ in tb["lag/policy_lag_max"]] == [1, 2, 3]
    assert "config" in tensorboard_texts(run)
    assert mlflow_metric(run, cfg.job.name, "reward/mean") == want
    assert [s for s, _ in mlflow_metric(run, cfg.job.name, "throughput/tokens_per_s")] == [1, 2, 3]
    hist = wandb_history(run)
    assert [(s, hist[s]["reward/mean"]) for s in (1, 2, 3)] == want
    assert all("time/train_s" in hist[s] for s in (1, 2, 3))
    (head,) = [r for r in wandb_records(run) if r.get("type") == "run"]
    assert head["run"]["display_name"] == cfg.job.name and head["run"]["telemetry"]["feature"]["offline"]
