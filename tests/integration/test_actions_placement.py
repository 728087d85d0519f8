"""The broker's Tangram placement with real processes on loopback (``python -m libra.broker`` with
``action_scheduler = "tangram"`` and two ``python -m libra.actors.runtime`` slots, real bubblewrap):

- a lone code action runs on more than one core, and the actions of a burst that run at the same time run
  on disjoint cores, as the sandboxes' CPU affinity shows (the broker names the cores in ``Assign.route``);
- reward-model calls from many trajectories share the GPU actor's service replicas: restored on demand,
  hits afterwards, the least recently used idle replica evicted for a new service, as the actor's service
  engine reports it (which cell, restored or not, what it evicted).

The "GPU actor" is a ``gpu0`` slot declared with two GPUs (``--service-gpus 2``); on a machine without a
GPU it runs its services on CPU in simulated one-GPU chunks and says so (``gpu_emulated``). Everything else
is real: processes, sockets, sandboxes, model weights copied in and out.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator

import pytest

from libra.bench.actions_real import PlacementCluster
from libra.client import Client
from libra.engines.tiny_model import TinyModelSpec, ensure_tiny_model

CORES = len(os.sched_getaffinity(0))

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
    pytest.mark.skipif(CORES < 2, reason="needs at least 2 CPU cores to grant more than one"),
]

# What the action itself sees: its CPU affinity and when it ran (wall clock), after ~0.3 s of CPU work.
PROBE = ("import json, os, time, hashlib\nt0 = time.time()\nh = b'x'\n"
         "for _ in range(120_000): h = hashlib.sha256(h).digest()\n"
         "print(json.dumps({'cpus': sorted(os.sched_getaffinity(0)), 't0': t0, 't1': time.time()}))")


@pytest.fixture(scope="module")
def cluster() -> Iterator[PlacementCluster]:
    models = ";".join(f"{name}={ensure_tiny_model(spec=TinyModelSpec(seed=seed))}" for name, seed in (("rm_b", 1), ("rm_c", 2)))
    broker = {"action_scheduler": "tangram",
              "tools": {"python": {"cpu": 1, "max_cpu": CORES, "parallel_fraction": 0.95, "duration_s": 1.0}}}
    actors = [("cpu0", ["--capacity", "4"]), ("gpu0", ["--service-gpus", "2", "--no-sandbox", "--capacity", "8"])]
    with PlacementCluster(broker, actors, env={"LIBRA_REWARD_MODELS": models}) as c:
        yield c


def probe(c: Client, trajectory: str) -> dict:
    r = c.call_tool("python", {"code": PROBE}, trajectory=trajectory, timeout=120)
    assert r.actor_id.endswith("cpu0")
    return json.loads(r.output["stdout"])


def test_a_lone_code_action_gets_more_than_one_core(cluster: PlacementCluster) -> None:
    with Client(cluster.url) as c:
        ran = probe(c, "lone")
    assert len(ran["cpus"]) > 1 and set(ran["cpus"]) <= os.sched_getaffinity(0)


def test_actions_running_at_once_never_share_a_core(cluster: PlacementCluster) -> None:
    runs: list[dict] = []
    with Client(cluster.url) as c:
        threads = [threading.Thread(target=lambda i=i: runs.append(probe(c, f"burst-{i}"))) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    assert len(runs) == 6
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            if a["t0"] < b["t1"] and b["t0"] < a["t1"]:  # they ran at the same time
                assert not set(a["cpus"]) & set(b["cpus"]), (a, b)


def score(c: Client, service: str, trajectory: str) -> dict:
    r = c.call_tool("reward_model", {"service": service, "text": "The answer is 42."}, trajectory=trajectory,
                    timeout=180)
    assert r.actor_id.endswith("gpu0")  # the GPU actor's replicas, not the CPU actor's own engine
    return r.output


def test_reward_calls_share_replicas_restored_on_demand_and_evicted_lru(cluster: PlacementCluster) -> None:
    with Client(cluster.url) as c:
        first = score(c, "tiny_reward", "traj-0")
        assert first["restored"] is True and first["evicted"] == []
        for i in range(1, 6):  # other trajectories hit the same resident replica
            again = score(c, "tiny_reward", f"traj-{i}")
            assert again["restored"] is False and again["cell"] == first["cell"] and again["score"] == first["score"]
        b = score(c, "rm_b", "traj-b")  # a free cell: restored without evicting anything
        assert b["restored"] is True and b["evicted"] == [] and b["cell"] != first["cell"]
        cc = score(c, "rm_c", "traj-c")  # no free cell: the least recently used idle replica goes
        assert cc["restored"] is True and cc["evicted"] == ["tiny_reward"] and cc["cell"] == first["cell"]
        back = score(c, "tiny_reward", "traj-6")  # restored on demand, evicting rm_b (now the LRU one)
        assert back["restored"] is True and back["evicted"] == ["rm_b"] and back["score"] == first["score"]
        outs: list[dict] = []
        threads = [threading.Thread(target=lambda i=i: outs.append(score(c, "rm_c", f"many-{i}"))) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    assert len(outs) == 4 and sum(o["restored"] for o in outs) <= 1  # at most one more replica for the rush
    assert {tuple(o["cell"]["gpus"]) for o in outs} <= {(0,), (1,)}


def test_status_shows_each_actors_cores_and_the_resident_service_replicas(cluster: PlacementCluster) -> None:
    with Client(cluster.url) as c:
        probe(c, "status")
        score(c, "tiny_reward", "status")
        st = c.status().stats["actions"]
    assert st["scheduler"] == "tangram" and st["running"] == 0
    cpu0 = next(v for k, v in st["cores"].items() if k.endswith("cpu0"))
    assert cpu0["cores"] == CORES and cpu0["free"] == CORES and cpu0["held_by"] == 0  # all back after the run
    gpu0 = next(v for k, v in st["services"].items() if k.endswith("gpu0"))
    assert gpu0.get("tiny_reward", 0) >= 1  # the replica the call used stays resident
