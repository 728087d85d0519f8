"""GPU services (reward models) on the GPU actors: evict-on-execution placement in the broker (pure).

ARL-Tangram's GPU manager (docs/papers.md §2.5, §4 item 14) decided by the broker: one
:class:`~libra.policies.actions.gpu_services.ServicePlacement` over a
:class:`~libra.policies.actions.gpu_cells.MultiLevelCellAllocator` per GPU actor (an actor whose hello labels
report ``gpus > 0``; a replica sits on one aligned cell of its GPUs and owns it exclusively). A call of
service ``S`` goes, in this order, to

1. an actor holding an idle resident replica of ``S`` (a hit: no copy; calls from many trajectories share it);
2. an actor with a free aligned cell big enough for ``S`` (a restore from host memory);
3. an actor where ``S`` fits once least-recently-used idle replicas are evicted (restore after eviction);

else it waits in its queue. Ties go to the actor with the fewest free GPUs (best fit), then its id. The
decision travels to the actor as a :class:`~libra.protocol.payloads_actions.ServiceRoute` (replica, cell,
restore, cells evicted first); the actor's service engine (``libra/engines/services.py``) does exactly that.

Service specs come from the ``services`` table of a service tool's declaration in ``BrokerConfig.tools``
(``{"reward_model": {"services": {"rm": {"gpus": 1, "checkpoint_gb": 14}}}}``); a service nobody declared is
placed as one GPU and ``DEFAULT_CHECKPOINT_GB``. The declaration's ``gpu_mem_gb`` (with ``workspace_gb``)
turns on the GPU memory model: replicas of several services stay resident on one cell while their memory
fits, a cell still executes one call at a time, and eviction happens only when memory is short. Its
``wait_for_resident`` makes a call wait for a busy resident replica of its service that is estimated to free
up sooner than a restore would take, instead of restoring another replica
(``ServicePlacement(wait_for_resident=True)``). Times are the core's ``now`` in seconds, made strictly
increasing (a nanosecond per decision and per release at the same ``now``) so LRU order has no ties, and the
state stays pure. Mutation rule: only :meth:`place`, :meth:`release` and :meth:`forget`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from libra.policies.actions.gpu_cells import Allocation, GpuCellError, MultiLevelCellAllocator
from libra.policies.actions.gpu_services import ServicePlacement, ServiceSpec
from libra.protocol.payloads_actions import Cell, ServiceRoute

from .sessions import ActorSession

__all__ = ["DEFAULT_CHECKPOINT_GB", "ServicePools", "service_specs"]

DEFAULT_CHECKPOINT_GB = 1.0


def service_specs(table: Mapping[str, Any]) -> dict[str, ServiceSpec]:
    """``{name: {"gpus", "checkpoint_gb", "reserve_gb"}}`` → specs; ``ValueError`` naming a bad entry."""
    out: dict[str, ServiceSpec] = {}
    for name, decl in table.items():
        if not isinstance(decl, Mapping):
            raise ValueError(f"service {name!r}: expected a table of gpus, checkpoint_gb, reserve_gb, got {decl!r}")
        try:
            out[name] = ServiceSpec(name, **decl)
        except (TypeError, GpuCellError) as exc:
            raise ValueError(f"service {name!r}: {exc} (fields: gpus, checkpoint_gb, reserve_gb)") from None
    return out


def _cell(a: Allocation, service: str | None = None) -> Cell:
    return Cell(node=a.node, gpus=list(a.gpus), service=service)


class ServicePools:
    """One evict-on-execution placement per GPU actor (see the module docstring)."""

    def __init__(self, specs: Mapping[str, ServiceSpec], gpu_mem_gb: float | None = None,
                 workspace_gb: float = 0.0, wait_for_resident: bool = False) -> None:
        self.specs = dict(specs)
        self.gpu_mem_gb = gpu_mem_gb
        self.workspace_gb = workspace_gb
        self.wait_for_resident = wait_for_resident
        ServicePlacement(MultiLevelCellAllocator(1), self.specs.values(), gpu_mem_gb=gpu_mem_gb,
                         workspace_gb=workspace_gb)  # checks the specs fit now: a bad config fails at start
        self._by_actor: dict[bytes, tuple[ActorSession, ServicePlacement]] = {}
        self._held: dict[str, tuple[bytes, ServicePlacement, int, bool]] = {}  # work -> (peer, pl, replica, restored)
        self._last = 0.0  # the last time handed to a placement (seconds, strictly increasing)

    def placement(self, sess: ActorSession, gpus: int) -> ServicePlacement:
        """The placement of GPU actor ``sess`` (``gpus`` GPUs, nodes of 8); new for a new session."""
        known = self._by_actor.get(sess.peer)
        if known is not None and known[0] is sess:
            return known[1]
        nodes = [8] * (gpus // 8) + ([gpus % 8] if gpus % 8 else [])
        pl = ServicePlacement(MultiLevelCellAllocator(nodes), self.specs.values(), gpu_mem_gb=self.gpu_mem_gb,
                              workspace_gb=self.workspace_gb, wait_for_resident=self.wait_for_resident)
        self._by_actor[sess.peer] = (sess, pl)
        return pl

    def forget(self, live: Iterable[bytes]) -> None:
        """Drop the placements of actors no longer connected (their replicas died with them)."""
        alive = set(live)
        for peer in [p for p in self._by_actor if p not in alive]:
            del self._by_actor[peer]

    def _spec(self, service: str) -> ServiceSpec:
        spec = self.specs.get(service)
        if spec is None:
            spec = self.specs[service] = ServiceSpec(service, 1, DEFAULT_CHECKPOINT_GB)
            for _, pl in self._by_actor.values():
                pl.register(spec)
        return spec

    def _time(self, now: float | None) -> float:
        self._last = max(self._last + 1e-9, now if now is not None else 0.0)
        return self._last

    def place(self, work_id: str, service: str, candidates: Sequence[tuple[ActorSession, int]],
              now: float | None = None) -> tuple[ActorSession, ServiceRoute] | None:
        """Place one call of ``service`` on one of ``candidates`` (``(actor, its GPUs)``) as the module
        docstring says; ``None``: it waits (every fitting cell executes)."""
        spec = self._spec(service)
        ranked = []
        for sess, gpus in candidates:
            if gpus < spec.gpus:
                continue
            pl = self.placement(sess, gpus)
            hit = any(svc == service and not busy for svc, _, busy in pl.replicas().values())
            free = pl.allocator.placeable(spec.gpus) > 0
            ranked.append(((not hit, not free, pl.allocator.free_gpus(), sess.actor_id), sess, pl))
        ranked.sort(key=lambda r: r[0])
        t = self._time(now)
        for _, sess, pl in ranked:
            before = pl.replicas()
            p = pl.acquire(service, t)
            if p is None:
                continue
            after = pl.replicas()
            gone = [_cell(a, svc) for rid, (svc, a, _) in before.items() if rid not in after]
            restored = p.instance not in before
            self._held[work_id] = (sess.peer, pl, p.instance, restored)
            return sess, ServiceRoute(service=service, replica=p.instance, cell=_cell(p.alloc), restore=restored,
                                      evict=gone, shared=pl.shared)
        return None

    def release(self, work_id: str, failed: bool = False, now: float | None = None) -> bool:
        """The call ``work_id`` ended: its replica stays resident and idle (LRU clock advances); a failed call
        that restored the replica evicts it (the actor dropped a half-restored copy). False if it held none."""
        held = self._held.pop(work_id, None)
        if held is None:
            return False
        _, pl, rid, restored = held
        if rid in pl.replicas():
            pl.release(rid, self._time(now))
            if failed and restored:
                pl.evict(rid)
        return True

    def resident(self) -> dict[str, dict[str, int]]:
        """Resident replicas per service, per GPU actor id (for status and tests)."""
        return {sess.actor_id: pl.resident() for sess, pl in self._by_actor.values()}
