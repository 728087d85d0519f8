"""C-MLFQ's learned prefix tree survives a broker restart (``--router-state``): real broker and actor
processes, a tiny HF model serving the generate turns, ``echo`` tool calls between them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from libra.client import Client
from libra.engines.tiny_model import ensure_tiny_model
from libra.local import LocalCluster, free_port
from libra.policies.routing.prefix_tree import CausalPrefixTree

pytestmark = pytest.mark.integration
N = 6


def _episode(c: Client, i: int) -> None:
    tid = f"traj-{i}"
    args = {"prompt_ids": [1, 2, 3], "max_new_tokens": 4, "seed": i, "prompt_id": f"p{i % 2}", "prompt_tokens": 3}
    r = c.request("generate", "", args, trajectory=tid, timeout=120)
    assert len(r.output["token_ids"]) == 4
    failing = i % 3 == 0
    payload = {"text": "x" * 5, **({"error": "simulated failure"} if failing else {})}
    tool = c.call_tool("echo", payload, trajectory=tid, timeout=60)
    assert tool.output["text"].startswith("x")
    c.request("generate", "", {**args, "seed": 100 + i}, trajectory=tid, timeout=120)
    c.end_trajectory(tid, total_output_tokens=8)


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_the_learned_tree_is_saved_periodically_at_exit_and_reloaded(tmp_path) -> None:
    model = ensure_tiny_model(tmp_path / "tiny")
    state = tmp_path / "router-state.json"
    port = free_port()
    broker_args = ["--router-state", str(state), "--router-state-interval-s", "0.3"]
    cluster = LocalCluster(cpu_slots=2, port=port, broker_args=broker_args,
                           actor_args=["--roles", "rollout=1,action=1", "--model-dir", str(model), "--rollout-batch", "4",
                                       "--torch-threads", "1", "--no-sandbox"])
    with cluster, Client(cluster.url) as c:
        cluster.wait_for_actors(2, timeout=120)
        for i in range(N):
            _episode(c, i)

        def saved_all() -> bool:  # the periodic save, while the broker still runs
            try:
                return CausalPrefixTree.load(state).global_tree.root.stats.count == N
            except Exception:
                return False

        _wait_for(saved_all, 30, "the periodic router-state save")
    tree = CausalPrefixTree.load(state)  # rewritten at shutdown, still complete
    assert tree.global_tree.root.stats.count == N and len(tree.history) == N
    assert tree.num_prompts == 2
    firsts = tree.global_tree.root.children
    assert {k: n.stats.count for k, n in firsts.items()} == {"echo:small:failure": 2, "echo:small:success": 4}

    proc = subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", f"tcp://127.0.0.1:{port}",
                             "--log-level", "info", *broker_args], stderr=subprocess.PIPE, text=True)
    try:
        loaded = None
        for line in proc.stderr:  # JSON log lines (stderr is a pipe)
            rec = json.loads(line)
            if rec.get("event") == "router_state_loaded":
                loaded = rec
            if rec.get("event") == "broker_started":
                break
        assert loaded is not None and loaded["history"] == N and loaded["prompts"] == 2
        with Client(f"tcp://127.0.0.1:{port}") as c2:
            assert c2.status().actors == []  # serving, with the tree loaded
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)  # drains and closes the pipe
    assert proc.returncode == 0
    assert CausalPrefixTree.load(state).to_dict()["global"] == tree.to_dict()["global"]
