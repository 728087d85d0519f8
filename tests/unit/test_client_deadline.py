"""Issue #28, item 3: a call's ``timeout`` is the caller's deadline. With the broker dead, ``timeout=3`` used to
raise after 5.00 s (the timeout plus a 2 s grace for the broker's own timeout reply, or the asyncio client's
5 s connect) with a message saying "within 3s". Now the call ends at its deadline, to within a poll tick, and
the message says how long it really waited. The sync client runs on a fake clock here (the deadline is
checked in the client's own time, no wall-clock threshold); the asyncio client's deadline is read from its
timer heap and its connect is bounded by the call's timeout."""

from __future__ import annotations

import asyncio
import re
import time
import types

import pytest

import libra.client.sync as sync_mod
from libra.client import BrokerUnreachable, Client, ToolTimeout
from libra.client.aio import AsyncClient
from libra.local import free_port


def _nowhere() -> str:
    return f"tcp://127.0.0.1:{free_port()}"  # nothing listens there


class FakeClock:
    """``time.monotonic`` for the sync client: every reading advances 50 ms."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        self.t += 0.05
        return self.t


def _stated(msg: str) -> float:
    found = re.search(r"(?:within|after) ([0-9.]+)s\b(?!.*after)", msg)
    assert found, msg
    return float(found.group(1))


@pytest.mark.parametrize("welcomed", [False, True])
def test_sync_call_ends_at_its_own_deadline_with_the_broker_dead(monkeypatch, welcomed: bool) -> None:
    clock = FakeClock()
    monkeypatch.setattr(sync_mod, "time", types.SimpleNamespace(monotonic=clock.monotonic, time=time.time))
    with Client(_nowhere(), connect_timeout=None) as c:
        if welcomed:
            c._welcomed.set()  # as if the broker had welcomed us and then died
        t0 = clock.t
        with pytest.raises(BrokerUnreachable if not welcomed else ToolTimeout) as err:
            c.call_tool("echo", 1, timeout=3)
        waited = clock.t - t0
        assert 3.0 <= waited < 3.5, waited  # was 5.0: the 2 s reply grace on top of the caller's 3 s
        assert 3.0 <= _stated(str(err.value)) < 3.5  # the message says what happened
        assert not c._pending
        fut = c.submit_tool("echo", 2, timeout=1.0)  # gather keeps the same deadline
        t1 = clock.t
        (res,) = c.gather([fut])
        assert isinstance(res, BrokerUnreachable if not welcomed else ToolTimeout)
        assert 1.0 <= clock.t - t1 < 1.5, clock.t - t1
        assert 1.0 <= _stated(str(res)) < 1.5


def test_async_call_deadline_is_the_callers_timeout() -> None:
    async def go() -> None:
        c = AsyncClient(_nowhere())
        c._ensure_reader()
        loop = asyncio.get_running_loop()
        try:
            before = loop.time()
            call = asyncio.ensure_future(c.call_tool("echo", 1, timeout=3))
            await asyncio.sleep(0)
            after = loop.time()
            ((at, *_),) = c._deadlines
            assert before + 3 <= at <= after + 3  # was + 2 s of reply grace
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            with pytest.raises(BrokerUnreachable) as err:  # a short one runs out: it says how long it waited
                await c.call_tool("echo", 1, timeout=0.2)
            assert "within 0.2" in str(err.value) and _stated(str(err.value)) >= 0.2
        finally:
            await c.close()

    asyncio.run(go())


def test_async_first_call_connects_within_its_own_timeout(monkeypatch) -> None:
    """A first call on a fresh client used to wait the 5 s default connect before its own 3 s applied."""
    asked: list[float] = []

    async def connect(self: AsyncClient, timeout: float = 5.0) -> AsyncClient:
        asked.append(timeout)
        raise BrokerUnreachable("stub")

    monkeypatch.setattr(AsyncClient, "connect", connect)

    async def go() -> None:
        c = AsyncClient(_nowhere())
        try:
            with pytest.raises(BrokerUnreachable):
                await c.call_tool("echo", 1, timeout=3)
        finally:
            await c.close()

    asyncio.run(go())
    assert asked == [3]
