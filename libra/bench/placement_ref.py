"""Reference (pre-optimisation) core pools of the broker's action placement, kept for equivalence tests and
benchmarks.

:class:`ScanningCorePools` is :class:`libra.broker.core_pools.CorePools` as first written: ``free_ids``,
``total_free`` and the NUMA choice scan every CPU id of every candidate actor on every call, so a placement
round over many 256-core actors costs O(grants x actors x cores). The broker's pools keep bitsets updated on
grant and release instead and must make the same decisions (same actor, same ids) on every sequence of
grants and releases: ``tests/unit/test_core_pools_equiv.py`` checks that on random sequences and
``python -m libra.bench placement`` times both. Not used by production code. Pure: no I/O, clocks or threads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from libra.broker.core_pools import resources_of
from libra.broker.sessions import ActorSession

__all__ = ["ScanningCorePools"]


@dataclass(slots=True)
class _Pool:
    numa: dict[int, int] = field(default_factory=dict)  # cpu id -> NUMA node
    used: dict[int, str] = field(default_factory=dict)  # cpu id -> work id holding it


@dataclass(frozen=True, slots=True)
class _ActorCores:
    pool: str
    cpus: tuple[int, ...]
    real: bool  # ids the actor reported (sent in the route) rather than anonymous ones
    gpus: int = 0  # GPUs its model services use (the resources it reported)


class ScanningCorePools:
    """The per-host core pools exactly as first implemented (every query scans every CPU id)."""

    def __init__(self) -> None:
        self._pools: dict[str, _Pool] = {}
        self._actors: dict[bytes, tuple[ActorSession, _ActorCores]] = {}
        self._held: dict[str, tuple[str, tuple[int, ...]]] = {}  # work id -> (pool, cpu ids)

    def actor(self, sess: ActorSession) -> _ActorCores:
        """The cores of ``sess`` (registered on first sight, again when the session object is new)."""
        known = self._actors.get(sess.peer)
        if known is not None and known[0] is sess:
            return known[1]
        res = resources_of(sess)
        if res.cpus is not None:
            key, cpus, real = f"host:{sess.host}", tuple(sorted(res.cpus)), True
            numa = dict(zip(res.cpus, res.numa or [0] * len(res.cpus)))
        else:
            key, cpus, real = f"actor:{sess.peer.hex()}", tuple(range(sess.cores)), False
            numa = dict.fromkeys(cpus, 0)
        pool = self._pools.setdefault(key, _Pool())
        pool.numa.update(numa)
        ac = _ActorCores(key, cpus, real, res.gpus)
        self._actors[sess.peer] = (sess, ac)
        return ac

    def forget(self, live: Iterable[bytes]) -> None:
        """Drop the records of actors no longer connected, and pools nobody uses or holds."""
        alive = set(live)
        for peer in [p for p in self._actors if p not in alive]:
            del self._actors[peer]
        used = {ac.pool for _, ac in self._actors.values()} | {k for k, _ in self._held.values()}
        for key in [k for k in self._pools if k not in used]:
            del self._pools[key]

    def free_count(self, sess: ActorSession) -> int:
        return len(self.free_ids(sess))

    def take_unparsed(self) -> list[tuple[str, str]]:
        return []

    def free_ids(self, sess: ActorSession) -> list[int]:
        ac = self.actor(sess)
        used = self._pools[ac.pool].used
        return [c for c in ac.cpus if c not in used]

    def total_free(self, actors: Sequence[ActorSession]) -> int:
        """Distinct free cores the ``actors`` can reach (shared cores of one host count once)."""
        free: set[tuple[str, int]] = set()
        for s in actors:
            ac = self.actor(s)
            free.update((ac.pool, c) for c in self.free_ids(s))
        return len(free)

    def _within(self, sess: ActorSession, n: int) -> tuple[tuple[int, ...], bool]:
        """``n`` free cores of ``sess``: best-fit NUMA node, else most-free nodes first; and whether they span
        more than one node."""
        numa = self._pools[self.actor(sess).pool].numa
        by_node: dict[int, list[int]] = {}
        for c in self.free_ids(sess):
            by_node.setdefault(numa.get(c, 0), []).append(c)
        fitting = [(len(ids), node) for node, ids in by_node.items() if len(ids) >= n]
        if fitting:
            return tuple(by_node[min(fitting)[1]][:n]), False
        chosen: list[int] = []
        for node in sorted(by_node, key=lambda nd: (-len(by_node[nd]), nd)):
            chosen += by_node[node][: n - len(chosen)]
            if len(chosen) >= n:
                break
        return tuple(sorted(chosen)), True

    def best_fit(self, candidates: Sequence[ActorSession], n: int, least: int = 1,
                 home: str | None = None) -> tuple[ActorSession, tuple[int, ...]] | None:
        """Where a grant of ``n`` cores goes (module docstring): ``(actor, cpu ids)``, fewer ids than ``n``
        when it had to shrink (never below ``least``), or ``None``."""
        best: tuple[tuple[bool, bool, int, str], ActorSession, tuple[int, ...]] | None = None
        widest: tuple[tuple[int, bool, str], ActorSession] | None = None
        for s in candidates:
            free = len(self.free_ids(s))
            if free >= n:
                ids, split = self._within(s, n)
                key = (s.actor_id != home, split, free - n, s.actor_id)
                if best is None or key < best[0]:
                    best = (key, s, ids)
            elif free >= least:
                wkey = (-free, s.actor_id != home, s.actor_id)
                if widest is None or wkey < widest[0]:
                    widest = (wkey, s)
        if best is not None:
            return best[1], best[2]
        if widest is None:
            return None
        s = widest[1]
        return s, self._within(s, -widest[0][0])[0]

    def take(self, work_id: str, sess: ActorSession, ids: Sequence[int]) -> bool:
        """Mark ``ids`` of ``sess``'s pool as held by ``work_id``; False (nothing taken) if one is not free
        (e.g. an adopted action whose cores were granted again meanwhile)."""
        ac = self.actor(sess)
        pool = self._pools[ac.pool]
        if work_id in self._held or any(c in pool.used or c not in ac.cpus for c in ids):
            return False
        for c in ids:
            pool.used[c] = work_id
        self._held[work_id] = (ac.pool, tuple(ids))
        return True

    def holds(self, work_id: str) -> bool:
        return work_id in self._held

    def give_back(self, work_id: str) -> int:
        """Release the cores ``work_id`` holds; returns how many (0 if none)."""
        held = self._held.pop(work_id, None)
        if held is None:
            return 0
        pool = self._pools.get(held[0])
        if pool is not None:
            for c in held[1]:
                if pool.used.get(c) == work_id:
                    del pool.used[c]
        return len(held[1])

    def real_ids(self, sess: ActorSession) -> bool:
        """Whether ``sess`` reported its CPU ids (grants on it name them in the route)."""
        return self.actor(sess).real
