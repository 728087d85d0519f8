"""Direct calls with real processes: a broker, two action slots, clients with ``direct=True``.

A lease sends ``echo`` calls straight to the actor that runs it inline; a lease whose actor changes roles
falls back to the broker without running anything twice; a lease whose actor is lost sends the calls that
actor never answered through the broker, with ``attempts`` 2."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from libra.client import Client
from libra.client.aio import AsyncClient
from libra.local import LocalCluster, free_port, stop_process

pytestmark = pytest.mark.integration


def cluster() -> LocalCluster:
    return LocalCluster(cpu_slots=2, broker_args=["--heartbeat-s", "0.3", "--liveness", "3"],
                        actor_args=["--no-sandbox", "--capacity", "4", "--no-restart"])


def leased(c: Client) -> str:
    """Call echo until the client holds a lease; returns the leased actor's id."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert c.call_tool("echo", "warm").output == "warm"
        if c._direct is not None and c._direct.by_tool:
            return c._direct.by_tool["echo"].actor_id
        time.sleep(0.02)
    raise AssertionError("no direct lease on echo within 20 s")


def test_direct_calls_skip_the_broker_and_a_role_change_falls_back_to_it() -> None:
    with cluster() as cl, Client(cl.url, direct=True) as c:
        actor_id = leased(c)
        rs = [c.call_tool("echo", {"i": i}) for i in range(50)]
        assert [r.output for r in rs] == [{"i": i} for i in range(50)]
        assert all(r.work_id.startswith("L") and r.attempts == 1 and r.actor_id == actor_id for r in rs)

        async def many() -> list:
            async with AsyncClient(cl.url, direct=True) as ac:
                for _ in range(200):
                    if (await ac.call_tool("echo", 0)).work_id.startswith("L"):
                        break
                    await asyncio.sleep(0.01)
                return await asyncio.gather(*(ac.call_tool("echo", i) for i in range(300)))

        ars = asyncio.run(many())
        assert [r.output for r in ars] == list(range(300)) and all(r.work_id.startswith("L") for r in ars)
        time.sleep(0.5)  # the actors report on their tick
        st = c.status().stats
        assert st["direct_completed"] >= 350 and st["leases_granted"] >= 2
        assert st["completed"] < 100  # the direct calls did not cross the broker

        # the leased actor is told to take no work: it holds no lease from then on, and a call sent on the old
        # lease is refused unrun and answered through the broker by the other actor
        c.direct(actor_id, [])
        rs = [c.call_tool("echo", {"j": j}) for j in range(20)]
        assert [r.output for r in rs] == [{"j": j} for j in range(20)]
        assert all(r.actor_id != actor_id and r.attempts == 1 for r in rs)
        time.sleep(0.5)
        leases = c.status().stats.get("leases", [])
        assert all(x["actor"] != actor_id for x in leases)


def test_a_lost_actor_s_unanswered_direct_calls_run_again_via_the_broker_with_attempts_2() -> None:
    with cluster() as cl, Client(cl.url, direct=True) as c:
        actor_id = leased(c)
        (pid,) = [a["pid"] for a in c.status().actors if a["id"] == actor_id]
        os.kill(pid, signal.SIGSTOP)  # frozen: what reaches its direct socket is never answered
        try:
            futs = [c.submit_tool("echo", {"k": k}, timeout=30) for k in range(5)]
            results = c.gather(futs)  # the broker expires it after 0.9 s and ends its lease as lost
        finally:
            os.kill(pid, signal.SIGKILL)
        assert [getattr(r, "output", r) for r in results] == [{"k": k} for k in range(5)]
        assert all(r.attempts == 2 and r.actor_id != actor_id and r.work_id.startswith("w") for r in results)
        st = c.status().stats
        assert st["leases_lost"] == 1 and st["actors_expired"] == 1


def test_direct_calls_go_on_through_a_broker_kill9_and_the_client_leases_again(tmp_path) -> None:
    """The lease lives between client and actor: calls keep being answered while the broker is down; the
    restarted broker knows no lease (the actor drops its own at the new welcome, the client at the
    broker's Disconnect), so calls fall back to the broker and the client then takes a new lease."""
    port = free_port()
    args = ["--heartbeat-s", "0.3", "--journal", str(tmp_path / "broker.sqlite")]
    cl = LocalCluster(cpu_slots=1, port=port, broker_args=args, actor_args=["--no-sandbox", "--capacity", "4"])
    cl.start()
    restarted: subprocess.Popen | None = None
    try:
        with Client(cl.url, direct=True) as c:
            leased(c)
            assert cl.broker is not None
            cl.broker.send_signal(signal.SIGKILL)
            cl.broker.wait()
            during = [c.call_tool("echo", i, timeout=30) for i in range(100)]  # no broker at all
            restarted = subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", cl.url,
                                          "--log-level", "warning", *args])
            after, i = [], 0
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                after.append(c.call_tool("echo", i, timeout=30))
                i += 1
                if after[-1].work_id.startswith("L") and any(r.work_id.startswith("w") for r in after):
                    break  # fell back to the broker, then leased again
                time.sleep(0.01)
            stats = c.status().stats
    finally:
        stop_process(restarted)
        cl.broker = None
        cl.stop()
    assert [r.output for r in during] == list(range(100)) and all(r.work_id.startswith("L") for r in during)
    assert [r.output for r in after] == list(range(len(after))) and all(r.attempts == 1 for r in after)
    assert any(r.work_id.startswith("w") for r in after) and after[-1].work_id.startswith("L")
    assert stats["leases_granted"] >= 1  # the new broker granted the new lease
