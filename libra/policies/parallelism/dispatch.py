"""Layout-aware training-data dispatch (EARL, arXiv 2510.05943 §3.2.2): which trainer rank gets which
trajectories, decided once by the driver, so the bytes can go straight from the producer to each rank.

Pure functions of the trajectories' token lengths and the data-parallel world size; no I/O, no clocks.

Objective: minimise the largest per-rank token count (the step waits for the slowest rank, and a
rank's forward/backward cost is close to linear in its tokens). This is makespan scheduling on
identical machines (NP-hard), so:

- ``"lpt"`` (default): longest-processing-time-first greedy (each trajectory, longest first, goes to
  the rank with the fewest tokens so far; ties to the lower rank), then a local search that moves one
  trajectory off the most loaded rank, or swaps one with another rank's shorter one, while that lowers
  the pair's maximum (each accepted move strictly lowers the sum of squared loads, so it terminates).
  The same search is also run from the two naive splits below and the best result is kept, so the
  plan is **never worse than either naive split** and within Graham's bound ``(4/3 - 1/(3·world_size)) · OPT``
  (tested against brute force on small instances).
- ``"round_robin"``: trajectory ``i`` to rank ``i % world_size`` (the naive baseline; what a
  centralised scatter does).
- ``"contiguous"``: consecutive blocks of (nearly) equal counts (another naive baseline).

Then, per rank, **sequence-length-aware micro-batch packing** (:func:`pack_micro_batches`): sorted
longest first and cut into runs whose padded size (members × longest member) stays within
``micro_batch_tokens``, with the fewest runs and, among those, the least padding (sorting keeps
padding small because neighbours have similar lengths).

Contracts: every index in ``range(len(lengths))`` is assigned to exactly one rank; indices inside a
rank are ascending; micro-batches index into that rank's list and cover it exactly once; every
micro-batch's padded size is ``<= micro_batch_tokens`` unless it is a single longer sequence. The
result is deterministic (every caller computes the same plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "STRATEGIES",
    "DispatchPlan",
    "contiguous_split",
    "imbalance",
    "lpt_split",
    "pack_micro_batches",
    "plan_dispatch",
    "refine",
    "round_robin_split",
]

STRATEGIES = ("lpt", "round_robin", "contiguous")


def imbalance(loads: Sequence[int | float]) -> float:
    """``max / mean`` of per-rank loads: 1.0 is perfect balance; 1.0 for all-zero loads."""
    if not loads:
        raise ValueError("imbalance of no ranks")
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    """Who trains on what. ``assignment[r]``: trajectory indices for rank ``r`` (ascending);
    ``micro_batches[r]``: micro-batches as positions into ``assignment[r]``; ``rank_tokens[r]``: its real
    tokens; ``rank_padded_tokens[r]``: tokens after padding each micro-batch to its longest member."""

    strategy: str
    assignment: tuple[tuple[int, ...], ...]
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    rank_tokens: tuple[int, ...]
    rank_padded_tokens: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.assignment)

    @property
    def max_tokens(self) -> int:
        return max(self.rank_tokens)

    @property
    def imbalance(self) -> float:
        """Max over mean of the per-rank real token counts."""
        return imbalance(self.rank_tokens)



def _check(lengths: Sequence[int], world_size: int) -> list[int]:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    out = []
    for i, n in enumerate(lengths):
        if type(n) is not int or n < 0:
            raise ValueError(f"lengths[{i}] must be a non-negative int, got {n!r}")
        out.append(n)
    return out


def round_robin_split(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """The naive baseline: index ``i`` to rank ``i % world_size``."""
    n = len(_check(lengths, world_size))
    return [list(range(r, n, world_size)) for r in range(world_size)]


def contiguous_split(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """The other naive baseline: consecutive blocks; the first ``n % world_size`` ranks get one extra."""
    n = len(_check(lengths, world_size))
    base, extra = divmod(n, world_size)
    out, pos = [], 0
    for r in range(world_size):
        size = base + (1 if r < extra else 0)
        out.append(list(range(pos, pos + size)))
        pos += size
    return out


def lpt_split(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Longest first, each to the currently least-loaded rank (ties: lower rank; equal lengths: lower index)."""
    ls = _check(lengths, world_size)
    groups: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for i in sorted(range(len(ls)), key=lambda i: (-ls[i], i)):
        r = min(range(world_size), key=lambda k: (loads[k], k))
        groups[r].append(i)
        loads[r] += ls[i]
    return [sorted(g) for g in groups]


def refine(lengths: Sequence[int], groups: Sequence[Sequence[int]], max_rounds: int | None = None) -> list[list[int]]:
    """Local search on a split (see the module docstring): while some move of one trajectory off the most
    loaded rank, or swap with a shorter one elsewhere, lowers that pair's maximum, apply the best one.
    Returns a new split (indices ascending per rank); never raises the maximum load."""
    ls = list(lengths)
    gs = [list(g) for g in groups]
    loads = [sum(ls[i] for i in g) for g in gs]
    rounds = max_rounds if max_rounds is not None else 4 * (len(ls) + 1) * max(1, len(gs))
    for _ in range(rounds):
        top = max(range(len(gs)), key=lambda k: (loads[k], -k))
        best: tuple[int, int, int | None, int] | None = None  # (new pair max, other rank, moved pos, swapped pos)
        for r in range(len(gs)):
            if r == top:
                continue
            for a_pos, a in enumerate(gs[top]):
                # move a to r
                pair = max(loads[top] - ls[a], loads[r] + ls[a])
                if pair < loads[top] and (best is None or pair < best[0]):
                    best = (pair, r, a_pos, -1)
                for b_pos, b in enumerate(gs[r]):
                    d = ls[a] - ls[b]
                    if d <= 0:
                        continue
                    pair = max(loads[top] - d, loads[r] + d)
                    if pair < loads[top] and (best is None or pair < best[0]):
                        best = (pair, r, a_pos, b_pos)
        if best is None:
            break
        _, r, a_pos, b_pos = best
        assert a_pos is not None
        a = gs[top].pop(a_pos)
        loads[top] -= ls[a]
        if b_pos >= 0:
            b = gs[r].pop(b_pos)
            gs[top].append(b)
            loads[top] += ls[b]
            loads[r] -= ls[b]
        gs[r].append(a)
        loads[r] += ls[a]
    return [sorted(g) for g in gs]


def pack_micro_batches(lengths: Sequence[int], max_tokens: int | None) -> list[list[int]]:
    """Micro-batches (positions into ``lengths``) for one rank, length aware.

    Sequences are sorted longest first and cut into consecutive runs so that every run's padded size
    (members × longest member) is ``<= max_tokens`` (a longer single sequence gets its own run). Among
    all such cuts, a dynamic programme picks the fewest micro-batches (each is a forward/backward pass)
    and, among those, the fewest padded tokens. ``None``: one micro-batch. Positions inside a
    micro-batch are ascending; micro-batches come longest first; empty input gives ``[]``.
    """
    n = len(lengths)
    if n == 0:
        return []
    if max_tokens is None:
        return [list(range(n))]
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    ls = [lengths[i] for i in order]
    inf = (n + 1, 0)
    best: list[tuple[int, int]] = [(0, 0)] + [inf] * n  # best[j]: (micro-batches, padded) for the first j
    cut = [0] * (n + 1)
    for i in range(n):  # a run starting at sorted position i is padded to ls[i]
        if best[i] == inf:
            continue
        j = i + 1
        while j <= n and (j - i == 1 or (j - i) * ls[i] <= max_tokens):
            cand = (best[i][0] + 1, best[i][1] + (j - i) * ls[i])
            if cand < best[j]:
                best[j], cut[j] = cand, i
            j += 1
    out: list[list[int]] = []
    j = n
    while j > 0:
        i = cut[j]
        out.append(sorted(order[i:j]))
        j = i
    return out[::-1]


def _sq(lengths: Sequence[int], groups: Sequence[Sequence[int]]) -> tuple[int, int]:
    loads = [sum(lengths[i] for i in g) for g in groups]
    return max(loads), sum(x * x for x in loads)


def plan_dispatch(lengths: Sequence[int], world_size: int, *, micro_batch_tokens: int | None = None,
                  strategy: str = "lpt") -> DispatchPlan:
    """The dispatch plan for trajectories of ``lengths`` tokens over ``world_size`` ranks (module docstring).

    Raises ``ValueError`` for an unknown ``strategy`` (known: :data:`STRATEGIES`), ``world_size < 1`` or a
    negative / non-int length.
    """
    ls = _check(lengths, world_size)
    if strategy == "lpt":
        groups = refine(ls, lpt_split(ls, world_size))
        for naive in (round_robin_split(ls, world_size), contiguous_split(ls, world_size)):
            if _sq(ls, naive)[0] < _sq(ls, groups)[0]:  # rare (e.g. Graham's worst cases): search from there too
                groups = min(groups, refine(ls, naive), key=lambda g: _sq(ls, g))  # ties keep LPT's
    elif strategy == "round_robin":
        groups = round_robin_split(ls, world_size)
    elif strategy == "contiguous":
        groups = contiguous_split(ls, world_size)
    else:
        raise ValueError(f"unknown dispatch strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
    micro = [pack_micro_batches([ls[i] for i in g], micro_batch_tokens) for g in groups]
    padded = [sum(len(mb) * max(ls[g[p]] for p in mb) for mb in mbs) for g, mbs in zip(groups, micro)]
    return DispatchPlan(
        strategy=strategy,
        assignment=tuple(tuple(g) for g in groups),
        micro_batches=tuple(tuple(tuple(mb) for mb in mbs) for mbs in micro),
        rank_tokens=tuple(sum(ls[i] for i in g) for g in groups),
        rank_padded_tokens=tuple(padded),
    )
