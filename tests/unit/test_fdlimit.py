"""``raise_open_files_limit`` lifts a low soft RLIMIT_NOFILE to the hard limit (in a child process, so the
test's own limits stay as they are), and a process started with 256 open files can then open 600 sockets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, resource, socket
from libra.transport.fdlimit import raise_open_files_limit
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
def try_open(n):
    socks = []
    try:
        for _ in range(n):
            socks.append(socket.socket())
        return len(socks)
    except OSError:
        return len(socks)
    finally:
        for s in socks:
            s.close()
before = try_open(600)
lim = raise_open_files_limit("test")
after = try_open(600)
print(json.dumps({"before": before, "after": after, "limits": [lim.before, lim.soft, lim.hard], "hard": hard}))
"""


def test_a_low_soft_limit_is_raised_to_the_hard_one() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if r["hard"] < 700:
        pytest.skip(f"the hard open-files limit here is {r['hard']}")
    assert r["limits"] == [256, r["hard"], r["hard"]]
    assert r["before"] < 256 and r["after"] == 600  # 600 sockets fit once raised, not before
