"""Analytic rollout (serving) cost model: what one inference instance of TP degree ``tp`` costs.

Role: the rollout half of the Global Resource Planner's cost evaluator (docs/papers.md §1.3.3) and
the profile source of the EARL parallelism selector. Pure arithmetic on a
:class:`~libra.policies.cost.profiles.HardwareProfile` and a
:class:`~libra.policies.cost.profiles.ModelProfile`.

The model (per instance of ``tp`` GPUs):

- KV bytes per token per GPU: ``2 * layers * ceil(kv_heads / tp) * head_dim * dtype_bytes``.
- Token capacity: ``(mem * gpu_memory_utilization - weights / tp - workspace) * (1 - frag) / kv``.
  A sequence longer than the capacity cannot run (OOM) and its cost is ``inf``.
- Prefill: ``(2 * P_active * tokens + 2 * layers * q_dim * sum(prompt^2)) / (tp * peak * prefill_mfu)``
  plus the TP all-reduces. ``sum(prompt^2)`` is approximated by ``(sum prompt)^2 / n``.
- Decode step with ``b`` running sequences holding ``T`` tokens of KV, a roofline:
  ``max((weights_read / tp + T * kv) / (mem_bw * decode_bw_util), (2 * P_active * b + 4 * layers * q_dim
  * T) / (tp * peak * decode_mfu)) + [tp > 1] * 2 * layers * (latency + ring bytes / bw_intra) +
  per_step_overhead + b * per_seq_step_overhead``. A dense model reads all weights; an MoE model
  reads its dense part plus the experts the batch touches (``1 - (1 - k/E)^b`` of them). Large
  short-context batches are compute-bound (Qwen3-14B at batch 256: 7.2 TFLOP a step against a 28 GB
  weight read), so TP-1 no longer loses to TP-8 by the bandwidth alone. The two overhead terms are the
  engine's CPU time per step (scheduling, sampling, detokenisation), which does not shrink with TP
  (docs/papers.md §1.7, "Per-step overhead").
- Prefill: the larger of its FLOPs at ``prefill_mfu`` and one weight read per 8K-token chunk.
- Steady batch ``b = clamp(min(n, max_batch, capacity / reserve), 1)`` and the batch's mean context:
  per request ``reserve = avg_prompt + f * avg_gen``, ``ctx = avg_prompt + avg_gen / 2``, or, given the
  residency sums of the requests, their generation-weighted means (:meth:`RolloutCostModel.resident_context`:
  long requests stay resident longest).
- Segment cost (one instance serving ``n`` requests): ``n * per_request_overhead + prefill +
  max(sum_gen / b, longest_gen) * step(b, b * (avg_prompt + avg_gen / 2))``. O(1) given the sums, and
  it broadcasts over numpy arrays so the planner's DP can build whole cost matrices at once.
  ``per_request_overhead_s`` is 0 in the bundled GPU profiles: the per-turn serving overhead
  (``per_turn_latency_s``) is latency of that trajectory only and costs the instance nothing
  (docs/papers.md §1.7); the simulator delays the turn by it.

Unlike the Libra reference code this model divides the weight bytes by ``tp`` exactly once (the
reference's decode step divides by ``tp`` twice, which makes one TP-8 GPU worth about 8.5 TP-1 GPUs).
The coefficients come from hardware physics and data sheets (HBM bandwidth x 0.7 efficiency, memory
utilisation 0.88, an all-reduce latency floor per layer), not from a fit: the paper's measured per-GPU
throughputs (:data:`CALIBRATION_TARGETS`, docs/papers.md §1.2 Fig. 3, read per GPU as §1.7 says) are
*validation* facts, and :func:`calibration_report` says how far the model is from each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from libra.policies.cost.profiles import HardwareProfile, ModelProfile, RolloutCalibration

__all__ = [
    "CALIBRATION_TARGETS",
    "CostModelError",
    "RolloutCostModel",
    "batch_latency",
    "bucket_throughput",
    "calibration_report",
]

#: The paper's measured facts the A800 rollout model is validated against (never fitted to; docs/papers.md
#: §1.2 Fig. 2a/3, §1.7): tokens/s *per GPU* of 8 A800 GPUs serving a batch of 512 Qwen3-14B requests as
#: 8 TP-1 or 1 TP-8 instances, and the growth of the batch latency from 1K- to 32K-token requests.
CALIBRATION_TARGETS: dict[str, float] = {
    "tp1_0_2k_tok_s_per_gpu": 1852.0,
    "tp8_0_2k_tok_s_per_gpu": 591.0,
    "tp1_16k_32k_tok_s_per_gpu": 430.0,
    "tp8_16k_32k_tok_s_per_gpu": 1220.0,
    "latency_ratio_1k_32k": 95.0,
}

#: Prompt share of a calibration request's length (the rest is generated).
CALIBRATION_PROMPT_FRACTION = 0.1

_PREFILL_CHUNK_TOKENS = 8192.0


class CostModelError(ValueError):
    """A cost-model argument is out of range (the message names it)."""


@dataclass(frozen=True, slots=True)
class _Derived:
    weight_bytes: float
    dense_bytes: float
    expert_bytes: float


class RolloutCostModel:
    """Cost of serving requests on one inference instance of a given TP degree.

    Every method is pure. ``tp`` must be a positive integer; methods raise :class:`CostModelError`
    otherwise. Times are seconds, sizes tokens or bytes.
    """

    def __init__(
        self,
        hardware: HardwareProfile,
        model: ModelProfile,
        calibration: RolloutCalibration | None = None,
    ) -> None:
        self.hardware = hardware
        self.model = model
        self.cal = calibration if calibration is not None else hardware.rollout
        b = model.dtype_bytes
        self._d = _Derived(
            weight_bytes=model.params * b,
            dense_bytes=model.dense_params * b,
            expert_bytes=model.n_layers * model.expert_params_per_layer * b,
        )

    # -- memory ---------------------------------------------------------------------------------
    def kv_bytes_per_token(self, tp: int) -> float:
        """KV-cache bytes per token on each GPU of the instance."""
        return self.model.kv_bytes_per_token(_check_tp(tp))

    def weight_bytes_per_gpu(self, tp: int) -> float:
        """Model weight bytes each GPU of the instance holds."""
        return self._d.weight_bytes / _check_tp(tp)

    def token_capacity(self, tp: int) -> float:
        """Tokens of KV cache the instance can hold (0.0 if the weights alone do not fit)."""
        hw, cal = self.hardware, self.cal
        free = hw.mem_bytes * cal.gpu_memory_utilization - self.weight_bytes_per_gpu(tp)
        free -= cal.activation_workspace_bytes
        return max(0.0, free * (1.0 - cal.kv_fragmentation) / self.kv_bytes_per_token(tp))

    def fits(self, tp: int, max_seq: float) -> bool:
        """OOM check: True iff one sequence of ``max_seq`` tokens fits in the instance's KV cache."""
        return max_seq <= self.token_capacity(tp)

    def fits_load(self, tp: int, context_len: float, concurrency: float) -> bool:
        """True iff ``concurrency`` sequences of ``context_len`` tokens are resident at once."""
        return concurrency * context_len <= self.token_capacity(tp)

    # -- step times -----------------------------------------------------------------------------
    def prefill_time(self, tp: int, prompt_tokens: Any, n: Any = 1.0) -> Any:
        """Seconds to prefill ``prompt_tokens`` prompt tokens spread over ``n`` requests.

        Broadcasts over numpy arrays.
        """
        tp = _check_tp(tp)
        m, hw, cal = self.model, self.hardware, self.cal
        p = np.asarray(prompt_tokens, dtype=float)
        n = np.maximum(np.asarray(n, dtype=float), 1.0)
        flops = 2.0 * m.active_params * p + 2.0 * m.n_layers * m.q_dim * p * p / n
        t = flops / (tp * hw.flops_peak * cal.prefill_mfu)
        weights = np.ceil(p / _PREFILL_CHUNK_TOKENS) * self._d.weight_bytes / tp / (hw.mem_bw * cal.decode_bw_util)
        t = np.maximum(t, weights)
        if tp > 1:
            chunks = np.ceil(p / _PREFILL_CHUNK_TOKENS)
            ring = 2.0 * (tp - 1) / tp * p * m.hidden * m.dtype_bytes / hw.bw_intra
            t = t + 2.0 * m.n_layers * (chunks * cal.tp_comm_overhead_s + ring)
        return _out(t)

    def decode_step(self, tp: int, active_seqs: Any, active_tokens: Any) -> Any:
        """Seconds for one decode step with ``active_seqs`` sequences holding ``active_tokens`` of KV.

        Broadcasts over numpy arrays.
        """
        tp = _check_tp(tp)
        m, hw, cal = self.model, self.hardware, self.cal
        b = np.maximum(np.asarray(active_seqs, dtype=float), 1.0)
        tokens = np.asarray(active_tokens, dtype=float)
        weights = self._d.dense_bytes
        if m.is_moe:
            touched = 1.0 - (1.0 - m.experts_per_token / m.n_experts) ** b
            weights = weights + self._d.expert_bytes * touched
        mem = (weights / tp + tokens * self.kv_bytes_per_token(tp)) / (hw.mem_bw * cal.decode_bw_util)
        t = np.maximum(mem, self.decode_flops(b, tokens) / (tp * hw.flops_peak * cal.decode_mfu))
        t = t + cal.per_step_overhead_s + b * cal.per_seq_step_overhead_s
        if tp > 1:
            ring = 2.0 * (tp - 1) / tp * b * m.hidden * m.dtype_bytes / hw.bw_intra
            t = t + 2.0 * m.n_layers * (cal.tp_comm_overhead_s + ring)
        return _out(t)

    def decode_flops(self, active_seqs: Any, active_tokens: Any) -> Any:
        """FLOPs of one decode step: ``2 * P_active`` per running sequence (the GEMMs) plus the attention
        core, ``4 * layers * q_dim`` per resident KV token (QK^T and PV). Broadcasts over numpy arrays."""
        m = self.model
        b = np.maximum(np.asarray(active_seqs, dtype=float), 1.0)
        return 2.0 * m.active_params * b + 4.0 * m.n_layers * m.q_dim * np.asarray(active_tokens, dtype=float)

    def batch_for_reserve(self, tp: int, n: Any, reserve: Any) -> Any:
        """``clamp(min(n, max_batch, capacity / reserve), 1)``: running sequences when each holds
        ``reserve`` KV tokens on average. Broadcasts over numpy arrays."""
        r = np.maximum(np.asarray(reserve, dtype=float), 1.0)
        b = np.minimum(np.minimum(np.asarray(n, dtype=float), float(self.cal.max_batch)), self.token_capacity(tp) / r)
        return _out(np.maximum(b, 1.0))

    def resident_context(self, avg_prompt: Any, avg_gen: Any, gen_sum: Any = None, gen_prompt_sum: Any = None,
                         gen_sq_sum: Any = None) -> tuple[Any, Any]:
        """``(ctx, reserve)``: the mean KV tokens a running sequence holds, and the per-sequence
        reserve the steady batch is sized by (``kv_reserve_gen_fraction`` of the generation in place
        of 1/2).

        A request holds KV only while it decodes, one token per step, so over a set of requests the
        running batch's mean context is *generation-weighted*: with the residency sums
        ``gen_prompt_sum = sum(g * resident_prompt)`` and ``gen_sq_sum = sum(g^2)`` (see
        ``rollout_dp.resident_prompt``), ``ctx = (gen_prompt_sum + gen_sq_sum / 2) / gen_sum``.
        Long requests stay resident longest (the inspection paradox): with a long-tailed mix this is
        about twice the per-request mean ``avg_prompt + avg_gen / 2``, which is what is returned
        without the sums (or where ``gen_sum`` is 0). Broadcasts over numpy arrays.
        """
        f = self.cal.kv_reserve_gen_fraction
        ap, ag = np.asarray(avg_prompt, dtype=float), np.asarray(avg_gen, dtype=float)
        ctx, reserve = ap + 0.5 * ag, ap + f * ag
        if gen_sum is None or gen_prompt_sum is None or gen_sq_sum is None:
            return _out(ctx), _out(reserve)
        g = np.asarray(gen_sum, dtype=float)
        has = g > 0
        gw = np.where(has, g, 1.0)
        mp, mg = np.asarray(gen_prompt_sum, dtype=float) / gw, np.asarray(gen_sq_sum, dtype=float) / gw
        return _out(np.where(has, mp + 0.5 * mg, ctx)), _out(np.where(has, mp + f * mg, reserve))

    # -- what the planner calls -----------------------------------------------------------------
    def segment_cost(self, tp: int, prompt_tokens_sum: Any, gen_tokens_sum: Any, n: Any, max_seq: Any,
                     max_gen: Any = None, gen_prompt_sum: Any = None, gen_sq_sum: Any = None) -> Any:
        """Seconds for one instance to serve ``n`` requests with the given token sums (O(1)).

        ``max_seq`` is the longest request's total length: it decides OOM (cost ``inf``) and, unless
        ``max_gen`` (the most tokens one request generates) is given, bounds the decode steps from
        below by ``max_seq * gen / total`` (the segment's generated share); with ``max_gen`` the
        bound is ``max_gen`` (a request decodes one token per step). The residency sums, when given,
        size the running batch and its KV by the generation-weighted context
        (:meth:`resident_context`); without them, by the mean request. ``n == 0`` costs 0.
        Broadcasts over numpy arrays, so the planner evaluates every contiguous segment of a sorted
        request list from prefix sums.
        """
        tp = _check_tp(tp)
        p = np.asarray(prompt_tokens_sum, dtype=float)
        g = np.asarray(gen_tokens_sum, dtype=float)
        n_arr = np.asarray(n, dtype=float)
        ms = np.asarray(max_seq, dtype=float)
        safe_n = np.maximum(n_arr, 1e-12)
        avg_p, avg_g = p / safe_n, g / safe_n
        ctx, reserve = self.resident_context(avg_p, avg_g, g, gen_prompt_sum, gen_sq_sum)
        b = np.asarray(self.batch_for_reserve(tp, n_arr, reserve), dtype=float)
        step = np.asarray(self.decode_step(tp, b, b * np.asarray(ctx, dtype=float)), dtype=float)
        total = np.maximum(p + g, 1e-12)
        tail = ms * g / total if max_gen is None else np.asarray(max_gen, dtype=float)
        steps = np.maximum(g / b, tail)
        cost = n_arr * self.cal.per_request_overhead_s + np.asarray(self.prefill_time(tp, p, n_arr)) + steps * step
        cost = np.where(ms > self.token_capacity(tp), np.inf, cost)
        cost = np.where(n_arr <= 0, 0.0, cost)
        return _out(cost)

    def tokens_per_s(self, tp: int, context_len: float, concurrency: float) -> float:
        """Decode-phase generated tokens/s of one instance with ``concurrency`` sequences at
        ``context_len`` tokens (0.0 if one such sequence does not fit)."""
        if context_len <= 0 or concurrency <= 0:
            raise CostModelError(f"context_len and concurrency must be > 0, got {context_len}, {concurrency}")
        cap = self.token_capacity(tp)
        if context_len > cap:
            return 0.0
        b = max(1.0, min(float(concurrency), float(self.cal.max_batch), cap / context_len))
        return b / float(self.decode_step(tp, b, b * context_len))


def _check_tp(tp: int) -> int:
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
        raise CostModelError(f"tp must be a positive integer, got {tp!r}")
    return int(tp)


def _out(x: Any) -> Any:
    arr = np.asarray(x, dtype=float)
    return float(arr) if arr.ndim == 0 else arr


# -- calibration ---------------------------------------------------------------------------------
def _batch_makespan(cm: RolloutCostModel, tp: int, n_gpus: int, lengths: np.ndarray, prompt_fraction: float) -> float:
    """Makespan of serving ``lengths`` on ``n_gpus // tp`` instances, requests dealt round-robin."""
    k = n_gpus // tp
    if k < 1:
        raise CostModelError(f"n_gpus={n_gpus} cannot hold one TP-{tp} instance")
    worst = 0.0
    for i in range(k):
        part = lengths[i::k]
        if part.size == 0:
            continue
        total = float(part.sum())
        worst = max(
            worst,
            float(cm.segment_cost(tp, prompt_fraction * total, (1 - prompt_fraction) * total, part.size, part.max())),
        )
    return worst


def bucket_throughput(
    cm: RolloutCostModel,
    tp: int,
    lo: float,
    hi: float,
    *,
    n_gpus: int = 8,
    n_requests: int = 512,
    prompt_fraction: float = CALIBRATION_PROMPT_FRACTION,
) -> float:
    """Aggregate tokens/s (prompt + generated) of ``n_gpus // tp`` TP-``tp`` instances serving
    ``n_requests`` requests whose lengths are spread evenly over ``[lo, hi]`` (the paper's Fig. 3 setup).
    """
    lengths = lo + (np.arange(n_requests) + 0.5) * (hi - lo) / n_requests
    ms = _batch_makespan(cm, tp, n_gpus, lengths, prompt_fraction)
    return float(lengths.sum() / ms) if math.isfinite(ms) and ms > 0 else 0.0


def batch_latency(
    cm: RolloutCostModel,
    length: float,
    *,
    n_gpus: int = 8,
    n_requests: int = 512,
    tps: tuple[int, ...] = (1, 2, 4, 8),
    prompt_fraction: float = CALIBRATION_PROMPT_FRACTION,
) -> float:
    """Seconds to serve ``n_requests`` requests of ``length`` tokens on ``n_gpus`` GPUs with the best
    homogeneous TP layout among ``tps`` (``inf`` if every layout OOMs)."""
    lengths = np.full(n_requests, float(length))
    return min(_batch_makespan(cm, tp, n_gpus, lengths, prompt_fraction) for tp in tps if tp <= n_gpus)


def calibration_report(cm: RolloutCostModel) -> dict[str, dict[str, float]]:
    """The model's values for each of :data:`CALIBRATION_TARGETS`: ``{key: {target, model, ratio}}``
    (per-GPU throughputs: the 8-GPU batch throughput divided by 8)."""
    values = {
        "tp1_0_2k_tok_s_per_gpu": bucket_throughput(cm, 1, 0, 2048) / 8,
        "tp8_0_2k_tok_s_per_gpu": bucket_throughput(cm, 8, 0, 2048) / 8,
        "tp1_16k_32k_tok_s_per_gpu": bucket_throughput(cm, 1, 16384, 32768) / 8,
        "tp8_16k_32k_tok_s_per_gpu": bucket_throughput(cm, 8, 16384, 32768) / 8,
        "latency_ratio_1k_32k": batch_latency(cm, 32768) / batch_latency(cm, 1024),
    }
    return {
        key: {"target": target, "model": values[key], "ratio": values[key] / target}
        for key, target in CALIBRATION_TARGETS.items()
    }
