"""The longest trajectory's share of a rollout: its critical path alone and the drained tail.

Role: the throughput objective (``PlannerConfig.objective = "throughput"``) prices an instance by its
busy time, but a rollout ends only when its longest trajectory does. :func:`solo_chain` is that
trajectory's time alone (batch 1, with its tools); :func:`drained_time` combines it with the busy time
and the loaded critical path (``rollout_dp.agentic_cost``). Pure numpy arithmetic over the cost model's
step times, so it holds whatever those costs are.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from libra.policies.cost.rollout import RolloutCostModel

__all__ = ["drained_time", "solo_chain"]


def solo_chain(cm: RolloutCostModel, tp: int, seg: Any, p: Any, n: Any) -> np.ndarray:
    """Seconds the segment's longest-decoding trajectory needs alone (batch 1, with its tools): ``gen_star``
    tokens at the batch-1 step, ``tool_star`` seconds, per turn the serving latency and overhead, and the
    prefill of its prompt (turns estimated as ``calls / n * gen_star / mean gen`` >= 1, prompt as
    ``max_seq - gen_star`` >= the mean prompt). A floor: no layout decodes it faster than alone."""
    safe_n = np.maximum(n, 1e-12)
    mean_gen = np.maximum(seg.gen / np.maximum(seg.n, 1e-12), 1e-12)
    turns = np.maximum(seg.calls / np.maximum(seg.n, 1e-12) * seg.gen_star / mean_gen, 1.0)
    prompt = np.maximum(seg.max_seq - seg.gen_star, p / safe_n)
    lat = float(cm.cal.per_request_overhead_s) + float(getattr(cm.cal, "per_turn_latency_s", 0.0))
    step1 = np.asarray(cm.decode_step(tp, 1.0, seg.max_seq), dtype=float)
    own_prefill = np.asarray(cm.prefill_time(tp, prompt, turns), dtype=float)
    return turns * lat + own_prefill + seg.gen_star * step1 + seg.tool_star


def drained_time(work: Any, chain_loaded: Any, chain_solo: Any) -> np.ndarray:
    """An instance's rollout time given its busy ``work``, the longest trajectory's critical path at
    the loaded batch (``chain_loaded``) and alone (``chain_solo``, :func:`solo_chain`).

    While the instance is busy the longest trajectory advances at the loaded pace, so after ``work``
    seconds it has done ``work / chain_loaded`` of its path; once the others have finished it runs
    the rest alone: ``work + (1 - work / chain_loaded) * chain_solo`` when ``chain_loaded > work``, else
    ``work``. Never below ``chain_solo`` (nor ``work``): a plan is never predicted faster than its
    slowest trajectory can decode alone."""
    loaded = np.maximum(np.asarray(chain_loaded, dtype=float), np.asarray(chain_solo, dtype=float))
    left = np.clip(1.0 - work / np.maximum(loaded, 1e-12), 0.0, 1.0)
    return np.where(loaded > work, work + left * chain_solo, work)
