"""libra.transport.endpoints: a loopback TCP endpoint switches to the broker's ipc path only when a broker serves it."""

from __future__ import annotations

import os
import socket
import stat

import pytest
import zmq

from libra.transport import endpoints as ep
from libra.broker.server import BrokerServer
from libra.client import Client


@pytest.fixture(autouse=True)
def ipc_dir(tmp_path, monkeypatch):
    d = tmp_path / "ipc"
    monkeypatch.setenv("LIBRA_IPC_DIR", str(d))
    monkeypatch.delenv("LIBRA_IPC", raising=False)
    return d


def test_parse_endpoints():
    assert ep.tcp_port("tcp://127.0.0.1:5555") == 5555
    assert ep.tcp_port("tcp://*:*") is None
    assert ep.tcp_port("ipc:///tmp/x") is None
    assert ep.is_loopback_tcp("tcp://localhost:1") and ep.is_loopback_tcp("tcp://[::1]:1")
    assert ep.is_loopback_tcp("tcp://127.0.0.2:1")
    assert not ep.is_loopback_tcp("tcp://10.0.0.5:1")


def test_only_loopback_or_wildcard_binds_get_a_path(ipc_dir):
    assert ep.broker_ipc_endpoint("tcp://127.0.0.1:7000") == f"ipc://{ipc_dir}/broker-7000.sock"
    assert ep.broker_ipc_endpoint("tcp://0.0.0.0:7000") is not None
    assert ep.broker_ipc_endpoint("tcp://10.0.0.5:7000") is None  # loopback peers cannot reach it anyway
    assert stat.S_IMODE(ipc_dir.stat().st_mode) == 0o700


def test_switched_off_by_env(monkeypatch):
    monkeypatch.setenv("LIBRA_IPC", "0")
    assert ep.broker_ipc_endpoint("tcp://127.0.0.1:7000") is None


def test_resolve_keeps_tcp_without_a_listener(ipc_dir):
    url = "tcp://127.0.0.1:7001"
    assert ep.resolve(url) == url  # nothing there
    ipc_dir.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(ipc_dir / "broker-7001.sock"))  # a socket file nobody listens on: a killed broker's
    stale.close()
    assert ep.resolve(url) == url
    ep.forget_ipc(url)
    assert not (ipc_dir / "broker-7001.sock").exists()
    assert ep.resolve("tcp://10.0.0.5:7001") == "tcp://10.0.0.5:7001"
    assert ep.resolve("ipc:///somewhere") == "ipc:///somewhere"


def test_client_on_loopback_tcp_uses_the_brokers_ipc_path(ipc_dir):
    import threading

    server = BrokerServer("tcp://127.0.0.1:0")
    assert server.ipc_endpoint is not None and server.ipc_endpoint.startswith("ipc://")
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        with Client(server.endpoint) as c:
            assert c.endpoint == server.ipc_endpoint
            assert c.status().actors == []  # served over ipc
        os.environ["LIBRA_IPC"] = "0"
        try:
            with Client(server.endpoint) as c:
                assert c.endpoint == server.endpoint
                assert c.status().actors == []
        finally:
            del os.environ["LIBRA_IPC"]
    finally:
        server.stop()
        t.join(5)
    path = server.ipc_endpoint[len("ipc://"):]
    assert not os.path.exists(path)  # libzmq removes the path when the broker closes


def test_broker_without_ipc_removes_a_stale_path(ipc_dir):
    from libra.local import free_port

    port = free_port()
    ipc_dir.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(ipc_dir / f"broker-{port}.sock"))  # left by a killed broker on this port
    stale.close()
    ctx = zmq.Context()
    server = BrokerServer(f"tcp://127.0.0.1:{port}", ctx=ctx, ipc=False)
    try:
        assert server.ipc_endpoint is None
        assert not (ipc_dir / f"broker-{port}.sock").exists()
        assert ep.resolve(f"tcp://127.0.0.1:{port}") == f"tcp://127.0.0.1:{port}"
    finally:
        server.sock.close(0)
        ctx.term()
