"""An actor frozen for longer than the broker's liveness (SIGSTOP, then SIGCONT: what a network blip looks
like to the broker) loses its session; its work waits queued. When it says hello again with the work it
still holds, the broker adopts it back instead of running it a second time."""

from __future__ import annotations

import collections
import os
import signal
import threading
import time

import pytest

from libra.bench.chaos import unisolated_path
from libra.client import Client
from libra.local import LocalCluster

pytestmark = pytest.mark.integration
N = 12


def test_a_frozen_actor_gets_its_work_back_and_nothing_runs_twice(tmp_path) -> None:
    ledger = tmp_path / "ledger"
    ledger.write_text("")
    cluster = LocalCluster(cpu_slots=1, broker_args=["--heartbeat-s", "0.3", "--liveness", "3"],
                           actor_args=["--allow-unisolated", "--capacity", "4", "--no-restart"],
                           env={"PATH": unisolated_path(tmp_path)})
    with cluster, Client(cluster.url) as c:
        (actor,) = cluster.status().actors
        futs = [c.submit_tool("bash", {"command": f"echo {i} >> {ledger}; sleep 1.0"}, timeout=120)
                for i in range(N)]
        results: list = []
        waiter = threading.Thread(target=lambda: results.extend(c.gather(futs)), daemon=True)
        waiter.start()  # the sync client has no background thread: a waiting caller drives its socket
        deadline = time.monotonic() + 60
        while len(ledger.read_text().split()) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(actor["pid"], signal.SIGSTOP)
        try:
            time.sleep(2.0)  # > 0.3 s × 3: the broker drops the session and queues its work again
            during = cluster.status()
        finally:
            os.kill(actor["pid"], signal.SIGCONT)
        waiter.join(120)
        stats = cluster.status().stats
    counts = collections.Counter(ledger.read_text().split())
    assert during.actors == [] and during.stats["actors_expired"] == 1  # the session was really lost
    assert all(not isinstance(r, Exception) and r.output["exit_code"] == 0 for r in results), results
    assert sorted(counts) == sorted(str(i) for i in range(N))
    assert all(v == 1 for v in counts.values()), counts  # nothing ran twice
    assert [r.attempts for r in results] == [1] * N
    assert stats["adopted"] >= 1
