"""Causal prefix tree of C-MLFQ: remaining-length statistics keyed by tool-return state sequences.

Research-notes §1.4.2. A node is reached by an ordered sequence of tool-return state keys
(:mod:`libra.policies.routing.tool_state`) and stores the distribution of the **remaining** generated length from
that point to the end of the trajectory: visit count, an all-time running mean, the last ``window_size``
(default 200) samples and the P90 over that window.

:class:`CausalPrefixTree` holds two forests:

- a per-prompt tree for each recently seen prompt id (LRU-capped at ``max_prompts``);
- a global tree keyed by the tool-state sequence alone (prompt ids are mostly unique online, tool states recur).

Contracts:

- **Insertion** happens once, at trajectory end (:meth:`CausalPrefixTree.record`): the root of both trees gets
  ``total_output_tokens``; for the i-th tool return at generated-token position ``p_i`` the node reached after
  i returns gets ``total_output_tokens - p_i``.
- **Lookup** (:meth:`CausalPrefixTree.lookup`) walks the prompt's tree (when the prompt is known) and the global
  tree to the deepest prefix whose node has at least ``min_visits`` visits, and answers from the *deeper* match,
  the prompt's tree on a tie. "Fall back to parent statistics" applies when the tool-state node is unseen: a
  prompt tree that lacks the node does not override a global node that has it, since the tool-return states are
  the causal signal and a prompt's tree mostly holds the group-mates that finished first, i.e. the short ones
  (docs/papers.md §1.4.1-§1.4.2). It returns ``None`` when neither root qualifies.
- **Drift**: every ``rebuild_interval`` steps both forests are rebuilt from the last ``history_size`` (default
  5000) finished trajectories (:meth:`CausalPrefixTree.maybe_rebuild`).
- **Persistence**: :meth:`to_dict`/:meth:`from_dict` (and :meth:`save`/:meth:`load`) use versioned JSON;
  :meth:`merge` combines trees from several ranks by count-weighted mean, concatenating windows and histories.

Memory is bounded by ``max_prompts`` trees, ``window_size`` samples per node, and ``history_size`` records;
the global tree only holds sequences seen since the last rebuild.
No I/O except the explicit :meth:`save`/:meth:`load`; no clocks, no threads.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "CausalPrefixTree",
    "FinishedTrajectory",
    "NodeEstimate",
    "NodeStats",
    "PrefixTree",
    "PrefixTreeError",
    "Snapshot",
    "percentile",
    "write_atomic",
]

FORMAT_NAME: Final = "libra-cmlfq-prefix-tree"
FORMAT_VERSION: Final = 1


class PrefixTreeError(ValueError):
    """Bad input to the prefix tree: an inconsistent trajectory record, bad parameters or a bad saved file."""


def _check_int(name: str, value: Any, minimum: int = 0) -> int:
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
        _check_int("total_output_tokens", self.total_output_tokens)
        if len(self.states) != len(self.positions):
            raise PrefixTreeError(
                f"trajectory has {len(self.states)} tool states but {len(self.positions)} positions"
            )
        prev = 0
        for i, (key, pos) in enumerate(zip(self.states, self.positions, strict=True)):
            if not isinstance(key, str) or not key:
                raise PrefixTreeError(f"states[{i}] must be a non-empty string, got {key!r}")
            _check_int(f"positions[{i}]", pos)
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
            stats.count = _check_int("n", data["n"])
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
                _check_int(f"window[{i}]", v)
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
        self.window_size = _check_int("window_size", window_size, 1)
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


class CausalPrefixTree:
    """Per-prompt forest plus global tree, with history-based rebuild, persistence and merge.

    Mutated only by :meth:`record`, :meth:`rebuild`/:meth:`maybe_rebuild`, :meth:`merge` and LRU reordering in
    :meth:`lookup`. Raises :class:`PrefixTreeError` for bad parameters. :meth:`freeze` / :meth:`thaw` let
    another thread serialise a consistent snapshot while the owner keeps routing and learning.
    """

    def __init__(
        self,
        *,
        window_size: int = 200,
        max_prompts: int = 10_000,
        history_size: int = 5000,
        rebuild_interval: int = 50,
    ) -> None:
        self.window_size = _check_int("window_size", window_size, 1)
        self.max_prompts = _check_int("max_prompts", max_prompts, 0)
        self.history_size = _check_int("history_size", history_size, 0)
        # 0 disables periodic rebuilds.
        self.rebuild_interval = _check_int("rebuild_interval", rebuild_interval, 0)
        self.global_tree = PrefixTree(window_size)
        self._prompts: OrderedDict[str, PrefixTree] = OrderedDict()
        self._history: deque[FinishedTrajectory] = deque(maxlen=history_size)
        self._last_rebuild_step = 0
        self.rebuilds = 0
        self._deferred: list[FinishedTrajectory] | None = None  # records held back while frozen

    # ----------------------------------------------------------------------------------------- queries

    @property
    def num_prompts(self) -> int:
        return len(self._prompts)

    @property
    def history(self) -> tuple[FinishedTrajectory, ...]:
        """The finished trajectories a rebuild would use, oldest first."""
        return tuple(self._history)

    def knows_prompt(self, prompt_id: str | None) -> bool:
        return prompt_id is not None and prompt_id in self._prompts

    def prompt_tree(self, prompt_id: str) -> PrefixTree | None:
        return self._prompts.get(prompt_id)

    def lookup(self, prompt_id: str | None, states: Sequence[str], *, min_visits: int = 1) -> NodeEstimate | None:
        """Estimate the remaining length after ``states`` (see the module docstring for the fallback rule).

        ``None`` means no statistics: the consulted tree has fewer than ``min_visits`` samples at its root.
        """
        found = self.lookup_window(prompt_id, states, min_visits=min_visits)
        return None if found is None else found[0]

    def lookup_window(self, prompt_id: str | None, states: Sequence[str], *,
                      min_visits: int = 1) -> tuple[NodeEstimate, tuple[int, ...]] | None:
        """:meth:`lookup` plus the matched node's window of remaining-length samples (oldest first), for
        policies that use the whole distribution (``cmlfq_cost``). Same node, same fallback rule."""
        _check_int("min_visits", min_visits, 1)
        found = self.global_tree.deepest(states, min_visits)
        source: Literal["prompt", "global"] = "global"
        if prompt_id is not None and prompt_id in self._prompts:
            self._prompts.move_to_end(prompt_id)
            mine = self._prompts[prompt_id].deepest(states, min_visits)
            if mine is not None and (found is None or mine[1] >= found[1]):
                found, source = mine, "prompt"
        if found is None:
            return None
        stats, depth = found
        est = NodeEstimate(count=stats.count, mean=stats.mean, p90=stats.p90, depth=depth, source=source)
        return est, tuple(stats.window)

    # ----------------------------------------------------------------------------------------- updates

    def record(self, traj: FinishedTrajectory) -> None:
        """Learn from one finished trajectory (both trees) and append it to the rebuild history. While the
        tree is frozen (:meth:`freeze`) the record is held back and applied by :meth:`thaw`."""
        if self._deferred is not None:
            self._deferred.append(traj)
            return
        self._insert(traj)
        self._history.append(traj)

    def _insert(self, traj: FinishedTrajectory) -> None:
        self.global_tree.insert(traj)
        if traj.prompt_id is None or self.max_prompts == 0:
            return
        tree = self._prompts.get(traj.prompt_id)
        if tree is None:
            tree = self._prompts[traj.prompt_id] = PrefixTree(self.window_size)
        else:
            self._prompts.move_to_end(traj.prompt_id)
        tree.insert(traj)
        while len(self._prompts) > self.max_prompts:
            self._prompts.popitem(last=False)

    def rebuild(self) -> None:
        """Drop both forests and re-insert the retained history (the last ``history_size`` trajectories)."""
        self.global_tree = PrefixTree(self.window_size)
        self._prompts = OrderedDict()
        for traj in self._history:
            self._insert(traj)
        self.rebuilds += 1

    def maybe_rebuild(self, step: int) -> bool:
        """Rebuild when ``step`` is at least ``rebuild_interval`` past the last rebuild; True if it rebuilt."""
        _check_int("step", step)
        if self.rebuild_interval == 0 or step - self._last_rebuild_step < self.rebuild_interval:
            return False
        self._last_rebuild_step = step
        self.rebuild()
        return True

    def merge(self, other: CausalPrefixTree) -> None:
        """Fold ``other`` (e.g. another rank's tree) into this one.

        Node means combine count-weighted, windows concatenate (ours first, keeping the newest
        ``window_size``), prompts absent here are added, histories concatenate (keeping the newest
        ``history_size``). ``other`` is not modified. Raises :class:`PrefixTreeError` while frozen.
        """
        if self._deferred is not None:
            raise PrefixTreeError("cannot merge into a prefix tree frozen for a snapshot")
        self.global_tree.merge(other.global_tree)
        for prompt_id, tree in other._prompts.items():
            mine = self._prompts.get(prompt_id)
            if mine is None:
                mine = self._prompts[prompt_id] = PrefixTree(self.window_size)
            mine.merge(tree)
        while len(self._prompts) > self.max_prompts:
            self._prompts.popitem(last=False)
        self._history.extend(other._history)

    @classmethod
    def from_trajectories(cls, trajs: Iterable[FinishedTrajectory], **params: Any) -> CausalPrefixTree:
        """Bootstrap a tree from logged trajectories (the offline profiler path)."""
        tree = cls(**params)
        for traj in trajs:
            tree.record(traj)
        return tree

    # ----------------------------------------------------------------------------------------- persistence

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready, versioned snapshot (trees, parameters and rebuild history)."""
        return self._dump(*self._state())

    def iter_json(self) -> Iterator[str]:
        """:meth:`to_dict` as compact JSON text in pieces (what :meth:`save` writes), without building it."""
        return self._iter_json(*self._state())

    def _state(self) -> tuple[PrefixTree, list[tuple[str, PrefixTree]], list[FinishedTrajectory], int]:
        """What a snapshot reads: the global tree, the prompt trees and history (copied lists), the last rebuild."""
        return self.global_tree, list(self._prompts.items()), list(self._history), self._last_rebuild_step

    def freeze(self) -> Snapshot:
        """Begin a snapshot that another thread may build while this one keeps using the tree.

        Until :meth:`thaw`, :meth:`record` holds trajectories back, so the nodes the snapshot reads do not
        change; lookups go on (they only reorder the prompt LRU, copied here), and a rebuild replaces the
        trees rather than changing the frozen ones. Returns the :class:`Snapshot` of the state at this
        call: read it from any one thread, then call :meth:`thaw` on the owning thread. Costs a copy of the
        prompt and history lists here (no tree walk). Raises :class:`PrefixTreeError` if the tree is
        already frozen."""
        if self._deferred is not None:
            raise PrefixTreeError("prefix tree is already frozen for a snapshot")
        self._deferred = []
        return Snapshot(self, self._state())

    def thaw(self) -> int:
        """End a snapshot: apply the records held back since :meth:`freeze` (in order); returns how many.
        A tree that is not frozen returns 0."""
        held, self._deferred = self._deferred or [], None
        for traj in held:
            self.record(traj)
        return len(held)

    @property
    def frozen(self) -> bool:
        """Whether a snapshot is open (:meth:`freeze` without :meth:`thaw`)."""
        return self._deferred is not None

    def _params(self) -> dict[str, int]:
        return {"window_size": self.window_size, "max_prompts": self.max_prompts,
                "history_size": self.history_size, "rebuild_interval": self.rebuild_interval}

    @staticmethod
    def _record(t: FinishedTrajectory) -> dict[str, Any]:
        return {"prompt_id": t.prompt_id, "states": list(t.states), "positions": list(t.positions),
                "total": t.total_output_tokens}

    def _dump(self, glob: PrefixTree, prompts: list[tuple[str, PrefixTree]], history: list[FinishedTrajectory],
              last_rebuild: int) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "params": self._params(),
            "last_rebuild_step": last_rebuild,
            "global": glob.to_dict(),
            "prompts": {pid: tree.to_dict() for pid, tree in prompts},
            "history": [self._record(t) for t in history],
        }

    def _iter_json(self, glob: PrefixTree, prompts: list[tuple[str, PrefixTree]], history: list[FinishedTrajectory],
                   last_rebuild: int) -> Iterator[str]:
        """``json.dumps(self._dump(...), separators=(",", ":"))`` in pieces."""
        dumps = json.dumps
        yield (f'{{"format":{dumps(FORMAT_NAME)},"version":{FORMAT_VERSION},'
               f'"params":{dumps(self._params(), separators=(",", ":"))},"last_rebuild_step":{last_rebuild},"global":')
        yield from glob.iter_json()
        yield ',"prompts":{'
        for i, (pid, tree) in enumerate(prompts):
            yield ("," if i else "") + dumps(pid) + ":"
            yield from tree.iter_json()
        yield '},"history":['
        for i, t in enumerate(history):
            yield ("," if i else "") + dumps(self._record(t), separators=(",", ":"))
        yield "]}"

    @classmethod
    def from_dict(cls, data: Any, **overrides: Any) -> CausalPrefixTree:
        """Rebuild from :meth:`to_dict` output; ``overrides`` replace saved parameters.

        Raises :class:`PrefixTreeError` naming the field for a wrong format, an unsupported version or bad content.
        """
        if not isinstance(data, Mapping):
            raise PrefixTreeError(f"prefix tree file must hold a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT_NAME:
            raise PrefixTreeError(f"not a prefix tree file: format={data.get('format')!r}, expected {FORMAT_NAME!r}")
        if data.get("version") != FORMAT_VERSION:
            raise PrefixTreeError(
                f"unsupported prefix tree version {data.get('version')!r} (this build reads {FORMAT_VERSION})"
            )
        params = data.get("params", {})
        if not isinstance(params, Mapping):
            raise PrefixTreeError("params must be an object")
        known = {"window_size", "max_prompts", "history_size", "rebuild_interval"}
        tree = cls(**{**{k: v for k, v in params.items() if k in known}, **overrides})
        tree._last_rebuild_step = _check_int("last_rebuild_step", data.get("last_rebuild_step", 0))
        if "global" not in data:
            raise PrefixTreeError("missing field 'global'")
        tree.global_tree = PrefixTree.from_dict(data["global"], tree.window_size, "global")
        prompts = data.get("prompts", {})
        if not isinstance(prompts, Mapping):
            raise PrefixTreeError("prompts must be an object")
        for pid, tdata in prompts.items():
            tree._prompts[pid] = PrefixTree.from_dict(tdata, tree.window_size, f"prompts[{pid!r}]")
        while len(tree._prompts) > tree.max_prompts:
            tree._prompts.popitem(last=False)
        history = data.get("history", [])
        if not isinstance(history, list):
            raise PrefixTreeError("history must be a list")
        for i, rec in enumerate(history):
            try:
                tree._history.append(
                    FinishedTrajectory(rec["prompt_id"], tuple(rec["states"]), tuple(rec["positions"]), rec["total"])
                )
            except (KeyError, TypeError) as exc:
                raise PrefixTreeError(f"history[{i}]: bad record ({exc!r})") from None
            except PrefixTreeError as exc:
                raise PrefixTreeError(f"history[{i}]: {exc}") from None
        return tree

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_dict` as JSON (:meth:`iter_json`), atomically (:func:`write_atomic`)."""
        write_atomic(path, self.iter_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str], **overrides: Any) -> CausalPrefixTree:
        """Read a file written by :meth:`save`. Raises :class:`PrefixTreeError` (naming the path) on bad content."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise PrefixTreeError(f"{path}: not valid JSON ({exc})") from None
        try:
            return cls.from_dict(data, **overrides)
        except PrefixTreeError as exc:
            raise PrefixTreeError(f"{path}: {exc}") from None


def write_atomic(path: str | os.PathLike[str], chunks: Iterable[str]) -> int:
    """Write the text ``chunks`` to ``PATH.tmp``, fsync it and rename it over ``path``; returns the bytes
    written. A reader sees the old file or the new one, never a partial one. Raises ``OSError``."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(chunks)
        fh.flush()
        os.fsync(fh.fileno())
        size = fh.tell()
    os.replace(tmp, target)
    return size


class Snapshot:
    """The state of a :class:`CausalPrefixTree` at :meth:`~CausalPrefixTree.freeze`; readable from another
    thread until the owner calls :meth:`~CausalPrefixTree.thaw`."""

    __slots__ = ("_args", "_tree")

    def __init__(self, tree: CausalPrefixTree, args: tuple[Any, ...]) -> None:
        self._tree, self._args = tree, args

    def to_dict(self) -> dict[str, Any]:
        """What :meth:`CausalPrefixTree.to_dict` returned at the freeze."""
        return self._tree._dump(*self._args)

    def iter_json(self) -> Iterator[str]:
        """The same as compact JSON text in pieces, without building the dicts."""
        return self._tree._iter_json(*self._args)
