"""Two actor supervisors on one host against one broker (real processes): the second cannot take the
first's actor ids (it is refused, with an error in its log, and the first keeps its sessions); with
--actor-id-prefix it runs beside it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from libra.client import Client
from libra.local import free_port

from .procs import stop_all

pytestmark = pytest.mark.integration


def _supervisor(url: str, *extra: str, log=subprocess.DEVNULL) -> subprocess.Popen:  # noqa: ANN001
    return subprocess.Popen([sys.executable, "-m", "libra.actors", "--broker", url, "--cpu-slots", "1",
                             "--gpu-slots", "0", "--no-sandbox", "--log-level", "info", *extra],
                            stdout=log, stderr=subprocess.STDOUT)


def _actors(c: Client, n: int, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        actors = c.status().actors
        if len(actors) >= n:
            return actors
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} actors registered")


def test_a_second_supervisor_is_refused_and_a_prefixed_one_runs_beside_the_first(tmp_path) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    broker = subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "warning"])
    procs = [broker]
    try:
        with Client(url, connect_timeout=30) as c:
            procs.append(_supervisor(url))
            (first,) = _actors(c, 1)
            log_file = (tmp_path / "second.log").open("w")
            second = _supervisor(url, log=log_file)
            procs.append(second)
            deadline = time.monotonic() + 30
            while c.status().stats.get("hellos_refused", 0) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(2.0)  # long enough for the old behaviour's knock-offs (about one a second)
            stats, actors = c.status().stats, c.status().actors
            assert stats.get("hellos_refused", 0) >= 2, stats  # refused, and refused again after a back-off
            assert [(a["id"], a["pid"]) for a in actors] == [(first["id"], first["pid"])]  # undisturbed
            assert stats.get("actors_expired", 0) == 0
            third = _supervisor(url, "--actor-id-prefix", "b")
            procs.append(third)
            ids = sorted(a["id"] for a in _actors(c, 2))
            assert ids == sorted([first["id"], first["id"].replace("/cpu0", "/b-cpu0")])
        second.send_signal(signal.SIGTERM)
        second.wait(30)
        log_file.close()
        log = (tmp_path / "second.log").read_text()
        assert "actor_id_refused" in log and "--actor-id-prefix" in log
    finally:
        stop_all(procs)
