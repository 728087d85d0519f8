"""A call that runs out of time says how many times it ran (#28 item 3, with the client's deadline kept).

The client's deadline is the caller's ``timeout``; the request carries a slightly shorter one to the broker
(``served_timeout``), so the broker's own typed timeout reply, with its ``attempts``, arrives before the
deadline instead of the client giving up blind. Real broker and action slot on loopback."""

from __future__ import annotations

import asyncio

import pytest

from libra.client import Client, ToolTimeout
from libra.client.aio import AsyncClient
from libra.client.common import served_timeout
from libra.local import LocalCluster

pytestmark = pytest.mark.integration


def test_served_timeout_leaves_a_margin_inside_the_callers_deadline() -> None:
    assert served_timeout(10) == pytest.approx(9.5)
    assert served_timeout(1) == pytest.approx(0.75)  # at most a quarter of a short timeout
    assert 0 < served_timeout(0.05) < 0.05


def test_a_timed_out_call_reports_the_brokers_attempts_sync_and_async() -> None:
    with LocalCluster(cpu_slots=1, actor_args=["--no-sandbox", "--capacity", "2", "--no-restart"]) as cl:
        with Client(cl.url) as c:
            assert c.call_tool("echo", "up", timeout=30).output == "up"
            with pytest.raises(ToolTimeout) as err:
                c.call_tool("sleep", {"seconds": 10}, timeout=1.5)
            assert err.value.attempts == 1, str(err.value)  # the broker's reply, not the client's blind deadline

        async def go() -> ToolTimeout:
            async with AsyncClient(cl.url) as ac:
                with pytest.raises(ToolTimeout) as aerr:
                    await ac.call_tool("sleep", {"seconds": 10}, timeout=1.5)
                return aerr.value

        assert asyncio.run(go()).attempts == 1
