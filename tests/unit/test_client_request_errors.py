"""Requests that cannot be sent fail at once with a typed error, in the caller, before anything is sent.

- An argument msgpack cannot carry (``object()``, a ``set``) is :class:`BadRequest` (it used to be a plain
  ``TypeError``, raised in whichever thread flushed the socket).
- A request over the frame limit is :class:`PayloadTooLarge` (it used to wait out its whole timeout and
  surface as ``ToolTimeout``). The limit is the client's own, lowered to the broker's from its welcome.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import pytest

from libra.client import BadRequest, Client, LibraError, PayloadTooLarge
from libra.client.aio import AsyncClient
from libra.client.common import batches
from libra.local import free_port
from libra.protocol import messages as m

BIG = b"x" * (70 * 1024 * 1024)  # over the default 64 MiB frame limit
NOWHERE = "tcp://127.0.0.1:9"  # nothing listens: a request that were sent would wait out its timeout


@pytest.mark.parametrize("bad", [object(), {1, 2}, {"nested": [object()]}], ids=["object", "set", "nested"])
def test_sync_client_refuses_unserialisable_arguments_before_sending(bad: object) -> None:
    with Client(NOWHERE, connect_timeout=None) as c:
        with pytest.raises(BadRequest, match="cannot be sent") as info:
            c.call_tool("echo", bad, timeout=60)
        assert isinstance(info.value, LibraError) and info.value.code == "bad_request"
        assert not c._pending and not c._outbox  # nothing was queued or sent


def test_sync_client_refuses_an_oversize_request_before_sending() -> None:
    with Client(NOWHERE, connect_timeout=None) as c:
        with pytest.raises(PayloadTooLarge) as info:
            c.call_tool("echo", BIG, timeout=60)
        assert info.value.size > info.value.limit == 64 * 1024 * 1024
        assert info.value.code == "payload_too_large" and isinstance(info.value, BadRequest)
        assert "over the frame limit" in str(info.value)
        assert not c._pending and not c._outbox
        with pytest.raises(PayloadTooLarge):  # the non-blocking form fails the same way
            c.submit_tool("echo", BIG, timeout=60)


def test_async_client_refuses_bad_and_oversize_requests_before_sending() -> None:
    async def go() -> None:
        c = AsyncClient(NOWHERE)
        c._ensure_reader()  # no hello round trip: nothing answers at this address
        try:
            with pytest.raises(BadRequest, match="cannot be sent"):
                await c.call_tool("echo", {1, 2}, timeout=60)
            with pytest.raises(PayloadTooLarge):
                await c.call_tool("echo", BIG, timeout=60)
            assert not c._pending
        finally:
            await c.close()

    asyncio.run(go())


def test_send_batches_keep_order_and_stay_under_the_byte_cap() -> None:
    items = [("a", 10), ("b", 2 << 20), ("c", 10), ("d", 10)] + [(f"m{i}", 1) for i in range(600)]
    out = list(batches(items))
    assert [x for b in out for x in b] == [m for m, _ in items]
    assert out[0] == ["a"] and out[1] == ["b"]  # a big message goes alone
    assert all(len(b) <= 256 for b in out)


@pytest.mark.integration
def test_the_broker_frame_limit_from_its_welcome_applies() -> None:
    """A broker started with a 1 MiB limit: a 2 MiB call fails at once in the client, the broker counts no
    bad frame, and the connection keeps working."""
    url = f"tcp://127.0.0.1:{free_port()}"
    broker = subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "warning",
                               "--max-frame-bytes", str(1 << 20)])
    try:
        with Client(url, connect_timeout=30) as c:
            with pytest.raises(PayloadTooLarge) as info:
                c.call_tool("echo", b"y" * (2 << 20), timeout=60)
            assert info.value.limit == 1 << 20
            assert c.status(timeout=10).stats["bad_frames"] == 0
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.wait(15)


@pytest.mark.integration
def test_the_broker_answers_an_oversize_frame_of_a_known_peer() -> None:
    """A peer that does not check (a raw socket) and sends a frame over the limit gets an ``Error`` naming the
    limit instead of a silently dropped connection, and the broker counts it."""
    import zmq

    from libra.protocol import decode, encode
    from libra.protocol import messages as m

    url = f"tcp://127.0.0.1:{free_port()}"
    broker = subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "warning",
                               "--max-frame-bytes", str(1 << 20)])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(url)
        sock.send_multipart(encode(m.ClientHello("raw", 1)))
        assert sock.poll(30_000) and isinstance(decode(sock.recv_multipart()).msg, m.Welcome)
        sock.send_multipart(encode(m.Submit("r1", "action", "echo", b"z" * (3 << 19), None, 10.0)))  # 1.5 MiB
        assert sock.poll(30_000), "no answer to an oversize frame"
        err = decode(sock.recv_multipart()).msg
        assert isinstance(err, m.Error) and err.code == "oversize" and str(1 << 20) in err.message
        with Client(url, connect_timeout=30) as c:
            assert c.status(timeout=10).stats["bad_frames"] == 1
    finally:
        sock.close()
        ctx.term()
        broker.send_signal(signal.SIGTERM)
        broker.wait(15)


def test_async_client_deadline_cancellation_and_keepalive_without_a_broker() -> None:
    """Every call has one timer: with no broker, a call fails with BrokerUnreachable at its deadline (not
    welcomed), ToolTimeout once welcomed; a cancelled call leaves nothing pending; while calls wait, one
    heartbeat per ping interval goes out, however many calls wait."""
    from libra.client import BrokerUnreachable, ToolTimeout

    async def go() -> None:
        c = AsyncClient(NOWHERE)
        c._ping_s = 0.05
        c._ensure_reader()
        sent: list[bytes] = []
        real_send = c._sock.send_multipart

        def spy(frames, *a, **kw):
            sent.append(bytes(frames[0][6:7]))
            return real_send(frames, *a, **kw)

        c._sock.send_multipart = spy  # type: ignore[method-assign]
        try:
            with pytest.raises(BrokerUnreachable):
                await c.call_tool("echo", 1, timeout=0.05)
            assert not c._pending
            c._welcomed.set()  # as if the broker had welcomed us and then gone silent
            before = sent.count(bytes([m.Heartbeat.KIND]))
            assert before >= 1  # the first call waited out its deadline with beats
            waiting = [asyncio.ensure_future(c.call_tool("echo", i, timeout=0.4)) for i in range(20)]
            await asyncio.sleep(0.25)
            beats = sent.count(bytes([m.Heartbeat.KIND])) - before
            assert 1 <= beats <= 6  # one per interval with 20 calls waiting, not one per call
            waiting[0].cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting[0]
            assert len(c._pending) == 19
            for w in waiting[1:]:
                with pytest.raises(ToolTimeout, match="no reply within 0.4s"):
                    await w
            assert not c._pending
        finally:
            await c.close()

    asyncio.run(go())


def test_a_future_two_threads_resolve_at_once_is_resolved_once_without_an_error() -> None:
    """The leader dispatching a reply and a ``gather`` that saw the reply's event both resolve the future; the
    loser's InvalidStateError used to escape from the leader's drain, dropping the replies it had read."""
    from concurrent.futures import Future

    from libra.client.common import ToolResult
    from libra.client.sync import _Pending

    class LateFuture(Future):  # what the loser sees: not done at its check, done by the time it sets
        def done(self) -> bool:
            return False

    with Client(NOWHERE, connect_timeout=None) as c:
        p = _Pending(None)
        p.value = ToolResult({"i": 1}, "w1", 1, "a", 0.0)
        p.future = LateFuture()
        Future.set_result(p.future, p.value)  # the winner
        c._resolve_future(p)  # the loser: no InvalidStateError
        assert p.future.result() is p.value
