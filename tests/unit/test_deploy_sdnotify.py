"""libra.transport.sdnotify against a real AF_UNIX datagram socket standing in for systemd's notify socket."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

from libra.transport import sdnotify


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "notify"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(10)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield s
    s.close()


def test_ready_and_stopping_datagrams(notify_socket: socket.socket) -> None:
    assert sdnotify.ready("listening on tcp://127.0.0.1:5555") is True
    msg = notify_socket.recv(4096).decode()
    assert msg.split("\n") == ["READY=1", f"MAINPID={os.getpid()}", "STATUS=listening on tcp://127.0.0.1:5555"]
    assert sdnotify.stopping() is True
    assert notify_socket.recv(4096) == b"STOPPING=1"


def test_abstract_namespace_address(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"libra-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        s.settimeout(10)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.ready() is True
        assert s.recv(4096).decode() == f"READY=1\nMAINPID={os.getpid()}"


def test_no_notify_socket_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.ready() is False and sdnotify.stopping() is False


def test_dead_notify_socket_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert sdnotify.ready() is False
