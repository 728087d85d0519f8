"""Evict-on-execution placement of GPU services (ARL-Tangram §2.5 GPU manager; research-notes §4 item 14).

GPU services (reward models, teacher models) keep their checkpoints in host RAM and are either *resident*
(a replica on GPUs, idle or busy) or *evicted*. :meth:`ServicePlacement.acquire` places one action:

1. an idle resident replica of the service (no cost; the most recently used one, its node is warm);
2. else a restore into a free aligned cell from the :class:`~libra.policies.gpu_cells.MultiLevelCellAllocator`
   (cost ``checkpoint_gb / (gpus · h2d_gbps)``: shards restore in parallel);
3. else a restore after evicting the least-recently-used idle replicas that occupy one target cell;
4. else ``None`` (every candidate cell holds a busy replica): the action waits.

The real engine (``libra/engines/services.py``) drives this class; the simulator does too. Pure state: no
I/O, clocks or threads (time comes in as ``now``). Mutation rule: only :meth:`~ServicePlacement.acquire`,
:meth:`~ServicePlacement.release` and :meth:`~ServicePlacement.evict_idle` change it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from libra.policies.gpu_cells import Allocation, GpuCellError, MultiLevelCellAllocator, cell_mask, level_of

__all__ = ["Placement", "PlacementStats", "ServicePlacement", "ServiceSpec"]


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """A GPU service: ``gpus`` per replica (1, 2, 4 or 8) and its checkpoint size in host RAM (GB, all shards)."""

    name: str
    gpus: int
    checkpoint_gb: float

    def __post_init__(self) -> None:
        level_of(self.gpus)
        if not (self.checkpoint_gb >= 0 and math.isfinite(self.checkpoint_gb)):
            raise GpuCellError(f"service {self.name!r}: checkpoint_gb must be a finite number >= 0, got {self.checkpoint_gb!r}")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where an action runs: replica ``instance``, its GPUs, the restore time paid first (0 if resident) and
    the services evicted to make room."""

    instance: int
    service: str
    alloc: Allocation
    restore_s: float
    evicted: tuple[str, ...] = ()


@dataclass(slots=True)
class _Replica:
    service: str
    alloc: Allocation
    busy: bool
    last_used: float


@dataclass(slots=True)
class PlacementStats:
    """Counters: acquisitions served by a resident replica (hits), restores and evictions."""

    hits: int = 0
    restores: int = 0
    evictions: int = 0
    restore_s: float = 0.0


class ServicePlacement:
    """Evict-on-execution placement of GPU services over a :class:`MultiLevelCellAllocator` (LRU eviction).

    ``h2d_gbps``: host-to-device bandwidth per GPU (GB/s); a replica restores its shards in parallel, so the
    cost is ``checkpoint_gb / (gpus · h2d_gbps)``. ``max_replicas`` caps resident replicas per service.
    Raises :class:`GpuCellError` for an unknown service or instance.
    """

    def __init__(
        self,
        allocator: MultiLevelCellAllocator,
        services: Iterable[ServiceSpec],
        *,
        h2d_gbps: float = 25.0,
        max_replicas: int | None = None,
    ) -> None:
        if not (h2d_gbps > 0 and math.isfinite(h2d_gbps)):
            raise GpuCellError(f"h2d_gbps must be a finite number > 0, got {h2d_gbps!r}")
        self.allocator = allocator
        self.services: dict[str, ServiceSpec] = {}
        for s in services:
            if s.name in self.services:
                raise GpuCellError(f"service {s.name!r} registered twice")
            self.services[s.name] = s
        self.h2d_gbps = h2d_gbps
        self.max_replicas = max_replicas
        self.stats = PlacementStats()
        self._replicas: dict[int, _Replica] = {}
        self._next = 0
        self._busy_gpus = 0

    def restore_cost(self, service: str) -> float:
        """Seconds to restore one replica of ``service`` from host RAM."""
        s = self._spec(service)
        return s.checkpoint_gb / (s.gpus * self.h2d_gbps)

    def _spec(self, service: str) -> ServiceSpec:
        try:
            return self.services[service]
        except KeyError:
            raise GpuCellError(f"unknown GPU service {service!r} (known: {', '.join(self.services)})") from None

    def resident(self) -> dict[str, int]:
        """Resident replicas per service (busy or idle)."""
        out: dict[str, int] = {}
        for r in self._replicas.values():
            out[r.service] = out.get(r.service, 0) + 1
        return out

    @property
    def busy_gpus(self) -> int:
        """GPUs held by replicas that are executing an action."""
        return self._busy_gpus

    def schedulable_gpus(self) -> int:
        """GPUs not executing anything: free ones plus idle replicas' (evictable on demand)."""
        return self.allocator.total_gpus - self._busy_gpus

    def acquire(self, service: str, now: float) -> Placement | None:
        """Place one action of ``service``: an idle resident replica, else a restore into a free cell, else a
        restore after evicting the least-recently-used idle replicas of one target cell. ``None`` if every
        target cell holds a busy replica (or ``max_replicas`` are resident and busy)."""
        spec = self._spec(service)
        mine = [(rid, r) for rid, r in self._replicas.items() if r.service == service]
        idle = [(r.last_used, rid) for rid, r in mine if not r.busy]
        if idle:
            rid = max(idle)[1]  # the most recently used replica: its node is warm
            self.stats.hits += 1
            return self._start(rid, 0.0, ())
        if self.max_replicas is not None and len(mine) >= self.max_replicas:
            return None
        alloc = self.allocator.allocate(spec.gpus)
        evicted: tuple[str, ...] = ()
        if alloc is None:
            target = self._eviction_target(spec.gpus)
            if target is None:
                return None
            node, index, victims = target
            for rid in victims:
                evicted += (self._replicas[rid].service,)
                self._evict(rid)
            alloc = self.allocator.allocate_at(node, spec.gpus, index)
        rid = self._next
        self._next += 1
        self._replicas[rid] = _Replica(service, alloc, False, now)
        cost = self.restore_cost(service)
        self.stats.restores += 1
        self.stats.restore_s += cost
        return self._start(rid, cost, evicted)

    def _start(self, rid: int, cost: float, evicted: tuple[str, ...]) -> Placement:
        r = self._replicas[rid]
        r.busy = True
        self._busy_gpus += len(r.alloc.gpus)
        return Placement(rid, r.service, r.alloc, cost, evicted)

    def _evict(self, rid: int) -> None:
        r = self._replicas.pop(rid)
        self.allocator.free(r.alloc)
        self.stats.evictions += 1

    def _eviction_target(self, size: int) -> tuple[int, int, list[int]] | None:
        """The aligned cell whose occupants are all idle replicas, choosing (LRU) the one whose most recently
        used victim is oldest, then fewest victims; ``None`` if none."""
        lvl = level_of(size)
        occ = self.allocator.occupancy
        absent = self.allocator.absent_masks
        best: tuple[float, int, int, int, list[int]] | None = None
        for node in range(len(occ)):
            for j in range(8 >> lvl):
                cmask = cell_mask(lvl, j)
                if absent[node] & cmask:
                    continue
                victims = [rid for rid, r in self._replicas.items() if r.alloc.node == node and r.alloc.mask & cmask]
                if any(self._replicas[v].busy for v in victims):
                    continue
                covered = 0
                for v in victims:
                    covered |= self._replicas[v].alloc.mask
                if (occ[node] & ~covered) & cmask:
                    continue  # occupied by something that is not a replica
                newest = max((self._replicas[v].last_used for v in victims), default=-math.inf)
                key = (newest, len(victims), node, j, victims)
                if best is None or key[:4] < best[:4]:
                    best = key
        return None if best is None else (best[2], best[3], best[4])

    def release(self, instance: int, now: float) -> None:
        """The action on replica ``instance`` finished: it stays resident and idle. Raises if not busy."""
        r = self._replicas.get(instance)
        if r is None or not r.busy:
            raise GpuCellError(f"replica {instance} is not executing an action")
        r.busy = False
        r.last_used = now
        self._busy_gpus -= len(r.alloc.gpus)

    def evict_idle(self, service: str | None = None) -> int:
        """Evict every idle replica (of ``service``, or all); returns how many were evicted."""
        ids = [rid for rid, r in self._replicas.items() if not r.busy and (service is None or r.service == service)]
        for rid in ids:
            self._evict(rid)
        return len(ids)

    def replicas(self) -> Mapping[int, tuple[str, Allocation, bool]]:
        """Resident replicas: id → (service, allocation, busy)."""
        return {rid: (r.service, r.alloc, r.busy) for rid, r in self._replicas.items()}
