"""cgroup v2 CPU/memory quotas for sandboxes (ARL-Tangram's allocate-on-execution through cgroups).

Role: when this process may manage a cgroup v2 subtree, every sandbox gets its own cgroup whose
``cpu.max`` is near zero while idle (the smallest quota the kernel accepts, 1 ms per 100 ms) and is
rewritten to ``cores x period`` just before an action starts and back right after it ends; ``memory.max``
bounds the whole sandbox (zygote plus action). Where cgroup v2 is not writable (a v1/hybrid host such as
the development VM, or an undelegated container) :func:`detect_cgroup_v2` says why and the pool falls
back to CPU affinity plus ``RLIMIT_CPU``.

Layout, under the cgroup this process runs in (``base``)::

    base/libra-sandbox-<pid>/            controllers enabled for children
        supervisor/                      this process, moved here only if ``base`` had to be emptied
        sbx-<slot>/                      one sandbox (its zygote and its actions)

Contracts: :func:`detect_cgroup_v2` never raises for a missing or read-only hierarchy, it returns
``(None, reason)``. :class:`CgroupV2` methods raise ``OSError`` only from ``__init__`` (setup failed:
the caller falls back) and are best effort afterwards (a failed quota write is logged, never fatal).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from libra.engines.sandbox.errors import SandboxUnavailable
from libra.logging import get_logger

__all__ = ["CgroupV2", "detect_cgroup_v2", "setup_cgroup"]

log = get_logger("sandbox")

PERIOD_US = 100_000
IDLE_QUOTA_US = 1_000  # the kernel's minimum: "zero" CPU for an idle sandbox


def detect_cgroup_v2(
    root: str | os.PathLike[str] = "/sys/fs/cgroup", self_cgroup: str | os.PathLike[str] = "/proc/self/cgroup"
) -> tuple[Path | None, str]:
    """Find the cgroup v2 directory this process may create sandbox groups under.

    Returns ``(base, "ok")`` or ``(None, reason)`` when cgroup v2 is not mounted at ``root``, the ``cpu``
    controller is not available to this process's cgroup, or its ``cgroup.subtree_control`` is not
    writable."""
    root = Path(root)
    if not (root / "cgroup.controllers").is_file():
        return None, f"no cgroup v2 hierarchy at {root} (cgroup v1 or hybrid host)"
    rel = None
    try:
        for line in Path(self_cgroup).read_text().splitlines():
            if line.startswith("0::"):
                rel = line[3:].strip()
    except OSError as exc:
        return None, f"cannot read {self_cgroup}: {exc}"
    if rel is None:
        return None, f"{self_cgroup} has no cgroup v2 entry"
    base = root / rel.lstrip("/")
    try:
        controllers = (base / "cgroup.controllers").read_text().split()
    except OSError as exc:
        return None, f"cannot read {base / 'cgroup.controllers'}: {exc}"
    if "cpu" not in controllers:
        return None, f"the cpu controller is not delegated to {base} (available: {controllers or 'none'})"
    if not os.access(base / "cgroup.subtree_control", os.W_OK):
        return None, f"{base / 'cgroup.subtree_control'} is not writable (not delegated to this user)"
    return base, "ok"


def _write(path: Path, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


class CgroupV2:
    """The sandbox cgroup subtree of one pool (see the module docstring). Not thread-safe on its own:
    each sandbox's group is touched only by the thread running that sandbox's action."""

    def __init__(self, base: Path, *, name: str | None = None) -> None:
        self.base = Path(base)
        self.parent = self.base / (name or f"libra-sandbox-{os.getpid()}")
        available = (self.base / "cgroup.controllers").read_text().split()
        self.controllers = [c for c in ("cpu", "memory", "pids") if c in available]
        enable = " ".join(f"+{c}" for c in self.controllers)
        self.parent.mkdir(exist_ok=True)
        self.moved_self = False
        try:
            _write(self.base / "cgroup.subtree_control", enable)
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            # "No internal processes": base holds processes (us). Move ourselves into a leaf and retry.
            leaf = self.parent / "supervisor"
            leaf.mkdir(exist_ok=True)
            _write(leaf / "cgroup.procs", str(os.getpid()))
            self.moved_self = True
            _write(self.base / "cgroup.subtree_control", enable)
        _write(self.parent / "cgroup.subtree_control", enable)

    def group(self, slot: int) -> Path:
        """The directory of sandbox ``slot``'s cgroup."""
        return self.parent / f"sbx-{slot}"

    def create(self, slot: int, *, memory_bytes: int) -> Path:
        """Create (or reset) sandbox ``slot``'s group at idle quota with ``memory.max``; returns its path."""
        path = self.group(slot)
        path.mkdir(exist_ok=True)
        self._set(path / "cpu.max", f"{IDLE_QUOTA_US} {PERIOD_US}")
        if "memory" in self.controllers:
            self._set(path / "memory.max", str(memory_bytes))
            self._set(path / "memory.swap.max", "0")
        return path

    def add(self, slot: int, pid: int) -> None:
        """Move process ``pid`` (a sandbox's zygote) into the slot's group."""
        _write(self.group(slot) / "cgroup.procs", str(pid))

    def grant(self, slot: int, cores: int) -> None:
        """Allocate on execution: give the slot ``cores`` cores' worth of quota."""
        self._set(self.group(slot) / "cpu.max", f"{max(1, cores) * PERIOD_US} {PERIOD_US}")

    def reclaim(self, slot: int) -> None:
        """Back to the idle (near-zero) quota after an action."""
        self._set(self.group(slot) / "cpu.max", f"{IDLE_QUOTA_US} {PERIOD_US}")

    def oom_kills(self, slot: int) -> int:
        """The slot's ``oom_kill`` counter from ``memory.events`` (0 when unavailable)."""
        try:
            for line in (self.group(slot) / "memory.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, slot: int) -> None:
        """Remove the slot's group (best effort: it must be empty)."""
        try:
            self.group(slot).rmdir()
        except OSError as exc:
            log.debug("cgroup_remove_failed", slot=slot, error=str(exc))

    def close(self) -> None:
        """Remove every sandbox group and the parent when empty (this process stays where it is)."""
        for child in list(self.parent.glob("sbx-*")):
            try:
                child.rmdir()
            except OSError:
                pass
        if not self.moved_self:
            try:
                self.parent.rmdir()
            except OSError:
                pass

    @staticmethod
    def _set(path: Path, value: str) -> None:
        try:
            _write(path, value)
        except OSError as exc:
            log.warning("cgroup_write_failed", path=str(path), value=value, error=str(exc))


def setup_cgroup(cpu_control: str, *, isolated: bool) -> tuple[CgroupV2 | None, str]:
    """Pick CPU control for a pool: ``(CgroupV2, "ok")`` or ``(None, why affinity is used instead)``.

    ``cpu_control`` is ``"auto"`` (cgroup v2 when usable), ``"cgroup"`` (required: raises
    :class:`SandboxUnavailable` with the reason when unusable) or ``"affinity"``."""
    if cpu_control == "affinity":
        return None, "cpu_control='affinity' requested"
    if not isolated:
        reason = "unisolated mode"
    else:
        base, reason = detect_cgroup_v2()
        if base is not None:
            try:
                return CgroupV2(base), "ok"
            except OSError as exc:
                reason = f"cgroup v2 setup under {base} failed: {exc}"
    if cpu_control == "cgroup":
        raise SandboxUnavailable(f"cpu_control='cgroup' but cgroup v2 is not usable: {reason}")
    return None, reason
