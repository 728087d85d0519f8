"""Value types shared by the Global Resource Planner modules: workload, search settings, plans.

Role: the inputs (:class:`Workload`, :class:`PlannerConfig`) and the decision (:class:`Plan`) of
GPU allocation, with no search logic. Plans are frozen values; C-MLFQ buckets are derived from them
with :meth:`Plan.buckets`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from libra.policies.cost.training import TrainConfig

__all__ = ["PLANNER_OBJECTIVES", "ROUTINGS", "Plan", "PlannerConfig", "PlannerError", "RolloutBucket", "RolloutInstance", "Workload",
           "as_workload", "pipeline_objective"]


#: ``PlannerConfig.routing`` values (see :class:`PlannerConfig`).
ROUTINGS = ("by_length", "length_blind", "round_robin", "start_small")
PLANNER_OBJECTIVES = ("throughput", "pipeline")


class PlannerError(ValueError):
    """Bad planner input (the message names the field and value)."""


@dataclass(frozen=True, slots=True)
class Workload:
    """Observed request lengths: ``prompt_tokens[i]`` and ``gen_tokens[i]`` of request ``i``, and
    ``turns[i]``: how many serving calls it makes (a multi-turn agentic trajectory is one request of
    the planner with one call per generate turn, each paying the serving overhead; 1 by default),
    and ``tool_seconds[i]``: the seconds it spends waiting on tool calls between its turns (none by
    default). Tool time sits on the trajectory's serial critical path but holds no batch slot of the
    rollout instance (see ``rollout_dp.agentic_cost``).

    Build with :meth:`from_pairs`; arrays are read-only float64.
    """

    prompt_tokens: np.ndarray
    gen_tokens: np.ndarray
    turns: np.ndarray | None = None
    tool_seconds: np.ndarray | None = None

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[float, ...]]) -> Workload:
        """From ``(prompt_len, output_len)`` pairs, ``(prompt_len, output_len, turns)`` triples or
        ``(prompt_len, output_len, turns, tool_seconds)`` rows (all rows the same width).
        Raises :class:`PlannerError` on an empty list, a negative / non-finite / all-zero entry,
        ``turns < 1`` or a negative / non-finite ``tool_seconds`` (naming its index)."""
        rows = [tuple(p) for p in pairs]
        if not rows:
            raise PlannerError("workload is empty: need at least one (prompt_len, output_len) pair")
        width = len(rows[0])
        for i, row in enumerate(rows):
            if len(row) not in (2, 3, 4) or len(row) != width:
                raise PlannerError(
                    f"workload[{i}] must be (prompt_len, output_len[, turns[, tool_seconds]]) like the rest, got {row!r}"
                )
            p, g = row[0], row[1]
            if not (math.isfinite(p) and math.isfinite(g)) or p < 0 or g < 0 or p + g <= 0:
                raise PlannerError(f"workload[{i}] has invalid lengths {row!r} (need finite, >= 0, total > 0)")
            if width >= 3 and not (math.isfinite(row[2]) and row[2] >= 1):
                raise PlannerError(f"workload[{i}] has invalid turns {row[2]!r} (need >= 1)")
            if width == 4 and not (math.isfinite(row[3]) and row[3] >= 0):
                raise PlannerError(f"workload[{i}] has invalid tool_seconds {row[3]!r} (need finite, >= 0)")
        arr = np.asarray(rows, dtype=float)
        prompt, gen = arr[:, 0].copy(), arr[:, 1].copy()
        turns = arr[:, 2].copy() if width >= 3 else None
        tool = arr[:, 3].copy() if width == 4 else None
        for a in (prompt, gen, turns, tool):
            if a is not None:
                a.setflags(write=False)
        return cls(prompt, gen, turns, tool)

    @property
    def calls(self) -> np.ndarray:
        """Serving calls per request (``turns``, or ones)."""
        return self.turns if self.turns is not None else np.ones_like(self.prompt_tokens)

    @property
    def size(self) -> int:
        """Number of requests."""
        return int(self.prompt_tokens.size)

    @property
    def totals(self) -> np.ndarray:
        """Total length (prompt + generated) of every request."""
        return self.prompt_tokens + self.gen_tokens

    def training_lengths(self, batch: int) -> np.ndarray:
        """``batch`` sequence lengths at evenly spaced quantiles of the totals (deterministic)."""
        totals = np.sort(self.totals)
        idx = np.minimum(((np.arange(batch) + 0.5) * totals.size / batch).astype(int), totals.size - 1)
        return totals[idx]


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """Search space and rules of the GRP search (defaults follow docs/papers.md §1.3.2).

    ``global_batch`` trajectories per step in GRPO groups of ``group_size``; ``granularity`` steps
    ``n_train``; ``max_dp_requests`` caps the rollout DP's quantile sample; ``require_heterogeneous``
    demands >= 2 distinct rollout TP degrees; ``max_instances`` caps rollout instances (None: no cap).
    ``pooled_buckets`` (default): score rollout layouts as deployed, the instances of one TP degree
    pooling one bucket's requests (``planner/buckets.py``); False: the reference's instance-level DP,
    one contiguous length range per instance (``planner/rollout_dp.py``). ``overlap_steps``: how many
    consecutive steps' rollouts may overlap (the asynchronous pipeline's policy lag; 1 = synchronous);
    the pooled model divides the longest request's decode tail by it.

    ``routing``: the router the plan will be deployed under, which decides how a layout is scored
    (``planner/buckets.py``). ``"by_length"`` (default): every request stays in the bucket of its
    length, a longer request never on a smaller TP than a shorter one (C-MLFQ-like routers; the
    pooled-bucket DP). ``"length_blind"``: the router ignores buckets and spreads trajectories over
    all rollout instances by least connections on ``load / tp`` (``least_loaded``), so each instance
    serves ``tp / W`` of *all* requests (``W``: rollout GPUs of the layout) with the full length mix;
    ``"round_robin"``: the same with ``1 / I`` each (``I`` instances). Under both blind modes the
    rollout time is the max over the TP degrees present, the longest trajectory may land on the worst
    of them, and heterogeneity only costs (``buckets.BlindTable``). ``"start_small"``: what
    C-MLFQ realises (docs/papers.md §1.4.3): every request starts in the smallest-TP bucket, which
    also carries every request's first turn (prefill, first generation, serving overhead), and moves
    at its first tool return to the bucket of its length, paying a re-prefill of its context there;
    single-turn requests never leave the smallest bucket (``planner/start_small.py``). Every mode but
    ``"by_length"`` needs ``pooled_buckets``.

    ``exact_pipeline`` (default True): with ``overlap_steps > 1`` the search minimises the full
    :attr:`Plan.objective` (pipeline bound ``(t_chain + t_train) / L`` included) exactly for every mode,
    re-solving the rollout DP on pipeline-shifted costs for each visited ``n_train``
    (``planner/search.py``); False: the rollout DP minimises ``T_rollout`` alone (the earlier search,
    which can return a plan predicted slower than another layout on the same data; kept because the
    simulated ablation measured it faster, see BENCHMARKS.md). No effect at ``overlap_steps = 1``.

    ``objective`` (default ``"throughput"``, docs/papers.md §1.3.1, §1.7): minimise ``max(T_train,
    T_rollout)`` with ``T_rollout`` the busiest instance's work (stalls + generated tokens / running batch ×
    decode step); no term models the longest trajectory's chain (each bucket's ``cost = work``, no pipeline
    shift, :attr:`Plan.objective` without ``t_chain``), as for a trainer that streams batches.
    ``"pipeline"``: the earlier objective (each bucket's ``max(work, chain / L)`` and, with ``overlap_steps
    > 1``, the pipeline bound ``(t_chain + t_train) / L``), kept for comparison.

    ``residency`` (default True): size each instance's running batch and its KV by the
    generation-weighted context of its requests (long requests stay resident longest;
    ``RolloutCostModel.resident_context``); False: by the mean request (the earlier model, kept for
    ``python -m libra.bench planner_accuracy``, which measures both against the simulator).
    """

    n_gpus: int
    global_batch: int
    group_size: int = 16
    train_tps: tuple[int, ...] = (1, 2, 4, 8)
    rollout_tps: tuple[int, ...] = (1, 2, 4, 8)
    granularity: int = 1
    min_train_gpus: int = 1
    min_rollout_gpus: int = 1
    max_dp_requests: int = 64
    require_heterogeneous: bool = False
    max_instances: int | None = None
    max_comm_ratio: float = 0.5
    max_bubble: float = 0.3
    max_micro_batch: int = 16
    zero_stage: int = 1
    pooled_buckets: bool = True
    overlap_steps: int = 1
    routing: str = "by_length"
    exact_pipeline: bool = True
    residency: bool = True
    objective: str = "throughput"

    def __post_init__(self) -> None:
        if self.objective not in PLANNER_OBJECTIVES:
            raise PlannerError(f"PlannerConfig.objective must be one of {PLANNER_OBJECTIVES}, got {self.objective!r}")
        for name in ("n_gpus", "global_batch", "group_size", "granularity", "max_dp_requests", "max_micro_batch",
                     "overlap_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlannerError(f"PlannerConfig.{name} must be a positive integer, got {value!r}")
        for name in ("min_train_gpus", "min_rollout_gpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlannerError(f"PlannerConfig.{name} must be an integer >= 0, got {value!r}")
        for name in ("train_tps", "rollout_tps"):
            tps = getattr(self, name)
            if not tps or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tps):
                raise PlannerError(f"PlannerConfig.{name} must be non-empty positive integers, got {tps!r}")
            object.__setattr__(self, name, tuple(sorted(set(tps))))
        if self.global_batch % self.group_size:
            raise PlannerError(
                f"PlannerConfig.global_batch={self.global_batch} is not a multiple of group_size={self.group_size}"
            )
        if self.min_train_gpus + self.min_rollout_gpus > self.n_gpus:
            raise PlannerError(
                f"min_train_gpus + min_rollout_gpus = {self.min_train_gpus + self.min_rollout_gpus} "
                f"exceeds n_gpus={self.n_gpus}"
            )
        if self.routing not in ROUTINGS:
            raise PlannerError(f"PlannerConfig.routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.routing != "by_length" and not self.pooled_buckets:  # blind and start-small models are bucket models
            raise PlannerError(f"PlannerConfig.routing={self.routing!r} needs pooled_buckets=True")
        if self.max_instances is not None and self.max_instances < 1:
            raise PlannerError(f"PlannerConfig.max_instances must be >= 1 or None, got {self.max_instances!r}")

    def train_candidates(self) -> list[int]:
        """``n_train`` values the outer loop visits (multiples of ``granularity`` within the minimums)."""
        lo = max(1, self.min_train_gpus)
        hi = self.n_gpus - self.min_rollout_gpus
        return [n for n in range(lo, hi + 1) if n % self.granularity == 0]


@dataclass(frozen=True, slots=True)
class RolloutInstance:
    """One rollout instance: its TP degree and the request-length range ``[min_tokens, max_tokens]``
    it serves (in sorted order), with its predicted busy time and (weighted) request count."""

    tp: int
    min_tokens: float
    max_tokens: float
    n_requests: float
    time: float


@dataclass(frozen=True, slots=True)
class RolloutBucket:
    """A C-MLFQ bucket: the instances of one TP degree and the longest length routed to it."""

    tp: int
    n_instances: int
    max_tokens: float


@dataclass(frozen=True, slots=True)
class Plan:
    """A GPU allocation: ``n_train`` training GPUs with layout ``train``, rollout instances, and the
    predicted stage times. ``objective = max(t_train, t_rollout)`` (the stages overlap).

    ``colocated``: time-sharing (verl's colocated mode): the same GPUs first roll out, then train, so
    ``n_train`` and the rollout instances may each cover every GPU and ``objective = t_train +
    t_rollout``."""

    n_gpus: int
    n_train: int
    train: TrainConfig | None
    rollout: tuple[RolloutInstance, ...]
    t_train: float
    t_rollout: float
    allocator: str = "grp"
    colocated: bool = False
    t_chain: float = 0.0
    overlap_steps: int = 1
    throughput: bool = False  # scored under PlannerConfig.objective = "throughput": no chain term

    @property
    def objective(self) -> float:
        """Predicted iteration time: ``max(t_train, t_rollout)`` (and, unless :attr:`throughput`, the
        lag-``L`` pipeline bound ``(t_chain + t_train) / L`` when ``overlap_steps > 1``), or their sum when
        colocated."""
        if self.colocated:
            return self.t_train + self.t_rollout
        if self.throughput:
            return max(self.t_train, self.t_rollout)
        return pipeline_objective(self.t_train, self.t_rollout, self.t_chain, self.overlap_steps)

    @property
    def rollout_tps(self) -> tuple[int, ...]:
        """The rollout TP multiset, sorted ascending."""
        return tuple(sorted(inst.tp for inst in self.rollout))

    @property
    def n_rollout(self) -> int:
        """GPUs in rollout instances."""
        return sum(inst.tp for inst in self.rollout)

    @property
    def n_idle(self) -> int:
        """GPUs the plan leaves unused (more would not lower the objective; the EHP can borrow them)."""
        if self.colocated:
            return self.n_gpus - max(self.n_train, self.n_rollout)
        return self.n_gpus - self.n_train - self.n_rollout

    def layout_key(self) -> tuple[int, TrainConfig | None, tuple[int, ...], bool]:
        """What a reconfiguration changes: ``(n_train, train layout, rollout TP multiset, colocated)``."""
        return (self.n_train, self.train, self.rollout_tps, self.colocated)

    def same_layout(self, other: Plan | None) -> bool:
        """True iff ``other`` deploys the same layout (times may differ)."""
        return other is not None and self.layout_key() == other.layout_key()

    def buckets(self) -> tuple[RolloutBucket, ...]:
        """C-MLFQ buckets, smallest TP first; thresholds are the longest length each TP serves,
        made non-decreasing, and the last bucket takes everything (``inf``)."""
        by_tp: dict[int, list[RolloutInstance]] = {}
        for inst in self.rollout:
            by_tp.setdefault(inst.tp, []).append(inst)
        out: list[RolloutBucket] = []
        running = 0.0
        tps = sorted(by_tp)
        for k, tp in enumerate(tps):
            running = max(running, max(i.max_tokens for i in by_tp[tp]))
            out.append(RolloutBucket(tp, len(by_tp[tp]), math.inf if k == len(tps) - 1 else running))
        return tuple(out)


def pipeline_objective(t_train: float, t_rollout: float, t_chain: float, overlap_steps: int) -> float:
    """``max(t_train, t_rollout)``, and with ``overlap_steps = L > 1`` at least ``(t_chain + t_train) / L``
    (see :class:`Plan`)."""
    obj = max(t_train, t_rollout)
    if overlap_steps > 1:
        obj = max(obj, (t_chain + t_train) / overlap_steps)
    return obj


def as_workload(requests: Workload | Sequence[tuple[float, float]]) -> Workload:
    """Accept a :class:`Workload` or ``(prompt_len, output_len)`` pairs."""
    return requests if isinstance(requests, Workload) else Workload.from_pairs(requests)


class Allocator(Protocol):
    """An allocation policy: proposes plans and scores deployed ones with the shared evaluator."""

    name: str

    def propose(self, workload: Workload, current: Plan | None = None) -> Plan:
        """The plan this policy wants for ``workload`` (``current``: the deployed plan, if any)."""
        ...

    def evaluate(self, plan: Plan, workload: Workload) -> Plan:
        """``plan``'s layout re-scored on ``workload``."""
        ...
