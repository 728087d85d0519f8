"""Indexed read-only views a scheduler is given: running actions and the waiting queue.

- :class:`RunningView`: one running action (the units it holds, its projected release time);
- :class:`RunningSet`: a ``Sequence[RunningView]`` indexed by resource and trajectory, so
  :func:`release_list` / :func:`held_units` cost O(actions on that resource) or O(1), and
  :func:`sorted_releases` costs O(1) (a per-resource list kept sorted on ``add`` / ``remove``);
- :class:`ActionQueue`: a ``Sequence[ActionSpec]`` in FCFS order indexed by each action's primary resource,
  so :func:`scan_order` can skip whole classes of actions whose primary resource has nothing free.

Schedulers accept any ``Sequence`` and fall back to plain scans; these classes only make the same decisions
cheaper. Pure data structures: no I/O, clocks or threads. Mutation rule: only ``add`` / ``remove``.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Iterator, Mapping, Sequence
from operator import itemgetter
from typing import NamedTuple, overload

from libra.policies.actions.model import ActionModelError, ActionSpec, resource_kind

_second = itemgetter(1)

__all__ = [
    "ActionQueue",
    "RunningSet",
    "RunningView",
    "held_units",
    "release_list",
    "scan_order",
    "sorted_releases",
]


class RunningView(NamedTuple):
    """Read-only view of a running action: the units it holds and when it is expected to release them."""

    action_id: str
    trajectory: str
    units: Mapping[str, int]
    expected_end: float


class RunningSet(Sequence[RunningView]):
    """The running actions, indexed by resource so :func:`release_list` costs O(actions on that resource).

    Mutation rule: only :meth:`add` and :meth:`remove` change it; both are O(resources of the action) plus
    an O(log k) search and a memmove into that resource's sorted release list. Iteration order is
    insertion order.
    """

    __slots__ = ("_by_id", "_by_res", "_by_traj", "_held", "_sorted")

    def __init__(self, views: Sequence[RunningView] = ()) -> None:
        self._by_id: dict[str, RunningView] = {}
        self._by_res: dict[str, dict[str, tuple[float, int]]] = {}
        self._by_traj: dict[str, int] = {}
        self._held: dict[str, int] = {}
        self._sorted: dict[str, list[tuple[float, int]]] = {}
        for v in views:
            self.add(v)

    def add(self, view: RunningView) -> None:
        """Add a running action. Raises :class:`ActionModelError` if its id is already present."""
        if view.action_id in self._by_id:
            raise ActionModelError(f"running action {view.action_id!r} added twice")
        self._by_id[view.action_id] = view
        for r, u in view.units.items():
            if u > 0:
                rel = (view.expected_end, u)
                self._by_res.setdefault(r, {})[view.action_id] = rel
                self._held[r] = self._held.get(r, 0) + u
                lst = self._sorted.get(r)
                if lst is None:
                    self._sorted[r] = [rel]
                else:
                    insort(lst, rel)
        self._by_traj[view.trajectory] = self._by_traj.get(view.trajectory, 0) + 1

    def remove(self, action_id: str) -> RunningView:
        """Remove and return a running action. Raises ``KeyError`` if it is not running."""
        view = self._by_id.pop(action_id)
        for r, u in view.units.items():
            d = self._by_res.get(r)
            if d is not None:
                rel = d.pop(action_id, None)
                if rel is not None:
                    self._held[r] -= u
                    lst = self._sorted[r]
                    del lst[bisect_left(lst, rel)]
        n = self._by_traj[view.trajectory] - 1
        if n:
            self._by_traj[view.trajectory] = n
        else:
            del self._by_traj[view.trajectory]
        return view

    def held(self, resource: str) -> int:
        """Units of ``resource`` held by running actions (O(1))."""
        return self._held.get(resource, 0)

    def has_trajectory(self, trajectory: str) -> bool:
        """Whether any action of ``trajectory`` is running (O(1))."""
        return trajectory in self._by_traj

    def releases(self, resource: str) -> list[tuple[float, int]]:
        """``(expected_end, units)`` of every running action holding ``resource`` (unordered, a fresh list)."""
        d = self._by_res.get(resource)
        return list(d.values()) if d else []

    def sorted_releases(self, resource: str) -> list[tuple[float, int]]:
        """``(expected_end, units)`` of every running action holding ``resource``, ascending (O(1)).

        The list is the set's own index: callers must not mutate it, and it changes on the next
        :meth:`add` / :meth:`remove`.
        """
        return self._sorted.get(resource) or []

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[RunningView]:
        return iter(self._by_id.values())

    def __contains__(self, item: object) -> bool:
        if isinstance(item, RunningView):
            return self._by_id.get(item.action_id) is item
        return item in self._by_id

    @overload
    def __getitem__(self, i: int) -> RunningView: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[RunningView]: ...
    def __getitem__(self, i: int | slice) -> RunningView | Sequence[RunningView]:
        return list(self._by_id.values())[i]


class ActionQueue(Sequence[ActionSpec]):
    """The waiting actions in FCFS order, indexed by each action's primary resource (its key elastic
    resource, else its first resource) so a scheduler can skip whole classes of actions whose primary
    resource has nothing free (:meth:`iter_open`) instead of reading them one by one.

    Mutation rule: only :meth:`add` and :meth:`remove` change it. Iteration is FCFS (insertion order).
    """

    __slots__ = ("_by_id", "_by_res", "_seq")

    def __init__(self, specs: Sequence[ActionSpec] = ()) -> None:
        self._by_id: dict[str, tuple[int, ActionSpec]] = {}
        self._by_res: dict[str, dict[str, tuple[int, ActionSpec]]] = {}
        self._seq = 0
        for spec in specs:
            self.add(spec)

    @staticmethod
    def primary(spec: ActionSpec) -> str:
        """The resource an action is filed under (``""`` for an action that demands nothing)."""
        if spec.key is not None:
            return spec.key
        return spec.items[0][0] if spec.items else ""

    def add(self, spec: ActionSpec) -> None:
        """Append an action. Raises :class:`ActionModelError` if its id is already queued."""
        if spec.id in self._by_id:
            raise ActionModelError(f"action {spec.id!r} queued twice")
        self._seq += 1
        entry = (self._seq, spec)
        self._by_id[spec.id] = entry
        self._by_res.setdefault(self.primary(spec), {})[spec.id] = entry

    def remove(self, action_id: str) -> ActionSpec:
        """Remove and return a queued action. Raises ``KeyError`` if it is not queued."""
        _seq, spec = self._by_id.pop(action_id)
        del self._by_res[self.primary(spec)][action_id]
        return spec

    def get(self, action_id: str) -> ActionSpec | None:
        """The queued action with this id, or ``None``."""
        e = self._by_id.get(action_id)
        return None if e is None else e[1]

    def iter_open(self, free: Mapping[str, int], always: Sequence[str] = ()) -> Iterator[ActionSpec]:
        """FCFS iteration over the actions whose primary resource has ``free > 0`` (or whose primary
        resource's kind is in ``always``). Skipped actions could not have fit anyway."""
        open_: list[dict[str, tuple[int, ActionSpec]]] = []
        closed: set[str] = set()
        n_open = 0
        for r, d in self._by_res.items():
            if not d:
                continue
            if free.get(r, 0) > 0 or r == "" or (always and resource_kind(r) in always):
                open_.append(d)
                n_open += len(d)
            else:
                closed.add(r)
        if not open_:
            return iter(())
        if len(open_) == 1:
            return map(_second, open_[0].values())
        if 2 * n_open >= len(self._by_id):
            # Mostly open: filtering the global FCFS order is cheaper than merging many sub-queues.
            primary = self.primary
            return (e[1] for e in self._by_id.values() if primary(e[1]) not in closed) if closed else iter(self)
        # (seq, spec) entries: seqs are unique, so the merge never compares specs.
        return map(_second, heapq.merge(*(d.values() for d in open_)))

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[ActionSpec]:
        return map(_second, self._by_id.values())

    def __contains__(self, item: object) -> bool:
        if isinstance(item, ActionSpec):
            e = self._by_id.get(item.id)
            return e is not None and e[1] is item
        return item in self._by_id

    @overload
    def __getitem__(self, i: int) -> ActionSpec: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[ActionSpec]: ...
    def __getitem__(self, i: int | slice) -> ActionSpec | Sequence[ActionSpec]:
        specs = [e[1] for e in self._by_id.values()]
        return specs[i]


def scan_order(queue: Sequence[ActionSpec], free: Mapping[str, int], always: Sequence[str] = ()) -> Iterator[ActionSpec]:
    """The order a scheduler reads ``queue``: :meth:`ActionQueue.iter_open` for an :class:`ActionQueue`,
    plain FCFS otherwise."""
    if isinstance(queue, ActionQueue):
        return queue.iter_open(free, always)
    return iter(queue)


def release_list(running: Sequence[RunningView], resource: str) -> list[tuple[float, int]]:
    """``(expected_end, units)`` of the running actions holding ``resource``: O(k) for a :class:`RunningSet`,
    a full scan otherwise."""
    if isinstance(running, RunningSet):
        return running.releases(resource)
    out: list[tuple[float, int]] = []
    for v in running:
        u = v.units.get(resource, 0)
        if u > 0:
            out.append((v.expected_end, u))
    return out


def sorted_releases(running: Sequence[RunningView], resource: str) -> list[tuple[float, int]]:
    """``(expected_end, units)`` of the running actions holding ``resource`` in ascending order: the set's
    own index for a :class:`RunningSet` (O(1); read-only), a sorted fresh list otherwise."""
    if isinstance(running, RunningSet):
        return running.sorted_releases(resource)
    out = release_list(running, resource)
    out.sort()
    return out


def held_units(running: Sequence[RunningView], resource: str) -> int:
    """Units of ``resource`` held by ``running``: O(1) for a :class:`RunningSet`, a scan otherwise."""
    if isinstance(running, RunningSet):
        return running.held(resource)
    return sum(v.units.get(resource, 0) for v in running)
