"""The GRP training decision tree: the best TP -> (EP) -> PP -> DP -> micro-batch layout for n GPUs.

Role: for a given number of training GPUs, return the layout with the smallest predicted step time
(docs/papers.md §1.3.2). Leaves are scored by :class:`~libra.policies.cost.training.TrainingCostModel`
on the real (non-uniform) batch lengths.

Feasibility rules (a layout is a leaf iff all hold; brute force over every (tp, ep, pp, dp, micro)
with the same rules gives the same optimum):

1. ``tp`` in the allowed set, ``tp <= gpus_per_node`` (TP stays inside a node), ``n % tp == 0``;
2. TP (+EP) communication / compute <= ``max_comm_ratio`` for one sequence of the mean length
   (ratio measured with dp = pp = 1, micro-batch 1);
3. MoE: ``ep`` divides ``n_experts`` and ``tp * ep <= gpus_per_node`` (All-to-All inside a node);
   dense: ``ep == 1``;
4. ``pp`` divides ``n_layers`` and ``n % (tp * pp) == 0``; ``dp = n / (tp * pp)``; MoE: ``dp % ep == 0``;
5. ``global_batch % dp == 0`` and GRPO groups are not split: ``(global_batch / dp) % group_size == 0``;
6. ``micro`` divides ``global_batch / dp`` and ``micro <= max_micro_batch``;
7. pipeline bubble ``(pp - 1) / (pp + n_micro - 1) <= max_bubble``;
8. the memory model does not report OOM, with the longest micro-batch sequence times ``headroom`` (>= 1:
   the margin for the growth the planner has observed, ``Replanner.headroom``; a layout chosen with none
   runs out of memory as soon as the longest sequence grows).

Pruning: a failed rule 1-3 cuts the whole subtree; along the micro-batch axis the bubble and the
memory only grow, so the first failure ends the branch; a leaf whose cheap lower bound already
reaches the caller's ``bound`` is skipped without simulating its pipeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from libra.policies.cost.training import TrainConfig, TrainEstimate, TrainingCostModel
from libra.policies.planner.types import PlannerConfig

__all__ = ["TrainChoice", "TrainingSearch", "divisors", "fits"]


def fits(cm: TrainingCostModel, cfg: TrainConfig, lengths: np.ndarray, headroom: float = 1.0,
         micro_lengths: np.ndarray | None = None) -> bool:
    """Whether layout ``cfg`` holds the batch ``lengths`` with its longest micro-batch sequence times
    ``headroom`` (rule 8; the Replanner also asks it of the deployed layout)."""
    if micro_lengths is None:
        micro_lengths = cm.micro_batch_lengths(np.sort(np.asarray(lengths, dtype=float)), cfg.dp, cfg.micro_batch)
    longest = float(micro_lengths.max()) * headroom
    return bool(cm.memory_bytes(cfg, longest, micro_lengths.size) <= cm.usable_memory())


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in ascending order."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, slots=True)
class TrainChoice:
    """A leaf of the decision tree and its estimate."""

    config: TrainConfig
    estimate: TrainEstimate

    @property
    def time(self) -> float:
        """Predicted step time in seconds."""
        return self.estimate.time


class TrainingSearch:
    """The decision tree over one training batch (``lengths``: one total length per sequence).

    ``leaves_evaluated`` counts pipeline simulations (a statistic for benchmarks).
    """

    def __init__(self, model: TrainingCostModel, config: PlannerConfig, lengths: np.ndarray,
                 headroom: float = 1.0) -> None:
        self.cm = model
        self.cfg = config
        self.headroom = max(1.0, float(headroom)) if math.isfinite(headroom) else 1.0
        self.lengths = np.sort(np.asarray(lengths, dtype=float))
        self.batch = int(self.lengths.size)
        self.mean_len = float(self.lengths.mean())
        self.leaves_evaluated = 0
        self._layer_divisors = divisors(self.cm.model.n_layers)
        self._structure_cache: dict[int, list[tuple[int, int, int, int]]] = {}
        self._micro_cache: dict[tuple[int, int], list[int]] = {}
        self._tp_ep = self._tp_ep_options()
        base = TrainConfig(1, 1, 1, 1)
        fwd, bwd, _ = self.cm.layer_times(base, self.lengths)
        self._work = float((fwd + bwd).sum()) * self.cm.model.n_layers

    def _tp_ep_options(self) -> list[tuple[int, int]]:
        m, hw = self.cm.model, self.cm.hardware
        out: list[tuple[int, int]] = []
        for tp in self.cfg.train_tps:
            if tp > hw.gpus_per_node:
                continue
            eps = [e for e in divisors(m.n_experts) if tp * e <= hw.gpus_per_node] if m.is_moe else [1]
            for ep in eps:
                probe = TrainConfig(tp, 1, 1, 1, ep=ep, zero_stage=self.cfg.zero_stage)
                if self.cm.comm_ratio(probe, self.mean_len) <= self.cfg.max_comm_ratio:
                    out.append((tp, ep))
        return out

    def lower_bound(self, n_train: int) -> float:
        """A lower bound on any layout's step time with ``n_train`` GPUs (ideal compute split)."""
        return self._work / n_train

    def configs(self, n_train: int) -> list[TrainConfig]:
        """Every layout passing rules 1-7 for ``n_train`` GPUs (memory is checked when scored)."""
        out: list[TrainConfig] = []
        for tp, ep, pp, dp in self._structures(n_train):
            for micro in self._micros(pp, dp):
                out.append(TrainConfig(tp, pp, dp, micro, ep=ep, zero_stage=self.cfg.zero_stage))
        return out

    def has_layout(self, n_train: int) -> bool:
        """True iff some (tp, ep, pp, dp) passes rules 1-5 for ``n_train`` GPUs."""
        return bool(self._structures(n_train))

    def _structures(self, n_train: int) -> list[tuple[int, int, int, int]]:
        cached = self._structure_cache.get(n_train)
        if cached is not None:
            return cached
        m, cfg = self.cm.model, self.cfg
        out = []
        for tp, ep in self._tp_ep:
            if n_train % tp:
                continue
            for pp in self._layer_divisors:
                if n_train % (tp * pp):
                    continue
                dp = n_train // (tp * pp)
                if m.is_moe and dp % ep:
                    continue
                if self.batch % dp or (self.batch // dp) % cfg.group_size:
                    continue
                out.append((tp, ep, pp, dp))
        self._structure_cache[n_train] = out
        return out

    def _micros(self, pp: int, dp: int) -> list[int]:
        cached = self._micro_cache.get((pp, dp))
        if cached is not None:
            return cached
        per_replica = self.batch // dp
        out = []
        for micro in divisors(per_replica):
            if micro > self.cfg.max_micro_batch:
                break
            n_micro = per_replica // micro
            if (pp - 1) / (pp + n_micro - 1) > self.cfg.max_bubble:
                break  # the bubble only grows with the micro-batch size
            out.append(micro)
        self._micro_cache[(pp, dp)] = out
        return out

    def best(self, n_train: int, bound: float = math.inf) -> TrainChoice | None:
        """The fastest feasible layout for ``n_train`` GPUs, or None if none exists or none can beat
        ``bound`` (leaves whose lower bound reaches ``bound`` are skipped)."""
        best: TrainChoice | None = None
        limit = bound
        for tp, ep, pp, dp in self._structures(n_train):
            for micro in self._micros(pp, dp):
                cfg = TrainConfig(tp, pp, dp, micro, ep=ep, zero_stage=self.cfg.zero_stage)
                micro_lengths = self.cm.micro_batch_lengths(self.lengths, dp, micro)
                if not fits(self.cm, cfg, self.lengths, self.headroom, micro_lengths):
                    break  # memory only grows with the micro-batch size
                if self.cm.lower_bound(cfg, micro_lengths) >= limit:
                    continue
                self.leaves_evaluated += 1
                est = self.cm.evaluate(cfg, self.lengths)
                if est.time < limit:
                    best, limit = TrainChoice(cfg, est), est.time
        return best
