"""Topology-aware GPU allocation: the Multi-Level Cell allocator and its first-fit baseline.

ARL-Tangram §2.5 / docs/papers.md §4 item 14. GPUs sit in nodes of up to 8; a request of 1, 2, 4 or 8 GPUs
gets one **aligned power-of-two cell** on one node (GPUs ``[i·s, (i+1)·s)``), so a multi-GPU service keeps
its NVLink/PCIe-switch locality and is never split across non-aligned chunks.

- :class:`MultiLevelCellAllocator`: a node's state is an 8-bit occupancy bitmap; the per-level *free* bitmaps
  follow bottom-up (a level-l cell is free iff both level-(l−1) halves are free: the DP over levels). A node's
  value ``V`` weighs free cells lexicographically, larger levels first. One request goes to the free cell,
  over all nodes, that loses the least ``V`` (best fit: keeps large cells whole), ties to the fuller node.
  :meth:`~MultiLevelCellAllocator.allocate_many` places a batch all-or-nothing by a DP over nodes and per-node
  placements that maximises the total ``V`` left.
- :class:`FirstFitAllocator`: the baseline. ``aligned=True``: the first free aligned cell in node/GPU order;
  ``aligned=False``: the lowest free GPU ids of the first node with enough free GPUs (may break locality).
- ``ServicePlacement`` / ``ServiceSpec`` / ``Placement`` (the evict-on-execution GPU service policy built on
  these cells) live in :mod:`libra.policies.actions.gpu_services`.

Pure state classes: no I/O, clocks or threads. Mutation rule: only the public allocate/free methods change
state; a wrong free raises ``GpuCellError``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

__all__ = [
    "Allocation",
    "FirstFitAllocator",
    "GpuCellError",
    "MultiLevelCellAllocator",
    "cell_mask",
    "level_free_masks",
    "level_of",
    "node_value",
]

NODE_GPUS: Final = 8
LEVELS: Final = 4  # cell sizes 1, 2, 4, 8
_WEIGHTS: Final = (1, 10, 100, 1000)  # lexicographic: at most 8/4/2/1 free cells per level on a node
_FULL: Final = (1 << NODE_GPUS) - 1


class GpuCellError(ValueError):
    """Raised for a bad request size, node layout, double free or unknown service/instance."""


def level_of(size: int) -> int:
    """Cell level of a request size (1→0, 2→1, 4→2, 8→3). Raises :class:`GpuCellError` for other sizes."""
    if size not in (1, 2, 4, 8):
        raise GpuCellError(f"GPU request size must be 1, 2, 4 or 8 (one aligned cell on one node), got {size!r}")
    return size.bit_length() - 1


def level_free_masks(occupied: int) -> tuple[int, int, int, int]:
    """Per-level free-cell bitmaps of a node: bit ``j`` of entry ``l`` is set iff cell ``j`` of size ``2**l``
    (GPUs ``[j·2**l, (j+1)·2**l)``) is entirely free."""
    f = ~occupied & _FULL
    out = [f]
    for _ in range(1, LEVELS):
        nxt = 0
        for j in range(8 >> len(out)):
            if (f >> (2 * j)) & 3 == 3:
                nxt |= 1 << j
        f = nxt
        out.append(f)
    return out[0], out[1], out[2], out[3]


def node_value(occupied: int) -> int:
    """Future-utilisation value of a node state: free cells per level weighted lexicographically (large first)."""
    return sum(w * bin(m).count("1") for w, m in zip(_WEIGHTS, level_free_masks(occupied)))


_FREE = tuple(level_free_masks(b) for b in range(1 << NODE_GPUS))
_VALUE = tuple(node_value(b) for b in range(1 << NODE_GPUS))


def cell_mask(level: int, index: int) -> int:
    """Bitmap (within its node) of cell ``index`` at ``level``."""
    size = 1 << level
    return ((1 << size) - 1) << (index * size)


def _best_cells() -> tuple[tuple[tuple[int, int] | None, ...], ...]:
    """For every node bitmap and level: ``(index, value after)`` of the free cell that keeps the most value."""
    table = []
    for b in range(1 << NODE_GPUS):
        row: list[tuple[int, int] | None] = []
        for lvl in range(LEVELS):
            best = None
            free = _FREE[b][lvl]
            for j in range(8 >> lvl):
                if free >> j & 1:
                    v = _VALUE[b | cell_mask(lvl, j)]
                    if best is None or v > best[1]:
                        best = (j, v)
            row.append(best)
        table.append(tuple(row))
    return tuple(table)


_BEST = _best_cells()


@dataclass(frozen=True, slots=True)
class Allocation:
    """GPUs given to one request: ``node``, ``gpus`` (indices within the node) and, for aligned placements,
    the cell ``(level, index)``."""

    node: int
    gpus: tuple[int, ...]
    level: int | None = None
    index: int | None = None

    @property
    def mask(self) -> int:
        """Bitmap of the GPUs within the node."""
        m = 0
        for g in self.gpus:
            m |= 1 << g
        return m

    @property
    def aligned(self) -> bool:
        """Whether the GPUs form one aligned power-of-two cell."""
        n = len(self.gpus)
        return n in (1, 2, 4, 8) and self.gpus[0] % n == 0 and self.gpus == tuple(range(self.gpus[0], self.gpus[0] + n))


class _NodeState:
    """Occupancy bitmaps of a set of nodes (shared by both allocators)."""

    def __init__(self, nodes: int | Sequence[int]) -> None:
        sizes = [NODE_GPUS] * nodes if isinstance(nodes, int) else list(nodes)
        if not sizes or any(not isinstance(s, int) or not 0 <= s <= NODE_GPUS for s in sizes):
            raise GpuCellError(f"nodes must be a positive count or a list of per-node GPU counts in 0..8, got {nodes!r}")
        # Absent GPUs (a partial node) are permanently occupied.
        self.absent = [_FULL & ~((1 << s) - 1) for s in sizes]
        self.occ = list(self.absent)
        self.total = sum(sizes)

    def take(self, node: int, mask: int) -> None:
        self.occ[node] |= mask

    def give(self, alloc: Allocation) -> None:
        m = alloc.mask
        if not 0 <= alloc.node < len(self.occ) or self.occ[alloc.node] & m != m or self.absent[alloc.node] & m:
            raise GpuCellError(f"freeing GPUs {alloc.gpus} on node {alloc.node} that are not allocated")
        self.occ[alloc.node] &= ~m

    def free_gpus(self) -> int:
        return sum(8 - bin(o).count("1") for o in self.occ)

    def free_cells(self, level: int) -> int:
        return sum(bin(_FREE[o][level]).count("1") for o in self.occ)

    def largest_free_cell(self) -> int:
        for lvl in range(LEVELS - 1, -1, -1):
            if any(_FREE[o][lvl] for o in self.occ):
                return 1 << lvl
        return 0


class _AllocatorBase:
    """Shared read-only metrics."""

    _st: _NodeState

    @property
    def total_gpus(self) -> int:
        """GPUs that exist (absent GPUs of partial nodes excluded)."""
        return self._st.total

    @property
    def absent_masks(self) -> tuple[int, ...]:
        """Per-node bitmaps of GPUs that do not exist (partial nodes)."""
        return tuple(self._st.absent)

    @property
    def occupancy(self) -> tuple[int, ...]:
        """Per-node occupancy bitmaps (bit g set = GPU g busy or absent)."""
        return tuple(self._st.occ)

    def free_gpus(self) -> int:
        """Free GPUs in total."""
        return self._st.free_gpus()

    def largest_free_cell(self) -> int:
        """Size of the largest free aligned cell (0 if none)."""
        return self._st.largest_free_cell()

    def placeable(self, size: int) -> int:
        """How many requests of ``size`` GPUs could be placed as aligned cells right now (independently)."""
        return self._st.free_cells(level_of(size))

    def fragmentation(self, size: int = 4) -> float:
        """Fraction of free GPUs that aligned requests of ``size`` cannot use (0 when nothing is free)."""
        free = self.free_gpus()
        return 0.0 if free == 0 else 1.0 - size * self.placeable(size) / free

    def free(self, alloc: Allocation) -> None:
        """Return an allocation's GPUs. Raises :class:`GpuCellError` if they are not allocated."""
        self._st.give(alloc)


class MultiLevelCellAllocator(_AllocatorBase):
    """Best-fit aligned cells by node value (see the module docstring).

    ``nodes``: a node count (8 GPUs each) or per-node GPU counts (a partial node has its low GPUs only).
    """

    def __init__(self, nodes: int | Sequence[int]) -> None:
        self._st = _NodeState(nodes)
        self._memo: dict[tuple[int, tuple[int, ...]], tuple[int, tuple[tuple[int, int], ...]] | None] = {}

    def allocate(self, size: int) -> Allocation | None:
        """One aligned cell of ``size`` GPUs, or ``None`` if no node has one free. Raises for a bad size."""
        lvl = level_of(size)
        occ = self._st.occ
        best: tuple[int, int, int, int] | None = None  # (loss, free gpus after, node, index)
        for n, b in enumerate(occ):
            cell = _BEST[b][lvl]
            if cell is None:
                continue
            key = (_VALUE[b] - cell[1], 8 - bin(b).count("1"), n, cell[0])
            if best is None or key < best:
                best = key
        if best is None:
            return None
        return self._take(best[2], lvl, best[3])

    def allocate_at(self, node: int, size: int, index: int) -> Allocation:
        """Take the given aligned cell. Raises :class:`GpuCellError` if it is not entirely free."""
        lvl = level_of(size)
        if not 0 <= node < len(self._st.occ) or not 0 <= index < (8 >> lvl):
            raise GpuCellError(f"no cell {index} of size {size} on node {node}")
        if not _FREE[self._st.occ[node]][lvl] >> index & 1:
            raise GpuCellError(f"cell {index} of size {size} on node {node} is not free")
        return self._take(node, lvl, index)

    def _take(self, node: int, lvl: int, index: int) -> Allocation:
        self._st.take(node, cell_mask(lvl, index))
        size = 1 << lvl
        return Allocation(node, tuple(range(index * size, (index + 1) * size)), lvl, index)

    def allocate_many(self, sizes: Iterable[int], *, max_states: int = 4096) -> list[Allocation] | None:
        """Place a batch all-or-nothing, maximising the total node value left (DP over nodes × per-node
        placements). Returns allocations in the order of ``sizes``, or ``None`` (nothing taken) if the batch
        does not fit. Batches with more than ``max_states`` count vectors are placed one by one, largest first.
        """
        sizes = list(sizes)
        levels = [level_of(s) for s in sizes]
        counts = [0] * LEVELS
        for lvl in levels:
            counts[lvl] += 1
        if math.prod(c + 1 for c in counts) > max_states:
            return self._allocate_sequential(sizes)
        occ = self._st.occ
        memo: dict[tuple[int, tuple[int, ...]], tuple[float, tuple[tuple[int, tuple[int, ...]], ...]] | None] = {}

        def best(i: int, rem: tuple[int, ...]) -> tuple[float, tuple[tuple[int, tuple[int, ...]], ...]] | None:
            if i == len(occ):
                return (0.0, ()) if not any(rem) else None
            key = (i, rem)
            if key in memo:
                return memo[key]
            out = None
            for sub in _subvectors(rem):
                placed = self._node_place(occ[i], sub)
                if placed is None:
                    continue
                tail = best(i + 1, tuple(r - s for r, s in zip(rem, sub)))
                if tail is None:
                    continue
                val = placed[0] + tail[0]
                if out is None or val > out[0]:
                    out = (val, ((i, sub),) + tail[1])
            memo[key] = out
            return out

        plan = best(0, tuple(counts))
        if plan is None:
            return None
        # Materialise: per node, the cells chosen for each level, handed out to requests in order.
        cells: dict[int, list[tuple[int, int]]] = {lvl: [] for lvl in range(LEVELS)}
        for node, sub in plan[1]:
            if any(sub):
                placed = self._node_place(occ[node], sub)
                assert placed is not None
                for lvl, idx in placed[1]:
                    cells[lvl].append((node, idx))
        out: list[Allocation] = []
        for lvl in levels:
            node, idx = cells[lvl].pop(0)
            out.append(self._take(node, lvl, idx))
        return out

    def _allocate_sequential(self, sizes: list[int]) -> list[Allocation] | None:
        order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
        got: dict[int, Allocation] = {}
        for i in order:
            a = self.allocate(sizes[i])
            if a is None:
                for b in got.values():
                    self.free(b)
                return None
            got[i] = a
        return [got[i] for i in range(len(sizes))]

    def _node_place(self, b: int, sub: tuple[int, ...]) -> tuple[int, tuple[tuple[int, int], ...]] | None:
        """Best placement of ``sub[l]`` cells of each level on a node with bitmap ``b``: ``(value after,
        ((level, index), ...))`` or ``None``. Largest level first; exhaustive over cells, memoised."""
        key = (b, sub)
        if key in self._memo:
            return self._memo[key]
        if not any(sub):
            res: tuple[int, tuple[tuple[int, int], ...]] | None = (_VALUE[b], ())
        else:
            lvl = max(i for i, c in enumerate(sub) if c)
            rest = tuple(c - (i == lvl) for i, c in enumerate(sub))
            res = None
            free = _FREE[b][lvl]
            for j in range(8 >> lvl):
                if free >> j & 1:
                    sub_res = self._node_place(b | cell_mask(lvl, j), rest)
                    if sub_res is not None and (res is None or sub_res[0] > res[0]):
                        res = (sub_res[0], ((lvl, j),) + sub_res[1])
        self._memo[key] = res
        return res


def _subvectors(rem: tuple[int, ...]) -> Iterable[tuple[int, ...]]:
    if not rem:
        yield ()
        return
    for head in range(rem[0] + 1):
        for tail in _subvectors(rem[1:]):
            yield (head,) + tail


class FirstFitAllocator(_AllocatorBase):
    """Baseline: first free place in node/GPU order (``aligned`` cells, or any GPUs when ``aligned=False``)."""

    def __init__(self, nodes: int | Sequence[int], *, aligned: bool = True) -> None:
        self._st = _NodeState(nodes)
        self.aligned = aligned

    def allocate(self, size: int) -> Allocation | None:
        """The first fitting place, or ``None``. Raises :class:`GpuCellError` for a bad size."""
        lvl = level_of(size)
        for n, b in enumerate(self._st.occ):
            if self.aligned:
                free = _FREE[b][lvl]
                if free:
                    j = (free & -free).bit_length() - 1
                    self._st.take(n, cell_mask(lvl, j))
                    return Allocation(n, tuple(range(j * size, (j + 1) * size)), lvl, j)
            else:
                gpus = tuple(g for g in range(NODE_GPUS) if not b >> g & 1)[:size]
                if len(gpus) == size:
                    a = Allocation(n, gpus)
                    self._st.take(n, a.mask)
                    return a
        return None
