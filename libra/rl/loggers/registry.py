"""The ``[job] loggers`` names, the interface every tracker keeps, and the checks of a job's list.

``jsonl`` is the run directory's ``metrics.jsonl``, written by every job whatever the list says (summaries,
plots and ``--resume`` read it). ``tensorboard`` (``torch.utils.tensorboard``; event files in
``RUN/tensorboard/``), ``mlflow`` (a local file store in ``RUN/mlruns/``, or ``MLFLOW_TRACKING_URI`` when set) and
``wandb`` (offline runs in ``RUN/wandb/``, unless ``WANDB_MODE`` says otherwise) are thin adapters over the
official packages (:mod:`libra.rl.loggers.adapters`), optional (the ``tracking`` extra) and imported only when a
job names them. :func:`logger_problems` is what ``load_job`` says of a bad list (an unknown or repeated name);
:func:`check_installed` imports the packages of a job's list before anything starts and raises
:class:`LoggerUnavailable` naming the one that is missing and the extra to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Protocol

from libra.config import ConfigError

__all__ = ["LOGGERS", "TRACKING_EXTRA", "LoggerUnavailable", "StepLogger", "check_installed", "logger_problems"]

TRACKING_EXTRA = "pip install 'libra[tracking]'"
# name → the module its adapter imports ("": none, the run directory's own file)
LOGGERS: dict[str, str] = {"jsonl": "", "tensorboard": "torch.utils.tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


class LoggerUnavailable(ConfigError):
    """A ``[job] loggers`` tracker that cannot run here: its package is not installed (or does not import), or it
    could not start its run. The message names the logger, the package and what to install."""


class StepLogger(Protocol):
    """One experiment tracker: the same step, scalars and texts for every backend
    (:func:`libra.rl.loggers.records.record_view`)."""

    name: str
    location: str  # where its files (or its server) are, for the end-of-run report

    def log_step(self, step: int, scalars: Mapping[str, float], texts: Mapping[str, str]) -> None: ...

    def close(self) -> None: ...


def logger_problems(names: list[str]) -> list[str]:
    """What is wrong with a ``[job] loggers`` list (empty: nothing): unknown names, a name given twice."""
    problems = []
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        problems.append(f"[job] loggers: unknown logger(s) {', '.join(repr(n) for n in unknown)} "
                        f"(known: {', '.join(LOGGERS)})")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        problems.append(f"[job] loggers: {', '.join(repr(n) for n in twice)} given more than once")
    return problems


def _hint(missing: str) -> str:
    return "pip install 'libra[train]'" if missing.split(".")[0] == "torch" else TRACKING_EXTRA


def check_installed(names: list[str]) -> None:
    """Import the package of every tracker in ``names``; :class:`LoggerUnavailable` for the first that does
    not import, naming it and the extra that installs it."""
    for name in names:
        module = LOGGERS.get(name, "")
        if not module:
            continue
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing = exc.name or name  # each tracker's package is named as the tracker
            raise LoggerUnavailable(f"[job] loggers: {name!r} needs the {missing!r} package, which does not import "
                                    f"here ({exc}): {_hint(missing)}") from None
