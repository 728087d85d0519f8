"""``libra dashboard`` under CURVE, like every other client (real processes on loopback): it takes its keys from
``LIBRA_CURVE_SECRET`` / ``LIBRA_BROKER_KEY``. With an operator's key it sees the broker's audit trail, so an
operator's directive shows in its timeline as a role switch; with a client key it sees the cluster but not the
trail (and says so); without keys it cannot reach the broker and its view says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from libra.client import Client
from libra.lifetime import die_with_parent
from libra.local import free_port, stop_process, wait_until
from libra.transport.security import CurveClient

from .role_keys import role_keys

pytestmark = pytest.mark.integration


def view(page: str) -> dict[str, Any]:
    with urllib.request.urlopen(page + "api/status", timeout=10) as r:
        return json.load(r)


def dashboard(url: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "libra.dashboard", "--broker", url, "--port", "0"],
                         stdout=subprocess.PIPE, text=True, env=env, preexec_fn=die_with_parent())
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.startswith("libra dashboard: http://"), line
    return p, line.split()[2]


def test_the_dashboard_follows_curve_and_an_operator_key_sees_the_timeline(tmp_path: Path) -> None:
    keys, allowed, broker_kp = role_keys(tmp_path, (("host1", "actors"), ("viewer", "clients"), ("ops", "operators")))
    url = f"tcp://127.0.0.1:{free_port()}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_CURVE") and k != "LIBRA_BROKER_KEY"}
    as_key = {n: {**base, "LIBRA_CURVE_SECRET": str(keys / f"{n}.key_secret"),
                  "LIBRA_BROKER_KEY": str(broker_kp.public_file)} for n in ("host1", "viewer", "ops")}
    procs = [subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "warning",
                               "--curve-secret", str(broker_kp.secret_file), "--curve-allow", str(allowed)]),
             subprocess.Popen([sys.executable, "-m", "libra.actors", "--broker", url, "--cpu-slots", "1", "--gpu-slots",
                               "0", "--no-sandbox", "--no-restart", "--log-level", "warning"], env=as_key["host1"])]
    dashes = [dashboard(url, as_key["ops"]), dashboard(url, as_key["viewer"]), dashboard(url, base)]
    (_, ops), (_, viewer), (_, nokey) = dashes
    try:
        wait_until(lambda: view(ops)["snapshot"]["actors"], 60.0, "the operator's dashboard to see the actor")
        ops_key = CurveClient.from_files(keys / "ops.key_secret", broker_kp.public_file)
        with Client(url, curve=ops_key, connect_timeout=30) as c:
            actor = c.status().actors[0]["id"]
            c.direct(actor, ["action", "episode"])
        wait_until(lambda: any(e["switch"] for e in view(ops)["timeline"]), 30.0, "the directive in the timeline")
        wait_until(lambda: view(viewer)["polls"] >= 3 and view(nokey)["error"], 30.0, "three polls")
        seen, client_view, outside = view(ops), view(viewer), view(nokey)
    finally:
        for p, _ in dashes:
            stop_process(p)
            if p.stdout is not None:
                p.stdout.close()
        for p in reversed(procs):
            stop_process(p)
    (switch,) = [e for e in seen["timeline"] if e["switch"]]
    assert switch["text"] == f"{actor} -> action,episode" and switch["by"] == "operator" and switch["actor"] == actor
    assert seen["audit_visible"] is True
    assert client_view["audit_visible"] is False and client_view["timeline"] == []  # the trail is an operator's
    assert [a["id"] for a in client_view["snapshot"]["actors"]] == [actor] and client_view["error"] is None
    assert outside["polls"] == 0 and "CURVE" in outside["error"]  # no keys: no way in, and the view says why
