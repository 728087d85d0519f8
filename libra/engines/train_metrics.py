"""The metrics one :meth:`GRPOTrainer.train_step <libra.engines.trainer.GRPOTrainer.train_step>` returns.

Built from the step's global (all-reduced, hence identical on every rank) diagnostic sums; the keys are
those the trainer documents. A pure function, apart from reading the clock for ``step_time_s``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

__all__ = ["step_metrics"]


def step_metrics(
    sums: Sequence[float],
    grad_norm: float,
    g_tokens: float,
    g_sequences: float,
    *,
    micro_batches: int,
    step: int,
    weights_version: int,
    lr: float,
    started: float,
) -> dict[str, float]:
    """The step's metrics: ``sums`` are the global ``(loss, clipped tokens, ratio sum, kl sum)``,
    ``g_tokens`` / ``g_sequences`` the batch's loss tokens and sequences over every rank, ``micro_batches``
    this rank's count, ``started`` the step's :func:`time.perf_counter` start. Per-token means are over
    ``max(g_tokens, 1)``; ``ratio_mean`` is 1.0 for a batch without loss tokens."""
    loss, clipped, ratio_sum, kl_sum = sums
    denom = max(g_tokens, 1.0)
    return {
        "loss": loss,
        "grad_norm": grad_norm,
        "clip_frac": clipped / denom,
        "ratio_mean": ratio_sum / denom if g_tokens else 1.0,
        "kl_mean": kl_sum / denom,
        "num_tokens": g_tokens,
        "num_sequences": g_sequences,
        "micro_batches": float(micro_batches),
        "step": float(step),
        "weights_version": float(weights_version),
        "lr": float(lr),
        "step_time_s": time.perf_counter() - started,
    }
