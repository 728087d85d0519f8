"""CurveZMQ: an allowed key works; an unknown key and a plaintext peer get nothing; a public bind
without keys is refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from libra.client import BrokerUnreachable, Client
from libra.transport.keys import create_keypair
from libra.local import free_port
from libra.transport.security import CurveClient, is_local_endpoint

pytestmark = pytest.mark.integration


def test_loopback_detection() -> None:
    assert is_local_endpoint("tcp://127.0.0.1:5555") and is_local_endpoint("tcp://[::1]:1")
    assert is_local_endpoint("ipc:///tmp/x") and not is_local_endpoint("tcp://0.0.0.0:5555")
    assert not is_local_endpoint("tcp://10.1.2.3:5555")


def test_public_bind_without_keys_is_refused() -> None:
    r = subprocess.run([sys.executable, "-m", "libra.broker", "--bind", f"tcp://0.0.0.0:{free_port()}"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "libra keys" in r.stderr and "--insecure" in r.stderr


def test_curve_allow_list(tmp_path) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    allowed.mkdir()
    broker_kp = create_keypair(keys, "broker")
    for name in ("client", "actor"):
        kp = create_keypair(keys, name)
        shutil.copy(kp.public_file, allowed / kp.public_file.name)
    create_keypair(keys, "stranger")
    url = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "LIBRA_CURVE_SECRET": str(keys / "actor.key_secret"),
           "LIBRA_BROKER_KEY": str(broker_kp.public_file)}
    broker_log = (tmp_path / "broker.log").open("w")
    broker = subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "info",
                               "--curve-secret", str(broker_kp.secret_file), "--curve-allow", str(allowed)],
                              stdout=broker_log, stderr=subprocess.STDOUT)
    actors = subprocess.Popen([sys.executable, "-m", "libra.actors", "--broker", url, "--cpu-slots", "1",
                               "--gpu-slots", "0", "--no-sandbox", "--no-restart", "--log-level", "warning"], env=env)
    try:
        good = CurveClient.from_files(keys / "client.key_secret", broker_kp.public_file)
        with Client(url, curve=good, connect_timeout=30) as c:
            deadline = time.monotonic() + 30
            while not c.status().actors and time.monotonic() < deadline:
                time.sleep(0.1)
            assert c.call_tool("echo", {"secret": 1}).output == {"secret": 1}  # the actor got in too
            with Client(url, curve=good, connect_timeout=10) as c2:  # the broker is up: its ipc path is found
                assert c2.endpoint.startswith("ipc://") and c2.call_tool("echo", 2).output == 2  # CURVE over ipc
            bad = CurveClient.from_files(keys / "stranger.key_secret", broker_kp.public_file)
            with pytest.raises(BrokerUnreachable, match="--curve-allow directory"):  # says what to check
                Client(url, curve=bad, connect_timeout=2)
            env_clean = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_CURVE")}
            assert "LIBRA_CURVE_SECRET" not in env_clean
            with pytest.raises(BrokerUnreachable, match="requires CURVE keys.*LIBRA_CURVE_SECRET"):
                Client(url, connect_timeout=2)  # plaintext: the error says the broker may require keys
            stats = c.status().stats
            assert stats["clients"] == 1 and stats["bad_frames"] == 0  # nothing of theirs reached the core
        lines = [json.loads(x) for x in (tmp_path / "broker.log").read_text().splitlines() if x.startswith("{")]
        started = next(x for x in lines if x["event"] == "broker_started")
        assert started["curve"].startswith("on")  # the start-up line says CURVE is on
        refused = [x for x in lines if x["event"] == "handshake_refused"]
        assert refused and refused[0]["peer"].startswith(("127.0.0.1", "localhost:")) and refused[0]["mechanism"] == "CURVE"
        assert refused[0]["client_key"] == (keys / "stranger.key").read_text().split('public-key = "')[1].split('"')[0]
    finally:
        broker_log.close()
        for p in (actors, broker):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
