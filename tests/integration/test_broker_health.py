"""The broker's /healthz and /readyz beside /metrics (libra.broker.health), asked over HTTP (urllib): a real
broker process; a standby that is alive but not ready until it takes over from a killed primary; and a broker
whose loop is stuck inside its core (in this process, so the test can hold the loop), which answers 503."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from libra.broker.config import BrokerConfig
from libra.broker.events import Tick
from libra.broker.health import BrokerHealth, HealthEndpoint
from libra.broker.metrics import BrokerMetrics
from libra.broker.server import BrokerServer
from libra.client import Client
from libra.local import free_port, wait_until

from .procs import stop_all

pytestmark = pytest.mark.integration


def get(url: str) -> tuple[int, bytes]:
    """(status, body) of a GET; an HTTP error status is an answer too."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def probe(base: str, path: str) -> tuple[int, dict]:
    code, body = get(base + path)
    return code, json.loads(body)


def broker(*args: str, log: Path) -> subprocess.Popen:
    with log.open("wb") as err:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-m", "libra.broker", "--metrics-host", "127.0.0.1", "--heartbeat-s",
                                 "0.3", "--log-level", "info", *args], stdout=subprocess.DEVNULL, stderr=err)


def test_a_broker_answers_its_probes_beside_its_metrics(tmp_path: Path) -> None:
    mport = free_port()
    base = f"http://127.0.0.1:{mport}"
    p = broker("--bind", f"tcp://127.0.0.1:{free_port()}", "--metrics-port", str(mport), log=tmp_path / "b.log")
    try:
        wait_until(lambda: probe(base, "/readyz")[0] == 200, 60, "the broker to be ready")
        code, body = probe(base, "/healthz")
        assert code == 200 and body["status"] == "ok" and body["phase"] == "serving"
        assert 0 <= body["last_tick_s"] < 10  # the loop ticks (every 0.15 s here)
        code, text = get(base + "/metrics")
        assert code == 200 and b"libra_broker_info" in text  # the same port still serves Prometheus
    finally:
        stop_all([p])
    assert p.returncode == 0
    with pytest.raises(urllib.error.URLError):  # gone with the broker
        get(base + "/healthz")


def test_a_standby_is_alive_but_not_ready_until_it_takes_over(tmp_path: Path) -> None:
    repl, sport, mport = free_port(), free_port(), free_port()
    base, url = f"http://127.0.0.1:{mport}", f"tcp://127.0.0.1:{sport}"
    primary = broker("--bind", f"tcp://127.0.0.1:{free_port()}", "--journal", str(tmp_path / "p.sqlite"),
                     "--replicate-bind", f"tcp://127.0.0.1:{repl}", log=tmp_path / "p.log")
    standby = broker("--bind", url, "--journal", str(tmp_path / "s.sqlite"), "--standby-of", f"tcp://127.0.0.1:{repl}",
                     "--takeover-after-s", "1.5", "--metrics-port", str(mport), log=tmp_path / "s.log")
    procs = [primary, standby]
    try:
        wait_until(lambda: probe(base, "/healthz")[0] == 200, 60, "the standby's health endpoint")
        wait_until(lambda: b"standby_snapshot_applied" in (tmp_path / "s.log").read_bytes(), 60,
                   "the standby to follow its primary")
        assert probe(base, "/readyz") == (503, {"status": "standby", "phase": "standby", "last_tick_s": None})
        assert probe(base, "/healthz")[1]["phase"] == "standby"
        assert get(base + "/metrics")[0] == 503  # no broker state to export while it stands by
        primary.kill()
        primary.wait(15)
        wait_until(lambda: probe(base, "/readyz")[0] == 200, 60, "the standby to take over")
        with Client(url, connect_timeout=10) as c:  # ready meant bound and serving
            assert c.status(timeout=10).actors == []
        assert get(base + "/metrics")[0] == 200
    finally:
        stop_all(procs)
    assert standby.returncode == 0, (tmp_path / "s.log").read_text()[-2000:]


def test_a_stuck_loop_answers_503_and_recovers(tmp_path: Path) -> None:
    http = HealthEndpoint(0, "127.0.0.1", BrokerHealth(stall_s=0.5))
    base = f"http://127.0.0.1:{http.port}"
    server = BrokerServer(f"tcp://127.0.0.1:{free_port()}", BrokerConfig(heartbeat_s=0.3), ipc=False,
                          on_ready=lambda _ep: http.health.set_phase("serving"))
    server.metrics = BrokerMetrics(server.state)
    http.attach(server.metrics)
    gate = threading.Event()
    gate.set()
    handle = server.state.handle

    def held(event, now):  # type: ignore[no-untyped-def]
        if type(event) is Tick:
            gate.wait(60)  # a tick while the gate is shut never returns: the loop is stuck in the core
        return handle(event, now)

    server.state.handle = held  # type: ignore[method-assign]
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    assert probe(base, "/readyz")[1]["status"] == "starting"  # not bound-and-serving yet
    loop.start()
    try:
        wait_until(lambda: probe(base, "/readyz")[0] == 200, 30, "the broker to be ready")
        gate.clear()
        wait_until(lambda: probe(base, "/healthz")[0] == 503, 30, "the stuck loop to be seen")
        code, body = probe(base, "/healthz")
        assert code == 503 and body["status"] == "stalled" and body["last_tick_s"] > 0.5
        assert probe(base, "/readyz")[0] == 503
        gate.set()
        wait_until(lambda: probe(base, "/healthz")[0] == 200, 30, "the loop to turn again")
        assert probe(base, "/readyz")[0] == 200
    finally:
        gate.set()
        server.stop()
        loop.join(30)
        http.close()
    assert not loop.is_alive()
