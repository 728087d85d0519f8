"""systemd readiness (Type=notify) of the real processes: a datagram socket stands in for systemd's
``$NOTIFY_SOCKET``. The broker says READY only once bound; an actor only after its first Welcome."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from libra.client import Client
from libra.local import free_port

pytestmark = pytest.mark.integration


def recv_state(sock: socket.socket) -> dict[str, str]:
    msg = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in msg.split("\n"))


@pytest.fixture
def notify(tmp_path: Path):
    path = tmp_path / "notify"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(60)
    yield s, str(path)
    s.close()


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_broker_ready_after_bind_and_stopping_on_sigterm(notify) -> None:
    sock, path = notify
    url = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "NOTIFY_SOCKET": path, "PYTHONUNBUFFERED": "1"}
    broker = subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "warning"],
                              env=env)
    try:
        st = recv_state(sock)
        assert st["READY"] == "1" and st["MAINPID"] == str(broker.pid) and url in st["STATUS"]
        host, port = url[len("tcp://"):].split(":")
        socket.create_connection((host, int(port)), timeout=5).close()  # bound when READY arrived
        with Client(url, connect_timeout=10) as c:
            assert c.status(timeout=10).actors == []
        broker.send_signal(signal.SIGTERM)
        assert recv_state(sock) == {"STOPPING": "1"}
        assert broker.wait(20) == 0
    finally:
        stop(broker)


def test_actor_ready_only_after_the_broker_handshake(notify) -> None:
    sock, path = notify
    url = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "NOTIFY_SOCKET": path, "PYTHONUNBUFFERED": "1"}
    actor = subprocess.Popen([sys.executable, "-m", "libra.actors.runtime", "--broker", url, "--slot", "cpu0",
                              "--no-sandbox", "--log-level", "warning"], env=env)
    broker = None
    try:
        # No broker yet: the actor runs and retries, but must not claim readiness.
        ctx = zmq.Context()
        try:  # wait until the actor's DEALER is really knocking at the address (proves it is up)
            probe = ctx.socket(zmq.ROUTER)
            probe.setsockopt(zmq.LINGER, 0)
            probe.bind(url)
            assert probe.poll(60_000), "actor never connected"
            probe.close(0)
        finally:
            ctx.term()
        sock.settimeout(0.5)
        with pytest.raises(socket.timeout):  # it said hello to a peer that never answered: no READY
            sock.recv(4096)
        sock.settimeout(60)
        broker = subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--heartbeat-s", "0.3",
                                   "--log-level", "warning"], env={**os.environ, "PYTHONUNBUFFERED": "1"})
        st = recv_state(sock)
        assert st["READY"] == "1" and st["MAINPID"] == str(actor.pid)
        with Client(url, connect_timeout=10) as c:  # the broker registered the actor before its Welcome
            assert [a["slot"] for a in c.status(timeout=10).actors] == ["cpu0"]
            assert c.call_tool("echo", {"ok": 1}, timeout=30).output == {"ok": 1}
        actor.send_signal(signal.SIGTERM)
        assert recv_state(sock) == {"STOPPING": "1"}
        assert actor.wait(20) == 0
    finally:
        stop(actor)
        if broker is not None:
            stop(broker)
