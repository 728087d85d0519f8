"""``libra dashboard`` and ``libra serve`` (real processes) exit 0 on SIGTERM after their clean shutdown, as
systemd and Kubernetes expect of a stop. uvicorn raises the caught signal again after its graceful shutdown, so
before the fix both died by the signal (exit status -15)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

import pytest

from libra.engines.tiny_model import ensure_tiny_model
from libra.local import free_port, stop_process

pytestmark = pytest.mark.integration


def _wait_accepting(url: str, proc: subprocess.Popen) -> None:
    """Until ``url``'s host:port takes a TCP connection (uvicorn serves, its signal handlers are in place)."""
    hostport = urlsplit(url)
    for _ in range(600):
        assert proc.poll() is None, "the server exited before it served"
        try:
            socket.create_connection((hostport.hostname, hostport.port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} never accepted a connection")


def _sigterm_after_banner(argv: list[str], banner: str) -> tuple[int, str]:
    """Start ``python -m libra ARGV``, wait for its ``banner`` line on stdout, SIGTERM it: its exit status."""
    proc = subprocess.Popen([sys.executable, "-m", "libra", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith(banner), (line, proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
        _wait_accepting(line.split()[2], proc)  # the banner may come before uvicorn serves (libra serve)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        return rc, proc.stderr.read()  # type: ignore[union-attr]
    finally:
        stop_process(proc, 5.0)
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]


@pytest.mark.timeout(120)
def test_the_dashboard_exits_0_on_sigterm() -> None:
    # no broker listens there: the dashboard serves anyway and shows the failed polls
    rc, err = _sigterm_after_banner(["dashboard", "--broker", f"tcp://127.0.0.1:{free_port()}", "--port", "0"],
                                    "libra dashboard: http://")
    assert rc == 0, (rc, err[-2000:])


@pytest.mark.timeout(180)
def test_libra_serve_exits_0_on_sigterm(tmp_path) -> None:
    model = ensure_tiny_model(tmp_path / "tiny")
    url = f"tcp://127.0.0.1:{free_port()}"
    broker = subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "warning"])
    try:
        rc, err = _sigterm_after_banner(["serve", "--broker", url, "--model-dir", str(model), "--port", "0"],
                                        "libra serve: http://")
        assert rc == 0, (rc, err[-2000:])
    finally:
        stop_process(broker, 10.0)
