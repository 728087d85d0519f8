"""A broker restart with 1,000 calls waiting: both clients reconnect once and resend each call once.

Before, every waiting call of the asyncio client pinged on its own and every ``Disconnect`` resent every
waiting call, so the traffic at the restarted broker grew with the square of the calls (853 waiting calls:
2.18 M duplicate submits). Real processes on loopback: a broker with no actors holds the calls in its
queue, is killed with SIGKILL and restarted (no journal), then an actor joins and runs them.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from libra.client import Client
from libra.client.aio import AsyncClient
from libra.local import free_port, wait_until

from .procs import stop_all

pytestmark = pytest.mark.integration
N = 1000


def _broker(url: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "warning",
                             "--heartbeat-s", "0.5"])


def _stats(url: str) -> dict[str, Any]:
    with Client(url, connect_timeout=10) as c:
        snap = c.status(timeout=10)
    return {"queued": sum(snap.queues.values()), **snap.stats}


@contextmanager
def _restarting_broker() -> Iterator[tuple[str, Callable[[], None], Callable[[], None]]]:
    """A broker on a fresh port; yields (url, restart, start_actor). Everything is stopped afterwards."""
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [_broker(url)]

    def restart() -> None:
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        procs[0] = _broker(url)

    def start_actor() -> None:
        procs.append(subprocess.Popen([sys.executable, "-m", "libra.actors", "--broker", url, "--cpu-slots", "1",
                                       "--gpu-slots", "0", "--no-sandbox", "--capacity", "64",
                                       "--log-level", "warning"]))

    try:
        yield url, restart, start_actor
    finally:
        stop_all(procs)


def _check_restarted_broker(url: str, restart: Callable[[], None], reconnects: Callable[[], int]) -> dict:
    wait_until(lambda: _stats(url)["queued"] == N, 90, f"{N} calls queued", step=0.2)
    restart()
    wait_until(lambda: _stats(url)["submitted"] >= N, 90, "the calls resent to the restarted broker", step=0.2)
    time.sleep(1.5)  # any storm would show in the counters within a ping interval or two
    stats = _stats(url)
    # Each waiting call reached the new broker exactly once: no duplicate submits, nothing missing.
    assert stats["submitted"] == N and stats["duplicates"] == 0 and stats["queued"] == N, stats
    assert reconnects() == 1, f"the client reconnected {reconnects()} times"
    return stats


def test_async_client_resends_each_waiting_call_once_after_a_broker_restart() -> None:
    with _restarting_broker() as (url, restart, start_actor):

        async def go() -> list[Any]:
            async with AsyncClient(url) as c:
                calls = [asyncio.ensure_future(c.call_tool("echo", {"i": i}, timeout=180)) for i in range(N)]
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, _check_restarted_broker, url, restart, lambda: c._gate.reconnects)
                start_actor()
                return await asyncio.gather(*calls)

        results = asyncio.run(go())
    assert [r.output for r in results] == [{"i": i} for i in range(N)]
    assert all(r.attempts == 1 for r in results)


def test_sync_client_resends_each_waiting_call_once_after_a_broker_restart() -> None:
    with _restarting_broker() as (url, restart, start_actor):
        with Client(url) as c:
            futures = [c.submit_tool("echo", {"i": i}, timeout=180) for i in range(N)]
            # The sync client has no background thread: a waiting caller drives its socket.
            waiter = threading.Thread(target=c.gather, args=(futures,), daemon=True)
            waiter.start()
            _check_restarted_broker(url, restart, lambda: c._gate.reconnects)
            start_actor()
            results = c.gather(futures)
            waiter.join(30)
    assert [r.output for r in results] == [{"i": i} for i in range(N)]
    assert all(r.attempts == 1 for r in results)
