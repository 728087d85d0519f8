"""An actor that a CURVE broker refuses (the wrong broker public key, or no keys at all) hears nothing back;
instead of only ``broker_silent`` it logs ONE ``broker_unanswered`` warning naming the likely causes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from libra.client import Client
from libra.transport.keys import create_keypair
from libra.local import free_port, stop_process
from libra.transport.security import CurveClient

pytestmark = pytest.mark.integration


def _events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line still being written
                pass
    return out


def test_refused_actors_say_why_the_broker_is_silent_once(tmp_path: Path) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    allowed.mkdir()
    broker_kp = create_keypair(keys, "broker")
    actor_kp = create_keypair(keys, "actor")
    (allowed / actor_kp.public_file.name).write_bytes(actor_kp.public_file.read_bytes())  # its key is allowed
    impostor = create_keypair(keys, "impostor")  # ... but it is given this key as the broker's
    url = f"tcp://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIBRA_CURVE", "LIBRA_BROKER_KEY"))}
    wrong_key = {**env, "LIBRA_CURVE_SECRET": str(actor_kp.secret_file), "LIBRA_BROKER_KEY": str(impostor.public_file)}
    procs: list[subprocess.Popen] = []
    logs = {name: (tmp_path / f"{name}.log") for name in ("broker", "wrong_key", "plaintext")}
    files = {name: path.open("w") for name, path in logs.items()}
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "info",
                                       "--curve-secret", str(broker_kp.secret_file), "--curve-allow", str(allowed)],
                                      stdout=files["broker"], stderr=subprocess.STDOUT, env=env))
        for name, actor_env in (("wrong_key", wrong_key), ("plaintext", env)):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "libra.actors", "--broker", url, "--cpu-slots", "1", "--gpu-slots", "0",
                 "--no-sandbox", "--no-direct", "--no-restart", "--log-level", "info"],
                stdout=files[name], stderr=subprocess.STDOUT, env=actor_env))
        deadline = time.monotonic() + 90  # a bound on a slow machine, not a measured threshold
        # wait until each actor has been silent twice: the second silence must not repeat the hint
        while time.monotonic() < deadline:
            if all(sum(e["event"] == "broker_silent" for e in _events(logs[n])) >= 2 for n in ("wrong_key", "plaintext")):
                break
            assert all(p.poll() is None for p in procs), "a process exited early: " + logs["wrong_key"].read_text()[-2000:]
            time.sleep(0.2)
        else:
            pytest.fail("the actors never reported a silent broker:\n" + logs["wrong_key"].read_text()[-2000:])
        for name, marks in (("wrong_key", ("uses CURVE keys", str(impostor.public_file), "--curve-allow")),
                            ("plaintext", ("no CURVE keys", "--curve-secret", "LIBRA_CURVE_SECRET"))):
            hints = [e for e in _events(logs[name]) if e["event"] == "broker_unanswered"]
            assert len(hints) == 1, f"{name}: {len(hints)} hints\n" + logs[name].read_text()[-3000:]
            assert hints[0]["level"] == "warning" and hints[0]["broker"] == url
            assert url in hints[0]["hint"] and "is a broker running there" in hints[0]["hint"]
            for mark in marks:
                assert mark in hints[0]["hint"], (name, mark, hints[0]["hint"])
        good = CurveClient.from_files(actor_kp.secret_file, broker_kp.public_file)
        with Client(url, curve=good, connect_timeout=30) as c:  # the broker is there: only the keys were wrong
            assert c.status().actors == []
    finally:
        for p in reversed(procs):
            stop_process(p, 10)
        for f in files.values():
            f.close()
