"""``libra run`` stopped with SIGTERM takes its local broker and actors down with it (they used to outlive it)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_stops_the_job_and_every_process_it_started(tmp_path) -> None:
    run = subprocess.Popen([sys.executable, "-m", "libra", "run", str(ROOT / "examples" / "arith_tiny.toml"),
                            "--run-dir", str(tmp_path / "run"), "--no-progress"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        parent = psutil.Process(run.pid)
        deadline = time.monotonic() + 120
        children: list[psutil.Process] = []
        while time.monotonic() < deadline:  # wait until the broker and the actor slots are up
            children = parent.children(recursive=True)
            if sum("libra.actors.runtime" in " ".join(c.cmdline()) for c in children if c.is_running()) >= 2:
                break
            time.sleep(0.5)
        assert any("libra.broker" in " ".join(c.cmdline()) for c in children), "the job started no broker"
        run.send_signal(signal.SIGTERM)
        run.wait(60)
        gone, alive = psutil.wait_procs(children, timeout=60)
        assert not alive, f"left running after SIGTERM: {[' '.join(p.cmdline()[:4]) for p in alive]}"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        for c in psutil.Process().children(recursive=True):
            c.kill()
