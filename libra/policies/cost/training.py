"""Analytic training cost model: time and memory of one optimisation step for a parallel layout.

Role: the training half of the Global Resource Planner's cost evaluator (docs/papers.md §1.3.3).
Pure arithmetic plus a small explicit pipeline simulation; no I/O.

The model:

- Per layer, a micro-batch of ``b`` sequences of length ``L`` costs forward
  ``(a_attn L^2 + b_attn L + g_attn) * b / tp + (a_mlp L + b_mlp) * b / tp``; backward uses the
  ``*_bwd`` coefficients plus a recompute of the attention core. Each term is multiplied by the
  interference factor ``1 + rho * bg^theta`` (``bg`` = 0.4 for ZeRO >= 2 with dp > 1, 0.2 for
  ZeRO-1, 0 otherwise; backward uses ``min(1.5 bg, 0.8)``); GEMM terms use ``rho_compute``, the
  attention core and the per-sequence fixed terms ``rho_memory``. The TP all-reduce adds
  ``2 * [2 (tp-1)/tp * b L d bytes] / bw_intra`` per layer and direction; MoE adds the EP all-to-all.
- :class:`TrainingCoefficients` defaults are the notes' values. :meth:`TrainingCoefficients.derive`
  replaces the model-dependent ones (``a_mlp``, ``b_attn``, ``a_attn``) with the model's FLOPs at the
  hardware's training MFU (the attention core slowed by the profile's ``attention_slowdown``), and
  keeps the notes' fixed per-sequence terms and interference constants.
- The batch is split into DP replicas by length quantiles (sorted lengths dealt round-robin); a
  micro-batch's length is the longest inside it. Each replica runs an explicit 1F1B schedule over its
  own micro-batches; the step's pipeline time is the slowest replica's. Then the exposed DP gradient
  all-reduce (``(dp-1)/dp * 2 P_local bytes / bw``, 70% exposed with pp = 1, 50% with pp > 1), the
  optimizer update (32 bytes of HBM traffic per local parameter), the weight export to the rollout side
  (``params * dtype_bytes / bw_inter``, :meth:`TrainingCostModel.export_time`) and (optionally) the
  forward-only pass that recomputes old log-probs. With the bundled profiles (``attention_slowdown = 1``)
  this is FLOPs at MFU (``6 N`` per token plus the causal attention core) plus fixed per-step costs;
  nothing is fitted to a length ratio (docs/papers.md §1.7).
- Memory per GPU: weights, fp32 gradients, Adam state (sharded by ZeRO stage), 1F1B in-flight
  activations (``34 b L d / tp`` bytes per layer, flash attention + sequence parallel) and the fp32
  logits of the log-prob recompute on the last stage. Over the usable memory means OOM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from libra.policies.cost.profiles import HardwareProfile, ModelProfile
from libra.policies.cost.rollout import CostModelError

__all__ = [
    "TrainConfig",
    "TrainEstimate",
    "TrainingCoefficients",
    "TrainingCostModel",
    "simulate_1f1b",
]

_ACT_BYTES_PER_TOKEN_HIDDEN = 34.0  # Korthikanti et al., with flash attention and sequence parallel
_WORKSPACE_BYTES = 1e9


@dataclass(frozen=True, slots=True)
class TrainingCoefficients:
    """Per-layer cost coefficients (seconds; ``a_*`` per token or token^2, ``b_*``/``g_*`` per sequence).

    The defaults are the research notes' values (§1.3.3); use :meth:`derive` for a specific model.
    """

    alpha_attn_fwd: float = 1.5e-12
    beta_attn_fwd: float = 2.5e-8
    gamma_attn_fwd: float = 8e-6
    alpha_mlp_fwd: float = 3.5e-8
    beta_mlp_fwd: float = 1e-5
    alpha_attn_bwd: float = 3e-12
    beta_attn_bwd: float = 5e-8
    gamma_attn_bwd: float = 1.5e-5
    alpha_mlp_bwd: float = 7e-8
    beta_mlp_bwd: float = 2e-5
    rho_compute: float = 0.08
    rho_memory: float = 0.45
    theta: float = 1.0

    @classmethod
    def derive(cls, model: ModelProfile, hardware: HardwareProfile) -> TrainingCoefficients:
        """Coefficients for ``model`` on ``hardware``: FLOP-derived GEMM and attention terms, the
        notes' fixed terms and interference constants. Backward costs twice the forward."""
        eff = hardware.flops_peak * hardware.training.mfu
        a_attn = 2.0 * model.q_dim * hardware.training.attention_slowdown / eff
        b_attn = 2.0 * model.attn_params_per_layer / eff
        a_mlp = 2.0 * model.mlp_active_params_per_layer / eff
        return cls(
            alpha_attn_fwd=a_attn,
            beta_attn_fwd=b_attn,
            alpha_mlp_fwd=a_mlp,
            alpha_attn_bwd=2 * a_attn,
            beta_attn_bwd=2 * b_attn,
            alpha_mlp_bwd=2 * a_mlp,
        )


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """A training layout: ``tp * pp * dp`` GPUs, expert parallel ``ep`` (MoE only; EP ranks live in
    the DP group), micro-batch of ``micro_batch`` sequences, ZeRO / distributed-optimizer stage."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    ep: int = 1
    zero_stage: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "micro_batch", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CostModelError(f"TrainConfig.{name} must be a positive integer, got {value!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise CostModelError(f"TrainConfig.zero_stage must be 0..3, got {self.zero_stage!r}")

    @property
    def n_gpus(self) -> int:
        """GPUs the layout occupies."""
        return self.tp * self.pp * self.dp


@dataclass(frozen=True, slots=True)
class TrainEstimate:
    """One step's predicted time (``inf`` when OOM) and its parts, plus peak memory per GPU."""

    time: float
    pipeline: float
    dp_comm: float
    optimizer: float
    logprob: float
    memory_bytes: float
    oom: bool
    n_micro: int
    bubble: float = field(default=0.0)
    export: float = field(default=0.0)


def simulate_1f1b(fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray | float = 0.0) -> float:
    """Makespan of a one-forward-one-backward pipeline schedule.

    ``fwd[s, m]`` / ``bwd[s, m]`` are the durations of micro-batch ``m`` on stage ``s``; ``p2p[m]``
    the activation/gradient transfer time between adjacent stages. Stage ``s`` runs
    ``min(pp - s - 1, M)`` warm-up forwards, then alternates forward/backward, then drains the
    backwards. Returns the time the last backward finishes.
    """
    fwd_a = np.asarray(fwd, dtype=float)
    bwd_a = np.asarray(bwd, dtype=float)
    pp, m_count = fwd_a.shape
    if pp == 1:
        return float(fwd_a.sum() + bwd_a.sum())
    # Plain Python lists: this loop runs 2 * pp * M times and numpy scalar indexing is slow.
    comm = np.broadcast_to(np.asarray(p2p, dtype=float), (m_count,)).tolist()
    f_dur, b_dur = fwd_a.tolist(), bwd_a.tolist()
    orders: list[list[tuple[bool, int]]] = []
    for s in range(pp):
        warm = min(pp - s - 1, m_count)
        order = [(True, m) for m in range(warm)]
        for i in range(m_count - warm):
            order.append((True, warm + i))
            order.append((False, i))
        order.extend((False, m) for m in range(m_count - warm, m_count))
        orders.append(order)
    f_end = [[-1.0] * m_count for _ in range(pp)]
    b_end = [[-1.0] * m_count for _ in range(pp)]
    free = [0.0] * pp
    pos = [0] * pp
    remaining = 2 * pp * m_count
    last = pp - 1
    while remaining:
        progressed = False
        for s in range(pp):
            order, fe, be, fd, bd = orders[s], f_end[s], b_end[s], f_dur[s], b_dur[s]
            p, t = pos[s], free[s]
            n_ops = len(order)
            while p < n_ops:
                is_fwd, m = order[p]
                if is_fwd:
                    if s:
                        dep = f_end[s - 1][m]
                        if dep < 0:
                            break
                        dep += comm[m]
                        t = max(t, dep)
                    t += fd[m]
                    fe[m] = t
                else:
                    if s == last:
                        dep = fe[m]
                    else:
                        dep = b_end[s + 1][m]
                        if dep < 0:
                            break
                        dep += comm[m]
                    t = max(t, dep)
                    t += bd[m]
                    be[m] = t
                p += 1
            if p != pos[s]:
                remaining -= p - pos[s]
                pos[s], free[s] = p, t
                progressed = True
        if not progressed:  # pragma: no cover - 1F1B orders are deadlock-free
            raise RuntimeError("1F1B simulation deadlocked")
    return float(max(b_end[0]))


def _forward_only(fwd: np.ndarray, p2p: np.ndarray) -> float:
    pp, m_count = fwd.shape
    if m_count == 0:
        return 0.0
    if pp == 1:
        return float(fwd.sum())
    comm = np.broadcast_to(np.asarray(p2p, dtype=float), (m_count,)).tolist()
    end = [0.0] * m_count
    for s, row in enumerate(fwd.tolist()):
        t = 0.0
        for m in range(m_count):
            ready = end[m] + comm[m] if s else 0.0
            t = max(t, ready) + row[m]
            end[m] = t
    return end[-1]


class TrainingCostModel:
    """Step time and memory of GRPO training for a :class:`TrainConfig` and a batch of lengths.

    ``coefficients`` default to :meth:`TrainingCoefficients.derive` for the model and hardware.
    ``recompute_logprobs`` adds the forward-only old-log-prob pass and its logits buffer.
    """

    def __init__(
        self,
        hardware: HardwareProfile,
        model: ModelProfile,
        coefficients: TrainingCoefficients | None = None,
        *,
        recompute_logprobs: bool = True,
    ) -> None:
        self.hardware = hardware
        self.model = model
        self.coef = coefficients if coefficients is not None else TrainingCoefficients.derive(model, hardware)
        self.recompute_logprobs = recompute_logprobs

    # -- per-layer costs --------------------------------------------------------------------------
    def _bg(self, cfg: TrainConfig) -> tuple[float, float]:
        if cfg.dp <= 1 or cfg.zero_stage == 0:
            return 0.0, 0.0
        bg = 0.4 if cfg.zero_stage >= 2 else 0.2
        return bg, min(1.5 * bg, 0.8)

    def layer_times(self, cfg: TrainConfig, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-layer ``(fwd_compute, bwd_compute, comm_per_direction)`` for micro-batches of
        ``cfg.micro_batch`` sequences padded to ``lengths`` (one entry per micro-batch)."""
        c, m, hw = self.coef, self.model, self.hardware
        L = np.asarray(lengths, dtype=float)
        scale = cfg.micro_batch / cfg.tp
        bg_f, bg_b = self._bg(cfg)
        kc_f, km_f = 1 + c.rho_compute * bg_f**c.theta, 1 + c.rho_memory * bg_f**c.theta
        kc_b, km_b = 1 + c.rho_compute * bg_b**c.theta, 1 + c.rho_memory * bg_b**c.theta
        core_f = c.alpha_attn_fwd * L * L
        fwd = (
            (c.beta_attn_fwd + c.alpha_mlp_fwd) * L * kc_f + (core_f + c.gamma_attn_fwd + c.beta_mlp_fwd) * km_f
        ) * scale
        core_b = c.alpha_attn_bwd * L * L + core_f  # backward recomputes the attention core
        bwd = (
            (c.beta_attn_bwd + c.alpha_mlp_bwd) * L * kc_b + (core_b + c.gamma_attn_bwd + c.beta_mlp_bwd) * km_b
        ) * scale
        tokens = cfg.micro_batch * L
        comm = np.zeros_like(L)
        if cfg.tp > 1:
            comm = comm + 2.0 * (2.0 * (cfg.tp - 1) / cfg.tp * tokens * m.hidden * m.dtype_bytes) / hw.bw_intra
        if m.is_moe and cfg.ep > 1:
            a2a = 2.0 * (cfg.ep - 1) / cfg.ep * tokens / cfg.tp * m.hidden * m.dtype_bytes * m.experts_per_token
            comm = comm + a2a / hw.bw_intra
        return fwd, bwd, comm

    def comm_ratio(self, cfg: TrainConfig, mean_len: float) -> float:
        """TP (and EP) communication over compute for one micro-batch of one sequence at ``mean_len``."""
        one = replace(cfg, micro_batch=1)
        fwd, bwd, comm = self.layer_times(one, np.array([float(mean_len)]))
        return float(2 * comm[0] / (fwd[0] + bwd[0]))

    def _head_time(self, cfg: TrainConfig, lengths: np.ndarray) -> np.ndarray:
        eff = self.hardware.flops_peak * self.hardware.training.mfu
        return 2.0 * self.model.hidden * self.model.vocab * cfg.micro_batch * lengths / cfg.tp / eff

    # -- memory -----------------------------------------------------------------------------------
    def local_params(self, cfg: TrainConfig) -> float:
        """Parameters held per GPU (dense part over tp*pp, experts also over ep)."""
        m = self.model
        ep = cfg.ep if m.is_moe else 1
        return m.dense_params / (cfg.tp * cfg.pp) + m.n_layers * m.expert_params_per_layer / (cfg.tp * cfg.pp * ep)

    def memory_bytes(self, cfg: TrainConfig, max_len: float, n_micro: int) -> float:
        """Peak bytes per GPU (the worst pipeline stage) for micro-batches up to ``max_len`` tokens."""
        m = self.model
        p = self.local_params(cfg)
        dp = cfg.dp
        weights = p * m.dtype_bytes / (dp if cfg.zero_stage >= 3 else 1)
        grads = p * 4.0 / (dp if cfg.zero_stage >= 2 else 1)
        optim = p * 12.0 / (dp if cfg.zero_stage >= 1 else 1)
        per_layer = _ACT_BYTES_PER_TOKEN_HIDDEN * cfg.micro_batch * max_len * m.hidden / cfg.tp
        layers_per_stage = m.n_layers / cfg.pp
        first = min(cfg.pp, n_micro) * layers_per_stage * per_layer
        last = layers_per_stage * per_layer
        if self.recompute_logprobs:
            last += 4.0 * cfg.micro_batch * max_len * m.vocab / cfg.tp
        return weights + grads + optim + max(first, last) + _WORKSPACE_BYTES

    def usable_memory(self) -> float:
        """Bytes per GPU the training memory model may use."""
        return self.hardware.mem_bytes * self.hardware.training.mem_fraction

    # -- the step -----------------------------------------------------------------------------------
    @staticmethod
    def micro_batch_lengths(lengths: Sequence[float] | np.ndarray, dp: int, micro_batch: int) -> np.ndarray:
        """Padded micro-batch lengths of the slowest DP replica.

        The sorted batch is dealt round-robin to ``dp`` replicas (deterministic length quantiles);
        the last replica receives the longest sequence of every stratum, so it dominates every other
        replica element-wise and its pipeline is the slowest. Its micro-batches are consecutive runs
        of ``micro_batch`` sequences, padded to their longest. Raises :class:`CostModelError` if the
        batch does not split evenly.
        """
        arr = np.sort(np.asarray(lengths, dtype=float))
        if arr.size == 0 or arr.size % (dp * micro_batch):
            raise CostModelError(f"batch of {arr.size} does not split into dp={dp} x micro_batch={micro_batch}")
        replica = arr[dp - 1 :: dp]
        return replica.reshape(-1, micro_batch).max(axis=1)

    def lower_bound(self, cfg: TrainConfig, micro_lengths: np.ndarray) -> float:
        """A cheap lower bound of the pipeline time: the busiest stage's total compute."""
        fwd, bwd, comm = self.layer_times(cfg, micro_lengths)
        per_layer = float((fwd + bwd + 2 * comm).sum())
        return per_layer * self.model.n_layers / cfg.pp

    def evaluate(self, cfg: TrainConfig, lengths: Sequence[float] | np.ndarray) -> TrainEstimate:
        """Predict one training step on ``lengths`` (one entry per sequence of the global batch).

        Returns a :class:`TrainEstimate` whose ``time`` is ``inf`` when the layout runs out of
        memory. Raises :class:`CostModelError` when the batch does not split evenly or ``pp`` does not
        divide the layer count.
        """
        m, hw = self.model, self.hardware
        if m.n_layers % cfg.pp:
            raise CostModelError(f"pp={cfg.pp} does not divide n_layers={m.n_layers}")
        micro = self.micro_batch_lengths(lengths, cfg.dp, cfg.micro_batch)
        n_micro = int(micro.size)
        mem = self.memory_bytes(cfg, float(micro.max()), n_micro)
        bubble = (cfg.pp - 1) / (cfg.pp + n_micro - 1)
        if mem > self.usable_memory():
            return TrainEstimate(math.inf, math.inf, 0.0, 0.0, 0.0, mem, True, n_micro, bubble)
        fwd, bwd, comm = self.layer_times(cfg, micro)
        lps = m.n_layers // cfg.pp
        stage_f = np.tile((fwd + comm) * lps, (cfg.pp, 1))
        stage_b = np.tile((bwd + comm) * lps, (cfg.pp, 1))
        head = self._head_time(cfg, micro)
        stage_f[-1] += head
        stage_b[-1] += 2 * head
        cross_node = cfg.tp * cfg.pp > hw.gpus_per_node
        p2p_bw = hw.bw_inter if cross_node else hw.bw_intra
        p2p = cfg.micro_batch * micro * m.hidden * m.dtype_bytes / cfg.tp / p2p_bw
        pipeline = simulate_1f1b(stage_f, stage_b, p2p)
        logprob = _forward_only(stage_f, p2p) if self.recompute_logprobs else 0.0
        dp_comm = 0.0
        if cfg.dp > 1:
            dp_bw = hw.bw_inter if cfg.n_gpus > hw.gpus_per_node else hw.bw_intra
            ep = cfg.ep if m.is_moe else 1
            dense = m.dense_params / (cfg.tp * cfg.pp)
            expert = m.n_layers * m.expert_params_per_layer / (cfg.tp * cfg.pp * ep)
            volume = (cfg.dp - 1) / cfg.dp * 2 * dense * m.dtype_bytes
            if ep < cfg.dp:
                volume += (cfg.dp / ep - 1) / (cfg.dp / ep) * 2 * expert * m.dtype_bytes
            dp_comm = volume / dp_bw * (0.7 if cfg.pp == 1 else 0.5)
        shard = cfg.dp if cfg.zero_stage >= 1 else 1
        optimizer = self.local_params(cfg) / shard * 32.0 / hw.mem_bw
        export = self.export_time()
        total = pipeline + logprob + dp_comm + optimizer + export
        return TrainEstimate(total, pipeline, dp_comm, optimizer, logprob, mem, False, n_micro, bubble, export)

    def export_time(self) -> float:
        """Seconds to stream the new weights to the rollout side after a step (``params * dtype_bytes /
        bw_inter``; 0 when the hardware profile sets ``training.export_weights = 0``)."""
        if not self.hardware.training.export_weights:
            return 0.0
        return self.model.params * self.model.dtype_bytes / self.hardware.bw_inter

    def step_time(self, cfg: TrainConfig, lengths: Sequence[float] | np.ndarray) -> float:
        """Seconds for one step (``inf`` if OOM); see :meth:`evaluate`."""
        return self.evaluate(cfg, lengths).time
