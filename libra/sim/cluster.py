"""Cluster layouts and per-instance cost arithmetic of the rollout simulator (``libra.sim.engine``).

Role: turn an allocation policy name and a GPU count into a static :class:`Layout` (rollout instances
with their bucket, TP degree and node; training GPUs; whether rollout and training time-share the same
GPUs), and give the simulator fast scalar versions of the cost model's rollout quantities.

Allocation policies. Static layouts, built here:

- ``static_uniform``: half the GPUs train, half serve as homogeneous TP-2 instances in one bucket;
- ``hetero``: the Libra 48-GPU R2E layout scaled to the cluster: a third of the GPUs (whole 8-GPU nodes,
  at least one) serve, each node as ``[TP1, TP1, TP2, TP4]``, in three buckets (TP1 short, TP2 medium,
  TP4 long, thresholds from the workload); the rest train;
- ``colocated``: every GPU serves (homogeneous TP-2, one bucket) and then trains, synchronously (verl's
  colocated mode; the simulator forces a policy lag of 1).

Planner-driven allocations (:data:`PLANNER_ALLOCATIONS`: ``grp_homogeneous``, ``grp``, ``grp_ehp``,
``static_best``, ``greedy``) start from a plan and re-plan online; their layouts come from
:mod:`libra.sim.planner`, not from :func:`make_layout`.

:class:`InstanceCosts` wraps :class:`~libra.policies.cost.RolloutCostModel`: for a dense model the
decode step is exactly linear in running sequences and KV tokens, so it is fitted once per TP degree
and evaluated as ``a + b·tokens + c·seqs`` (MoE models call the cost model each time). KV migration
costs ``fixed + tokens·kv_bytes/bandwidth`` (defaults: 25 GB/s same node, 10 GB/s across nodes, so
40K tokens move in < 330 ms on one node and ≤ 733 ms across nodes, docs/papers.md §1.4.3).
Pure: no I/O, no clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from libra.policies.cost import RolloutCostModel
from libra.policies.routing.interface import BucketSpec, MigrationQuery

__all__ = ["ALLOCATIONS", "PLANNER_ALLOCATIONS", "STATIC_ALLOCATIONS", "InstanceCosts", "Layout", "RolloutInstanceSpec",
           "SimConfigError", "homogeneous_layout", "make_layout"]

STATIC_ALLOCATIONS: Final = ("static_uniform", "hetero", "colocated")
PLANNER_ALLOCATIONS: Final = ("grp_homogeneous", "grp", "grp_ehp", "static_best", "greedy")
ALLOCATIONS: Final = STATIC_ALLOCATIONS + PLANNER_ALLOCATIONS
NODE_GPUS: Final = 8
HETERO_NODE: Final = (1, 1, 2, 4)


class SimConfigError(ValueError):
    """A simulator setting that cannot work (names the setting and the accepted values)."""


@dataclass(frozen=True, slots=True)
class RolloutInstanceSpec:
    """One simulated rollout instance: its actor id, node, bucket and TP degree."""

    id: str
    node: str
    bucket: str
    tp: int


@dataclass(frozen=True, slots=True)
class Layout:
    """A static allocation: rollout instances, buckets, training GPUs, time-sharing flag."""

    name: str
    gpus: int
    instances: tuple[RolloutInstanceSpec, ...]
    buckets: tuple[BucketSpec, ...]
    train_gpus: int
    colocated: bool = False
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def rollout_gpus(self) -> int:
        return sum(i.tp for i in self.instances)


def homogeneous_layout(name: str, gpus: int, rollout_gpus: int, tp: int, train_gpus: int,
                       colocated: bool = False) -> Layout:
    """``rollout_gpus // tp`` TP-``tp`` instances in one bucket (``"all"``), ``train_gpus`` training
    GPUs; raises :class:`SimConfigError` if not one instance fits."""
    n = rollout_gpus // tp
    if n < 1:
        raise SimConfigError(f"allocation {name!r}: {rollout_gpus} rollout GPUs cannot hold one TP-{tp} instance")
    insts = tuple(RolloutInstanceSpec(f"r{i:03d}", f"n{(i * tp) // NODE_GPUS}", "all", tp) for i in range(n))
    return Layout(name, gpus, insts, (BucketSpec("all", tp, 1 << 30),), train_gpus, colocated)


def make_layout(allocation: str, gpus: int, bucket_thresholds: tuple[int, ...] = (4000, 12000, 30000)) -> Layout:
    """The :class:`Layout` of ``allocation`` on ``gpus`` GPUs (see the module docstring).

    Raises :class:`SimConfigError` for an unknown policy or a cluster too small for it (``hetero`` needs
    at least 16 GPUs: one rollout node and one training node).
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 2:
        raise SimConfigError(f"--gpus must be an integer >= 2, got {gpus!r}")
    if allocation == "static_uniform":
        return homogeneous_layout(allocation, gpus, gpus // 2, 2, gpus - gpus // 2, False)
    if allocation == "colocated":
        return homogeneous_layout(allocation, gpus, gpus, 2, gpus, True)
    if allocation == "hetero":
        if gpus < 2 * NODE_GPUS:
            raise SimConfigError(f"allocation 'hetero' needs at least {2 * NODE_GPUS} GPUs, got {gpus}")
        nodes = max(1, round(gpus / 3 / NODE_GPUS))
        names = ("short", "medium", "long")
        thr = tuple(bucket_thresholds)[:3]
        if len(thr) < 3:
            raise SimConfigError(f"allocation 'hetero' needs 3 bucket thresholds, got {bucket_thresholds}")
        tps = sorted(set(HETERO_NODE))
        buckets = tuple(BucketSpec(n, tp, t) for n, tp, t in zip(names, tps, thr))
        by_tp = {b.tp: b.name for b in buckets}
        insts = []
        for node in range(nodes):
            for k, tp in enumerate(HETERO_NODE):
                insts.append(RolloutInstanceSpec(f"r{node}-{k}-tp{tp}", f"n{node}", by_tp[tp], tp))
        return Layout(allocation, gpus, tuple(insts), buckets, gpus - nodes * NODE_GPUS, False,
                      {"node": "[TP1, TP1, TP2, TP4]"})
    if allocation in PLANNER_ALLOCATIONS:
        raise SimConfigError(f"allocation {allocation!r} is planner-driven: its layout comes from libra.sim.planner")
    raise SimConfigError(f"unknown allocation {allocation!r} (known: {', '.join(ALLOCATIONS)})")


class InstanceCosts:
    """Fast scalar rollout costs for the simulator (see the module docstring)."""

    def __init__(self, cm: RolloutCostModel, *, kv_bw_same_node: float = 25e9, kv_bw_cross_node: float = 10e9,
                 kv_fixed_s: float = 0.02, reserve_tokens: int = 8192) -> None:
        if not (kv_bw_same_node > 0 and kv_bw_cross_node > 0 and kv_fixed_s >= 0 and reserve_tokens > 0):
            raise SimConfigError("KV bandwidths and reserve_tokens must be > 0, kv_fixed_s >= 0")
        self.cm = cm
        self.kv_bw_same_node = kv_bw_same_node
        self.kv_bw_cross_node = kv_bw_cross_node
        self.kv_fixed_s = kv_fixed_s
        self.reserve_tokens = reserve_tokens
        self.request_overhead_s = float(cm.cal.per_request_overhead_s)
        self.turn_latency_s = float(cm.cal.per_turn_latency_s)
        self._lin: dict[int, tuple[float, float, float]] = {}
        self._kv_bytes_full = float(cm.kv_bytes_per_token(1))

    def _fit(self, tp: int) -> tuple[float, float, float]:
        lin = self._lin.get(tp)
        if lin is None:
            d = self.cm.decode_step
            base = float(d(tp, 1, 0.0))
            per_tok = (float(d(tp, 1, 1e6)) - base) / 1e6
            per_seq = float(d(tp, 2, 0.0)) - base
            lin = (base - per_seq, per_tok, per_seq)
            self._lin[tp] = lin
        return lin

    def decode_step(self, tp: int, seqs: int, tokens: float) -> float:
        """Seconds of one decode step with ``seqs`` running sequences holding ``tokens`` of KV."""
        if self.cm.model.is_moe:
            return float(self.cm.decode_step(tp, seqs, tokens))
        a, b, c = self._fit(tp)
        return a + b * tokens + c * max(1, seqs)

    def prefill(self, tp: int, tokens: float) -> float:
        """Seconds to prefill ``tokens`` new tokens of one sequence (0 for none)."""
        return float(self.cm.prefill_time(tp, tokens)) if tokens > 0 else 0.0

    def token_capacity(self, tp: int) -> float:
        return float(self.cm.token_capacity(tp))

    def max_seqs(self, tp: int) -> int:
        """Broker credit of a TP-``tp`` instance: sequences of ``reserve_tokens`` that fit its KV cache."""
        return max(1, min(int(self.cm.cal.max_batch), int(self.token_capacity(tp) // self.reserve_tokens)))

    def kv_seconds(self, q: MigrationQuery) -> float:
        """KV transfer of ``q.seq_len`` tokens (offload, reshard, load)."""
        bw = self.kv_bw_same_node if q.same_node else self.kv_bw_cross_node
        return self.kv_fixed_s + q.seq_len * self._kv_bytes_full / bw

    def reprefill_seconds(self, q: MigrationQuery) -> float:
        """Recomputing ``q.seq_len`` tokens of context on the target."""
        return self.prefill(q.dst_tp, q.seq_len)
