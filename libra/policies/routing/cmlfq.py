"""C-MLFQ: the causality-driven multi-level feedback queue router of Libra (docs/papers.md §1.4.3).

Levels are rollout *buckets* (instances of one TP degree, each with a ``max_tokens`` threshold on the
*remaining* generated length). The router:

1. places every new trajectory in the **smallest** bucket (reason ``initial``), least-loaded among ready
   instances under the queue cap, with the fallbacks of :func:`libra.policies.routing.interface.place`;
2. after each tool return, reduces the return to a tool-state key (:mod:`libra.policies.routing.tool_state`), appends it
   to the trajectory's sequence and looks the sequence up in the causal prefix tree
   (:mod:`libra.policies.routing.prefix_tree`, deepest-prefix fallback, prompt tree first);
3. with ``rule="mean_p90"`` (the paper's rule, the default) migrates **iff** ``bucket(mean) == bucket(p90) !=
   current`` -- up or down -- and otherwise stays on its instance; with ``rule="mode"`` it moves to the bucket
   holding the most samples of the node's window (ties keep the current bucket), the rule that maximises the
   expected routing accuracy given the node. Reasons: ``no_stats`` (no node, or fewer than ``min_visits``
   samples), ``mean_p90_disagree``, ``already_in_target_bucket``, ``migrate`` (and ``target_bucket_full``
   when the target has no room). Why ``mode`` exists (issue #27): at the first tool return on search_r1,
   65 % of the paper rule's decisions were ``mean_p90_disagree`` -- a global node's window mixes short and
   long tails, so its mean and P90 almost never share a bucket -- and those stays were right only 62 % of
   the time; the modal bucket uses the same node and is right more often (``python -m libra.bench routing``
   prints both rules beside never migrating);
4. on a migration picks KV transfer or re-prefill with ``choose_mode`` (default: Libra's heuristic, re-prefill
   up to 4096 tokens same-node / 2048 cross-node, else KV; :func:`libra.policies.routing.interface.mode_by_cost` builds
   a chooser from two cost functions);
5. at ``finish`` inserts the trajectory (states, response positions ``p_i``, total response tokens -- generated
   plus tool-returned, the unit of the bucket thresholds) into the tree, and at
   ``on_step`` rebuilds the tree every ``rebuild_interval`` steps from the last ``history_size`` trajectories.

Pure: no I/O, clocks or threads. The tree can be shared with (or loaded from) other ranks via
:class:`libra.policies.routing.prefix_tree.CausalPrefixTree`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from libra.policies.routing.prefix_tree import CausalPrefixTree, FinishedTrajectory, NodeEstimate
from libra.policies.routing.sticky import StickyRouter, Track
from libra.policies.routing.interface import (
    BucketSpec,
    CapMetric,
    ClusterView,
    ClusterViewError,
    InstanceView,
    MigrateMode,
    MigrationQuery,
    NoInstanceAvailable,
    RouteDecision,
    Router,
    RoutingError,
    ToolReturn,
    TrajectoryInfo,
    WhenFull,
    bucket_for,
    bucket_index_for,
    heuristic_migrate_mode,
    mode_by_cost,
)
from libra.policies.routing.tool_state import DEFAULT_THRESHOLDS, SizeThresholds, extract_tool_state

__all__ = [
    "REASONS",
    "RULES",
    "BucketSpec",
    "CMLFQRouter",
    "ClusterView",
    "InstanceView",
    "NoInstanceAvailable",
    "RouteDecision",
    "Router",
    "RoutingError",
    "ToolReturn",
    "TrajectoryInfo",
    "bucket_for",
    "heuristic_migrate_mode",
    "modal_bucket",
    "mode_by_cost",
    "tool_state_key",
]

#: Every reason a C-MLFQ decision can carry.
REASONS = (
    "initial",
    "no_stats",
    "mean_p90_disagree",
    "already_in_target_bucket",
    "migrate",
    "target_bucket_full",
    "reroute",
)

Rule = Literal["mean_p90", "mode"]
RULES: tuple[Rule, ...] = ("mean_p90", "mode")
"""The move rules by name (see the module docstring, step 3)."""


def modal_bucket(window: Sequence[float], buckets: Sequence[BucketSpec], current: int) -> int:
    """Index of the bucket holding the most of ``window``'s samples; ``current`` wins ties (and an empty
    window)."""
    counts = [0] * len(buckets)
    for r in window:
        counts[bucket_index_for(r, buckets)] += 1
    best = current
    for i, c in enumerate(counts):
        if c > counts[best]:
            best = i
    return best


def tool_state_key(ret: ToolReturn, thresholds: SizeThresholds = DEFAULT_THRESHOLDS) -> str:
    """The ``"{tool}:{size}:{status}"`` key of a tool return (raises ``ToolStateError`` on bad fields)."""
    return extract_tool_state(
        ret.tool,
        ret.output,
        status=ret.status,
        payload_tokens=ret.payload_tokens,
        payload_chars=ret.payload_chars,
        thresholds=thresholds,
    ).key


class CMLFQRouter(StickyRouter):
    """The C-MLFQ router (see the module docstring).

    ``tree`` may be passed in (shared, pre-trained, or loaded from disk); otherwise one is built from
    ``window_size``, ``max_prompts``, ``history_size`` and ``rebuild_interval``. ``min_visits`` is the sample
    count below which a node counts as unseen; ``rule`` picks the move rule by name (:data:`RULES`). Raises ``ClusterViewError``/``PrefixTreeError`` for bad
    parameters.
    """

    name = "cmlfq"
    commit_when_full = True

    def __init__(
        self,
        *,
        tree: CausalPrefixTree | None = None,
        thresholds: SizeThresholds = DEFAULT_THRESHOLDS,
        min_visits: int = 1,
        window_size: int = 200,
        max_prompts: int = 10_000,
        history_size: int = 5000,
        rebuild_interval: int = 50,
        max_queue_length: int = 3,
        cap_metric: CapMetric = "queued",
        when_full: WhenFull = "overflow",
        choose_mode: Callable[[MigrationQuery], MigrateMode] = heuristic_migrate_mode,
        rule: Rule = "mean_p90",
    ) -> None:
        super().__init__(max_queue_length=max_queue_length, cap_metric=cap_metric, when_full=when_full,
                         choose_mode=choose_mode)
        if isinstance(min_visits, bool) or not isinstance(min_visits, int) or min_visits < 1:
            raise ClusterViewError(f"min_visits must be a positive integer, got {min_visits!r}")
        if not isinstance(thresholds, SizeThresholds):
            raise ClusterViewError(f"thresholds must be a SizeThresholds, got {type(thresholds).__name__}")
        self.tree = tree if tree is not None else CausalPrefixTree(
            window_size=window_size, max_prompts=max_prompts, history_size=history_size,
            rebuild_interval=rebuild_interval,
        )
        if rule not in RULES:
            raise ClusterViewError(f"rule must be one of {RULES}, got {rule!r}")
        self.rule: Rule = rule
        self.thresholds = thresholds
        self.min_visits = min_visits
        #: The lookup behind the latest tool-return decision (for metrics and debugging), or ``None``.
        self.last_estimate: NodeEstimate | None = None

    def _initial_bucket(self, traj: TrajectoryInfo, view: ClusterView) -> tuple[int, str]:
        return 0, "initial"

    def _decide(self, track: Track, ret: ToolReturn, view: ClusterView) -> tuple[int, str]:
        key = tool_state_key(ret, self.thresholds)
        track.states.append(key)
        current = view.bucket_index(track.bucket)
        found = self.tree.lookup_window(track.info.prompt_id, track.states, min_visits=self.min_visits)
        est = self.last_estimate = found[0] if found is not None else None
        if found is None or est is None:
            return current, "no_stats"
        if self.rule == "mode":
            target = modal_bucket(found[1], view.buckets, current)
            return (current, "already_in_target_bucket") if target == current else (target, "migrate")
        b_mean = bucket_index_for(est.mean, view.buckets)
        b_p90 = bucket_index_for(est.p90, view.buckets)
        if b_mean != b_p90:
            return current, "mean_p90_disagree"
        if b_mean == current:
            return current, "already_in_target_bucket"
        return b_mean, "migrate"

    def _learn(self, track: Track, total_output_tokens: int) -> None:
        self.tree.record(
            FinishedTrajectory(track.info.prompt_id, tuple(track.states), tuple(track.positions), total_output_tokens)
        )

    def on_step(self, step: int) -> None:
        """Rebuild the tree when ``rebuild_interval`` steps have passed since the last rebuild."""
        self.tree.maybe_rebuild(step)

    def describe(self) -> dict[str, Any]:
        """Small summary for logs and status output."""
        return {
            "router": self.name,
            "active_trajectories": self.active_trajectories,
            "tree_prompts": self.tree.num_prompts,
            "tree_global_nodes": self.tree.global_tree.node_count,
            "tree_history": len(self.tree.history),
            "tree_rebuilds": self.tree.rebuilds,
        }
