"""SandboxPool: a warm pool of isolated sandboxes that runs tool calls for one CPU actor.

Role: ARL-Tangram's CPU manager (allocate-on-execution) on one host. A sandbox is a persistent private
workspace directory bound to one trajectory (state survives between that trajectory's actions) plus a
sleeping zygote process inside bubblewrap; it holds no cores while idle. Each action is a fresh process
forked by the zygote, started as an unprivileged uid with rlimits, pinned to the cores granted for this
action (and, where cgroup v2 is delegated, given a ``cpu.max`` quota of exactly those cores, reclaimed
when the action ends). See :mod:`~libra.engines.sandbox.isolation` for what the sandbox can see and
:mod:`~libra.engines.sandbox.errors` for the result/error contract. One sandbox and the start of its
zygote are in :mod:`~libra.engines.sandbox.slot`; the pool's isolation mode and report in
:mod:`~libra.engines.sandbox.pool_isolation`.

Public API::

    pool = SandboxPool(warm=2, max_sandboxes=16, limits=SandboxLimits(timeout_s=30))
    out = pool.run("traj-1", "python", {"code": "print(1)"}, cores=2)   # {"stdout", "stderr", ...}
    pool.finished(["traj-1"])   # the trajectory ended: its sandbox is retired in the background
    pool.release("traj-1"); pool.isolation_report(); pool.stats(); pool.close()

Contracts:

- ``run`` is safe to call from many threads at once. Actions of one trajectory run one at a time, in
  arrival order of the lock; actions of different trajectories run in parallel.
- A trajectory's workspace lives until ``release(trajectory)``, until ``finished([trajectory])`` (the
  actor learns it from the broker: a finished trajectory's ids ride on the next action placed on this actor,
  ``ActionRoute.release``) and it is idle, until it has been idle ``ttl_s``, or until its slot is reclaimed
  for a new trajectory when all ``max_sandboxes`` slots are bound: a finished trajectory's idle slot first
  (``sandbox_evicted`` at info, ``reason="trajectory_finished"``), else the least recently used idle one (its
  state is then lost: ``sandbox_evicted`` is a warning, ``reason="all_bound"``).
- After every action the zygote kills every process the action left behind: no background process
  survives an action, so an idle sandbox uses no CPU.
- ``warm`` sandboxes are started ahead of time (workspace created, bwrap namespaces set up, zygote
  interpreter loaded) so a new trajectory's first action pays no setup.
- Without bubblewrap the constructor raises :class:`SandboxUnavailable` unless ``allow_unisolated=True``;
  unisolated mode is a plain subprocess with the same rlimits and no filesystem or network isolation
  (NOT safe for untrusted code; ``RLIMIT_NPROC`` then counts every process of the pool's user), and
  :meth:`isolation_report` says so. A bwrap that exists but cannot create namespaces also raises it.

Why a zygote: see :mod:`~libra.engines.sandbox.slot`.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Self

from libra.engines.sandbox.cgroup import setup_cgroup
from libra.engines.sandbox.cores import CoreAllocator, read_numa_nodes
from libra.engines.sandbox.errors import (SandboxBusy, SandboxCancelled, SandboxCrashed, SandboxDenied, SandboxError,
                                         SandboxLimits, SandboxMemoryExceeded, SandboxOutputLimit, SandboxTimeout,
                                         SandboxUnavailable)
from libra.engines.sandbox.isolation import WORKSPACE_MOUNT
from libra.engines.sandbox.outcome import interpret_outcome
from libra.engines.sandbox.pool_isolation import MAX_SLOTS, PoolIsolation, isolation_report
from libra.engines.sandbox.proc import RawOutcome, ZygoteGone, wipe_tree
from libra.engines.sandbox.slot import Slot, root_prefix, start_zygote
from libra.engines.sandbox.tools import ToolCall, ToolContext, get_tool, xdist_available
from libra.logging import get_logger

__all__ = ["SandboxBusy", "SandboxCancelled", "SandboxCrashed", "SandboxDenied", "SandboxError", "SandboxLimits",
           "SandboxMemoryExceeded", "SandboxOutputLimit", "SandboxPool", "SandboxTimeout", "SandboxUnavailable"]

log = get_logger("sandbox")

class SandboxPool:
    """A warm pool of bubblewrap sandboxes for one actor (see the module docstring)."""

    def __init__(
        self,
        *,
        warm: int = 2,
        max_sandboxes: int = 16,
        limits: SandboxLimits | None = None,
        root_dir: str | os.PathLike[str] | None = None,
        ttl_s: float = 900.0,
        cpu_ids: Iterable[int] | None = None,
        cpu_control: str = "auto",
        allow_unisolated: bool = False,
        python: str | None = None,
        extra_ro_binds: Sequence[str] = (),
        uid_base: int | None = None,
        bwrap: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= max_sandboxes <= MAX_SLOTS:
            raise ValueError(f"max_sandboxes must be in 1..{MAX_SLOTS}, got {max_sandboxes}")
        if not 0 <= warm <= max_sandboxes:
            raise ValueError(f"warm must be in 0..max_sandboxes ({max_sandboxes}), got {warm}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if cpu_control not in ("auto", "cgroup", "affinity"):
            raise ValueError(f"unknown cpu_control: {cpu_control!r} (known: affinity, auto, cgroup)")
        self.limits = limits or SandboxLimits()
        self._warm_target = warm
        self._max = max_sandboxes
        self._ttl = ttl_s
        self._clock = clock
        self._python = python or sys.executable
        self._iso = PoolIsolation.resolve(self._python, bwrap=bwrap, allow_unisolated=allow_unisolated,
                                          extra_ro=extra_ro_binds, uid_base=uid_base)
        self._mode, self._privileged, self._uid_base = self._iso.mode, self._iso.privileged, self._iso.uid_base
        self._init_cpu(cpu_ids, cpu_control)
        self._owns_root = root_dir is None
        self._root = Path(root_dir) if root_dir is not None else Path(tempfile.mkdtemp(prefix=root_prefix()))
        self._root.mkdir(parents=True, exist_ok=True)
        os.chmod(self._root, 0o700)
        self._xdist = xdist_available(self._python)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._free = list(range(max_sandboxes))
        self._live: dict[int, Slot] = {}
        self._by_traj: dict[str, Slot] = {}
        self._warm: deque[Slot] = deque()
        self._spawn_q: deque[tuple[Slot, bool, Future[None]]] = deque()
        self._closed = False
        self._finishing = False  # a finished trajectory's sandbox may wait to be retired
        self._counters = {"actions": 0, "spawns": 0, "respawns": 0, "evictions": 0, "expired": 0, "finished": 0}
        self._warm_failures = 0
        self._probed = False
        self._spawner = threading.Thread(target=self._spawner_loop, name="libra-sandbox-spawner", daemon=True)
        self._spawner.start()
        try:
            self._probe()
        except BaseException:
            self.close()
            raise
        log.info("sandbox_pool_started", **{k: v for k, v in self.isolation_report().items() if k != "rlimits"})

    # ------------------------------------------------------------------------------------------ setup
    def _init_cpu(self, cpu_ids: Iterable[int] | None, cpu_control: str) -> None:
        ids = tuple(cpu_ids) if cpu_ids is not None else tuple(sorted(os.sched_getaffinity(0)))
        allowed = os.sched_getaffinity(0)
        bad = [c for c in ids if c not in allowed]
        if bad:
            raise ValueError(f"cpu_ids {bad} are not usable by this process (allowed: {sorted(allowed)})")
        self._cores = CoreAllocator(ids, read_numa_nodes())
        self._cgroup, self._cgroup_reason = setup_cgroup(cpu_control, isolated=self._mode == "bwrap")

    def _probe(self) -> None:
        """Start the first sandbox now so a host that cannot run bwrap fails at construction."""
        with self._lock:
            slot = self._new_slot_locked()
        try:
            self._spawn_sync(slot, wipe=False)
        except SandboxUnavailable as exc:
            if self._mode != "bwrap":
                raise
            hint = "" if self._privileged else (
                " Unprivileged bubblewrap needs user namespaces (on Ubuntu 24.04 AppArmor restricts them: "
                "sysctl kernel.apparmor_restrict_unprivileged_userns=0, or run the actor as root).")
            raise SandboxUnavailable(f"bubblewrap is installed but cannot create a sandbox on this host: {exc}."
                                     f"{hint} Fix that, or pass allow_unisolated=True to run without isolation "
                                     "(NOT safe for untrusted code)") from exc
        with self._cv:
            self._warm.append(slot)
            self._probed = True
            self._cv.notify_all()

    # --------------------------------------------------------------------------------------- public
    def run(self, trajectory: str, tool: str, args: Mapping[str, Any], *, cores: int = 1,
            core_ids: Sequence[int] | None = None, cancel: threading.Event | None = None) -> dict[str, Any]:
        """Run one tool call in ``trajectory``'s sandbox with ``cores`` cores (or exactly ``core_ids``).

        Setting ``cancel`` while the action runs kills it and raises :class:`SandboxCancelled`.

        Returns the result mapping ``{"stdout", "stderr", "exit_code", "truncated", "duration_s"}`` (plus
        tool extras). Raises :class:`SandboxDenied` for a bad request and the other
        :class:`SandboxError` subclasses as documented in :mod:`~libra.engines.sandbox.errors`."""
        if not isinstance(trajectory, str) or not trajectory:
            raise SandboxDenied(f"trajectory must be a non-empty string, got {trajectory!r}")
        try:
            builder = get_tool(tool)
        except ValueError as exc:
            raise SandboxDenied(str(exc)) from None
        n_cores = self._check_cores(cores, core_ids)
        ctx = ToolContext(self._python, WORKSPACE_MOUNT, n_cores, self.limits, self._xdist)
        call = builder(args, ctx)  # may raise SandboxDenied: before any workspace is bound
        while True:
            slot = self._checkout(trajectory)
            try:
                with slot.lock:
                    if slot.trajectory != trajectory:  # released or evicted while we waited: start over
                        continue
                    if self._mode != "bwrap":  # unisolated: the workspace is the host directory itself
                        call = builder(args, ToolContext(self._python, str(slot.workspace), n_cores,
                                                         self.limits, self._xdist))
                    outcome = self._execute(slot, call, n_cores, core_ids, cancel)
                    return interpret_outcome(tool, call, outcome, self.limits)
            finally:
                with self._cv:
                    slot.busy -= 1
                    slot.last_used = self._clock()
                    if slot.finished and not slot.busy:
                        self._finishing = True
                        self._cv.notify_all()

    def release(self, trajectory: str) -> bool:
        """Destroy ``trajectory``'s sandbox and workspace (waits for its running action); False if none."""
        with self._lock:
            slot = self._by_traj.pop(trajectory, None)
            if slot is None:
                return False
            slot.trajectory = None
        self._retire(slot)
        log.debug("sandbox_released", trajectory=trajectory, slot=slot.index)
        return True

    def finished(self, trajectories: Iterable[str]) -> int:
        """The ``trajectories`` ended: their sandboxes are retired by the pool's own thread as soon as they are
        idle (no wait here), and until then are the first taken over when every slot is bound. Unknown ids are
        ignored. Returns how many bound sandboxes were marked."""
        marked = 0
        with self._cv:
            for trajectory in trajectories:
                slot = self._by_traj.get(trajectory) if isinstance(trajectory, str) else None
                if slot is not None and not slot.finished:
                    slot.finished = True
                    marked += 1
            if marked:
                self._finishing = True
                self._cv.notify_all()
        return marked

    def isolation_report(self) -> dict[str, Any]:
        """Which isolation mechanisms are active, for the actor to log and report."""
        return isolation_report(self._iso, cgroup=self._cgroup, cgroup_reason=self._cgroup_reason,
                                cpu_ids=self._cores.cpu_ids, limits=self.limits, root=self._root,
                                warm_target=self._warm_target, max_sandboxes=self._max, xdist=self._xdist)

    def stats(self) -> dict[str, int]:
        """Counters and current occupancy (a snapshot)."""
        with self._lock:
            return {
                **self._counters,
                "live": len(self._live),
                "warm": len(self._warm),
                "bound": len(self._by_traj),
                "busy": sum(1 for s in self._live.values() if s.busy),
            }

    def close(self) -> None:
        """Kill every sandbox, stop the spawner and remove the workspaces this pool created. Idempotent."""
        with self._cv:
            if self._closed and not self._spawner.is_alive():
                return
            self._closed = True
            slots = list(self._live.values())
            pending = list(self._spawn_q)
            self._spawn_q.clear()
            self._cv.notify_all()
        for _, _, fut in pending:
            fut.set_exception(SandboxError("the sandbox pool is closed"))
        for slot in slots:
            if slot.proc is not None:
                slot.proc.kill()
        if self._spawner.is_alive() and threading.current_thread() is not self._spawner:
            self._spawner.join(timeout=30)
        if self._cgroup is not None:
            self._cgroup.close()
        if self._owns_root:
            wipe_tree(self._root)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ internals
    def _check_cores(self, cores: int, core_ids: Sequence[int] | None) -> int:
        if core_ids is not None:
            ids = list(core_ids)
            bad = [c for c in ids if c not in self._cores.cpu_ids]
            if not ids or bad:
                raise SandboxDenied(f"core_ids must be a non-empty subset of {list(self._cores.cpu_ids)}, got {ids}")
            return len(set(ids))
        if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
            raise SandboxDenied(f"cores must be a positive integer, got {cores!r}")
        return min(cores, len(self._cores.cpu_ids))

    def _new_slot_locked(self) -> Slot:
        index = self._free.pop(0)
        uid = self._uid_base + index if self._uid_base is not None else None
        slot = Slot(index, self._root / f"ws-{index}", uid)
        self._live[index] = slot
        return slot

    def _checkout(self, trajectory: str) -> Slot:
        """The slot bound to ``trajectory`` (binding a warm, new or evicted one), with ``busy`` counted."""
        with self._cv:
            if self._closed:
                raise SandboxError("the sandbox pool is closed")
            slot = self._by_traj.get(trajectory)
            if slot is not None:
                slot.finished = False  # a call after its end: the trajectory is evidently still going
            else:
                slot = self._warm.popleft() if self._warm else None
                if slot is None and self._free:
                    slot = self._new_slot_locked()
                if slot is None:
                    slot = self._evict_locked()  # same index and workspace; wiped and restarted before use
                slot.trajectory = trajectory
                self._by_traj[trajectory] = slot
                self._cv.notify_all()  # the spawner may top up the warm set
            slot.busy += 1
            slot.last_used = self._clock()
            return slot

    def _evict_locked(self) -> Slot:
        """Unbind an idle slot for a new trajectory: a finished trajectory's first (its state is not needed: info),
        else the least recently used one (its trajectory loses its workspace: a warning)."""
        idle = [s for s in self._by_traj.values() if s.busy == 0]
        if not idle:
            raise SandboxBusy(f"all {self._max} sandboxes are running actions; retry later")
        victim = min(idle, key=lambda s: (not s.finished, s.last_used))
        del self._by_traj[victim.trajectory]  # type: ignore[arg-type]
        if victim.finished:
            log.info("sandbox_evicted", trajectory=victim.trajectory, slot=victim.index, reason="trajectory_finished")
            self._counters["finished"] += 1
        else:
            log.warning("sandbox_evicted", trajectory=victim.trajectory, slot=victim.index, reason="all_bound",
                        detail=f"all {self._max} sandboxes were bound to live trajectories: the least recently "
                               "used idle one lost its workspace")
            self._counters["evictions"] += 1
        victim.trajectory, victim.finished, victim.needs_wipe = None, False, True
        return victim

    def _execute(self, slot: Slot, call: ToolCall, n_cores: int, core_ids: Sequence[int] | None,
                 cancel: threading.Event | None) -> RawOutcome:
        """Run ``call`` in ``slot`` (caller holds ``slot.lock``); starts or restarts its zygote as needed."""
        if slot.needs_wipe or slot.proc is None or not slot.proc.alive():
            wipe = slot.needs_wipe
            if slot.proc is not None and not wipe:
                with self._lock:
                    self._counters["respawns"] += 1
                log.info("sandbox_respawned", slot=slot.index, trajectory=slot.trajectory)
            self._spawn_sync(slot, wipe=wipe)
            slot.needs_wipe = False
        with self._lock:
            granted = tuple(sorted(set(core_ids))) if core_ids is not None else self._cores.acquire(n_cores)
        try:
            cwd = WORKSPACE_MOUNT if self._mode == "bwrap" else str(slot.workspace)
            request = {
                "argv": list(call.argv), "env": dict(call.env), "cwd": cwd, "files": dict(call.files),
                "rlimits": self.limits.rlimits(cpu_seconds=math.ceil(call.timeout_s * len(granted)) + 1),
                "cpus": list(granted), "uid": slot.uid, "gid": slot.uid,
            }
            oom_before = 0
            if self._cgroup is not None:
                self._cgroup.grant(slot.index, len(granted))
                oom_before = self._cgroup.oom_kills(slot.index)
            for attempt in (0, 1):
                try:
                    assert slot.proc is not None
                    outcome = slot.proc.execute(request, timeout_s=call.timeout_s,
                                                output_bytes=self.limits.output_bytes,
                                                kill_grace_s=self.limits.kill_grace_s, clock=self._clock,
                                                cancel=cancel)
                    if self._cgroup is not None:
                        outcome.oom_killed = self._cgroup.oom_kills(slot.index) > oom_before
                    return outcome
                except ZygoteGone:
                    if attempt:
                        raise SandboxCrashed("the sandbox could not be restarted to run the action") from None
                    with self._lock:
                        self._counters["respawns"] += 1
                    self._spawn_sync(slot, wipe=False)
            raise AssertionError("unreachable")
        finally:
            if self._cgroup is not None:
                self._cgroup.reclaim(slot.index)
            with self._lock:
                self._counters["actions"] += 1
                slot.actions += 1
                if core_ids is None:
                    self._cores.release(granted)

    def _retire(self, slot: Slot) -> None:
        """Kill a slot that is no longer bound, wipe its workspace and free its index."""
        with slot.lock:
            if slot.proc is not None:
                slot.proc.kill()
                slot.proc = None
            wipe_tree(slot.workspace)
            if self._cgroup is not None:
                self._cgroup.remove(slot.index)
        with self._cv:
            if self._live.get(slot.index) is slot:
                del self._live[slot.index]
                self._free.append(slot.index)
                self._free.sort()
            self._cv.notify_all()

    # -------------------------------------------------------------------------------------- spawning
    def _spawn_sync(self, slot: Slot, *, wipe: bool) -> None:
        """Start ``slot``'s zygote on the spawner thread and wait (bwrap dies with the thread that made it)."""
        fut: Future[None] = Future()
        with self._cv:
            if self._closed:
                raise SandboxError("the sandbox pool is closed")
            self._spawn_q.append((slot, wipe, fut))
            self._cv.notify_all()
        fut.result()

    def _start_slot(self, slot: Slot, wipe: bool) -> None:
        """On the spawner thread: (re)create the workspace if needed and start the zygote."""
        start_zygote(slot, self._iso, python=self._python, limits=self.limits, cgroup=self._cgroup, wipe=wipe)
        self._counters["spawns"] += 1

    def _spawner_loop(self) -> None:
        next_reap = self._clock()
        while True:
            with self._cv:
                while not self._closed and not self._spawn_q and not self._needs_warm_locked():
                    if self._clock() >= next_reap or self._finishing:
                        break
                    self._cv.wait(timeout=1.0)
                if self._closed:
                    return
                job = self._spawn_q.popleft() if self._spawn_q else None
                warm_slot = None
                if job is None and self._needs_warm_locked():
                    warm_slot = self._new_slot_locked()
            if job is not None:
                slot, wipe, fut = job
                try:
                    self._start_slot(slot, wipe)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                    fut.set_exception(exc)
                else:
                    fut.set_result(None)
            elif warm_slot is not None:
                self._start_warm(warm_slot)
            if self._finishing:
                self._retire_finished()
            if self._clock() >= next_reap:
                self._reap_expired()
                next_reap = self._clock() + 1.0

    def _needs_warm_locked(self) -> bool:
        return (self._probed and len(self._warm) < self._warm_target and bool(self._free)
                and self._warm_failures < 3 and not self._closed)

    def _start_warm(self, slot: Slot) -> None:
        try:
            self._start_slot(slot, wipe=True)
        except (SandboxError, OSError) as exc:
            log.error("sandbox_warm_start_failed", slot=slot.index, error=str(exc))
            with self._cv:
                self._warm_failures += 1
                del self._live[slot.index]
                self._free.append(slot.index)
                self._free.sort()
            return
        with self._cv:
            self._warm_failures = 0
            if self._closed:
                slot.proc.kill()  # type: ignore[union-attr]
            else:
                self._warm.append(slot)

    def _retire_finished(self) -> None:
        """On the spawner thread: retire the idle sandboxes of finished trajectories (busy ones on a later pass:
        ``run`` sets ``_finishing`` again when it lets go of one)."""
        with self._cv:
            self._finishing = False
            done = [(s, s.trajectory) for s in self._by_traj.values() if s.finished and s.busy == 0]
            for s, trajectory in done:
                del self._by_traj[trajectory]  # type: ignore[arg-type]
                s.trajectory, s.finished = None, False
                self._counters["finished"] += 1
        for s, trajectory in done:
            log.debug("sandbox_released", trajectory=trajectory, slot=s.index, reason="trajectory_finished")
            self._retire(s)

    def _reap_expired(self) -> None:
        now = self._clock()
        with self._cv:
            expired = [s for s in self._by_traj.values() if s.busy == 0 and now - s.last_used > self._ttl]
            for s in expired:
                del self._by_traj[s.trajectory]  # type: ignore[arg-type]
                log.info("sandbox_expired", trajectory=s.trajectory, slot=s.index)
                s.trajectory = None
                self._counters["expired"] += 1
        for s in expired:
            self._retire(s)
