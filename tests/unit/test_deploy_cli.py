"""``python -m libra keys`` (CurveZMQ certificate files) and the ``status --watch`` frame renderers."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.auth

from libra.commands.status import render_watch, render_watch_rich
from libra.transport.keys import KeyFileError, create_keypair, load_keypair

needs_curve = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


@needs_curve
def test_keys_command_writes_a_usable_certificate_pair(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "libra", "keys", "--out", str(tmp_path / "k"), "--name", "actor-gpu0"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    pub, sec = tmp_path / "k" / "actor-gpu0.key", tmp_path / "k" / "actor-gpu0.key_secret"
    assert stat.S_IMODE(sec.stat().st_mode) == 0o600
    assert stat.S_IMODE(pub.stat().st_mode) == 0o644
    assert sorted(os.listdir(tmp_path / "k")) == ["actor-gpu0.key", "actor-gpu0.key_secret", "allowed"]  # no temp left
    public, secret = zmq.auth.load_certificate(sec)
    assert zmq.auth.load_certificate(pub) == (public, None)
    assert len(public) == 40 and len(secret) == 40 and public.decode() in out.stdout
    assert zmq.curve_public(secret) == public  # the pair belongs together


@needs_curve
def test_keys_refuse_to_overwrite_unless_forced(tmp_path: Path) -> None:
    first = create_keypair(tmp_path, "broker")
    with pytest.raises(KeyFileError, match="already exists"):
        create_keypair(tmp_path, "broker")
    r = subprocess.run([sys.executable, "-m", "libra", "keys", "--out", str(tmp_path), "--name", "broker"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "--force" in r.stderr
    assert load_keypair(first.secret_file).public_key == first.public_key  # untouched
    second = create_keypair(tmp_path, "broker", overwrite=True)
    assert second.public_key != first.public_key
    assert stat.S_IMODE(second.secret_file.stat().st_mode) == 0o600


@needs_curve
def test_keys_bad_names_and_world_readable_secrets_are_refused(tmp_path: Path) -> None:
    for bad in ("", "../x", "a/b", ".hidden"):
        with pytest.raises(KeyFileError, match="bad key name"):
            create_keypair(tmp_path, bad)
    kp = create_keypair(tmp_path, "c")
    os.chmod(kp.secret_file, 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_keypair(kp.secret_file)


ACTORS = [
    {"id": "h1/cpu0", "host": "h1", "slot": "cpu0", "kinds": ["action"], "state": "busy", "load": 3,
     "capacity": 4, "completed": 120},
    {"id": "h1/cpu1", "host": "h1", "slot": "cpu1", "kinds": ["action"], "state": "idle", "load": 0,
     "capacity": 4, "completed": 80},
]
QUEUES = {"action:echo": 7}


def test_watch_frame_plain_shows_actors_queues_and_rates() -> None:
    prev = {"submitted": 100, "completed": 90, "failed": 0, "requeued": 0}
    now = {"submitted": 140, "completed": 120, "failed": 2, "requeued": 1}
    text = render_watch(ACTORS, QUEUES, now, broker="tcp://b:5555", prev_stats=prev, dt=2.0, clock="12:00:00")
    lines = text.splitlines()
    assert lines[0].startswith("libra status --watch  tcp://b:5555  12:00:00")
    assert lines[1] == "rates/s: submitted=20.0  completed=15.0  failed=1.0  requeued=0.5"
    assert any(ln.startswith("h1/cpu0") and "busy" in ln and "3/4" in ln for ln in lines)
    assert any(ln.startswith("action:echo") and ln.rstrip().endswith("7") for ln in lines)
    first = render_watch([], {}, now, broker="tcp://b:5555")
    assert "(first sample)" in first and "(no actors connected)" in first
    down = render_watch([], {}, {}, broker="tcp://b:5555", error="no status reply within 5s")
    assert "!! no status reply within 5s (retrying)" in down


def test_watch_frame_rich_renders_the_same_content() -> None:
    pytest.importorskip("rich")
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=120, color_system=None).print(
        render_watch_rich(ACTORS, QUEUES, {"completed": 120}, broker="tcp://b:5555",
                          prev_stats={"completed": 100}, dt=4.0, clock="12:00:01"))
    out = buf.getvalue()
    assert "tcp://b:5555" in out and "completed=5.0" in out
    assert "h1/cpu0" in out and "h1/cpu1" in out and "3/4" in out and "action:echo" in out
