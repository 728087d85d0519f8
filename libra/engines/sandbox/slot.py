"""One sandbox of a :class:`~libra.engines.sandbox.pool.SandboxPool` and how its zygote is started.

A :class:`Slot` is a workspace index with its private workspace directory, the host uid its actions run
as (privileged bwrap only), its zygote process and the trajectory bound to it. :func:`start_zygote`
(re)creates the workspace and starts the slot's zygote, inside bubblewrap or as a plain process group,
and puts it in the slot's cgroup when the pool has one. The pool calls it from its spawner thread only
(a bwrap sandbox dies with the thread that started it).

Why a zygote: starting ``bwrap`` costs a few milliseconds per call (namespaces, mounts) on top of the
interpreter's own start. The zygote pays that once per sandbox; per action it only forks, drops to the
sandbox uid, applies limits and execs the tool, so a warm action costs about as much as a bare
``subprocess.run`` of the same command. ``python -m libra.bench sandbox`` measures warm, bare and
one-shot bwrap side by side. Actions are a fresh ``execve`` (not code run inside the forked zygote) so
their semantics are exactly those of ``python -c``.

A pool's own root directory is ``<tmp>/libra-sandbox-<pid>-XXXX`` (:func:`root_prefix`): the pid of the actor
process that made it, so a supervisor that reaps a killed actor removes what the actor could not
(:func:`sweep_roots_of`).
"""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from libra.engines.sandbox.cgroup import CgroupV2
from libra.engines.sandbox.errors import SandboxLimits
from libra.engines.sandbox.isolation import ZYGOTE_MOUNT, build_bwrap_argv
from libra.engines.sandbox.pool_isolation import PoolIsolation
from libra.engines.sandbox.proc import ZYGOTE_FILE, SandboxProcess, wipe_tree
from libra.logging import get_logger

__all__ = ["Slot", "start_zygote"]

log = get_logger("sandbox")


@dataclass(slots=True, eq=False)
class Slot:
    """One sandbox: a workspace index, its process, and who uses it. Mutated under the pool lock, except
    ``proc``, which only the holder of ``lock`` touches."""

    index: int
    workspace: Path
    uid: int | None
    proc: SandboxProcess | None = None
    trajectory: str | None = None
    busy: int = 0  # run() calls that hold or wait for this slot
    last_used: float = 0.0
    actions: int = 0
    needs_wipe: bool = False  # taken over from an evicted trajectory: wipe and restart before use
    finished: bool = False  # its trajectory ended (the broker said so): retired once idle, or taken over first
    lock: threading.Lock = field(default_factory=threading.Lock)


ROOT_PREFIX = "libra-sandbox-"


def root_prefix(pid: int | None = None) -> str:
    """The name prefix of the root directory a pool of process ``pid`` (default: this one) creates."""
    return f"{ROOT_PREFIX}{os.getpid() if pid is None else pid}-"


def sweep_roots_of(pid: int, tmp_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the pool roots process ``pid`` left in ``tmp_dir`` (default: the temp directory); call it only
    once ``pid`` is dead (a live pool's sandboxes would lose their workspaces). Returns what was removed."""
    removed = []
    for path in sorted(Path(tmp_dir or tempfile.gettempdir()).glob(root_prefix(pid) + "*")):
        if path.is_dir() and not path.is_symlink():
            wipe_tree(path)
            removed.append(path)
    return removed


def start_zygote(slot: Slot, iso: PoolIsolation, *, python: str, limits: SandboxLimits, cgroup: CgroupV2 | None,
                 wipe: bool) -> None:
    """Kill ``slot``'s old zygote if any, (re)create its workspace (emptied first when ``wipe``) and start a
    new zygote running ``python``; sets ``slot.proc``. Raises what starting the process raises."""
    if slot.proc is not None:
        slot.proc.kill()
        slot.proc = None
    if wipe:
        wipe_tree(slot.workspace)
    slot.workspace.mkdir(mode=0o700, exist_ok=True)
    if slot.uid is not None:
        os.chown(slot.workspace, slot.uid, slot.uid)
    if iso.mode == "bwrap":
        prefix = build_bwrap_argv(iso.bwrap or "bwrap", workspace=str(slot.workspace), command=(),
                                  ro_paths=iso.ro_paths, root_links=iso.root_links,
                                  privileged=iso.privileged, tmp_mb=limits.tmp_mb,
                                  ro_files={ZYGOTE_FILE: ZYGOTE_MOUNT})
        proc = SandboxProcess.start(prefix, python, ZYGOTE_MOUNT, mode="ns", want_host_pid=cgroup is not None)
    else:
        proc = SandboxProcess.start((), python, ZYGOTE_FILE, mode="pgrp", cwd=str(slot.workspace))
    if cgroup is not None:
        cgroup.create(slot.index, memory_bytes=(limits.memory_mb + 64) << 20)
        if proc.host_pid is not None:
            try:
                cgroup.add(slot.index, proc.host_pid)
            except OSError as exc:
                log.warning("cgroup_add_failed", slot=slot.index, error=str(exc))
    slot.proc = proc
