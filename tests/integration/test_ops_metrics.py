"""A real broker with ``--metrics-port`` and two actor slots: scrape /metrics while echo calls run,
and watch the cluster with ``python -m libra status --watch``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

pytest.importorskip("prometheus_client", reason="prometheus-client is not installed (pip install prometheus-client)")

from prometheus_client.parser import text_string_to_metric_families

from libra.client import Client
from libra.client.aio import AsyncClient
from libra.local import LocalCluster, free_port

pytestmark = pytest.mark.integration

CALLS = 2000


@pytest.fixture(scope="module")
def metered():
    port = free_port()
    c = LocalCluster(cpu_slots=2, broker_args=["--heartbeat-s", "0.3", "--metrics-port", str(port),
                                               "--metrics-host", "127.0.0.1"],
                     actor_args=["--no-restart", "--no-sandbox", "--capacity", "4"])
    c.start(timeout=60)
    c.metrics_url = f"http://127.0.0.1:{port}/metrics"  # type: ignore[attr-defined]
    yield c
    c.stop()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_scrape_while_echo_calls_run(metered) -> None:
    url = metered.metrics_url
    base = scrape(url).get(("libra_work_completed_total", ()), 0.0)
    done = threading.Event()
    results: list = []

    async def burst() -> list:
        async with AsyncClient(metered.url) as c:
            return await asyncio.gather(*(c.call_tool("echo", {"i": i}) for i in range(CALLS)))

    def run() -> None:
        try:
            results.extend(asyncio.run(burst()))
        finally:
            done.set()

    t = threading.Thread(target=run)
    t.start()
    scrapes = []
    while not done.is_set():  # scrape as fast as we can while the calls run: never an error, never backwards
        scrapes.append(scrape(url))
    t.join()
    assert len(results) == CALLS and [r.output for r in results] == [{"i": i} for i in range(CALLS)]
    completed = [s[("libra_work_completed_total", ())] for s in scrapes]
    assert completed == sorted(completed)
    deadline = time.monotonic() + 30
    while True:  # the loop publishes a snapshot every 0.5 s
        s = scrape(url)
        if s[("libra_work_completed_total", ())] >= base + CALLS or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert s[("libra_work_completed_total", ())] == base + CALLS
    assert s[("libra_replies_total", (("kind", "action"), ("outcome", "ok")))] >= CALLS
    assert s[("libra_work_latency_seconds_count", (("kind", "action"),))] >= CALLS
    assert s[("libra_work_latency_seconds_bucket", (("kind", "action"), ("le", "+Inf")))] >= CALLS
    assert s[("libra_actors", (("role", "action"), ("state", "idle")))] == 2
    assert s[("libra_actor_capacity", ())] == 8
    assert s[("libra_work_inflight", ())] == 0
    assert s[("libra_broker_core_errors_total", ())] == 0
    assert s[("libra_broker_info", (("broker_id", "libra-broker"), ("router", "cmlfq")))] == 1


def test_queue_depth_is_visible_while_work_waits(metered) -> None:
    url = metered.metrics_url
    out: list = []
    with Client(metered.url) as c:
        futs = [c.submit_tool("sleep", {"seconds": 0.4}) for _ in range(24)]  # 8 run, 16 wait
        t = threading.Thread(target=lambda: out.extend(c.gather(futs)))
        t.start()
        depths = []
        while t.is_alive():
            depths.append(scrape(url).get(("libra_queue_depth", (("kind", "action"), ("name", "sleep"))), 0.0))
            time.sleep(0.05)
        t.join()
    assert len(out) == 24 and all(r.output is not None for r in out)
    assert max(depths) > 0


def test_status_watch_command_redraws(metered) -> None:
    r = subprocess.run([sys.executable, "-m", "libra", "status", "--broker", metered.url, "--watch",
                        "--interval", "0.2", "--count", "2"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    frames = [f for f in r.stdout.split("libra status --watch") if f.strip()]
    assert len(frames) == 2
    assert "(first sample)" in frames[0] and "rates/s: submitted=" in frames[1]
    assert all("cpu0" in f and "cpu1" in f for f in frames)
