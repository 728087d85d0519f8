"""The agentic RL job: job files (``config``), pure job state (``job``), the episode session
(``episode``), the driver (``driver``: ``python -m libra run JOB.toml``) and run metrics (``metrics``)."""

from __future__ import annotations

from libra.rl.config import JobConfig, load_job

__all__ = ["JobConfig", "load_job"]
