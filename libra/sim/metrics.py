"""Metrics of a simulated run (``libra.sim.engine``): per-trajectory records and the run summary.

Definitions (``makespan`` = virtual time when the last training step ends):

- ``tokens_per_s``: Σ over trajectories of (prompt + generated + tool payload tokens) / makespan (the
  Libra analysis script's Σ(input + output) / time); ``trajectories_per_s`` likewise;
- ``step_time_s``: intervals between consecutive training-step ends (the first from 0): mean, p50, p99;
- ``rollout_time_s``: mean over steps of (last trajectory end − release of the step);
  ``train_time_s``: mean training-step duration; ``*_total_s`` the sums;
- ``gpu_idle_fraction``: 1 − (Σ instance busy seconds × TP + Σ training seconds × training GPUs) /
  (GPUs × makespan); an instance is busy while it decodes or prefills;
- ``routing_accuracy``: over trajectories with at least one tool call, the share whose logical bucket
  chosen at the first tool return (the ``Assign.route`` bucket of the turn after it) equals the bucket of
  the true remaining *response* tokens at that point (generated + tool-returned tokens still to come,
  ``TrajectorySpec.remaining_response_after_returns[0]``; bucket thresholds are in that unit);
- ``migrated_token_ratio``: context tokens moved or recomputed because a trajectory changed instance
  (counted once per move, whole context) / Σ trajectory tokens;
- ``batching``: the execution model run (``streaming`` or ``barrier``, :mod:`libra.sim.batching`);
  ``staleness``: over every trained trajectory, the training version that consumed it minus the version
  its first turn was generated with: mean, max, and ``step_max_mean`` (the mean over steps of each
  step's maximum).

Pure: reads the simulator's state, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from libra.broker.state import BrokerState
    from libra.sim.batching import BatchFormer
    from libra.sim.cluster import Layout
    from libra.sim.config import SimConfig
    from libra.sim.instance import SimInstance
    from libra.traces import TrajectorySpec

__all__ = ["RunView", "SimResult", "TrajRecord", "summarize"]


@dataclass(frozen=True, slots=True)
class TrajRecord:
    """One finished trajectory."""

    id: str
    step: int
    tokens: int
    start: float
    end: float
    first_route: str | None
    true_bucket: str | None
    migrations: int
    migrated_tokens: int


@dataclass(frozen=True, slots=True)
class SimResult:
    """The run summary (see the module docstring); :meth:`to_dict` is the ``--json`` object."""

    router: str
    allocation: str
    gpus: int
    rollout_gpus: int
    train_gpus: int
    steps: int
    trajectories: int
    tokens: int
    makespan_s: float
    tokens_per_s: float
    trajectories_per_s: float
    step_time_s: dict[str, float]
    rollout_time_s: float
    train_time_s: float
    rollout_time_total_s: float
    train_time_total_s: float
    gpu_idle_fraction: float
    routing_accuracy: float
    routing_decisions: int
    migrated_token_ratio: float
    migrations: int
    kv_migrations: int
    reprefill_migrations: int
    buckets: list[dict[str, Any]]
    bucket_turns: dict[str, int]
    batching: str = "barrier"
    staleness: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: _clean(v) for k, v in asdict(self).items()}


def _clean(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 6) if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


class RunView(Protocol):
    """What :func:`summarize` reads of a finished run (a :class:`~libra.sim.engine.Simulator` has it all)."""

    cfg: SimConfig
    layout: Layout
    broker: BrokerState
    instances: Mapping[bytes, SimInstance]
    by_step: Sequence[Sequence[TrajectorySpec]]
    records: Sequence[TrajRecord]
    now: float
    rollout_start: Sequence[float]
    rollout_end: Sequence[float]
    train_start: Sequence[float]
    train_end: Sequence[float]
    kv_moves: int
    reprefill_moves: int
    former: BatchFormer


def summarize(sim: RunView) -> SimResult:
    """Compute the :class:`SimResult` of a finished simulator."""
    recs = sim.records
    lay = sim.layout
    ends = [t for t in sim.train_end if not math.isnan(t)]
    makespan = max(ends) if ends else sim.now
    steps = np.diff([0.0, *ends]) if ends else np.zeros(1)
    tokens = sum(r.tokens for r in recs)
    scored = [r for r in recs if r.true_bucket is not None and r.first_route is not None]
    hits = sum(r.first_route == r.true_bucket for r in scored)
    migrated = sum(r.migrated_tokens for r in recs)
    rollout = [e - s for s, e in zip(sim.rollout_start, sim.rollout_end) if not (math.isnan(s) or math.isnan(e))]
    train = [e - s for s, e in zip(sim.train_start, sim.train_end) if not (math.isnan(s) or math.isnan(e))]
    busy = sum(i.busy_s * i.tp for i in sim.instances.values()) + sum(train) * lay.train_gpus
    idle = 1.0 - busy / (lay.gpus * makespan) if makespan > 0 else 0.0
    turns: dict[str, int] = {b.name: 0 for b in lay.buckets}
    for i in sim.instances.values():
        turns[i.spec.bucket] += sim.broker.actors[i.peer].completed
    return SimResult(
        router=sim.cfg.router,
        allocation=lay.name,
        gpus=lay.gpus,
        rollout_gpus=lay.rollout_gpus,
        train_gpus=lay.train_gpus,
        steps=len(sim.by_step),
        trajectories=len(recs),
        tokens=tokens,
        makespan_s=makespan,
        tokens_per_s=tokens / makespan if makespan > 0 else 0.0,
        trajectories_per_s=len(recs) / makespan if makespan > 0 else 0.0,
        step_time_s={"mean": float(np.mean(steps)), "p50": float(np.percentile(steps, 50)),
                     "p99": float(np.percentile(steps, 99))},
        rollout_time_s=float(np.mean(rollout)) if rollout else 0.0,
        train_time_s=float(np.mean(train)) if train else 0.0,
        rollout_time_total_s=float(sum(rollout)),
        train_time_total_s=float(sum(train)),
        gpu_idle_fraction=max(0.0, idle),
        routing_accuracy=hits / len(scored) if scored else math.nan,
        routing_decisions=len(scored),
        migrated_token_ratio=migrated / tokens if tokens else 0.0,
        migrations=sum(r.migrations for r in recs),
        kv_migrations=sim.kv_moves,
        reprefill_migrations=sim.reprefill_moves,
        buckets=[{"name": b.name, "tp": b.tp, "max_tokens": b.max_tokens,
                  "instances": sum(1 for i in lay.instances if i.bucket == b.name)} for b in lay.buckets],
        bucket_turns=turns,
        batching=sim.former.mode,
        staleness=_staleness(sim.former.staleness),
    )


def _staleness(per_step: Sequence[Sequence[int]]) -> dict[str, float]:
    flat = [x for s in per_step for x in s]
    if not flat:
        return {"mean": 0.0, "max": 0.0, "step_max_mean": 0.0}
    return {"mean": float(np.mean(flat)), "max": float(max(flat)),
            "step_max_mean": float(np.mean([max(s) for s in per_step if s]))}
