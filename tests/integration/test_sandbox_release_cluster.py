"""Issue 28 item 5 through a real broker (``action_scheduler = "tangram"``) and a real action slot: after the
client ends a trajectory (``EndTrajectory``), the broker sends its id with the next sandbox call on that actor
and the actor's pool retires the trajectory's sandbox, so the workspace it left is gone (before, it stayed
bound until evicted under pressure or 15 idle minutes)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from libra.client import Client
from libra.local import LocalCluster

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
]


def _marks(tmp: Path) -> list[Path]:
    return list(tmp.glob("libra-sandbox-*/ws-*/mark.txt"))  # the slot's pool root, seen from the host


def test_an_ended_trajectorys_sandbox_is_released(tmp_path: Path) -> None:
    cfg = tmp_path / "broker.toml"
    cfg.write_text('[broker]\naction_scheduler = "tangram"\n')
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with LocalCluster(cpu_slots=1, broker_args=["--config", str(cfg)], actor_args=["--no-restart"],
                      env={"TMPDIR": str(tmp)}) as cluster, Client(cluster.url) as c:
        c.call_tool("python", {"code": "pass", "files": {"mark.txt": "x"}}, trajectory="ep-1", timeout=60)
        c.call_tool("python", {"code": "pass"}, trajectory="ep-2", timeout=60)
        assert len(_marks(tmp)) == 1  # ep-1's workspace, kept between its calls
        c.end_trajectory("ep-1", 10, True)
        c.call_tool("python", {"code": "pass"}, trajectory="ep-2", timeout=60)  # carries ep-1's release
        for _ in range(600):  # the pool retires it on its own thread, at once; this only waits for that thread
            if not _marks(tmp):
                break
            time.sleep(0.05)
        assert _marks(tmp) == []
