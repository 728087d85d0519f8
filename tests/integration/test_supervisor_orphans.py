"""A supervisor that is SIGKILLed takes its slots with it (real processes): each slot process is started with
``PR_SET_PDEATHSIG`` and gets SIGKILL when the supervisor dies, instead of living on as an orphan that keeps
retrying its broker and holding its model's memory (five were found after a test harness's stop)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from libra.local import free_port

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")]


def _wait(cond, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_killed_supervisor_leaves_no_slot_behind() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"  # no broker: the slots keep trying to reach it
    sup = subprocess.Popen([sys.executable, "-m", "libra.actors", "--broker", url, "--cpu-slots", "2",
                            "--gpu-slots", "0", "--no-sandbox"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    slots: list[psutil.Process] = []
    try:
        parent = psutil.Process(sup.pid)
        _wait(lambda: len(parent.children()) == 2, 60.0, "two slot processes")
        slots = parent.children()
        sup.send_signal(signal.SIGKILL)
        sup.wait(30)
        _wait(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in slots), 60.0,
              "the slots to exit after their supervisor died")
    finally:  # whatever is left (the supervisor, or orphans when the test fails)
        for p in [*psutil.Process().children(recursive=True), *slots]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
