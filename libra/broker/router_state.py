"""Keeps the rollout router's learned state on disk so a broker restart does not start C-MLFQ cold.

C-MLFQ (and ``cmlfq_cost``) learn a causal prefix tree from every finished trajectory
(docs/papers.md §1.4.2: "trees are persisted per rank"). Without this file a restarted broker routes
every trajectory to the smallest bucket until the tree has relearned. ``python -m libra.broker
--router-state FILE`` turns it on:

- **At start** (:meth:`RouterStateFile.apply`): if ``FILE`` exists and the configured router learns a
  tree, the broker's ``router_params["tree"]`` becomes the saved tree, which takes precedence over a
  ``tree`` bootstrap file in the config (the saved state grew from it). A file that cannot be read or is
  not a prefix tree is moved aside to ``FILE.corrupt-<unix time>`` with an error log, and the broker
  starts with an empty tree rather than refusing to start.
- **While serving** (:meth:`RouterStateFile.maybe_save`, called from the broker's tick): every
  ``interval_s`` seconds, if trajectories finished since the last save, the tree is frozen on the loop
  thread (``CausalPrefixTree.freeze``: a copy of its prompt and history lists, about a millisecond) and one
  background thread streams the snapshot as JSON (``Snapshot.iter_json``: no dict graph, so no full
  garbage collections holding the GIL) to ``FILE.tmp``, then fsync, rename over ``FILE``. Walking a large
  tree takes long (0.6 s for 20K trajectories and 1,280 prompts), so it must not run on the loop. Routing goes on meanwhile; trajectories that finish are held back and learned at the next tick
  after the write (``thaw``). A save still running when the next one is due is not doubled up; that
  interval is skipped.
- **At shutdown** (:meth:`RouterStateFile.close`): the background write is joined and a last snapshot is
  written synchronously.

A router without a learned tree (``round_robin``, ``least_loaded``, ...) leaves the file alone. Write
errors are logged (``router_state_save_failed``) and never stop the broker.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from libra.logging import get_logger
from libra.policies.routing.prefix_tree import CausalPrefixTree, PrefixTreeError, write_atomic
from libra.policies.routing.baselines import router_accepts

from .config import BrokerConfig

__all__ = ["RouterStateFile", "learned_tree"]

log = get_logger("libra.broker")


def learned_tree(router: Any) -> CausalPrefixTree | None:
    """The prefix tree a router learns into, or ``None`` for a router that learns none."""
    tree = getattr(router, "tree", None)
    return tree if isinstance(tree, CausalPrefixTree) else None


class RouterStateFile:
    """Load, periodically save and finally save one router-state file (see the module docstring).

    Raises ``ValueError`` for a non-positive ``interval_s``. Not thread-safe: call from the broker loop.
    """

    def __init__(self, path: str | os.PathLike[str], interval_s: float = 60.0) -> None:
        if not (interval_s > 0):
            raise ValueError(f"router state interval must be > 0 seconds, got {interval_s!r}")
        self.path = Path(path)
        self.interval_s = float(interval_s)
        self.saves = 0
        self.failures = 0
        self._next_at: float | None = None
        self._saved_mark: tuple[int, int] | None = None
        self._writer: threading.Thread | None = None
        self._frozen: CausalPrefixTree | None = None  # the tree a background save is reading

    # ------------------------------------------------------------------------------------------ start

    def apply(self, config: BrokerConfig) -> BrokerConfig:
        """``config`` with the saved tree as ``router_params["tree"]`` when the file holds one and the router
        learns a tree; otherwise ``config`` unchanged (an unreadable file is moved aside first)."""
        if not router_accepts(config.router, "tree"):
            log.info("router_state_unused", path=str(self.path), router=config.router)
            return config
        if not self.path.exists():
            log.info("router_state_new", path=str(self.path))
            return config
        try:
            tree = CausalPrefixTree.load(self.path)
        except (OSError, UnicodeDecodeError, PrefixTreeError) as exc:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            try:
                os.replace(self.path, aside)
            except OSError as move_exc:
                log.error("router_state_unreadable", path=str(self.path), error=str(exc), moved_aside=None,
                          move_error=str(move_exc))
            else:
                log.error("router_state_unreadable", path=str(self.path), error=str(exc), moved_aside=str(aside))
            return config
        log.info("router_state_loaded", path=str(self.path), prompts=tree.num_prompts,
                 global_nodes=tree.global_tree.node_count, history=len(tree.history))
        self._saved_mark = None
        return dataclasses.replace(config, router_params={**config.router_params, "tree": tree})

    # ------------------------------------------------------------------------------------------ saving

    def maybe_save(self, router: Any, now: float) -> bool:
        """Start a background save if ``interval_s`` has passed since the last one and the router's tree
        changed since the last save. True if a save started. Also thaws the tree once the previous
        background save is done."""
        writing = self._writer is not None and self._writer.is_alive()
        if not writing:
            self._thaw()
        if self._next_at is None:
            self._next_at = now + self.interval_s
            return False
        if now < self._next_at:
            return False
        self._next_at = now + self.interval_s
        if writing:
            return False
        tree = self._changed(router)
        if tree is None:
            return False
        snap = tree.freeze()
        self._frozen = tree
        self._writer = threading.Thread(target=lambda: self._write(snap.iter_json()), name="router-state",
                                        daemon=True)
        self._writer.start()
        return True

    def close(self, router: Any) -> None:
        """Join a running save, thaw the tree, and write the final snapshot synchronously (if anything
        changed)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        self._thaw()
        tree = self._changed(router)
        if tree is not None:
            self._write(tree.iter_json())

    def _thaw(self) -> None:
        if self._frozen is not None:
            self._frozen.thaw()
            self._frozen = None

    def _changed(self, router: Any) -> CausalPrefixTree | None:
        """The router's tree if it changed since the last save (and mark it saved), else None. Between
        rebuilds every learned trajectory adds one to the global root's count."""
        tree = learned_tree(router)
        if tree is None:
            return None
        mark = (tree.rebuilds, tree.global_tree.root.stats.count)
        if mark == self._saved_mark:
            return None
        self._saved_mark = mark
        return tree

    def _write(self, chunks: Iterable[str]) -> None:
        """Write the JSON ``chunks`` atomically (``prefix_tree.write_atomic``); errors are logged and counted."""
        try:
            size = write_atomic(self.path, chunks)
        except OSError as exc:
            self.failures += 1
            self._saved_mark = None  # retry at the next interval
            log.error("router_state_save_failed", path=str(self.path), error=str(exc))
            return
        self.saves += 1
        log.debug("router_state_saved", path=str(self.path), bytes=size)
