"""Stopping the processes an integration test started: SIGTERM, a grace period, then SIGKILL."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable


def stop_all(procs: Iterable[subprocess.Popen], grace_s: float = 15.0) -> None:
    """Stop every process still running, last started first."""
    for p in reversed(list(procs)):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
