"""``libra.lifetime.die_with_parent``: a child started with it ends when its parent is SIGKILLed (a killed
``libra run`` or test leaves no broker or supervisor behind); one started without it lives on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")

PARENT = """
import signal, subprocess, sys
from libra.lifetime import die_with_parent
fn = die_with_parent(signal.SIGTERM) if sys.argv[1] == "on" else None
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=fn)
print(p.pid, flush=True)
import time; time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_child_dies_with_its_sigkilled_parent_only_when_asked(mode: str) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True)
    with parent.stdout:
        child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + (10 if mode == "on" else 1.5)  # "off": still there a while after
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(child) is (mode == "off")
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
