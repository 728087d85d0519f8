"""A rollout slot that dies in the middle of ``libra run`` (SIGKILL, as a native crash or the OOM killer
would) does not stop the job: its turns go to the other instance (contexts re-fetched from the episode
runner), the supervisor restarts the slot, and the job ends with every version trained."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import shutil
import threading
import time
from pathlib import Path

import pytest

from libra.actors.slot_records import slot_record_path
from libra.rl.config import load_job
from libra.rl.driver import run_job
from libra.rl.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith_tiny.toml"


def test_a_rollout_slot_killed_mid_job_is_restarted_and_the_job_finishes(tmp_path: Path, capfd) -> None:
    cfg = load_job(EXAMPLE).with_run_dir(str(tmp_path / "run"))
    # five steps, and the kill lands once the slot has loaded the first published version: at least three more
    # versions follow, each waited for by every rollout instance, so the job cannot end before the restart
    cfg = dataclasses.replace(cfg, actors=dataclasses.replace(cfg.actors, allow_unisolated=False),
                              job=dataclasses.replace(cfg.job, steps=5))
    run = tmp_path / "run"
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(summary=run_job(cfg, progress=False)), daemon=True)
    t.start()
    killed = None
    deadline = time.monotonic() + 240
    while killed is None and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
        for f in sorted((run / "actors").glob("*.json")):
            st = json.loads(f.read_text())  # written atomically (a rename)
            # the slot's own record says it loaded a trained version: the kill lands in the middle of the job
            # (the driver's metrics lag the broker by its poll, so they cannot say where the job is)
            if st.get("role") == "rollout" and (st.get("weights_version") or 0) >= 1 and st.get("pid"):
                os.kill(int(st["pid"]), signal.SIGKILL)
                killed = st["slot"], int(st["pid"])
                break
    assert killed is not None, "no rollout slot found to kill while the job ran"
    t.join(timeout=300)
    assert not t.is_alive(), "the job did not finish after a rollout slot was killed"
    summary = out["summary"]
    # a group can go stale while the killed slot's turns are re-run: the cut drops it (counted) and admits another
    # in its place, so every step still trains (before, with nothing else outstanding, the job waited for ever)
    assert summary["final_version"] == 5
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5]
    slot, pid = killed
    # the supervisor started the slot again: the restarted process's own record (the end-of-run wait holds the job
    # until a slot whose record's process is gone writes a new one), or the supervisor's restart warning
    restarted = json.loads(slot_record_path(run, slot).read_text())
    err = capfd.readouterr().err
    restarts = [json.loads(line) for line in err.splitlines() if line.startswith("{") and '"slot_restarted"' in line]
    assert restarted["pid"] != pid or any(r["slot"] == slot and r["pid"] != pid for r in restarts), (
        f"slot {slot} (pid {pid}) was not seen restarted; its record: {restarted}; stderr tail: {err[-3000:]}")
