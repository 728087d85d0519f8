"""Actors and a client given two broker addresses move to the second by themselves when the first is killed.

Two real, independent brokers on loopback (``python -m libra.broker``, each with its own journal); actors started
with ``--broker B1,B2`` and a client with both. B1 is killed with SIGKILL while calls wait on it, and nothing else
is started: the actors (silent broker: next address) and the client (silent while calls wait: next address,
hello, each unanswered call resent once) arrive at B2, the waiting calls are answered there and new calls run
there. B2 is an independent broker here, so the calls pending on B1 run again on B2; exactly-once across a
primary and its standby is the standby broker's journal-following, not this test's. The times the actors and
the client took to move are printed, not asserted (no wall-clock thresholds).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from libra.client import Client
from libra.client.aio import AsyncClient
from libra.local import free_port, wait_until

from .procs import stop_all

pytestmark = pytest.mark.integration
CALLS = 8


def _broker(url: str, journal: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "warning",
                             "--heartbeat-s", "0.3", "--liveness", "3", "--journal", journal])


def _async_calls(urls: list[str], n: int, moved: list[float]) -> tuple[list, str]:
    """``n`` sleep calls through an AsyncClient given both addresses (in its own event loop): their outputs, the
    address it ended on; ``moved`` gets the time it left the first broker."""
    async def go() -> tuple[list, str]:
        async with AsyncClient(urls) as c:
            async def watch() -> None:
                while c.broker_url == urls[0]:
                    await asyncio.sleep(0.01)
                moved.append(time.monotonic())

            watcher = asyncio.ensure_future(watch())
            rs = await asyncio.gather(*(c.call_tool("sleep", {"seconds": 1.0}, timeout=120) for _ in range(n)))
            await asyncio.wait_for(watcher, 30)
            return [r.output for r in rs], c.broker_url

    return asyncio.run(go())


def _actor_count(url: str) -> int:
    with Client(url, connect_timeout=10) as c:
        return len(c.status(timeout=10).actors)


def test_actors_and_a_client_move_to_the_second_broker_when_the_first_is_killed(tmp_path) -> None:
    b1, b2 = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    first = _broker(b1, str(tmp_path / "b1.sqlite"))
    procs = [first, _broker(b2, str(tmp_path / "b2.sqlite"))]
    procs.append(subprocess.Popen([sys.executable, "-m", "libra.actors", "--broker", f"{b1},{b2}", "--cpu-slots",
                                   "2", "--gpu-slots", "0", "--no-sandbox", "--capacity", "4", "--no-direct",
                                   "--log-level", "warning"]))
    answers: dict[int, object] = {}
    lock = threading.Lock()
    try:
        wait_until(lambda: _actor_count(b1) == 2, 120, "both actors registered at the first broker", step=0.3)
        assert _actor_count(b2) == 0
        with Client([b1, b2], connect_timeout=30) as c, ThreadPoolExecutor(CALLS + 1) as pool:
            assert c.broker_url == b1

            def one(i: int) -> None:
                r = c.call_tool("sleep", {"seconds": 1.0}, trajectory=f"t{i}", timeout=120)
                with lock:
                    assert i not in answers, f"call {i} answered twice"
                    answers[i] = (r.output, time.monotonic())

            moved: dict[str, list[float]] = {"sync": [], "async": []}

            def watch() -> None:
                while c.broker_url == b1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                moved["sync"].append(time.monotonic())

            deadline = time.monotonic() + 300
            futs = [pool.submit(one, i) for i in range(CALLS)]
            aio = pool.submit(_async_calls, [b1, b2], 2, moved["async"])
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            wait_until(lambda: _running(b1) > 0, 60, "calls running at the first broker", step=0.05)
            first.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            first.wait()
            wait_until(lambda: _actor_count(b2) == 2, 120, "both actors at the second broker", step=0.1)
            actors_moved = time.monotonic() - killed
            for f in futs:
                f.result(timeout=180)
            aio_outputs, aio_url = aio.result(timeout=180)
            watcher.join(30)
            client_moved = c.broker_url == b2
            after = c.call_tool("echo", {"new": 1}, timeout=60)  # a new call, on the second broker
            stats = c.status(timeout=10).stats
    finally:
        stop_all(procs)
    last = max(t for _, t in answers.values()) - killed
    print(f"\nactors_moved_s={actors_moved:.2f} client_moved_s={moved['sync'][0] - killed:.2f} "
          f"async_client_moved_s={moved['async'][0] - killed:.2f} client_last_answer_after_kill_s={last:.2f} "
          f"b2_submitted={stats.get('submitted')} b2_completed={stats.get('completed')}")
    assert client_moved and after.output == {"new": 1}
    assert aio_url == b2 and aio_outputs == [{"slept": 1.0}] * 2
    assert sorted(answers) == list(range(CALLS)) and all(o == {"slept": 1.0} for o, _ in answers.values())
    # every call still waiting at the kill was resent to the second broker once (independent brokers: it ran there)
    assert 1 <= stats["submitted"] <= CALLS + 3 and stats.get("duplicates", 0) == 0, stats


def _running(url: str) -> int:
    """Calls held by actors at the broker at ``url`` (0 while they are only queued)."""
    with Client(url, connect_timeout=10) as c:
        return sum(int(a.get("load", 0)) for a in c.status(timeout=10).actors)
