"""The broker's own periodic planner moves GPU actors between rollout and training while a client keeps
running trajectories: real processes (a broker with a ``[broker.planner]`` table, four hybrid actors on
GPU-named slots of this CPU host, the tiny model), no work lost or duplicated, and the status shows the
plan and the new roles (issue #4)."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from libra.client import Client
from libra.engines.tiny_model import ensure_tiny_model
from libra.local import free_port
from .steady_load import SteadyLoad

pytestmark = pytest.mark.integration

CONFIG = """
[broker]
router = "least_loaded"

[broker.planner]
allocation = "grp_homogeneous"
hardware = "cpu"
model = "tiny"
interval_s = 1.5
group_size = 4
"""


def test_the_broker_planner_applies_a_plan_under_load(tmp_path) -> None:
    model = ensure_tiny_model(tmp_path / "tiny")
    cfg = tmp_path / "broker.toml"
    cfg.write_text(CONFIG)
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--config", str(cfg),
                               "--heartbeat-s", "0.5", "--log-level", "warning"])]
    procs += [subprocess.Popen([sys.executable, "-m", "libra.actors.runtime", "--broker", url, "--slot", f"gpu{k}",
                                "--role", "hybrid", "--model-dir", str(model), "--rollout-batch", "4",
                                "--torch-threads", "1", "--log-level", "warning"]) for k in range(4)]
    try:
        with Client(url, connect_timeout=30) as c, ThreadPoolExecutor(6) as pool:
            deadline = time.monotonic() + 60
            while len(c.status().actors) < 4:
                assert time.monotonic() < deadline, "actors did not connect"
                time.sleep(0.2)
            def one(i: int):
                tid = f"traj-{i}"
                r = c.request("generate", "", {"prompt_ids": [1, 2, 3 + i % 5], "max_new_tokens": 4, "seed": i},
                              trajectory=tid, timeout=120)
                c.end_trajectory(tid, total_output_tokens=len(r.output["token_ids"]))
                return i, r

            load = SteadyLoad(pool, one, period_s=0.03).start()
            try:
                deadline = time.monotonic() + 90
                while True:
                    snap = c.status()
                    planner = snap.stats["planner"]
                    roles = [a["role"].get("role") for a in snap.actors]
                    plan = planner["plan"]
                    if planner["plans_applied"] >= 1 and plan is not None \
                            and roles.count("train") == plan["n_train"] and "rollout" in roles:
                        break
                    assert time.monotonic() < deadline, f"no plan applied: {planner}"
                    time.sleep(0.2)
                time.sleep(1.0)  # keep serving on the new layout
            finally:
                load.stop()
            stats = c.status().stats
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    # a round may come before the actors are up (1.5 s interval; a loaded machine starts them slower)
    assert planner["decisions"][0]["reason"] in ("too_few_gpu_actors", "insufficient_history", "initial_plan")
    assert any(d["reason"] == "initial_plan" for d in planner["decisions"])
    assert 1 <= plan["n_train"] < 4 and sum(plan["rollout_tps"]) + plan["n_train"] <= 4
    assert not load.errors, load.errors[:5]
    assert len(load.results) == load.submitted > 20
    assert sorted(i for i, _ in load.results) == list(range(load.submitted))  # every request answered, once each
    assert all(len(r.output["token_ids"]) == 4 for _, r in load.results)
    assert stats["completed"] == load.submitted and stats["failed"] == 0 and stats["duplicates"] == 0
