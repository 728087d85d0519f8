"""Shared cases of the router tests: the R2E bucket layout, a four-instance cluster and hand-built tool returns."""

from __future__ import annotations

from libra.policies.routing.interface import BucketSpec, ClusterView, InstanceView, ToolReturn, TrajectoryInfo
from libra.policies.routing.prefix_tree import CausalPrefixTree, FinishedTrajectory

# The 48-GPU R2E bucket configuration: short TP1 <= 4000, medium TP2 <= 12000, long TP4 <= 30000.
BUCKETS = (BucketSpec("short", 1, 4000), BucketSpec("medium", 2, 12000), BucketSpec("long", 4, 30000))
LONG_FAIL = "bash:large:failure"
SMALL_OK = "bash:small:success"


def cluster(**loads: tuple[int, int]) -> ClusterView:
    """s0, s1 (short, node a), m0 (medium, node a), l0 (long, node b); ``loads`` maps id -> (active, queued)."""
    spec = [("s0", "short", "a"), ("s1", "short", "a"), ("m0", "medium", "a"), ("l0", "long", "b")]
    return ClusterView(BUCKETS, tuple(InstanceView(i, b, *loads.get(i, (0, 0)), node=n) for i, b, n in spec))


def ret(state: str, position: int, context: int = 1000) -> ToolReturn:
    tool, size, status = state.split(":")
    return ToolReturn(tool, position=position, context_tokens=context,
                      payload_tokens={"small": 100, "medium": 2000, "large": 9000}[size], status=status)


def info(tid: str, prompt: str | None = None, **kw: int) -> TrajectoryInfo:
    return TrajectoryInfo(tid, prompt_id=prompt, **kw)


def trained_tree(samples: dict[tuple[str, ...], list[int]]) -> CausalPrefixTree:
    """A global tree trained on one trajectory per sample: ``states`` at positions 10, 20, ... and then
    ``remaining`` more tokens. (Prefixes of ``states`` see these trajectories too.)"""
    tree = CausalPrefixTree()
    for states, remainings in samples.items():
        for r in remainings:
            positions = tuple(10 * (i + 1) for i in range(len(states)))
            tree.record(FinishedTrajectory(None, states, positions, r + positions[-1] if positions else r))
    return tree
