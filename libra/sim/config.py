"""The settings of one simulated run (:class:`SimConfig`), read by :class:`~libra.sim.engine.Simulator` and by
the planner-driven allocation (:mod:`libra.sim.planner`). :mod:`libra.sim.engine` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["STEP_TOKENS", "SimConfig", "default_prompts"]

#: Tokens per training step in the paper's R2E runs: 763 tok/s x 454 s mean step time (docs/papers.md §1.5, §1.7).
STEP_TOKENS = 346_000


def default_prompts(gpus: int) -> int:
    """GRPO groups (of 16) per step by default: ``gpus / 16``, i.e. 3 on the paper's 48 GPUs, which on the R2E-like
    trace (mean length 2.2K -> 9.2K tokens over 20 steps) gives ~365K tokens per step, the paper's ~346K
    (:data:`STEP_TOKENS`; docs/papers.md §1.7: B = 48 trajectories, in flight at most 2B, eta = 2)."""
    return max(1, round(gpus / 16))


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Simulation settings. ``router_params`` go to the router; ``bucket_thresholds``/``size_thresholds``
    come from the workload profile (C-MLFQ tool-return size classes, bucket ``max_tokens``)."""

    router: str = "cmlfq"
    allocation: str = "hetero"
    gpus: int = 48
    lag: int = 2
    seed: int = 0
    hardware: str = "a800"
    model: str = "qwen3-14b"
    router_params: dict[str, Any] = field(default_factory=dict)
    bucket_thresholds: tuple[int, ...] = (4000, 12000, 30000)
    size_thresholds: tuple[int, int] | None = None
    predictor_noise: float = 2.0
    rebuild_interval: int = 5
    min_visits: int = 10  # C-MLFQ: samples a prefix node needs before its mean/P90 count (P90 needs >= 10)
    tick_s: float = 30.0
    reserve_tokens: int | None = None  # broker credit = KV capacity / this; None: the planner's reserve (libra.sim.engine)
    allocation_params: dict[str, Any] = field(default_factory=dict)  # planner allocations (planner.py)
    batching: str = "streaming"  # "streaming" (docs/papers.md §1.7) or "barrier" (the earlier model): batching.py
    eta: int = 2  # streaming: max head off-policyness (admitted groups < (eta + version + 1) * B)
    max_concurrent: int | None = None  # streaming: running groups at most this (None: 2 * B)
    weight_sync_s: float = 0.0  # seconds added to every training step for the weight sync
