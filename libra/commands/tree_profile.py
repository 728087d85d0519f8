"""The offline profiler: bootstrap C-MLFQ's causal prefix tree from logged trajectories (docs/papers.md §1.4.2).

A trace in the format of ``docs/trace-format.md`` (recorded from a run, or generated) becomes the
:class:`~libra.policies.routing.prefix_tree.FinishedTrajectory` records the router would have learned had those
trajectories run through the broker: each tool return's key is extracted as the broker does
(:func:`libra.broker.rollout.tool_output_fields`, then the extractor) for a simulated tool result
(``{"payload_tokens": n, "status": s}``), its position is the response position
(generated + tool-returned tokens, this return included) and the total is the response length.
:func:`profile_tree` records them in trace order; the result loads into a broker with
``router_params = {tree = "FILE"}`` or ``python -m libra.broker --router-state FILE``.

Pure (no I/O); the command line is ``python -m libra tree`` (:mod:`libra.commands.tree`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from libra.broker.rollout import tool_output_fields
from libra.policies.routing.prefix_tree import CausalPrefixTree, FinishedTrajectory
from libra.policies.routing.tool_state import DEFAULT_THRESHOLDS, SizeThresholds, extract_tool_state

from libra.traces import TrajectorySpec

__all__ = ["finished_from_trace", "profile_tree"]


def finished_from_trace(spec: TrajectorySpec, thresholds: SizeThresholds = DEFAULT_THRESHOLDS) -> FinishedTrajectory:
    """What the router learns from ``spec`` once it finishes (see the module docstring)."""
    states = []
    for turn in spec.tool_turns:
        output = {"payload_tokens": turn.payload_tokens or 0, "status": turn.status or "success"}
        tokens, chars, status = tool_output_fields(output, True)  # the simulator's tool actor answers ok
        st = extract_tool_state(turn.tool or "tool", output, status=status, payload_tokens=tokens,
                                payload_chars=chars, thresholds=thresholds)
        states.append(st.key)
    return FinishedTrajectory(spec.prompt_id, tuple(states), spec.response_positions, spec.total_response_tokens)


def profile_tree(trajs: Iterable[TrajectorySpec], thresholds: SizeThresholds = DEFAULT_THRESHOLDS,
                 **tree_params: Any) -> CausalPrefixTree:
    """A prefix tree learned from ``trajs`` in order; ``tree_params`` go to :class:`CausalPrefixTree`
    (``window_size``, ``max_prompts``, ``history_size``, ``rebuild_interval``)."""
    return CausalPrefixTree.from_trajectories((finished_from_trace(t, thresholds) for t in trajs), **tree_params)
