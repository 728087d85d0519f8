"""Thin adapters over the official tracking packages, each a :class:`~libra.rl.loggers.registry.StepLogger`.

Each is built with the run directory, the run's name (``[job] name``) and the resolved job configuration (a
nested mapping), imports its package only then, and logs what :func:`libra.rl.loggers.records.record_view`
gives: scalars by step, texts (the broker's decisions) by step, the configuration once.

- :class:`TensorBoardLogger`: ``torch.utils.tensorboard.SummaryWriter`` into ``RUN/tensorboard/``; scalars with
  ``add_scalar``, texts with ``add_text``, the configuration as the text ``config`` at step 0; flushed after
  every step, so a crashed run keeps its steps.
- :class:`MlflowLogger`: ``MlflowClient`` on ``MLFLOW_TRACKING_URI`` when set, else a local file store in
  ``RUN/mlruns/`` (MLflow 3 refuses its file store unless ``MLFLOW_ALLOW_FILE_STORE`` is true: set here when
  unset; readers such as ``mlflow ui --backend-store-uri RUN/mlruns`` need it too). One MLflow run per job run in
  the experiment named as the job; the configuration as flattened params (``env.options.max_operand``); scalars
  with ``log_batch``; each text key as an artifact ``decisions/<what>.txt`` holding every decision so far.
- :class:`WandbLogger`: ``wandb.init(mode="offline")`` into ``RUN/wandb/`` unless ``WANDB_MODE`` is set (then
  W&B does what it says; ``wandb sync RUN/wandb/offline-run-*`` uploads an offline run later); project
  ``WANDB_PROJECT`` or ``libra``; the console is not captured and system stats are off (the job's own records
  carry the GPU memory). W&B's steps must not go back: a record of an earlier step (a decision made during a
  step that was already logged) is logged at the newest step.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["MlflowLogger", "TensorBoardLogger", "WandbLogger", "flat_params"]


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested mapping as ``{"table.key": "value"}`` (lists and scalars as JSON text)."""
    out: dict[str, str] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flat_params(v, key + "."))
        else:
            out[key] = v if isinstance(v, str) else json.dumps(v, default=str)
    return out


class TensorBoardLogger:
    name = "tensorboard"

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.location = str(run_dir / "tensorboard")
        self._w = SummaryWriter(log_dir=self.location)
        body = json.dumps(config, indent=1, sort_keys=True, default=str)
        self._w.add_text("config", "\n".join("    " + line for line in body.splitlines()), 0)  # a Markdown code block
        self._w.flush()

    def log_step(self, step: int, scalars: Mapping[str, float], texts: Mapping[str, str]) -> None:
        for k, v in scalars.items():
            self._w.add_scalar(k, v, step)
        for k, t in texts.items():
            self._w.add_text(k, t, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


_MLFLOW_KEY = re.compile(r"[^\w\-. /:]")  # what MLflow allows in a metric or param name


class MlflowLogger:
    name = "mlflow"

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.location = os.environ.get("MLFLOW_TRACKING_URI") or ""
        if not self.location:  # the run directory's own store
            self.location = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.location)
        exp = self.client.get_experiment_by_name(run_name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(run_name)
        self.run_id: str = self.client.create_run(exp_id, run_name=run_name).info.run_id
        params = [Param(_MLFLOW_KEY.sub("_", k)[:250], v[:6000]) for k, v in flat_params(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self._texts: dict[str, list[str]] = {}

    def log_step(self, step: int, scalars: Mapping[str, float], texts: Mapping[str, str]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_MLFLOW_KEY.sub("_", k), float(v), now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])
        for k, t in texts.items():
            lines = self._texts.setdefault(k, [])
            lines.append(f"step {step}: {t}")
            self.client.log_text(self.run_id, "\n".join(lines) + "\n", f"{_MLFLOW_KEY.sub('_', k)}.txt")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbLogger:
    name = "wandb"

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or "offline"
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "libra", name=run_name, dir=str(run_dir),
                              mode=mode, config=dict(config), reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        self.location = str(Path(self.run.dir).parent)  # RUN/wandb/offline-run-<time>-<id>
        self._step = 0

    def log_step(self, step: int, scalars: Mapping[str, float], texts: Mapping[str, str]) -> None:
        self._step = max(step, self._step)
        self.run.log({**scalars, **texts}, step=self._step)

    def close(self) -> None:
        self.run.finish()
