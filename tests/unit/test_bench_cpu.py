"""The CPU accounting of ``python -m libra.bench broker``: a process tree's CPU seconds (psutil), per call."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


from libra.bench.broker_drive import cpu_per_call, cpu_s

def test_a_process_trees_cpu_counts_its_children_and_per_call_divides_it() -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"],
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        last = -1.0
        while (now := cpu_s(parent.pid)) < 0.3 or now != last:  # the grandchild's burn, counted; then it sleeps
            assert time.monotonic() < deadline, f"tree CPU stayed at {now}"
            last = now
            time.sleep(0.2)
        before = cpu_per_call({"tree": parent.pid}, 10)
        assert set(before) == {"tree", "client"} and before["tree"] >= 0.3
        t = time.process_time()
        while time.process_time() - t < 0.1:
            pass
        per = cpu_per_call({"tree": parent.pid}, 10, before)
        assert per["client"] >= 0.1 / 10 * 1e6 * 0.9  # this process's CPU, µs per call
        assert 0 <= per["tree"] < 0.05 / 10 * 1e6  # the tree sleeps now
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the grandchild too
        parent.wait()
    assert cpu_s(2**22 + 12345) == 0.0  # no such process
