"""C-MLFQ's drift rebuild in a running broker (docs/papers.md §1.4.2): real processes (a broker whose
config counts a policy step every ``router_step_s`` when no job publishes weights, one rollout actor on the
tiny model); the prefix trees learn the finished trajectories and are rebuilt from that history, as the
broker's status shows. The job path (a published weights version is a step) is tested on the pure core in
``tests/unit/test_broker_job.py``."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from libra.client import Client
from libra.engines.tiny_model import ensure_tiny_model
from libra.local import free_port, stop_process

pytestmark = pytest.mark.integration

CONFIG = """
[broker]
router = "cmlfq"
router_step_s = 0.5
router_params = { rebuild_interval = 2 }
"""


def test_the_broker_rebuilds_the_prefix_trees_as_policy_steps_pass(tmp_path) -> None:
    model = ensure_tiny_model(tmp_path / "tiny")
    cfg = tmp_path / "broker.toml"
    cfg.write_text(CONFIG)
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--config", str(cfg),
                               "--log-level", "warning"]),
             subprocess.Popen([sys.executable, "-m", "libra.actors.runtime", "--broker", url, "--slot", "cpu0",
                               "--role", "rollout", "--model-dir", str(model), "--rollout-batch", "4",
                               "--torch-threads", "1", "--log-level", "warning"])]
    try:
        with Client(url, connect_timeout=30) as c:
            deadline = time.monotonic() + 60
            while len(c.status().actors) < 1:
                assert time.monotonic() < deadline, "the rollout actor did not connect"
                time.sleep(0.2)
            for i in range(6):  # finished trajectories: the history a rebuild learns from
                tid = f"traj-{i}"
                r = c.request("generate", "", {"prompt_ids": [1, 2, 3 + i % 3], "max_new_tokens": 4, "seed": i},
                              trajectory=tid, timeout=60)
                c.end_trajectory(tid, total_output_tokens=len(r.output["token_ids"]))
            before = c.status().stats["router"]
            deadline = time.monotonic() + 30
            while True:
                router = c.status().stats["router"]
                if router["tree_rebuilds"] >= before["tree_rebuilds"] + 2:
                    break
                assert time.monotonic() < deadline, f"no rebuild as steps passed: {router}"
                time.sleep(0.2)
        assert router["router"] == "cmlfq" and router["steps"] >= 2 * router["tree_rebuilds"] >= 4
        assert router["tree_history"] == 6  # the finished trajectories each rebuild learns from
        assert router["turns"] == 6
    finally:
        for p in reversed(procs):
            stop_process(p)
