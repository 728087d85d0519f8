"""Experiment tracking behind one interface: ``[job] loggers = ["jsonl", "tensorboard", "mlflow", "wandb"]``.

The run directory stays the source of truth: ``metrics.jsonl`` is written by every job, and the trackers a job
names log the same step records (reward, accuracy, tool use, eval pass@k, policy lag, rollout/train/wait
seconds, tokens/s, GPU memory, the planner's predicted vs measured step, its decisions as text) through
:class:`~libra.rl.loggers.registry.StepLogger` adapters over the official packages, which are optional (the
``tracking`` extra) and imported only when named. ``registry``: the names, the interface, the checks;
``records``: record → (step, scalars, texts); ``adapters``: TensorBoard, MLflow, W&B; ``fanout``: the one writer
the driver uses.
"""

from __future__ import annotations

from libra.rl.loggers.records import gpu_fields, record_view
from libra.rl.loggers.registry import LOGGERS, LoggerUnavailable, StepLogger, check_installed, logger_problems

__all__ = ["LOGGERS", "LoggerUnavailable", "StepLogger", "check_installed", "gpu_fields", "logger_problems",
           "record_view"]
