"""A serving owner's process for tests: ``python -m libra.serving --tiny small`` on a free loopback port."""

from __future__ import annotations

import contextlib
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from libra.local import stop_process
from libra.serving.process import start_serving


@contextlib.contextmanager
def serving_process(work: Path, window_s: float = 8.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """``(base url, process)`` of a serving process on one CPU thread, stopped on exit."""
    proc, url = start_serving(work / "serving.err", window_s=window_s)
    try:
        yield url, proc
    finally:
        stop_process(proc)
        if proc.stdout:
            proc.stdout.close()


def load_reading(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/load", timeout=10) as resp:
        return json.loads(resp.read())
