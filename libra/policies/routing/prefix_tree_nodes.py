"""The parts of C-MLFQ's causal prefix tree: one finished-trajectory record, the statistics one node keeps,
and a single tree of such nodes keyed by tool-state sequences.

:class:`FinishedTrajectory` is what the tree learns from; :class:`NodeStats` holds a node's visit count,
all-time running mean and window of remaining-length samples (with their P90); :class:`PrefixTree` is one
per-prompt tree or the global tree, with insertion, deepest-prefix search, node-by-node merge and its own
JSON form. :class:`NodeEstimate` is what a lookup answers. The forests, rebuild and file format are in
:mod:`libra.policies.routing.prefix_tree` and :mod:`libra.policies.routing.prefix_tree_io`.
No I/O, no clocks, no threads.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "FinishedTrajectory",
    "NodeEstimate",
    "NodeStats",
    "PrefixTree",
    "PrefixTreeError",
    "check_int",
    "percentile",
]


class PrefixTreeError(ValueError):
    """Bad input to the prefix tree: an inconsistent trajectory record, bad parameters or a bad saved file."""


def check_int(name: str, value: Any, minimum: int = 0) -> int:
    """``value`` if it is an integer (not a bool) ``>= minimum``; otherwise raises :class:`PrefixTreeError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PrefixTreeError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` with linear interpolation between order statistics.

    Raises :class:`PrefixTreeError` on an empty sequence or ``q`` outside [0, 1].
    """
    if not values:
        raise PrefixTreeError("percentile of an empty sequence")
    if not 0.0 <= q <= 1.0:
        raise PrefixTreeError(f"quantile must be in [0, 1], got {q}")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class FinishedTrajectory:
    """What the tree learns from one finished trajectory.

    ``states[i]`` is the key of the (i+1)-th tool return and ``positions[i]`` the number of tokens the
    trajectory had generated when that tool was called. Raises :class:`PrefixTreeError` unless the two have
    equal length, positions are non-decreasing and ``0 <= positions[i] <= total_output_tokens``.
    """

    prompt_id: str | None
    states: tuple[str, ...]
    positions: tuple[int, ...]
    total_output_tokens: int

    def __post_init__(self) -> None:
        check_int("total_output_tokens", self.total_output_tokens)
        if len(self.states) != len(self.positions):
            raise PrefixTreeError(
                f"trajectory has {len(self.states)} tool states but {len(self.positions)} positions"
            )
        prev = 0
        for i, (key, pos) in enumerate(zip(self.states, self.positions, strict=True)):
            if not isinstance(key, str) or not key:
                raise PrefixTreeError(f"states[{i}] must be a non-empty string, got {key!r}")
            check_int(f"positions[{i}]", pos)
            if pos < prev:
                raise PrefixTreeError(f"positions[{i}]={pos} is smaller than positions[{i - 1}]={prev}")
            if pos > self.total_output_tokens:
                raise PrefixTreeError(
                    f"positions[{i}]={pos} exceeds total_output_tokens={self.total_output_tokens}"
                )
            prev = pos

    def remaining(self) -> tuple[int, ...]:
        """Remaining generated tokens after each tool return: ``total_output_tokens - positions[i]``."""
        return tuple(self.total_output_tokens - p for p in self.positions)


class NodeStats:
    """Remaining-length statistics of one node. Mutated only by :meth:`add` and :meth:`merge`."""

    __slots__ = ("_p90", "count", "mean", "window")

    def __init__(self, window_size: int) -> None:
        self.count = 0
        self.mean = 0.0
        self.window: deque[int] = deque(maxlen=window_size)
        self._p90: float | None = None

    def add(self, remaining: int) -> None:
        """Record one remaining-length sample (running mean over all samples, window of the latest)."""
        self.count += 1
        self.mean += (remaining - self.mean) / self.count
        self.window.append(remaining)
        self._p90 = None

    @property
    def p90(self) -> float:
        """P90 over the window (0.0 for an empty window)."""
        if self._p90 is None:
            self._p90 = percentile(self.window, 0.9) if self.window else 0.0
        return self._p90

    def merge(self, other: NodeStats) -> None:
        """Combine with ``other``: count-weighted mean; ``other``'s samples appended after ours in the window."""
        total = self.count + other.count
        if total:
            self.mean = (self.count * self.mean + other.count * other.mean) / total
        self.count = total
        self.window.extend(other.window)
        self._p90 = None

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.count, "mean": self.mean, "window": list(self.window)}

    @classmethod
    def from_dict(cls, data: Any, window_size: int, where: str) -> NodeStats:
        """Parse saved stats; raises :class:`PrefixTreeError` naming ``where`` on a bad field."""
        if not isinstance(data, Mapping):
            raise PrefixTreeError(f"{where}: expected an object, got {type(data).__name__}")
        stats = cls(window_size)
        try:
            stats.count = check_int("n", data["n"])
            mean = data["mean"]
            window = data["window"]
        except KeyError as exc:
            raise PrefixTreeError(f"{where}: missing field {exc.args[0]!r}") from None
        except PrefixTreeError as exc:
            raise PrefixTreeError(f"{where}: {exc}") from None
        if isinstance(mean, bool) or not isinstance(mean, (int, float)) or mean < 0:
            raise PrefixTreeError(f"{where}.mean must be a non-negative number, got {mean!r}")
        if not isinstance(window, list):
            raise PrefixTreeError(f"{where}.window must be a list, got {type(window).__name__}")
        for i, v in enumerate(window):
            try:
                check_int(f"window[{i}]", v)
            except PrefixTreeError as exc:
                raise PrefixTreeError(f"{where}.{exc}") from None
        stats.mean = float(mean)
        stats.window.extend(window)
        return stats


class _Node:
    __slots__ = ("children", "stats")

    def __init__(self, window_size: int) -> None:
        self.stats = NodeStats(window_size)
        self.children: dict[str, _Node] = {}


@dataclass(frozen=True, slots=True)
class NodeEstimate:
    """A lookup result: the matched node's statistics, how deep the match went, and which forest answered."""

    count: int
    mean: float
    p90: float
    depth: int
    source: Literal["prompt", "global"]


class PrefixTree:
    """One tree of :class:`NodeStats` keyed by tool-state sequences (a per-prompt tree or the global tree)."""

    __slots__ = ("_nodes", "root", "window_size")

    def __init__(self, window_size: int = 200) -> None:
        self.window_size = check_int("window_size", window_size, 1)
        self.root = _Node(window_size)
        self._nodes = 1

    @property
    def node_count(self) -> int:
        """Number of nodes including the root."""
        return self._nodes

    def insert(self, traj: FinishedTrajectory) -> None:
        """Add one trajectory: the root gets the total, the node after i returns gets ``total - p_i``."""
        node = self.root
        node.stats.add(traj.total_output_tokens)
        for key, remaining in zip(traj.states, traj.remaining(), strict=True):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(self.window_size)
                self._nodes += 1
            child.stats.add(remaining)
            node = child

    def deepest(self, states: Sequence[str], min_visits: int = 1) -> tuple[NodeStats, int] | None:
        """Stats and depth of the deepest prefix of ``states`` whose node has ``>= min_visits`` visits.

        ``None`` when the root itself has fewer visits.
        """
        node = self.root
        if node.stats.count < min_visits:
            return None
        depth = 0
        for key in states:
            child = node.children.get(key)
            if child is None or child.stats.count < min_visits:
                break
            node = child
            depth += 1
        return node.stats, depth

    def merge(self, other: PrefixTree) -> None:
        """Merge ``other`` into this tree node by node (count-weighted means; see :meth:`NodeStats.merge`)."""
        stack = [(self.root, other.root)]
        while stack:
            mine, theirs = stack.pop()
            mine.stats.merge(theirs.stats)
            for key, child in theirs.children.items():
                target = mine.children.get(key)
                if target is None:
                    target = mine.children[key] = _Node(self.window_size)
                    self._nodes += 1
                stack.append((target, child))

    def to_dict(self) -> dict[str, Any]:
        def dump(node: _Node) -> dict[str, Any]:
            out = node.stats.to_dict()
            out["children"] = {k: dump(c) for k, c in node.children.items()}
            return out

        return dump(self.root)

    def iter_json(self) -> Iterator[str]:
        """``json.dumps(self.to_dict(), separators=(",", ":"))`` in pieces, without building the dicts (a
        big tree's dicts are enough objects to trigger full garbage collections)."""
        dumps = json.dumps
        stack: list[tuple[Iterator[tuple[str, _Node]], bool]] = []
        node: _Node | None = self.root
        while True:
            if node is not None:
                st = node.stats
                yield (f'{{"n":{st.count},"mean":{dumps(st.mean)},"window":[{",".join(map(str, st.window))}],'
                       '"children":{')
                stack.append((iter(node.children.items()), True))
                node = None
            if not stack:
                return
            it, first = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                yield "}}"
                continue
            stack[-1] = (it, False)
            yield ("" if first else ",") + dumps(nxt[0]) + ":"
            node = nxt[1]

    @classmethod
    def from_dict(cls, data: Any, window_size: int, where: str) -> PrefixTree:
        """Parse a saved tree; raises :class:`PrefixTreeError` naming the bad node's path."""
        tree = cls(window_size)

        def load(node_data: Any, path: str) -> _Node:
            node = _Node(window_size)
            node.stats = NodeStats.from_dict(node_data, window_size, path)
            children = node_data.get("children", {})
            if not isinstance(children, Mapping):
                raise PrefixTreeError(f"{path}.children must be an object")
            for key, child in children.items():
                if not key:
                    raise PrefixTreeError(f"{path}.children has an empty key")
                node.children[key] = load(child, f"{path}.children[{key!r}]")
                tree._nodes += 1
            return node

        tree.root = load(data, where)
        return tree
