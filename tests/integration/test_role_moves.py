"""A forced plan moves two actors from rollout (generate) to training (train) and back while a client
keeps submitting generate work: real processes, real tiny model, no work lost or duplicated, and the
status shows the new roles (issue #4)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from libra.client import Client
from libra.engines.tiny_model import ensure_tiny_model
from libra.local import LocalCluster
from .steady_load import SteadyLoad

pytestmark = pytest.mark.integration


def _kinds(c: Client) -> dict[str, list[str]]:
    return {a["id"]: a["kinds"] for a in c.status().actors}


def _wait_kinds(c: Client, want: dict[str, list[str]], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = _kinds(c)
        if all(now.get(a) == k for a, k in want.items()):
            return
        time.sleep(0.1)
    raise AssertionError(f"roles did not switch: {_kinds(c)} != {want}")


def test_plan_moves_two_actors_to_training_and_back_under_load(tmp_path) -> None:
    model = ensure_tiny_model(tmp_path / "tiny")
    cluster = LocalCluster(cpu_slots=4, broker_args=["--heartbeat-s", "0.5"],
                           actor_args=["--roles", "hybrid=4", "--model-dir", str(model), "--rollout-batch", "4",
                                       "--torch-threads", "1", "--no-restart"])
    with cluster, Client(cluster.url) as c, ThreadPoolExecutor(6) as pool:
        actors = sorted(_kinds(c))
        assert len(actors) == 4 and all(k == ["generate"] for k in _kinds(c).values())
        def one(i: int):
            r = c.request("generate", "", {"prompt_ids": [1, 2, 3 + i % 5], "max_new_tokens": 4, "seed": i},
                          timeout=120)
            return i, r

        movers = actors[:2]
        # a burst above one actor's capacity first, so that every actor is seen serving before the moves (the
        # steady load alone may go to the same two: its turns take milliseconds once the engines are warm)
        with ThreadPoolExecutor(16) as burst:
            warm = list(burst.map(one, range(-32, 0)))
        assert {r.actor_id for _, r in warm} == set(actors)
        load = SteadyLoad(pool, one).start()
        time.sleep(1.0)
        for a in movers:
            c.direct(a, ["train"], config={"role": "train", "group": "replica0"})
        _wait_kinds(c, {a: ["train"] for a in movers})
        snap = c.status()
        roles = {a["id"]: a["role"].get("role") for a in snap.actors}
        assert all(roles[a] == "train" for a in movers)
        time.sleep(1.0)  # the other two keep serving generate alone
        for a in movers:
            c.direct(a, ["generate"], config={"role": "rollout", "bucket": "default"})
        _wait_kinds(c, {a: ["generate"] for a in actors})
        time.sleep(1.0)
        load.stop()
        stats = c.status().stats
    assert not load.errors, load.errors[:5]
    assert len(load.results) == load.submitted > 20
    ids = sorted(i for i, _ in load.results)
    assert ids == list(range(load.submitted))  # every request answered, once each
    assert all(len(r.output["token_ids"]) == 4 for _, r in load.results)
    assert {r.actor_id for _, r in load.results} >= set(actors[2:])  # the others served throughout
    assert stats["completed"] == load.submitted + len(warm) and stats["failed"] == 0 and stats["duplicates"] == 0
    assert stats["stale_results"] == 0
