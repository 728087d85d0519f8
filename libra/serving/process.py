"""Start ``python -m libra.serving`` as a child process and read the address it announces: for the benchmarks
and tests that need a real serving owner on loopback."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

__all__ = ["start_serving"]


def start_serving(stderr_path: Path, *, preset: str = "small", window_s: float = 10.0, cpu_threads: int = 1,
                  max_batch: int = 32) -> tuple[subprocess.Popen, str]:
    """``(process, base url)`` of a serving process on a free loopback port (the random-initialised ``preset``
    model, ``cpu_threads`` torch threads), its stderr in ``stderr_path``. Raises ``RuntimeError`` (the process
    killed) when it announces no address; the caller stops it (``libra.local.stop_process``) and closes its
    stdout."""
    with open(stderr_path, "w") as err:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "libra.serving", "--tiny", preset, "--port", "0",
                                 "--cpu-threads", str(cpu_threads), "--max-batch-size", str(max_batch),
                                 "--window-s", str(window_s)], stdout=subprocess.PIPE, stderr=err, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    m = re.search(r"http://127\.0\.0\.1:\d+", line)
    if not m:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"libra.serving announced no address: {line!r}; its stderr: "
                           f"{Path(stderr_path).read_text()[-2000:]}")
    return proc, m[0]
