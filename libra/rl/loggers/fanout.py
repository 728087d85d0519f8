"""One writer for a run's records: ``metrics.jsonl`` first, then every tracker of ``[job] loggers``.

:func:`open_run_loggers` opens ``RUN/metrics.jsonl`` (always: it is the run's source of truth) and the trackers
the list names (:mod:`libra.rl.loggers.adapters`). :meth:`RunLoggers.write` takes every record the driver
writes (steps, eval rounds, decisions): the line goes to ``metrics.jsonl`` exactly as before, then each tracker
logs :func:`~libra.rl.loggers.records.record_view` of it. A tracker that fails while the job runs is said once
and dropped (the job and its run directory go on); one that cannot start fails the job before it is submitted
(:class:`~libra.rl.loggers.registry.LoggerUnavailable`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from libra.logging import get_logger
from libra.rl.loggers.adapters import MlflowLogger, TensorBoardLogger, WandbLogger
from libra.rl.loggers.records import record_view
from libra.rl.loggers.registry import LoggerUnavailable, StepLogger, check_installed
from libra.rl.metrics import MetricsWriter

__all__ = ["ADAPTERS", "RunLoggers", "open_run_loggers"]

log = get_logger("libra.rl.loggers")

ADAPTERS: dict[str, Callable[[Path, str, Mapping[str, Any], int | None], StepLogger]] = {  # resume_step: None fresh
    "tensorboard": TensorBoardLogger, "mlflow": MlflowLogger, "wandb": WandbLogger}


class RunLoggers:
    """``metrics.jsonl`` and the trackers behind the one ``write(record)`` the driver calls."""

    def __init__(self, metrics: MetricsWriter, trackers: list[StepLogger]) -> None:
        self.metrics = metrics
        self.trackers = list(trackers)

    def write(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        view = record_view(record)
        if view is None:
            return
        for t in list(self.trackers):
            try:
                t.log_step(*view)
            except Exception as exc:  # noqa: BLE001 - a tracker's failure must not stop the job
                log.warning("tracker_dropped", logger=t.name, error=f"{type(exc).__name__}: {exc}",
                            note="the run directory keeps every record")
                self.trackers.remove(t)
                _close(t)

    def locations(self) -> dict[str, str]:
        """Tracker name → where it wrote (for the end-of-run report)."""
        return {t.name: t.location for t in self.trackers}

    def close(self) -> None:
        self.metrics.close()
        for t in self.trackers:
            _close(t)


def _close(t: StepLogger) -> None:
    try:
        t.close()
    except Exception as exc:  # noqa: BLE001
        log.warning("tracker_close_failed", logger=t.name, error=f"{type(exc).__name__}: {exc}")


def open_run_loggers(names: list[str], run_dir: Path, run_name: str, config: Mapping[str, Any],
                     resume_step: int | None = None) -> RunLoggers:
    """``RUN/metrics.jsonl`` and the trackers of ``names`` (``jsonl`` is the file itself); ``resume_step``: the
    run resumes from that step's checkpoint, each tracker continues its run (``RUN/trackers.json``); raises
    :class:`LoggerUnavailable` (and closes what it opened) when a tracker's package is missing or its run does
    not start."""
    check_installed(names)
    trackers: list[StepLogger] = []
    try:
        for name in names:
            if name in ADAPTERS:
                try:
                    trackers.append(ADAPTERS[name](run_dir, run_name, config, resume_step))
                except Exception as exc:  # noqa: BLE001 - said as the typed error, naming the tracker
                    raise LoggerUnavailable(f"[job] loggers: {name!r} could not start its run in {run_dir} "
                                            f"({type(exc).__name__}: {exc})") from exc
    except BaseException:
        for t in trackers:
            _close(t)
        raise
    return RunLoggers(MetricsWriter(run_dir / "metrics.jsonl"), trackers)
