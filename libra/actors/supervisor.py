"""Starts and supervises one actor process per slot on this host.

Each slot runs ``python -m libra.actors.runtime``. A child that exits while the supervisor is not
stopping is restarted with a back-off that doubles (0.5 s → 30 s) and resets after a minute of
health. SIGTERM/SIGINT are forwarded; children get ``grace_s`` to drain before SIGKILL. On Linux each child
is also asked (``prctl(PR_SET_PDEATHSIG)``) to get SIGKILL when the supervisor dies, so a supervisor that is
itself SIGKILLed (an operator's ``kill -9``, a test harness's stop after its own grace) leaves no orphaned slots
behind that would bid, hold memory and retry a broker forever. SIGKILL, not SIGTERM: a slot already draining
for the supervisor's SIGTERM ignores a second one (two such orphans were found still running after a job's
stop); the broker re-queues what a killed slot held, as for any lost actor.

Each child's environment is :func:`slot_environment` (pure): the supervisor's own, its slot's CUDA settings
(:func:`libra.actors.slots.slot_cuda_env`: PCI bus order, the slot's entry of an existing
``CUDA_VISIBLE_DEVICES``, no GPU for a CPU slot), then the slot's own settings. Slot names are checked when
the supervisor is built: a bad one raises :class:`~libra.engines.device.errors.SlotNameError` before any child starts.

A slot that dies without cleaning up (SIGKILL, a crash) leaves files named after its pid: its sandbox pool's
root directory (``<tmp>/libra-sandbox-<pid>-*``, :func:`libra.engines.sandbox.slot.sweep_roots_of`) and its
direct-call socket file (``<ipc dir>/actor-<pid>-*.sock``). The supervisor removes them when it reaps the slot
(:func:`sweep_slot_leftovers`), before it restarts it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from libra.lifetime import die_with_parent
from libra.logging import get_logger
from libra.transport.endpoints import parse_endpoints

from .slots import slot_cuda_env

log = get_logger("libra.supervisor")

def service_gpus_of(argv: Sequence[str]) -> int:
    """The ``--service-gpus G`` a slot's arguments give its model services (0 if none)."""
    args = list(argv)
    for i, a in enumerate(args):
        if a == "--service-gpus" and i + 1 < len(args):
            return int(args[i + 1])
        if a.startswith("--service-gpus="):
            return int(a.partition("=")[2])
    return 0


def slot_environment(slot: str, parent: Mapping[str, str], *, extra: Mapping[str, str] | None = None,
                     service_gpus: int = 0) -> dict[str, str]:
    """The environment of ``slot``'s process: ``parent``'s, ``PYTHONFAULTHANDLER=1`` (a slot that dies of a
    signal in a native library writes its Python stacks first), the slot's CUDA settings, then ``extra``."""
    return {**parent, "PYTHONFAULTHANDLER": "1", **slot_cuda_env(slot, parent, service_gpus=service_gpus),
            **(extra or {})}


@dataclass
class _Child:
    slot: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    backoff_s: float = 0.5
    restart_at: float | None = None
    restarts: int = 0
    env: dict[str, str] | None = field(default=None)


def sweep_slot_leftovers(pid: int) -> list[str]:
    """Remove what the dead slot process ``pid`` left behind (see the module docstring); returns the paths."""
    from libra.transport.endpoints import ipc_dir
    from libra.engines.sandbox.slot import sweep_roots_of

    removed = [str(p) for p in sweep_roots_of(pid)]
    for path in sorted(ipc_dir().glob(f"actor-{pid}-*.sock")):
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(str(path))
    if removed:
        log.info("slot_leftovers_removed", pid=pid, paths=removed)
    return removed


class Supervisor:
    def __init__(self, broker: str | list[str], slots: list[str], *, capacity: int = 4, restart: bool = True,
                 extra_args: list[str] | None = None, grace_s: float = 10.0,
                 slot_args: dict[str, list[str]] | None = None,
                 slot_env: dict[str, dict[str, str]] | None = None) -> None:
        self.restart = restart
        self.grace_s = grace_s
        self._stop = threading.Event()
        #: One id per supervisor run, sent by every slot it starts: the broker lets a restarted slot of this
        #: supervisor replace its old session, but refuses an actor id that another supervisor holds live.
        self.instance = uuid.uuid4().hex[:12]
        self.children = []
        broker = ",".join(parse_endpoints(broker))  # one address or a list (each slot moves on a silence)
        for slot in slots:
            argv = [sys.executable, "-m", "libra.actors.runtime", "--broker", broker, "--slot", slot,
                    "--capacity", str(capacity), "--instance", self.instance, *(extra_args or []),
                    *(slot_args or {}).get(slot, [])]
            try:
                gpus = service_gpus_of(argv)
            except ValueError:
                gpus = 0  # the runtime refuses the bad number itself, with its own message
            # computed now: a bad slot name or a GPU the supervisor may not use fails before anything starts
            env = slot_environment(slot, os.environ, extra=(slot_env or {}).get(slot), service_gpus=gpus)
            self.children.append(_Child(slot, argv, env=env))

    def stop(self) -> None:
        self._stop.set()

    def _spawn(self, c: _Child) -> None:
        # env: slot_environment, computed when the supervisor was built
        c.proc = subprocess.Popen(c.argv, env=c.env, preexec_fn=die_with_parent(signal.SIGKILL))
        c.started_at = time.monotonic()
        c.restart_at = None
        if c.restarts:  # a slot that died and came back: worth an operator's attention
            log.warning("slot_restarted", slot=c.slot, pid=c.proc.pid, restarts=c.restarts)
        else:
            log.info("slot_started", slot=c.slot, pid=c.proc.pid, restarts=c.restarts)

    def run(self) -> int:
        for c in self.children:
            self._spawn(c)
        while not self._stop.wait(0.2):
            now = time.monotonic()
            for c in self.children:
                if c.proc is not None and c.proc.poll() is not None:
                    rc = c.proc.returncode
                    sweep_slot_leftovers(c.proc.pid)
                    c.proc = None
                    if not self.restart:
                        log.warning("slot_exited", slot=c.slot, returncode=rc, restart=False)
                        continue
                    if now - c.started_at > 60:
                        c.backoff_s = 0.5
                    c.restart_at = now + c.backoff_s
                    log.warning("slot_exited", slot=c.slot, returncode=rc, restart_in_s=c.backoff_s)
                    c.backoff_s = min(30.0, c.backoff_s * 2)
                elif c.proc is None and c.restart_at is not None and now >= c.restart_at:
                    c.restarts += 1
                    self._spawn(c)
            if not self.restart and all(c.proc is None for c in self.children):
                break
        return self._shutdown()

    def _shutdown(self) -> int:
        live = [c for c in self.children if c.proc is not None and c.proc.poll() is None]
        for c in live:
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for c in live:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("slot_killed_after_grace", slot=c.slot, pid=c.proc.pid)
                c.proc.kill()
                c.proc.wait()
            sweep_slot_leftovers(c.proc.pid)
        log.info("supervisor_stopped")
        return 0
