"""Real processes on loopback TCP: broker + ``python -m libra.actors --cpu-slots 2`` + clients."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import zmq

from libra.client import Client, ToolFailed, UnknownTool
from libra.client.aio import AsyncClient
from libra.protocol import decode_many, encode
from libra.protocol import messages as m

pytestmark = pytest.mark.integration


def test_status_json_shows_both_actors(cluster) -> None:
    out = subprocess.run([sys.executable, "-m", "libra", "status", "--broker", cluster.url, "--json"],
                         capture_output=True, text=True, timeout=30, check=True)
    snap = json.loads(out.stdout)
    assert sorted(a["slot"] for a in snap["actors"]) == ["cpu0", "cpu1"]
    for a in snap["actors"]:
        assert a["kinds"] == ["action"] and a["state"] == "idle" and a["capacity"] == 4
        assert {"echo", "sleep"} <= set(a["capabilities"]["action"])
    assert isinstance(snap["queues"], dict)
    text = subprocess.run([sys.executable, "-m", "libra", "status", "--broker", cluster.url],
                          capture_output=True, text=True, timeout=30, check=True).stdout
    assert "cpu0" in text and "cpu1" in text


def test_thousand_concurrent_echo_calls_async(cluster) -> None:
    async def go() -> list:
        async with AsyncClient(cluster.url) as c:
            return await asyncio.gather(*(c.call_tool("echo", {"i": i, "pad": "x" * (i % 50)}) for i in range(1000)))

    results = asyncio.run(go())
    assert [r.output for r in results] == [{"i": i, "pad": "x" * (i % 50)} for i in range(1000)]
    assert {r.actor_id for r in results} == {a["id"] for a in cluster.status().actors}  # both served


def test_thousand_concurrent_echo_calls_from_threads_sharing_one_client(cluster) -> None:
    with Client(cluster.url) as c, ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda i: c.call_tool("echo", [i, str(i)], timeout=30).output, range(1000)))
        assert outs == [[i, str(i)] for i in range(1000)]
        futs = [c.submit_tool("echo", i) for i in range(500)]
        assert [r.output for r in c.gather(futs)] == list(range(500))


def test_typed_errors(cluster) -> None:
    with Client(cluster.url) as c:
        with pytest.raises(UnknownTool):
            c.call_tool("no_such_tool", {})
        with pytest.raises(ToolFailed) as ei:
            c.call_tool("sleep", {"seconds": "soon"})
        assert ei.value.tool_code == "bad_request"


def test_sigkill_of_actor_holding_sleep_completes_once_on_the_other(cluster) -> None:
    with Client(cluster.url) as c:
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(r=c.call_tool("sleep", {"seconds": 1.5}, timeout=30)))
        t.start()
        holder = None
        deadline = time.monotonic() + 10
        while holder is None and time.monotonic() < deadline:
            busy = [a for a in c.status().actors if a["load"] > 0]
            holder = busy[0] if busy else None
            time.sleep(0.02)
        assert holder is not None, "no actor picked up the sleep call"
        os.kill(holder["pid"], signal.SIGKILL)
        t.join(30)
        r = result["r"]
        assert r.output == {"slept": 1.5}
        assert r.actor_id != holder["id"] and r.attempts == 2
        stats = c.status().stats
        assert stats["completed"] == 1 and stats["requeued"] == 1 and stats["actors_expired"] == 1
        assert stats["stale_results"] == 0


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def test_malformed_frame_burst_broker_keeps_serving_memory_flat(cluster) -> None:
    ctx = zmq.Context()
    try:
        with Client(cluster.url) as c:
            c.call_tool("echo", 0)
            rss0 = _rss(cluster.broker.pid)
            # a stranger: garbage, wrong version, unknown kind, oversize -> dropped, never answered
            stranger = ctx.socket(zmq.DEALER)
            stranger.setsockopt(zmq.LINGER, 0)
            stranger.connect(cluster.url)
            # a known client that then misbehaves -> gets Error replies
            known = ctx.socket(zmq.DEALER)
            known.setsockopt(zmq.LINGER, 0)
            known.connect(cluster.url)
            known.send_multipart(encode(m.ClientHello("bad-client", 1)))
            assert known.poll(5000)
            assert isinstance(decode_many(known.recv_multipart())[0].msg, m.Welcome)
            bad = [
                [b"\x00garbage"],
                [b"LIBRA9", b"\x05", b"\x90"],
                [b"LIBRA1", b"\xfe", b"\x90"],
                [b"LIBRA1", bytes([m.Submit.KIND]), b"\xc1\xc1"],
                [b"LIBRA1", bytes([m.Submit.KIND]), b"\x92\x01\x02"],
            ]
            for i in range(4000):
                stranger.send_multipart(bad[i % len(bad)])
                known.send_multipart(bad[i % len(bad)])
            big = b"x" * (70 * 1024 * 1024)  # over the 64 MiB limit: libzmq drops the connection
            stranger.send_multipart([b"LIBRA1", bytes([m.Submit.KIND]), big])
            errors = 0
            deadline = time.monotonic() + 20
            while errors < 4000 and time.monotonic() < deadline:
                if known.poll(200):
                    errors += sum(isinstance(d.msg, m.Error) for d in decode_many(known.recv_multipart()))
            assert errors == 4000
            assert not stranger.poll(300), "a stranger must not get answers"
            # still serving
            assert c.call_tool("echo", "after").output == "after"
            assert c.status().stats["bad_frames"] >= 8000
            growth = _rss(cluster.broker.pid) - rss0
            assert growth < 30 * 1024 * 1024, f"broker RSS grew by {growth / 1e6:.1f} MB"
    finally:
        ctx.destroy(0)
