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

Resuming (``libra run --resume``; ``resume_step``: the checkpoint's step, None for a fresh run): each tracker
continues the run it started. The ids are kept in ``RUN/trackers.json`` (:data:`TRACKER_IDS`, written as soon as a
run starts, removed by a fresh run): MLflow reopens its run (``run_id``; status back to RUNNING, only params the
run lacks are logged: MLflow refuses to change one, e.g. a raised ``[job] steps``; a step the crashed run logged
after its checkpoint holds both values, MLflow has no way to remove one), W&B passes ``id=`` with
``resume="allow"`` (an offline run then writes a second ``offline-run-*`` directory with the same id, which
``wandb sync`` adds to that run). TensorBoard writes a new event file in the same directory with
``purge_step = resume_step + 1``: the steps the crashed run logged after its checkpoint (trained again now) are
hidden from readers instead of shown twice; the configuration text is not written again.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["TRACKER_IDS", "MlflowLogger", "TensorBoardLogger", "WandbLogger", "flat_params", "read_tracker_ids"]

TRACKER_IDS = "trackers.json"  # in the run directory: {"mlflow": {"run_id", "location"}, "wandb": {"id"}}


def read_tracker_ids(run_dir: Path) -> dict[str, Any]:
    """The tracker runs the run directory's earlier runs started (``{}`` when none, or unreadable)."""
    try:
        ids = json.loads((run_dir / TRACKER_IDS).read_text())
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def _save_tracker_id(run_dir: Path, name: str, value: dict[str, Any]) -> None:
    ids = {**read_tracker_ids(run_dir), name: value}
    tmp = run_dir / f".{TRACKER_IDS}.tmp"
    tmp.write_text(json.dumps(ids, indent=1))
    os.replace(tmp, run_dir / TRACKER_IDS)


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

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any], resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.location = str(run_dir / "tensorboard")
        self._w = SummaryWriter(log_dir=self.location, purge_step=None if resume_step is None else resume_step + 1)
        if resume_step is not None:
            return  # the configuration is in the directory already
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

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any], resume_step: int | None = None) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.location = os.environ.get("MLFLOW_TRACKING_URI") or ""
        if not self.location:  # the run directory's own store
            self.location = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.location)
        have: dict[str, str] = {}
        old = read_tracker_ids(run_dir).get("mlflow") if resume_step is not None else None
        if isinstance(old, dict) and old.get("location") == self.location and old.get("run_id"):
            self.run_id: str = str(old["run_id"])
            have = dict(self.client.get_run(self.run_id).data.params)  # raises if the run is gone: said as typed
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            exp = self.client.get_experiment_by_name(run_name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(run_name)
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        _save_tracker_id(run_dir, "mlflow", {"run_id": self.run_id, "location": self.location})
        params = [Param(_MLFLOW_KEY.sub("_", k)[:250], v[:6000]) for k, v in flat_params(config).items()]
        params = [p for p in params if p.key not in have]  # a resumed run keeps the values it has
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

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any], resume_step: int | None = None) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or "offline"
        old = read_tracker_ids(run_dir).get("wandb") if resume_step is not None else None
        run_id = str(old["id"]) if isinstance(old, dict) and old.get("id") else None  # None: W&B makes one
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "libra", name=run_name, dir=str(run_dir),
                              mode=mode, config=dict(config), reinit="create_new", id=run_id, resume="allow",
                              settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        _save_tracker_id(run_dir, "wandb", {"id": self.run.id})
        self.location = str(Path(self.run.dir).parent)  # RUN/wandb/offline-run-<time>-<id>
        self._step = 0

    def log_step(self, step: int, scalars: Mapping[str, float], texts: Mapping[str, str]) -> None:
        self._step = max(step, self._step)
        self.run.log({**scalars, **texts}, step=self._step)

    def close(self) -> None:
        self.run.finish()
