"""Core granting for allocate-on-execution: which CPU ids an action runs on (pure, no I/O in the class).

ARL-Tangram's CPU manager keeps sandboxes at zero CPU while idle and grants cores only while an action
runs, preferring cores of one NUMA domain. :class:`CoreAllocator` is that bookkeeping for one actor's
cores: ``acquire(n)`` returns ``n`` core ids (the least-loaded ones, packed into the NUMA node with the
most idle cores), ``release(ids)`` gives them back. It never blocks and never refuses: deciding *how many*
cores an action gets, and whether it should wait, is the action policy's job; if the policy over-grants,
cores are shared (load counts above one) rather than the call failing.

Mutation rule: only ``acquire``/``release`` change state; callers serialise them (the pool holds a lock).
:func:`parse_cpulist` and :func:`read_numa_nodes` read the kernel's ``0-3,8`` list format.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

__all__ = ["CoreAllocator", "parse_cpulist", "read_numa_nodes"]


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Parse a kernel CPU list (``"0-3,8,10-11"``) into sorted ids; ``ValueError`` names a bad item."""
    ids: set[int] = set()
    for item in text.strip().split(","):
        item = item.strip()
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        try:
            start = int(lo)
            end = int(hi) if sep else start
        except ValueError:
            raise ValueError(f"bad CPU list item {item!r} in {text!r}") from None
        if start < 0 or end < start:
            raise ValueError(f"bad CPU range {item!r} in {text!r}")
        ids.update(range(start, end + 1))
    return tuple(sorted(ids))


def read_numa_nodes(root: str | os.PathLike[str] = "/sys/devices/system/node") -> dict[int, int]:
    """Map CPU id -> NUMA node from sysfs; empty when the host exposes no NUMA information."""
    mapping: dict[int, int] = {}
    base = Path(root)
    if not base.is_dir():
        return mapping
    for node_dir in sorted(base.glob("node[0-9]*")):
        try:
            node = int(node_dir.name[4:])
            cpus = parse_cpulist((node_dir / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        for cpu in cpus:
            mapping[cpu] = node
    return mapping


class CoreAllocator:
    """Least-loaded, NUMA-packed core grants over a fixed set of CPU ids (see the module docstring)."""

    def __init__(self, cpu_ids: Iterable[int], numa_node_of: Mapping[int, int] | None = None) -> None:
        ids = tuple(sorted({int(c) for c in cpu_ids}))
        if not ids:
            raise ValueError("CoreAllocator needs at least one CPU id")
        if any(c < 0 for c in ids):
            raise ValueError(f"CPU ids must be >= 0, got {ids}")
        self._ids = ids
        self._node = {c: (numa_node_of or {}).get(c, 0) for c in ids}
        self._load = {c: 0 for c in ids}

    @property
    def cpu_ids(self) -> tuple[int, ...]:
        """The CPU ids this allocator grants from."""
        return self._ids

    def load(self) -> dict[int, int]:
        """Current number of grants holding each core (a copy)."""
        return dict(self._load)

    def acquire(self, n: int) -> tuple[int, ...]:
        """Grant ``n`` cores (clamped to the number of CPUs); returns sorted ids. ``ValueError`` if n < 1.

        Preference: the NUMA node with the most idle cores first, least-loaded cores first within it,
        lower ids breaking ties; other nodes fill the remainder the same way."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"cores must be a positive integer, got {n!r}")
        n = min(n, len(self._ids))
        idle_per_node: dict[int, int] = {}
        for c in self._ids:
            idle_per_node.setdefault(self._node[c], 0)
            if self._load[c] == 0:
                idle_per_node[self._node[c]] += 1
        # Node order: most idle cores first, then node id.
        rank = {node: i for i, node in enumerate(sorted(idle_per_node, key=lambda nd: (-idle_per_node[nd], nd)))}
        chosen = sorted(self._ids, key=lambda c: (self._load[c], rank[self._node[c]], c))[:n]
        for c in chosen:
            self._load[c] += 1
        return tuple(sorted(chosen))

    def release(self, cores: Sequence[int]) -> None:
        """Return a grant made by :meth:`acquire`; ``ValueError`` for a core that is not held."""
        counts = Counter(cores)
        for c, k in counts.items():
            if self._load.get(c, 0) < k:
                raise ValueError(f"core {c} released but not held (held: {self.load()})")
        for c, k in counts.items():
            self._load[c] -= k
