"""CPU cores of the action actors, pooled per host, and where a grant of ``n`` cores goes (pure).

An action actor reports its resources in its hello labels (:class:`~libra.protocol.payloads_actions.
ActorResources`): the CPU ids its sandboxes run on (``cpus``) and the NUMA node of each (``numa``). Actors on
one host that list the same ids share them: one pool per host, and a core is granted to at most one running
action at a time, whichever actor runs it. An actor that reports no ids gets a private pool of ``cores``
anonymous cores (its grants then carry a count only).

:meth:`CorePools.best_fit` picks, for a grant of ``n`` cores, the actor and the exact cores:

- among the candidate actors whose free cores fit ``n``: the trajectory's home actor first (the one whose
  sandbox holds its workspace), then a placement inside one NUMA node before one that spans nodes, then
  **best fit** (the fewest free cores left after the grant, so large grants stay possible), then actor id;
- inside the actor, the NUMA node with the fewest free cores that still fits ``n`` (best fit again); when no
  node fits, the nodes with the most free cores first;
- when no actor fits ``n``, the grant shrinks to the most free cores any candidate has (the degree of
  parallelism is elastic) if that is at least the action's minimum; else it stays queued.

Bookkeeping (the broker runs one placement round per submitted or finished action, over every actor): each
pool keeps its CPU ids as bitsets, the ids of each NUMA node and the ids held, updated by :meth:`take` and
:meth:`give_back`; an actor's free cores in a node are one AND of those with its own ids and their count one
popcount. A query costs O(NUMA nodes) word-wide operations, whatever the number of cores, and only the chosen
grant's ids are enumerated, so a round costs O(grants x actors). ``tests/unit/test_core_pools_oracle.py``
checks the decisions against a brute-force search over small hosts; ``python -m libra.bench placement`` times them.

Labels that do not parse fall back to the session's ``cores`` (a private pool) and are reported once through
:meth:`CorePools.take_unparsed` for the broker's shell to log.

Pure: no I/O, clocks or logging. Mutation rule: only :meth:`take`, :meth:`give_back`, :meth:`forget` (and
:meth:`take_unparsed`, which empties its report).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any
from dataclasses import dataclass, field

from libra.protocol.payloads_actions import ActorResources
from libra.protocol.payloads_base import PayloadError

from .sessions import ActorSession

__all__ = ["CorePools", "parse_resources"]


def parse_resources(sess: ActorSession) -> tuple[ActorResources, str | None]:
    """The resources ``sess`` reported in its hello labels, and why they did not parse (``None`` when they
    did): labels that do not parse count as none reported (its ``cores`` then stay the session's), and the
    reason is kept for the broker's shell to log (:meth:`CorePools.take_unparsed`)."""
    keys = ("cores", "cpus", "numa", "gpus", "gpu_emulated")
    try:
        return ActorResources.from_wire({k: sess.labels[k] for k in keys if k in sess.labels}), None
    except PayloadError as exc:
        return ActorResources(), str(exc)


def _mask(ids: Iterable[int]) -> int:
    m = 0
    for c in ids:
        m |= 1 << c
    return m


def _lowest(mask: int, n: int) -> list[int]:
    """The ``n`` lowest ids set in ``mask`` (ascending)."""
    out: list[int] = []
    while mask and len(out) < n:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


@dataclass(slots=True)
class _Pool:
    """One pool's cores as bitsets (bit ``c`` is CPU id ``c``), kept up to date on every grant and release:
    ``used_mask`` (the held ids) and ``nodes`` (NUMA node -> its ids), so that what an actor has free, per
    node or in all, is a few word-wide ANDs and popcounts instead of a scan of every id."""

    numa: dict[int, int] = field(default_factory=dict)  # cpu id -> NUMA node
    used: dict[int, str] = field(default_factory=dict)  # cpu id -> work id holding it
    used_mask: int = 0
    nodes: dict[int, int] = field(default_factory=dict)  # NUMA node -> mask of its ids (ascending node order)
    held: int = 0  # grants holding cores of this pool

    def add(self, numa: dict[int, int]) -> None:
        changed = any(self.numa.get(c) != nd for c, nd in numa.items())
        self.numa.update(numa)
        if changed:
            nodes: dict[int, int] = {}
            for c, nd in self.numa.items():
                nodes[nd] = nodes.get(nd, 0) | (1 << c)
            self.nodes = dict(sorted(nodes.items()))


@dataclass(frozen=True, slots=True)
class _ActorCores:
    pool: str
    cpus: tuple[int, ...]
    real: bool  # ids the actor reported (sent in the route) rather than anonymous ones
    gpus: int = 0  # GPUs its model services use (the resources it reported)
    mask: int = 0  # its cpus as a bitset


class CorePools:
    """Per-host core pools of the action actors (see the module docstring). Every query costs O(NUMA nodes)
    word-wide bit operations (the pools keep their free ids as bitsets updated on take and give back); only
    the chosen grant's ids are enumerated."""

    def __init__(self) -> None:
        self._pools: dict[str, _Pool] = {}
        self._actors: dict[bytes, tuple[ActorSession, _ActorCores]] = {}
        self._held: dict[str, tuple[str, tuple[int, ...]]] = {}  # work id -> (pool, cpu ids)
        self.unparsed: list[tuple[str, str]] = []  # (actor id, why) of hello labels that did not parse, unread

    def actor(self, sess: ActorSession) -> _ActorCores:
        """The cores of ``sess`` (registered on first sight, again when the session object is new)."""
        known = self._actors.get(sess.peer)
        if known is not None and known[0] is sess:
            return known[1]
        res, why = parse_resources(sess)
        if why is not None:
            self.unparsed.append((sess.actor_id, why))
        if res.cpus is not None:
            key, cpus, real = f"host:{sess.host}", tuple(sorted(res.cpus)), True
            numa = dict(zip(res.cpus, res.numa or [0] * len(res.cpus)))
        else:
            key, cpus, real = f"actor:{sess.peer.hex()}", tuple(range(sess.cores)), False
            numa = dict.fromkeys(cpus, 0)
        pool = self._pools.setdefault(key, _Pool())
        pool.add(numa)
        ac = _ActorCores(key, cpus, real, res.gpus, _mask(cpus))
        self._actors[sess.peer] = (sess, ac)
        return ac

    def take_unparsed(self) -> list[tuple[str, str]]:
        """The actors whose hello labels did not parse since the last call (``(actor id, why)``); each is
        reported once per session, for the shell to log."""
        out, self.unparsed = self.unparsed, []
        return out

    def forget(self, live: Iterable[bytes]) -> None:
        """Drop the records of actors no longer connected, and pools nobody uses or holds."""
        alive = set(live)
        for peer in [p for p in self._actors if p not in alive]:
            del self._actors[peer]
        used = {ac.pool for _, ac in self._actors.values()}
        for key in [k for k, p in self._pools.items() if k not in used and p.held == 0]:
            del self._pools[key]

    def _free_mask(self, sess: ActorSession) -> tuple[_Pool, int]:
        ac = self.actor(sess)
        pool = self._pools[ac.pool]
        return pool, ac.mask & ~pool.used_mask

    def free_count(self, sess: ActorSession) -> int:
        """How many of ``sess``'s cores are free."""
        return self._free_mask(sess)[1].bit_count()

    def free_ids(self, sess: ActorSession) -> list[int]:
        """``sess``'s free cores, ascending."""
        free = self._free_mask(sess)[1]
        return _lowest(free, free.bit_count())

    def total_free(self, actors: Sequence[ActorSession]) -> int:
        """Distinct free cores the ``actors`` can reach (shared cores of one host count once)."""
        reach: dict[str, int] = {}
        for s in actors:
            ac = self.actor(s)
            reach[ac.pool] = reach.get(ac.pool, 0) | ac.mask
        return sum((m & ~self._pools[k].used_mask).bit_count() for k, m in reach.items())

    def _nodes(self, sess: ActorSession) -> list[tuple[int, int, int]]:
        """``(free count, node, free mask)`` of each NUMA node where ``sess`` has a free core."""
        pool, free = self._free_mask(sess)
        out = []
        for nd, nm in pool.nodes.items():
            f = free & nm
            if f:
                out.append((f.bit_count(), nd, f))
        return out

    def _within(self, sess: ActorSession, n: int) -> tuple[tuple[int, ...], bool]:
        """``n`` free cores of ``sess``: best-fit NUMA node, else most-free nodes first; and whether they span
        more than one node."""
        nodes = self._nodes(sess)
        fitting = [(k, nd, f) for k, nd, f in nodes if k >= n]
        if fitting:
            return tuple(_lowest(min(fitting)[2], n)), False
        chosen: list[int] = []
        for _k, _nd, f in sorted(nodes, key=lambda x: (-x[0], x[1])):
            chosen += _lowest(f, n - len(chosen))
            if len(chosen) >= n:
                break
        return tuple(sorted(chosen)), True

    def best_fit(self, candidates: Sequence[ActorSession], n: int, least: int = 1,
                 home: str | None = None) -> tuple[ActorSession, tuple[int, ...]] | None:
        """Where a grant of ``n`` cores goes (module docstring): ``(actor, cpu ids)``, fewer ids than ``n``
        when it had to shrink (never below ``least``), or ``None``."""
        best: tuple[tuple[bool, bool, int, str], ActorSession] | None = None
        widest: tuple[tuple[int, bool, str], ActorSession] | None = None
        for s in candidates:
            ac = self.actor(s)
            pool = self._pools[ac.pool]
            fm = ac.mask & ~pool.used_mask
            free = fm.bit_count()
            if free >= n:
                spans = not any((fm & nm).bit_count() >= n for nm in pool.nodes.values())
                key = (s.actor_id != home, spans, free - n, s.actor_id)
                if best is None or key < best[0]:
                    best = (key, s)
            elif free >= least:
                wkey = (-free, s.actor_id != home, s.actor_id)
                if widest is None or wkey < widest[0]:
                    widest = (wkey, s)
        if best is not None:
            return best[1], self._within(best[1], n)[0]
        if widest is None:
            return None
        s = widest[1]
        return s, self._within(s, -widest[0][0])[0]

    def take(self, work_id: str, sess: ActorSession, ids: Sequence[int]) -> bool:
        """Mark ``ids`` of ``sess``'s pool as held by ``work_id``; False (nothing taken) if one is not free
        (e.g. an adopted action whose cores were granted again meanwhile) or not one of ``sess``'s."""
        ac = self.actor(sess)
        pool = self._pools[ac.pool]
        if work_id in self._held or not all(isinstance(c, int) and c >= 0 for c in ids):
            return False
        want = _mask(ids)
        if want & ~ac.mask or want & pool.used_mask:
            return False
        for c in ids:
            pool.used[c] = work_id
        pool.used_mask |= want
        pool.held += 1
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
            pool.held -= 1
            for c in held[1]:
                if pool.used.get(c) == work_id:
                    del pool.used[c]
                    pool.used_mask &= ~(1 << c)
        return len(held[1])

    def real_ids(self, sess: ActorSession) -> bool:
        """Whether ``sess`` reported its CPU ids (grants on it name them in the route)."""
        return self.actor(sess).real

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per action actor seen so far: its host pool, cores, free cores and the actions holding some."""
        out: dict[str, dict[str, Any]] = {}
        for sess, ac in self._actors.values():
            pool, free = self._free_mask(sess)
            busy = ac.mask & ~free
            out[sess.actor_id] = {"pool": ac.pool, "cores": ac.mask.bit_count(), "free": free.bit_count(),
                                  "held_by": len({pool.used[c] for c in _lowest(busy, busy.bit_count())})}
        return out
