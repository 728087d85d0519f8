"""Sandboxed ``python`` through a real broker and ``python -m libra.actors`` (real bubblewrap): stdout comes
back, a timeout is a typed ``ToolFailed`` with ``tool_code == "timeout"``; ``reward_model`` scores through
the broker and an unknown service is ``ToolFailed`` with ``tool_code == "unknown_service"``. Tool code cannot
reach the broker (its TCP port or its ipc path) or a data-plane server (#33: the network is denied)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from libra.client import Client, ToolFailed
from libra.local import LocalCluster

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap"),
]


@pytest.fixture(scope="module")
def sandbox_cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(cpu_slots=1, actor_args=["--no-restart", "--capacity", "2"])
    c.start(timeout=60)
    yield c
    c.stop()


def test_python_through_the_broker_returns_stdout(sandbox_cluster: LocalCluster) -> None:
    with Client(sandbox_cluster.url) as c:
        r = c.call_tool("python", {"code": "import sys\nprint(6 * 7)\nprint('oops', file=sys.stderr)"},
                        trajectory="sanity", timeout=60)
        assert r.output["stdout"] == "42\n" and r.output["stderr"] == "oops\n" and r.output["exit_code"] == 0
        again = c.call_tool("python", {"code": "import os; print(sorted(os.listdir('.')))",
                                       "files": {"kept.txt": "x"}}, trajectory="sanity", timeout=60)
        assert "kept.txt" in again.output["stdout"]


def test_timeout_is_tool_failed_with_code_timeout(sandbox_cluster: LocalCluster) -> None:
    with Client(sandbox_cluster.url) as c:
        with pytest.raises(ToolFailed) as ei:
            c.call_tool("python", {"code": "while True: pass", "timeout_s": 0.5}, trajectory="spin", timeout=60)
        assert ei.value.tool_code == "timeout"
        assert c.call_tool("python", {"code": "print('alive')"}, trajectory="spin", timeout=60).output["stdout"] == "alive\n"


def test_tool_code_cannot_reach_the_broker_or_the_data_plane(sandbox_cluster: LocalCluster) -> None:
    from libra.dataplane import DataPlaneServer
    from libra.transport.endpoints import broker_ipc_endpoint

    server = DataPlaneServer()  # a data-plane server on this host's loopback, as every actor runs one
    try:
        host, port = sandbox_cluster.url[len("tcp://"):].rsplit(":", 1)
        dp_port = server.endpoint.rsplit(":", 1)[1]
        ipc = broker_ipc_endpoint(sandbox_cluster.url)
        code = (
            "import socket\n"
            f"for addr in [({host!r}, {port}), ('127.0.0.1', {dp_port})]:\n"
            "    try:\n        socket.create_connection(addr, timeout=2)\n        print('CONNECTED', addr)\n"
            "    except OSError as exc:\n        print('refused', type(exc).__name__)\n"
            f"path = {(ipc or 'ipc:///nonexistent')[len('ipc://'):]!r}\n"
            "try:\n    s = socket.socket(socket.AF_UNIX)\n    s.connect(path)\n    print('CONNECTED', path)\n"
            "except OSError as exc:\n    print('refused', type(exc).__name__)\n")
        with Client(sandbox_cluster.url) as c:
            out = c.call_tool("python", {"code": code}, trajectory="escape", timeout=60).output
        assert ipc is not None and "CONNECTED" not in out["stdout"] and out["stdout"].count("refused") == 3, out
    finally:
        server.close()


def test_reward_model_through_the_broker_and_unknown_service(sandbox_cluster: LocalCluster) -> None:
    with Client(sandbox_cluster.url) as c:
        first = c.call_tool("reward_model", {"service": "tiny_reward", "text": "The answer is 42."}, timeout=120).output
        again = c.call_tool("reward_model", {"service": "tiny_reward", "text": "The answer is 42."}, timeout=60).output
        assert first["restored"] is True and again["restored"] is False and again["score"] == first["score"] < 0
        with pytest.raises(ToolFailed) as ei:
            c.call_tool("reward_model", {"service": "no_such_model", "text": "hi there"}, timeout=60)
        assert ei.value.tool_code == "unknown_service" and "tiny_reward" in str(ei.value)
