"""Reference sums shared by the planner tests: random request sets and the direct (loop) evaluation of
``agentic_cost`` for a pooled bucket, against which the planner's vectorised tables are checked."""

from __future__ import annotations

import math

import numpy as np

from libra.policies.cost import RolloutCostModel, load_hardware, load_model

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


def _resident(items: list[tuple[float, float, float]]) -> tuple[float, float]:
    """``(ctx, reserve)`` of a running batch drawn from ``items`` (``(prompt, gen, calls)`` each), by
    loops: each item is resident for its ``gen`` decode steps, holding its prompt as it arrives (one
    part per call, ``prompt * (1 + 1 / calls) / 2`` on average) plus half its generation."""
    f = RM.cal.kv_reserve_gen_fraction
    gsum = sum(g for _, g, _ in items)
    if gsum <= 0:
        n = max(len(items), 1)
        ap, ag = sum(p for p, _, _ in items) / n, sum(g for _, g, _ in items) / n
        return ap + ag / 2, ap + f * ag
    held = [(g, p * (1 + 1 / max(c, 1.0)) / 2, g) for p, g, c in items]
    return (sum(g * (rp + x / 2) for g, rp, x in held) / gsum, sum(g * (rp + f * x) for g, rp, x in held) / gsum)


def _pooled_agentic(reqs: list[tuple[float, float, float, float]], tp: int, k: int, lag: int) -> tuple[float, float]:
    """Direct sums of ``agentic_cost`` for the busiest of ``k`` instances: ``(cost, chain)``; the chain is
    the request generating the most (ties: the last)."""
    parts = [(p, g, c, t, p + g) for p, g, c, t in reqs]
    return _direct_parts(parts, float(len(reqs)), tp, k, lag, [_star([(r[1], r[3]) for r in reqs])])


def _direct_parts(parts: list[tuple[float, float, float, float, float]], n_req: float, tp: int, k: int, lag: int,
                  stars: list[tuple[float, float]]) -> tuple[float, float]:
    """``agentic_cost`` by hand for the busiest of ``k`` instances pooling ``parts`` (``(prompt, gen,
    calls, tool, context)`` each) that stand for ``n_req`` requests; the chain is the largest over the
    ``stars`` (``(generated, tool seconds)`` of each critical-path candidate). ``(cost, chain)``."""
    if max((x[4] for x in parts), default=0.0) > RM.token_capacity(tp):
        return math.inf, math.inf
    if n_req <= 0:
        return 0.0, 0.0
    share = min(k, n_req)
    p, g, c, tool = (sum(x[i] for x in parts) / share for i in range(4))
    m = n_req / share
    ctx, reserve = _resident([(x[0], x[1], x[2]) for x in parts])
    b0 = float(RM.batch_for_reserve(tp, m, reserve))
    step0 = float(RM.decode_step(tp, b0, b0 * ctx))
    b = max(b0 * (1 - tool / (tool + g * step0)), 1.0) if tool > 0 else b0
    step = float(RM.decode_step(tp, b, b * ctx))
    stall = c * RM.cal.per_request_overhead_s + float(RM.prefill_time(tp, p, m))
    chain = max(lag * stall + gs * step + ts for gs, ts in stars)
    return max(stall + g / b * step, chain / lag), chain


def _star(items: list[tuple[float, float]]) -> tuple[float, float]:
    """The ``(generated, tool)`` pair generating the most (ties: the last); ``(0, 0)`` for none."""
    best = (0.0, 0.0)
    for a, it in enumerate(items):
        if a == 0 or it[0] >= best[0]:
            best = it
    return best


def _start_small_bucket(reqs: list[tuple[float, float, float, float]], tp: int, k: int, j: int, i: int, head: bool,
                        lag: int) -> tuple[float, float]:
    """One bucket of the start-small model by hand (``reqs`` sorted by total length; see
    ``planner_start_small``). The head keeps requests ``0..i-1`` whole and serves the first turn of the
    rest: ``1/turns`` of the prompt and of the generated tokens, one call, no tool seconds (a single-turn
    request whole). A rest bucket serves requests ``j..i-1`` after their first turn: ``turns - 1``
    calls, ``(1 - 1/turns)`` of the generated tokens, all tool seconds and a prefill of the remaining
    ``(1 - 1/turns)`` prompt plus the re-prefilled first-turn context ``(prompt + gen) / turns``."""
    if head:
        whole = [(p, g, c, t, p + g) for p, g, c, t in reqs[:i]]
        first = [(p / c, g / c, 1.0, 0.0 if c > 1 else t, (p + g) / c) for p, g, c, t in reqs[i:]]
        stars = [_star([(x[1], x[3]) for x in whole]), _star([(x[1], x[3]) for x in first])]
        return _direct_parts(whole + first, float(len(reqs)), tp, k, lag, stars)
    multi = [r for r in reqs[j:i] if r[2] > 1]
    rest = [(p + g / c, g * (1 - 1 / c), c - 1, t, p + g) for p, g, c, t in multi]
    return _direct_parts(rest, float(len(multi)), tp, k, lag, [_star([(r[1], r[3]) for r in multi])])
