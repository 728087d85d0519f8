"""Start a broker and actors as real processes on loopback, and stop them cleanly.

Used by ``python -m libra demo``/``run``, the integration tests and the benchmarks, so that all of them
exercise exactly what an operator runs (``python -m libra.broker`` and ``python -m libra.actors``). Both get
SIGTERM when the process (the thread) that started them dies (``libra.lifetime``): a killed ``libra run`` or
test leaves nothing running.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from libra.lifetime import die_with_parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(p: subprocess.Popen | None, grace_s: float = 15.0) -> None:
    """SIGTERM ``p`` if it still runs, wait up to ``grace_s`` for it to drain, then SIGKILL it."""
    if p is not None and p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_until(cond: Callable[[], Any], timeout: float, what: str, step: float = 0.05) -> None:
    """Poll ``cond`` every ``step`` seconds until it is true; an exception counts as not yet (a broker that
    is still starting). Raises ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except Exception:  # noqa: BLE001
            pass
        time.sleep(step)
    raise TimeoutError(f"timed out waiting for {what}")


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a process a local cluster starts: this one's, unbuffered, plus ``extra``."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **extra}


@dataclass
class LocalCluster:
    """A broker plus an actor supervisor on ``127.0.0.1``. Use as a context manager."""

    cpu_slots: int = 2
    port: int = 0
    broker_args: list[str] = field(default_factory=list)
    actor_args: list[str] = field(default_factory=list)
    log_level: str = "warning"
    env: dict[str, str] = field(default_factory=dict)
    gpu_slots: str = "0"  # --gpu-slots of the supervisor ("auto": the GPUs NVML finds, for --gpu-roles)
    broker: subprocess.Popen | None = None
    actors: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        return child_env(self.env)

    def start(self, wait_actors: int | None = None, timeout: float = 60.0) -> "LocalCluster":
        if not self.port:
            self.port = free_port()
        try:  # an interrupt or a failure while starting must not leave the processes behind
            self.broker = subprocess.Popen(
                [sys.executable, "-m", "libra.broker", "--bind", self.url, "--log-level", self.log_level,
                 *self.broker_args], env=self._env(), preexec_fn=die_with_parent(signal.SIGTERM))
            self._await_ipc()
            self.start_actors()
            self.wait_for_actors(self.cpu_slots if wait_actors is None else wait_actors, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _await_ipc(self, timeout: float = 10.0) -> None:
        """Give the broker up to ``timeout`` s to bind its ipc path, so the actors connect there rather than
        over loopback TCP (a peer picks its transport when it connects; see libra.transport.endpoints). Not an error
        when it never comes (ipc switched off, or the path could not be bound): TCP works the same."""
        from libra.transport.endpoints import resolve

        env = self._env()
        if "--no-ipc" in self.broker_args or env.get("LIBRA_IPC", "1").lower() in ("0", "off", "false", "no"):
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.broker is not None and self.broker.poll() is None:
            if resolve(self.url) != self.url:
                return
            time.sleep(0.02)

    def start_actors(self) -> None:
        self.actors = subprocess.Popen(
            [sys.executable, "-m", "libra.actors", "--broker", self.url, "--cpu-slots", str(self.cpu_slots),
             "--gpu-slots", self.gpu_slots, "--log-level", self.log_level, *self.actor_args], env=self._env(),
            preexec_fn=die_with_parent(signal.SIGTERM))

    def status(self, timeout: float = 5.0) -> Any:
        from libra.client import Client

        with Client(self.url, connect_timeout=timeout) as c:
            return c.status(timeout)

    def wait_for_actors(self, n: int, timeout: float = 60.0) -> list[dict]:
        """Block until at least ``n`` actors are registered and idle-or-busy; return them."""
        deadline = time.monotonic() + timeout
        last: list[dict] = []
        while time.monotonic() < deadline:
            if self.broker is not None and self.broker.poll() is not None:
                raise RuntimeError(f"broker exited with {self.broker.returncode}")
            if self.actors is not None and self.actors.poll() is not None:  # e.g. a --tools module that fails
                raise RuntimeError(f"the actors' supervisor exited with {self.actors.returncode} (its error is above)")
            try:
                last = self.status(timeout=2.0).actors
            except Exception:
                last = []
            if len(last) >= n:
                return last
            time.sleep(0.1)
        raise TimeoutError(f"only {len(last)} of {n} actors registered within {timeout}s")

    def stop(self, grace_s: float = 15.0) -> None:
        for p in (self.actors, self.broker):
            stop_process(p, grace_s)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
