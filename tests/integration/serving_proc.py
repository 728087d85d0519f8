"""A serving owner's process for tests: ``python -m libra.serving --tiny small`` on a free loopback port."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from libra.local import stop_process


@contextlib.contextmanager
def serving_process(work: Path, window_s: float = 8.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """``(base url, process)`` of a serving process on one CPU thread, stopped on exit."""
    err = open(work / "serving.err", "w+")  # noqa: SIM115 (closed below, after the process)
    proc = subprocess.Popen([sys.executable, "-m", "libra.serving", "--tiny", "small", "--port", "0",
                             "--cpu-threads", "1", "--max-batch-size", "32", "--window-s", str(window_s)],
                            stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        m = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert m, f"no address announced: {line!r} {(work / 'serving.err').read_text()[-2000:]}"
        yield m[0], proc
    finally:
        stop_process(proc)
        if proc.stdout:
            proc.stdout.close()
        err.close()


def load_reading(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/load", timeout=10) as resp:
        return json.loads(resp.read())
