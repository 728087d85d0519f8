"""Reference sums shared by the planner tests: random request sets and the direct (loop) evaluation of
``agentic_cost`` for a pooled bucket, against which the planner's vectorised tables are checked."""

from __future__ import annotations

import math

import numpy as np

from libra.policies.cost_model import RolloutCostModel, load_hardware, load_model

RM = RolloutCostModel(load_hardware("a800"), load_model("qwen3-14b"))


def _requests(n: int, seed: int) -> list[tuple[float, float, float]]:
    rng = np.random.default_rng(seed)
    total = np.exp(rng.uniform(np.log(300), np.log(30000), n)).round()
    prompt = np.minimum(rng.uniform(100, 2048, n), total / 2).round()
    turns = rng.integers(1, 6, n)
    return list(zip(prompt.tolist(), (total - prompt).tolist(), turns.astype(float).tolist()))


def _agentic_requests(n: int, seed: int) -> list[tuple[float, float, float, float]]:
    rng = np.random.default_rng(seed)
    return [(p, g, c, float(t)) for (p, g, c), t in zip(_requests(n, seed), rng.uniform(0.0, 400.0, n))]


def _pooled_agentic(reqs: list[tuple[float, float, float, float]], tp: int, k: int, lag: int) -> tuple[float, float]:
    """Direct sums of ``agentic_cost`` for the busiest of ``k`` instances: ``(cost, chain)``."""
    n = len(reqs)
    share = min(k, n)
    p, g, c, tool = (sum(r[x] for r in reqs) / share for x in range(4))
    m = n / share
    if max(r[0] + r[1] for r in reqs) > RM.token_capacity(tp):
        return math.inf, math.inf
    avg_p, avg_g = p / m, g / m
    b0 = float(RM.steady_batch(tp, m, avg_p, avg_g))
    step0 = float(RM.decode_step(tp, b0, b0 * (avg_p + avg_g / 2)))
    b = max(b0 * (1 - tool / (tool + g * step0)), 1.0) if tool > 0 else b0
    step = float(RM.decode_step(tp, b, b * (avg_p + avg_g / 2)))
    stall = c * RM.cal.per_request_overhead_s + float(RM.prefill_time(tp, p, m))
    star = max(range(n), key=lambda a: (reqs[a][1], a))  # most generated tokens (ties: the last)
    chain = lag * stall + reqs[star][1] * step + reqs[star][3]
    return max(stall + g / b * step, chain / lag), chain
