"""How one :class:`~libra.engines.sandbox.pool.SandboxPool` isolates its sandboxes: the resolved isolation
mode (bubblewrap or unisolated, privileged or in a user namespace, which uids the actions run as) and the
isolation report the actor logs.

:meth:`PoolIsolation.resolve` reads the host once, when the pool is built (it raises
:class:`~libra.engines.sandbox.errors.SandboxUnavailable` without bubblewrap unless unisolated mode is
allowed); :func:`isolation_report` describes a pool's mechanisms as a JSON-ready mapping.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libra.engines.sandbox.cgroup import CgroupV2
from libra.engines.sandbox.errors import SandboxLimits, SandboxUnavailable
from libra.engines.sandbox.isolation import bwrap_version, find_bwrap, host_root_links, interpreter_paths

__all__ = ["MAX_SLOTS", "UNAVAILABLE_HINT", "PoolIsolation", "isolation_report"]

UNAVAILABLE_HINT = ("install bubblewrap (apt-get install bubblewrap) or pass allow_unisolated=True to run "
                    "without isolation (NOT safe for untrusted code)")
MAX_SLOTS = 4096  # sandboxes one pool may hold; also the width of a pool's uid range


@dataclass(frozen=True, slots=True)
class PoolIsolation:
    """The isolation facts a pool starts every sandbox with (see :meth:`resolve`)."""

    mode: str  # "bwrap" or "unisolated"
    bwrap: str | None  # path of the bwrap binary; None when unisolated
    bwrap_version: str | None
    root_links: dict[str, str | None]  # host_root_links(): how /bin, /lib* are laid out on this host
    ro_paths: tuple[str, ...]  # the interpreter's prefixes and the extra read-only binds
    uid_base: int | None  # first per-slot host uid (bwrap as root only), else None
    privileged: bool  # the pool runs as root

    @classmethod
    def resolve(cls, python: str, *, bwrap: str | None, allow_unisolated: bool, extra_ro: Sequence[str],
                uid_base: int | None) -> PoolIsolation:
        """Find bubblewrap and fix the isolation mode for tools run by ``python``.

        Raises :class:`SandboxUnavailable` without bwrap unless ``allow_unisolated``; ``ValueError`` for a
        ``uid_base`` outside ``1000..0xFFFF0000 - MAX_SLOTS``."""
        privileged = os.geteuid() == 0
        path = find_bwrap(bwrap)
        if path is None and not allow_unisolated:
            raise SandboxUnavailable(f"bubblewrap (bwrap) was not found: {UNAVAILABLE_HINT}")
        mode = "bwrap" if path else "unisolated"
        version = bwrap_version(path) if path else None
        root_links = host_root_links()
        ro_paths = (*interpreter_paths(python), *(os.path.abspath(p) for p in extra_ro))
        if uid_base is None:
            uid_base = 0x5A000000 + (os.getpid() % 4096) * MAX_SLOTS
        if not 1000 <= uid_base <= 0xFFFF0000 - MAX_SLOTS:
            raise ValueError(f"uid_base must be in 1000..{0xFFFF0000 - MAX_SLOTS}, got {uid_base}")
        # As root, each action runs as a dedicated host uid (RLIMIT_NPROC is never enforced for uid 0).
        base = uid_base if (mode == "bwrap" and privileged) else None
        return cls(mode, path, version, root_links, ro_paths, base, privileged)


def isolation_report(iso: PoolIsolation, *, cgroup: CgroupV2 | None, cgroup_reason: str,
                     cpu_ids: Sequence[int], limits: SandboxLimits, root: Path, warm_target: int,
                     max_sandboxes: int, xdist: bool) -> dict[str, Any]:
    """Which isolation mechanisms a pool has active, for the actor to log and report."""
    bwrap = iso.mode == "bwrap"
    return {
        "mode": iso.mode,
        "isolated": bwrap,
        "warning": None if bwrap else "no isolation: NOT safe for untrusted code",
        "bwrap": iso.bwrap,
        "bwrap_version": iso.bwrap_version,
        "user_namespace": bwrap and not iso.privileged,
        "sandbox_uid": f"per-slot host uid from {iso.uid_base}" if iso.uid_base is not None
        else ("65534 (user namespace)" if bwrap else "pool's uid"),
        "namespaces": ["mount", "pid", "net", "ipc", "uts", *([] if iso.privileged else ["user"])]
        if bwrap else [],
        "network": "none (loopback only)" if bwrap else "host",
        "cpu_control": "cgroup_v2" if cgroup is not None else "affinity",
        "cgroup": str(cgroup.parent) if cgroup is not None else None,
        "cgroup_reason": cgroup_reason,
        "cpu_ids": list(cpu_ids),
        "rlimits": limits.rlimits(cpu_seconds=math.ceil(limits.timeout_s) + 1),
        "output_cap_bytes": limits.output_bytes,
        "workspaces": str(root),
        "warm_target": warm_target,
        "max_sandboxes": max_sandboxes,
        "zygote": True,
        "xdist": xdist,
    }
