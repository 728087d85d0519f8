"""Issue 28 item 6, the parts that need no process of their own: socket files removed on close, a dead
process's sandbox roots and socket files swept by pid, the secret keys directory git-ignored."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import zmq

from libra.actors.supervisor import sweep_slot_leftovers
from libra.engines.sandbox.slot import root_prefix, sweep_roots_of
from libra.transport.zmqio import bind_ipc, close_socket

ROOT = Path(__file__).resolve().parents[2]


def test_close_socket_removes_the_ipc_file_libzmq_leaves(tmp_path: Path) -> None:
    ctx = zmq.Context()
    try:
        plain, mine = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
        plain.bind(f"ipc://{tmp_path / 'plain.sock'}")
        assert bind_ipc(mine, tmp_path / "mine.sock") == f"ipc://{tmp_path / 'mine.sock'}"
        plain.close(0)
        close_socket(mine)
    finally:
        ctx.term()
    assert (tmp_path / "plain.sock").exists()  # what libzmq does on its own (why close_socket exists)
    assert not (tmp_path / "mine.sock").exists()


def test_sandbox_roots_carry_the_pid_and_are_swept_by_it(tmp_path: Path) -> None:
    assert root_prefix() == f"libra-sandbox-{os.getpid()}-" and root_prefix(12) == "libra-sandbox-12-"
    dead = tmp_path / "libra-sandbox-999999-abc"
    (dead / "ws-0").mkdir(parents=True)
    (dead / "ws-0" / "f").write_text("x")
    os.chmod(dead / "ws-0", 0)  # a workspace its code made unreadable
    other = tmp_path / "libra-sandbox-9999991-abc"  # another pid that starts with the same digits
    other.mkdir()
    assert sweep_roots_of(999999, tmp_path) == [dead]
    assert not dead.exists() and other.exists()


def test_supervisor_sweeps_a_dead_slots_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("LIBRA_IPC_DIR", str(tmp_path / "ipc"))
    (tmp_path / "tmp" / "libra-sandbox-424242-x1" / "ws-0").mkdir(parents=True)
    (tmp_path / "ipc").mkdir()
    (tmp_path / "ipc" / "actor-424242-0a1b2c3d.sock").touch()
    (tmp_path / "ipc" / "actor-4242421-0a1b2c3d.sock").touch()
    removed = sweep_slot_leftovers(424242)
    assert sorted(Path(p).name for p in removed) == ["actor-424242-0a1b2c3d.sock", "libra-sandbox-424242-x1"]
    assert os.listdir(tmp_path / "tmp") == [] and os.listdir(tmp_path / "ipc") == ["actor-4242421-0a1b2c3d.sock"]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_secret_keys_are_git_ignored() -> None:
    for path in ("keys/broker.key_secret", "keys/allowed/host1.key", "elsewhere/host1.key_secret"):
        assert subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", path]).returncode == 0, path
