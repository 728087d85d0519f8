"""Read a run's trackers back with each package's own reader (the tests of ``libra.rl.loggers``).

- TensorBoard: ``EventAccumulator`` over ``RUN/tensorboard`` (scalars by tag, texts by tag).
- MLflow: ``MlflowClient(...).get_metric_history`` on the file store in ``RUN/mlruns``, and the run's artifacts.
- W&B: ``wandb leet inspect --json`` (W&B's reader of an offline run's ``.wandb`` transaction log: one JSON
  object per record), its ``history`` records; :func:`wandb_offline_runs` reads each ``offline-run-*`` directory
  (a resumed run writes one more, with the same run id).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_texts(run_dir: Path) -> dict[str, list[tuple[int, str]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    return {tag.removesuffix("/text_summary"): [(e.step, make_ndarray(e.tensor_proto).item().decode())
                                                for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]}


def mlflow_run(run_dir: Path, experiment: str) -> tuple[Any, str]:
    """``(MlflowClient, run id)`` of the one run of ``experiment`` in ``RUN/mlruns``."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r} in {run_dir / 'mlruns'}"
    (run,) = client.search_runs([exp.experiment_id])
    return client, run.info.run_id


def mlflow_metric(run_dir: Path, experiment: str, key: str) -> list[tuple[int, float]]:
    client, run_id = mlflow_run(run_dir, experiment)
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def wandb_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of the one offline W&B run in ``RUN/wandb``, as ``wandb leet inspect --json`` prints them."""
    (run,) = sorted((run_dir / "wandb").glob("offline-run-*"))
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run)],
                         capture_output=True, text=True, timeout=120, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def wandb_history(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Step → the history row W&B recorded for it (the keys logged at that step)."""
    return {int(r["history"]["step"]["num"]): r["history"]["item"]
            for r in wandb_records(run_dir) if r.get("type") == "history"}


def wandb_offline_runs(run_dir: Path) -> list[tuple[str, list[int]]]:
    """``(run id, steps of its history rows)`` of each offline W&B directory in ``RUN/wandb``, oldest first."""
    out = []
    for d in sorted((run_dir / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime):
        res = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(d)],
                             capture_output=True, text=True, timeout=120, check=True)
        recs = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
        (run,) = [r["run"] for r in recs if r.get("type") == "run"]
        out.append((run["run_id"], [int(r["history"]["step"]["num"]) for r in recs if r.get("type") == "history"]))
    return out
