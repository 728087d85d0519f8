"""Issue 28 item 6 on real processes: nothing is left in the temp or ipc directory by an actor slot that is
SIGKILLed (its supervisor sweeps the slot's sandbox root and socket file when it reaps it) or stopped with
SIGTERM (the actor removes its own), nor by ``bench broker --trace-hops`` (its stamp folder)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from libra.local import free_port, wait_until

pytestmark = [pytest.mark.integration]



def _files(tmp: Path, ipc: Path, pid: int) -> list[str]:
    return sorted([p.name for p in tmp.glob(f"libra-sandbox-{pid}-*")] + [p.name for p in ipc.glob(f"actor-{pid}-*")])


def test_killed_and_stopped_slots_leave_no_sandbox_root_or_socket_file(tmp_path: Path) -> None:
    tmp, ipc = tmp_path / "tmp", tmp_path / "ipc"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "LIBRA_IPC_DIR": str(ipc)}
    url = f"tcp://127.0.0.1:{free_port()}"  # no broker: the slot keeps trying to reach it
    sup = subprocess.Popen([sys.executable, "-m", "libra.actors", "--broker", url, "--cpu-slots", "1",
                            "--gpu-slots", "0", "--allow-unisolated"], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        parent = psutil.Process(sup.pid)
        wait_until(lambda: len(parent.children()) == 1, 60.0, "the slot process")
        first = parent.children()[0].pid
        wait_until(lambda: len(_files(tmp, ipc, first)) == 2, 120.0, "the slot's sandbox root and socket file")
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: not _files(tmp, ipc, first), 60.0, "the supervisor to sweep the killed slot's files")
        wait_until(lambda: [c.pid for c in parent.children()] not in ([], [first]), 60.0, "the restarted slot")
        second = parent.children()[0].pid
        wait_until(lambda: len(_files(tmp, ipc, second)) == 2, 120.0, "the restarted slot's files")
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(60) == 0
        assert os.listdir(tmp) == [] and os.listdir(ipc) == []
    finally:
        _kill_children()


def test_an_actor_stopped_with_sigterm_removes_its_own_files(tmp_path: Path) -> None:
    tmp, ipc = tmp_path / "tmp", tmp_path / "ipc"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "LIBRA_IPC_DIR": str(ipc)}
    url = f"tcp://127.0.0.1:{free_port()}"
    actor = subprocess.Popen([sys.executable, "-m", "libra.actors.runtime", "--broker", url, "--slot", "cpu0",
                              "--allow-unisolated"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(_files(tmp, ipc, actor.pid)) == 2, 120.0, "the actor's sandbox root and socket file")
        actor.send_signal(signal.SIGTERM)
        assert actor.wait(60) == 0
        assert os.listdir(tmp) == [] and os.listdir(ipc) == []  # no supervisor swept them: the actor did
    finally:
        _kill_children()


def _kill_children() -> None:
    for p in psutil.Process().children(recursive=True):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def test_trace_hops_removes_its_stamp_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from libra.bench.broker_hops import trace

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert trace(5, window=2)["calls"] == 5
    assert list(tmp_path.glob("libra-hops-*")) == []


def test_a_broker_stopped_with_sigterm_removes_its_ipc_file(tmp_path: Path) -> None:
    ipc = tmp_path / "ipc"
    port = free_port()
    broker = subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", f"tcp://127.0.0.1:{port}"],
                              env={**os.environ, "LIBRA_IPC_DIR": str(ipc)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: (ipc / f"broker-{port}.sock").exists(), 60.0, "the broker's ipc file")
        broker.send_signal(signal.SIGTERM)
        assert broker.wait(60) == 0
        assert os.listdir(ipc) == []
    finally:
        _kill_children()
