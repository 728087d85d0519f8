"""Chaos: while a job of 600 tool calls and generate turns runs, SIGKILL a third of the actors one after
another (the supervisor restarts them). Every accepted request ends exactly once — a result, or a typed
failure after bounded retries — nothing hangs, and the job finishes (issue #7)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from libra.client import Client, LibraError
from libra.engines.tiny_model import ensure_tiny_model
from libra.local import LocalCluster

pytestmark = pytest.mark.integration

N = 600


def test_sigkill_a_third_of_the_actors_during_a_job(tmp_path) -> None:
    model = ensure_tiny_model(tmp_path / "tiny")
    cluster = LocalCluster(cpu_slots=6, broker_args=["--heartbeat-s", "0.3", "--max-retries", "5"],
                           actor_args=["--roles", "hybrid=3,action=3", "--model-dir", str(model),
                                       "--rollout-batch", "4", "--torch-threads", "1", "--no-sandbox"])
    rng = random.Random(7)
    outcomes: dict[int, object] = {}
    with cluster, Client(cluster.url) as c, ThreadPoolExecutor(16) as pool:
        start_pids = {a["id"]: a["pid"] for a in c.status().actors}
        assert len(start_pids) == 6

        def one(i: int) -> None:
            try:
                if i % 3 == 0:
                    r = c.request("generate", "", {"prompt_ids": [1, 2, 3], "max_new_tokens": 4, "seed": i},
                                  timeout=120)
                    ok = len(r.output["token_ids"]) == 4
                elif i % 3 == 1:
                    r = c.call_tool("sleep", {"seconds": 0.05}, trajectory=f"t{i % 40}", timeout=120)
                    ok = r.output == {"slept": 0.05}
                else:
                    r = c.call_tool("echo", {"i": i}, trajectory=f"t{i % 40}", timeout=120)
                    ok = r.output == {"i": i}
                outcomes[i] = "ok" if ok else f"wrong:{r.output!r}"
            except LibraError as exc:  # typed failure (retries exhausted etc.) is an accepted ending
                outcomes[i] = type(exc).__name__

        def killer() -> None:
            victims = rng.sample(sorted(start_pids), 2)  # a third of 6
            for v in victims:
                time.sleep(1.5)
                pid = {a["id"]: a["pid"] for a in c.status().actors}.get(v, start_pids[v])
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        k = threading.Thread(target=killer)
        k.start()
        futs = [pool.submit(one, i) for i in range(N) if not time.sleep(0.005)]
        for f in futs:
            f.result(timeout=300)  # nothing hangs: every call returns or raises a typed error
        k.join()
        # the killed actors came back (new pids, same ids) and the cluster is whole again
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = {a["id"]: a["pid"] for a in c.status().actors}
            if len(now) == 6:
                break
            time.sleep(0.2)
        stats = c.status().stats
    assert sorted(outcomes) == list(range(N))  # every request ended, exactly once each
    bad = {i: o for i, o in outcomes.items() if o != "ok"}
    assert all(o in ("WorkLost", "ToolTimeout") for o in bad.values()), bad
    assert len(now) == 6 and sum(now[a] != start_pids[a] for a in now) == 2
    assert stats["completed"] + stats["failed"] == N and stats["duplicates"] == 0
