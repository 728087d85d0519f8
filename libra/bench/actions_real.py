"""Action placement on a real loopback cluster: a broker (``python -m libra.broker`` with an action scheduler
or none) and action actors (``python -m libra.actors.runtime``, one process per slot), and the burst of
``pytest`` actions behind ``python -m libra.bench actions --real``.

:class:`PlacementCluster` keeps its actors running across :meth:`~PlacementCluster.restart_broker`, so two
schedulers are compared on the very same actor processes (same sandboxes, same cores): the broker is
restarted on the same port with the other ``[broker]`` table and the actors reconnect by themselves.

``fifo`` is the broker without an action scheduler: first come first served by credit, each action on the
least-loaded actor with a free work slot, one core each (its sandbox picks the least-loaded core, so more
concurrent actions than cores share them). ``tangram`` is the broker's placement (``libra/broker/actions.py``).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libra.local import child_env, free_port, stop_process, wait_until
from libra.rl.config import toml_value

__all__ = ["PYTEST_FILES", "PlacementCluster", "burst", "compare", "toml_broker"]

#: The workspace of every ``pytest`` action of the burst: a few CPU-bound tests (about 0.3 s of work).
PYTEST_FILES = {
    "test_work.py": (
        "import hashlib\n\n\n"
        "def spin(n):\n"
        "    h = b'x'\n"
        "    for _ in range(n):\n"
        "        h = hashlib.sha256(h).digest()\n"
        "    return h\n\n\n"
        "def test_a():\n    assert len(spin(60_000)) == 32\n\n\n"
        "def test_b():\n    assert len(spin(60_000)) == 32\n\n\n"
        "def test_c():\n    assert len(spin(60_000)) == 32\n"
    ),
}


def toml_broker(table: dict[str, Any]) -> str:
    """A ``[broker]`` table as TOML text (values: strings, numbers, booleans, nested tables)."""
    return "[broker]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in table.items())


@dataclass
class PlacementCluster:
    """A broker and action actors on loopback (see the module docstring). Use as a context manager.

    ``actors``: ``(slot, extra runtime arguments)`` per actor process, e.g. ``("cpu0", ["--capacity", "4"])`` or
    ``("gpu0", ["--service-gpus", "2", "--no-sandbox"])``."""

    broker: dict[str, Any]
    actors: list[tuple[str, list[str]]]
    env: dict[str, str] = field(default_factory=dict)
    log_level: str = "warning"
    port: int = 0
    procs: list[subprocess.Popen] = field(default_factory=list)
    broker_proc: subprocess.Popen | None = None
    _dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _start_broker(self) -> None:
        assert self._dir is not None
        cfg = Path(self._dir.name) / "broker.toml"
        cfg.write_text(toml_broker(self.broker))
        self.broker_proc = subprocess.Popen(
            [sys.executable, "-m", "libra.broker", "--bind", self.url, "--config", str(cfg), "--log-level",
             self.log_level], env=child_env(self.env))

    def start(self, timeout: float = 90.0) -> "PlacementCluster":
        self._dir = tempfile.TemporaryDirectory(prefix="libra-placement-")
        self.port = self.port or free_port()
        try:
            self._start_broker()
            for slot, extra in self.actors:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "libra.actors.runtime", "--broker", self.url, "--slot", slot,
                     "--log-level", self.log_level, *extra], env=child_env(self.env)))
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def status(self) -> Any:
        from libra.client import Client

        with Client(self.url, connect_timeout=2.0) as c:
            return c.status(2.0)

    def wait_ready(self, timeout: float) -> None:
        """Until every actor is registered with the broker."""
        def ready() -> bool:
            if self.broker_proc is not None and self.broker_proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.broker_proc.returncode}")
            return len(self.status().actors) >= len(self.actors)

        wait_until(ready, timeout, f"{len(self.actors)} actors to register", step=0.2)

    def restart_broker(self, broker: dict[str, Any], timeout: float = 90.0) -> None:
        """Stop the broker and start one with ``broker`` as its ``[broker]`` table on the same port; the
        actors (still running) reconnect to it."""
        stop_process(self.broker_proc)
        self.broker = broker
        self._start_broker()
        self.wait_ready(timeout)

    def stop(self) -> None:
        for p in reversed(self.procs):
            stop_process(p)
        stop_process(self.broker_proc)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "PlacementCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _burst(url: str, n: int, tag: str, timeout: float) -> list[dict[str, Any]]:
    from libra.client.aio import AsyncClient

    async with AsyncClient(url) as c:
        async def one(i: int) -> dict[str, Any]:
            t0 = time.perf_counter()
            r = await c.call_tool("pytest", {"files": PYTEST_FILES, "args": ["-q", "-p", "no:cacheprovider"]},
                                  trajectory=f"{tag}-{i}", timeout=timeout)
            act = time.perf_counter() - t0
            return {"act_s": act, "exec_s": r.output["duration_s"], "passed": r.output["summary"]["passed"],
                    "actor": r.actor_id}

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def burst(url: str, n: int, tag: str, timeout: float = 300.0) -> list[dict[str, Any]]:
    """Submit ``n`` ``pytest`` actions at once (one trajectory each) and wait for all: per action its ACT
    (submit → reply, seconds), execution time and passed-test count."""
    return asyncio.run(_burst(url, n, tag, timeout))


def compare(n: int, rounds: int, cpu_slots: int, capacity: int, tools: dict[str, Any]) -> dict[str, Any]:
    """Mean ACT of a burst of ``n`` pytest actions under ``tangram`` and ``fifo``, alternating ``rounds``
    times on the same actor processes (the broker restarted between them)."""
    configs = {"tangram": {"action_scheduler": "tangram", "tools": tools}, "fifo": {}}
    actors = [(f"cpu{i}", ["--capacity", str(capacity)]) for i in range(cpu_slots)]
    acts: dict[str, list[float]] = {k: [] for k in configs}
    execs: dict[str, list[float]] = {k: [] for k in configs}
    checks: dict[str, int] = {k: 0 for k in configs}
    t0 = time.perf_counter()
    with PlacementCluster(configs["tangram"], actors) as cl:
        burst(cl.url, 2, "warmup")  # sandboxes warm, pytest's files in the page cache
        current = "tangram"
        for r in range(rounds):
            for name in (("tangram", "fifo") if r % 2 == 0 else ("fifo", "tangram")):
                if name != current:
                    cl.restart_broker(configs[name])
                    current = name
                res = burst(cl.url, n, f"{name}-{r}")
                acts[name] += [x["act_s"] for x in res]
                execs[name] += [x["exec_s"] for x in res]
                checks[name] += sum(x["passed"] for x in res)
    out: dict[str, Any] = {"n": n, "rounds": rounds, "cpu_slots": cpu_slots, "capacity": capacity,
                           "cores": len(os.sched_getaffinity(0)), "tools": tools, "wall_s": time.perf_counter() - t0}
    for name, xs in acts.items():
        out[name] = {"act_mean_s": statistics.fmean(xs), "act_p50_s": statistics.median(xs),
                     "exec_mean_s": statistics.fmean(execs[name]),
                     "act_max_s": max(xs), "actions": len(xs), "tests_passed": checks[name]}
    out["ratio_fifo_over_tangram"] = out["fifo"]["act_mean_s"] / out["tangram"]["act_mean_s"]
    return out
