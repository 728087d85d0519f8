"""Stopping the processes an integration test started: SIGTERM, a grace period, then SIGKILL."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable

from libra.local import stop_process


def stop_all(procs: Iterable[subprocess.Popen], grace_s: float = 15.0) -> None:
    """Stop every process still running, last started first."""
    for p in reversed(list(procs)):
        stop_process(p, grace_s)
