"""Causal prefix tree of C-MLFQ: remaining-length statistics keyed by tool-return state sequences.

docs/papers.md §1.4.2. A node is reached by an ordered sequence of tool-return state keys
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
- **Persistence**: :meth:`to_dict`/:meth:`from_dict` (and :meth:`save`/:meth:`load`) use versioned JSON
  (the format is in :mod:`libra.policies.routing.prefix_tree_io`); :meth:`merge` combines trees from several
  ranks by count-weighted mean, concatenating windows and histories.

Memory is bounded by ``max_prompts`` trees, ``window_size`` samples per node, and ``history_size`` records;
the global tree only holds sequences seen since the last rebuild.
The node statistics and the single tree are in :mod:`libra.policies.routing.prefix_tree_nodes`; this module
re-exports them, so ``from libra.policies.routing.prefix_tree import ...`` gives every public name.
No I/O except the explicit :meth:`save`/:meth:`load`; no clocks, no threads.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from libra.policies.routing.prefix_tree_io import (
    FORMAT_NAME,
    FORMAT_VERSION,
    Snapshot,
    TreeState,
    check_header,
    dump_state,
    iter_state_json,
    parse_body,
    write_atomic,
)
from libra.policies.routing.prefix_tree_nodes import (
    FinishedTrajectory,
    NodeEstimate,
    NodeStats,
    PrefixTree,
    PrefixTreeError,
    check_int,
    percentile,
)

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
        self.window_size = check_int("window_size", window_size, 1)
        self.max_prompts = check_int("max_prompts", max_prompts, 0)
        self.history_size = check_int("history_size", history_size, 0)
        # 0 disables periodic rebuilds.
        self.rebuild_interval = check_int("rebuild_interval", rebuild_interval, 0)
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
        check_int("min_visits", min_visits, 1)
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
        check_int("step", step)
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
        return dump_state(self._state())

    def iter_json(self) -> Iterator[str]:
        """:meth:`to_dict` as compact JSON text in pieces (what :meth:`save` writes), without building it."""
        return iter_state_json(self._state())

    def _state(self) -> TreeState:
        """What a snapshot reads: the parameters, the global tree, the prompt trees and history (copied lists),
        the last rebuild."""
        params = {"window_size": self.window_size, "max_prompts": self.max_prompts,
                  "history_size": self.history_size, "rebuild_interval": self.rebuild_interval}
        return TreeState(params, self.global_tree, list(self._prompts.items()), list(self._history),
                         self._last_rebuild_step)

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
        return Snapshot(self._state())

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

    @classmethod
    def from_dict(cls, data: Any, **overrides: Any) -> CausalPrefixTree:
        """Rebuild from :meth:`to_dict` output; ``overrides`` replace saved parameters.

        Raises :class:`PrefixTreeError` naming the field for a wrong format, an unsupported version or bad content.
        """
        tree = cls(**{**check_header(data), **overrides})
        body = parse_body(data, tree.window_size)
        tree._last_rebuild_step = body.last_rebuild_step
        tree.global_tree = body.global_tree
        tree._prompts.update(body.prompts)
        while len(tree._prompts) > tree.max_prompts:
            tree._prompts.popitem(last=False)
        tree._history.extend(body.history)
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
