"""Evict-on-execution placement of GPU services (ARL-Tangram §2.5 GPU manager; docs/papers.md §4 item 14).

GPU services (reward models, teacher models) keep their checkpoints in host RAM and are either *resident*
(a replica on GPUs, idle or busy) or *evicted*. A replica sits on one aligned cell of the
:class:`~libra.policies.actions.gpu_cells.MultiLevelCellAllocator` (``gpus`` GPUs on one node). Two memory
contracts, chosen by ``gpu_mem_gb``:

**Exclusive cells** (``gpu_mem_gb=None``, the default): one replica owns its cell's GPUs, idle or busy; the
allocator's occupancy is the GPUs held by resident replicas. :meth:`ServicePlacement.acquire` places one
action:

1. an idle resident replica of the service (no cost; the most recently used one, its node is warm);
2. else a restore into a free aligned cell from the allocator (cost ``checkpoint_gb / (gpus · h2d_gbps)``:
   shards restore in parallel);
3. else a restore after evicting the least-recently-used idle replicas that occupy one target cell;
4. else ``None`` (every candidate cell holds a busy replica): the action waits.

**GPU memory model** (``gpu_mem_gb`` = memory per GPU, GB): a replica takes ``checkpoint_gb / gpus +
reserve_gb`` GB on each GPU of its cell (its shard plus any memory it keeps while resident, e.g. a
pre-allocated KV pool, :class:`ServiceSpec`), and replicas of *different* services may be resident on the
same GPUs while, on every GPU, their memory sums to at most ``gpu_mem_gb − workspace_gb``. ``workspace_gb``
is kept free on every GPU for the activations of the action executing there: compute stays exclusive (a
cell executes one action at a time), so one workspace per GPU serves whichever resident replica runs. The
allocator's occupancy is the GPUs *executing* an action (taken at acquire, returned at release). A cell is
*idle* when none of its GPUs executes (nor is absent or held by another allocator user). ``acquire``:

1. a resident idle replica of the service on an idle cell: a hit (no cost; the most recently used one);
2. else a new replica restored into an idle cell that holds no replica of this service: the cell whose
   restore needs no eviction, else the one whose youngest victim is the least recently used (then fewest
   victims); ties go to the cell left with the most free memory (it spreads replicas over cells, so they
   contend less for compute). Victims are idle replicas on that cell, least recently used first, and only
   those needed to fit: eviction happens only when GPU memory is short;
3. else ``None``: every cell is executing or already holds this service (whose replica is busy there, or
   idle behind another service's action), or ``max_replicas`` are resident. The action waits.

**Wait or restore** (``wait_for_resident=True``, both contracts): before a restore (step 2 or 3 of either
list), if a resident replica of the service is busy -- or, under the memory model, idle on a cell that is
executing another service's action -- and is estimated to free up sooner than the restore would take,
``acquire`` returns ``None`` and the action waits for it: it finishes earlier than after a restore, and
the idle cell and the LRU victims are left alone. The estimate is the action's start + its restore + the
service's mean action time, learned online from :meth:`~ServicePlacement.release` (no estimate before a
service's first completed action; an action already past its estimate is not waited for, so a long tail
cannot hold callers indefinitely). The ``k``-th caller told to wait for a service at the same ``now``
counts the ``k`` earlier ones (replicas' free times in turn, then one mean action time per round). Times
must be seconds for this; it is off by default.

A busy replica is never evicted and a cell is never booked twice. The real engine
(``libra/engines/services.py``) drives this class; the simulator does too. Pure state: no I/O, clocks or
threads (time comes in as ``now``). Mutation rule: only :meth:`~ServicePlacement.register`, :meth:`~ServicePlacement.acquire`,
:meth:`~ServicePlacement.release`, :meth:`~ServicePlacement.evict` and :meth:`~ServicePlacement.evict_idle`
change it. The broker (``libra/broker/service_pools.py``) keeps one per GPU actor and sends its decisions to
the actor in ``Assign.route``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from libra.policies.actions.gpu_cells import Allocation, GpuCellError, MultiLevelCellAllocator, cell_mask, level_of

__all__ = ["Placement", "PlacementStats", "ServicePlacement", "ServiceSpec"]

_EPS = 1e-9  # GB: tolerance of the per-GPU memory sums


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """A GPU service: ``gpus`` per replica (1, 2, 4 or 8), its checkpoint size in host RAM (GB, all shards)
    and ``reserve_gb``, the memory per GPU a resident replica keeps beyond its shard while resident (e.g. a
    pre-allocated KV pool; an executing action's transient activations use the placement's
    ``workspace_gb`` instead). ``reserve_gb`` only counts under the GPU memory model
    (``ServicePlacement(gpu_mem_gb=...)``)."""

    name: str
    gpus: int
    checkpoint_gb: float
    reserve_gb: float = 0.0

    def __post_init__(self) -> None:
        level_of(self.gpus)
        for field in ("checkpoint_gb", "reserve_gb"):
            v = getattr(self, field)
            if not (v >= 0 and math.isfinite(v)):
                raise GpuCellError(f"service {self.name!r}: {field} must be a finite number >= 0, got {v!r}")

    @property
    def gb_per_gpu(self) -> float:
        """Memory one resident replica takes on each of its GPUs: its shard plus ``reserve_gb``."""
        return self.checkpoint_gb / self.gpus + self.reserve_gb


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
    started: float = 0.0  # when its current action was placed
    restore_s: float = 0.0  # the restore that action paid first


@dataclass(slots=True)
class PlacementStats:
    """Counters: acquisitions served by a resident replica (hits), restores and evictions."""

    hits: int = 0
    restores: int = 0
    evictions: int = 0
    restore_s: float = 0.0
    waits: int = 0  # acquisitions told to wait for a busy resident replica instead of restoring


class ServicePlacement:
    """Evict-on-execution placement of GPU services over a :class:`MultiLevelCellAllocator` (LRU eviction).

    ``h2d_gbps``: host-to-device bandwidth per GPU (GB/s); a replica restores its shards in parallel, so the
    cost is ``checkpoint_gb / (gpus · h2d_gbps)``. ``max_replicas`` caps resident replicas per service.
    ``gpu_mem_gb``: memory per GPU (GB) for the GPU memory model, or ``None`` for exclusive cells;
    ``workspace_gb``: memory per GPU kept free for the executing action's activations (memory model only;
    see the module docstring). ``wait_for_resident``: wait for a busy resident replica that frees up sooner
    than a restore (module docstring; ``now`` must then be in seconds). Raises :class:`GpuCellError` for an unknown service or instance, a bad
    parameter, or a service whose replica does not fit in ``gpu_mem_gb − workspace_gb`` per GPU.
    """

    def __init__(
        self,
        allocator: MultiLevelCellAllocator,
        services: Iterable[ServiceSpec],
        *,
        h2d_gbps: float = 25.0,
        max_replicas: int | None = None,
        gpu_mem_gb: float | None = None,
        workspace_gb: float = 0.0,
        wait_for_resident: bool = False,
    ) -> None:
        if not (h2d_gbps > 0 and math.isfinite(h2d_gbps)):
            raise GpuCellError(f"h2d_gbps must be a finite number > 0, got {h2d_gbps!r}")
        if gpu_mem_gb is not None and not (gpu_mem_gb > 0 and math.isfinite(gpu_mem_gb)):
            raise GpuCellError(f"gpu_mem_gb must be None or a finite number > 0, got {gpu_mem_gb!r}")
        below = gpu_mem_gb is None or workspace_gb < gpu_mem_gb
        if not (workspace_gb >= 0 and math.isfinite(workspace_gb) and below):
            raise GpuCellError(f"workspace_gb must be a finite number >= 0 and below gpu_mem_gb, got {workspace_gb!r}")
        cap = None if gpu_mem_gb is None else gpu_mem_gb - workspace_gb
        self.allocator = allocator
        self.services: dict[str, ServiceSpec] = {}
        self.h2d_gbps = h2d_gbps
        self.max_replicas = max_replicas
        self.gpu_mem_gb = gpu_mem_gb
        self.workspace_gb = workspace_gb
        self._cap = cap
        for s in services:
            self.register(s)
        self.stats = PlacementStats()
        self._replicas: dict[int, _Replica] = {}
        self._next = 0
        self._busy_gpus = 0
        self.wait_for_resident = wait_for_resident
        self._exec: dict[str, tuple[int, float]] = {}  # service -> (completed actions, mean seconds)
        self._wait_now: float | None = None
        self._waiting: dict[str, int] = {}  # service -> callers told to wait at ``_wait_now``

    def register(self, s: ServiceSpec) -> None:
        """Add service ``s`` (any time: it starts evicted). Raises :class:`GpuCellError` for a name registered
        twice or a replica that does not fit a GPU under the memory model."""
        if s.name in self.services:
            raise GpuCellError(f"service {s.name!r} registered twice")
        cap = self._cap
        if cap is not None and s.gb_per_gpu > cap + _EPS:
            raise GpuCellError(
                f"service {s.name!r} needs {s.gb_per_gpu:g} GB per GPU (checkpoint {s.checkpoint_gb:g} GB / "
                f"{s.gpus} GPUs + reserve {s.reserve_gb:g} GB) but a GPU holds {cap:g} GB of replicas "
                f"({self.gpu_mem_gb:g} GB − workspace {self.workspace_gb:g} GB)"
            )
        self.services[s.name] = s

    @property
    def replica_capacity_gb(self) -> float | None:
        """GB per GPU available to resident replicas (``gpu_mem_gb − workspace_gb``; ``None``: exclusive)."""
        return self._cap

    @property
    def shared(self) -> bool:
        """Whether the GPU memory model is on (replicas of different services may share GPUs)."""
        return self.gpu_mem_gb is not None

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

    def memory_used(self) -> tuple[tuple[float, ...], ...]:
        """GB taken on every GPU (per node, then GPU index 0..7) by resident replicas, ``gb_per_gpu`` each.
        Under the GPU memory model no entry exceeds :attr:`replica_capacity_gb`."""
        out = [[0.0] * 8 for _ in self.allocator.occupancy]
        for r in self._replicas.values():
            gb = self.services[r.service].gb_per_gpu
            for g in r.alloc.gpus:
                out[r.alloc.node][g] += gb
        return tuple(tuple(row) for row in out)

    @property
    def busy_gpus(self) -> int:
        """GPUs held by replicas that are executing an action."""
        return self._busy_gpus

    def schedulable_gpus(self) -> int:
        """GPUs not executing anything: free ones plus idle replicas' (evictable on demand)."""
        return self.allocator.total_gpus - self._busy_gpus

    def acquire(self, service: str, now: float) -> Placement | None:
        """Place one action of ``service`` (the steps of the module docstring for the memory contract in
        force). ``None`` if the action must wait."""
        spec = self._spec(service)
        mine = [r for r in self._replicas.values() if r.service == service]
        # ready: idle, and (memory model) on a cell that executes nothing; exclusive cells are their own
        occ = self.allocator.occupancy if self.shared else None
        ready = [(r.last_used, rid) for rid, r in self._replicas.items()
                 if r.service == service and not r.busy and not (occ is not None and occ[r.alloc.node] & r.alloc.mask)]
        if ready:
            rid = max(ready)[1]  # the most recently used replica: its node is warm
            self.stats.hits += 1
            return self._start(rid, 0.0, (), now)
        if self.max_replicas is not None and len(mine) >= self.max_replicas:
            return None
        if self.wait_for_resident and self._worth_waiting(spec, mine, now):
            return None
        if self.shared:
            return self._restore_shared(spec, mine, now)
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
        return self._restore(spec, alloc, now, evicted)

    def _restore(self, spec: ServiceSpec, alloc: Allocation, now: float, evicted: tuple[str, ...]) -> Placement:
        rid = self._next
        self._next += 1
        self._replicas[rid] = _Replica(spec.name, alloc, False, now)
        cost = self.restore_cost(spec.name)
        self.stats.restores += 1
        self.stats.restore_s += cost
        return self._start(rid, cost, evicted, now)

    def _start(self, rid: int, cost: float, evicted: tuple[str, ...], now: float) -> Placement:
        r = self._replicas[rid]
        r.started, r.restore_s = now, cost
        if self.shared:  # the cell's GPUs now execute: nothing else may start or restore there
            a = r.alloc
            assert a.level is not None and a.index is not None
            self.allocator.allocate_at(a.node, len(a.gpus), a.index)
        r.busy = True
        self._busy_gpus += len(r.alloc.gpus)
        return Placement(rid, r.service, r.alloc, cost, evicted)

    def _evict(self, rid: int) -> None:
        r = self._replicas.pop(rid)
        if not self.shared:  # shared: an idle replica holds memory only, no allocator cell
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

    # ------------------------------------------------------------------ GPU memory model

    def _restore_shared(self, spec: ServiceSpec, mine: list[_Replica], now: float) -> Placement | None:
        """Step 2 of the memory model: a new replica on an idle cell, evicting only what memory needs."""
        target = self._shared_target(spec, [r.alloc for r in mine])
        if target is None:
            return None
        alloc, victims = target
        evicted: tuple[str, ...] = ()
        for rid in victims:
            evicted += (self._replicas[rid].service,)
            self._evict(rid)
        return self._restore(spec, alloc, now, evicted)

    def _shared_target(self, spec: ServiceSpec, mine: list[Allocation]) -> tuple[Allocation, list[int]] | None:
        """The idle cell for a new replica of ``spec`` and the replicas to evict there (module docstring,
        step 2); ``None`` if no idle cell is free of this service."""
        lvl = level_of(spec.gpus)
        occ = self.allocator.occupancy
        best: tuple[tuple[float, int, float, int, int], Allocation, list[int]] | None = None
        for node, busy in enumerate(occ):
            own = 0
            for a in mine:
                if a.node == node:
                    own |= a.mask
            for j in range(8 >> lvl):
                cmask = cell_mask(lvl, j)
                if busy & cmask or own & cmask:
                    continue  # executing / absent / taken by another allocator user, or this service is here
                residents = [rid for rid, r in self._replicas.items() if r.alloc.node == node and r.alloc.mask & cmask]
                victims = self._victims(cmask, spec.gb_per_gpu, residents)
                newest = max((self._replicas[v].last_used for v in victims), default=-math.inf)
                left = self._free_after(cmask, spec.gb_per_gpu, residents, victims)
                key = (newest, len(victims), -left, node, j)
                if best is None or key < best[0]:
                    gpus = tuple(range(j << lvl, (j + 1) << lvl))
                    best = (key, Allocation(node, gpus, lvl, j), victims)
        return None if best is None else (best[1], best[2])

    def _used(self, cmask: int, residents: list[int], skip: Iterable[int] = ()) -> dict[int, float]:
        """GB taken on each GPU of ``cmask`` by ``residents`` other than ``skip``."""
        gone = set(skip)
        used = {g: 0.0 for g in range(8) if cmask >> g & 1}
        for rid in residents:
            if rid in gone:
                continue
            r = self._replicas[rid]
            gb = self.services[r.service].gb_per_gpu
            for g in r.alloc.gpus:
                if g in used:
                    used[g] += gb
        return used

    def _free_after(self, cmask: int, need: float, residents: list[int], victims: list[int]) -> float:
        """The least free GB over the cell's GPUs once ``victims`` are evicted and ``need`` is placed."""
        assert self._cap is not None
        return min(self._cap - u - need for u in self._used(cmask, residents, victims).values())

    def _victims(self, cmask: int, need: float, residents: list[int]) -> list[int]:
        """The idle replicas to evict from a cell so that ``need`` GB fits on each of its GPUs: least recently
        used first, skipping any that frees no GPU still short, then dropping (most recent first) any whose
        eviction turned out unnecessary. Empty if it already fits."""
        cap = self._cap
        assert cap is not None

        def fits(evicted: list[int]) -> bool:
            return all(u + need <= cap + _EPS for u in self._used(cmask, residents, evicted).values())

        if fits([]):
            return []
        chosen: list[int] = []
        for rid in sorted(residents, key=lambda v: (self._replicas[v].last_used, v)):
            r = self._replicas[rid]
            assert not r.busy, "a replica on an idle cell cannot be executing"
            used = self._used(cmask, residents, chosen)
            if any(u + need > cap + _EPS and r.alloc.mask >> g & 1 for g, u in used.items()):
                chosen.append(rid)
                if fits(chosen):
                    break
        for rid in reversed(list(chosen)):
            rest = [v for v in chosen if v != rid]
            if fits(rest):
                chosen = rest
        return chosen

    # ------------------------------------------------------------------ wait or restore

    def mean_action_s(self, service: str) -> float | None:
        """Mean seconds of the service's completed actions (restore excluded), or ``None`` before the first."""
        e = self._exec.get(service)
        return None if e is None else e[1]

    def _free_at(self, r: _Replica) -> float:
        """Estimated time ``r``'s current action ends (``inf`` when its service has no estimate yet)."""
        mean = self.mean_action_s(r.service)
        return math.inf if mean is None else r.started + r.restore_s + mean

    def _worth_waiting(self, spec: ServiceSpec, mine: list[_Replica], now: float) -> bool:
        """Whether a resident replica of ``spec`` frees up sooner than a restore would take (module docstring);
        if so, the caller is counted as waiting at ``now``."""
        mean = self.mean_action_s(spec.name)
        if mean is None or not mine:
            return False
        times = []
        for r in mine:
            if r.busy:
                t = self._free_at(r)
            else:  # idle, but its cell executes another service's action
                t = max((self._free_at(q) for q in self._replicas.values()
                         if q.busy and q.alloc.node == r.alloc.node and q.alloc.mask & r.alloc.mask), default=now)
            if now < t < math.inf:  # overdue actions have no estimate left: not waited for
                times.append(t)
        if not times:
            return False
        if now != self._wait_now:
            self._wait_now, self._waiting = now, {}
        k = self._waiting.get(spec.name, 0)
        times.sort()
        free_at = times[k % len(times)] + (k // len(times)) * mean
        if free_at - now >= self.restore_cost(spec.name):
            return False
        self._waiting[spec.name] = k + 1
        self.stats.waits += 1
        return True

    # ------------------------------------------------------------------ release / evict

    def release(self, instance: int, now: float) -> None:
        """The action on replica ``instance`` finished: it stays resident and idle (and, under the memory
        model, its cell stops executing). Raises if not busy."""
        r = self._replicas.get(instance)
        if r is None or not r.busy:
            raise GpuCellError(f"replica {instance} is not executing an action")
        r.busy = False
        r.last_used = now
        took = now - r.started - r.restore_s
        if took >= 0:
            n, mean = self._exec.get(r.service, (0, 0.0))
            self._exec[r.service] = (n + 1, mean + (took - mean) / (n + 1))
        self._busy_gpus -= len(r.alloc.gpus)
        if self.shared:
            self.allocator.free(r.alloc)

    def evict(self, instance: int) -> None:
        """Evict the idle replica ``instance`` (e.g. its restore failed on the device). Raises
        :class:`GpuCellError` if there is no such replica or it is executing."""
        r = self._replicas.get(instance)
        if r is None or r.busy:
            raise GpuCellError(f"replica {instance} is not an idle resident replica")
        self._evict(instance)

    def evict_idle(self, service: str | None = None) -> int:
        """Evict every idle replica (of ``service``, or all); returns how many were evicted."""
        ids = [rid for rid, r in self._replicas.items() if not r.busy and (service is None or r.service == service)]
        for rid in ids:
            self._evict(rid)
        return len(ids)

    def replicas(self) -> Mapping[int, tuple[str, Allocation, bool]]:
        """Resident replicas: id → (service, allocation, busy)."""
        return {rid: (r.service, r.alloc, r.busy) for rid, r in self._replicas.items()}
