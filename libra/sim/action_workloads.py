"""Seeded workload generators for the action-level simulator (docs/papers.md §5.2).

A workload is a batch of :class:`TrajectoryPlan` s: each trajectory alternates LLM "think" gaps (fixed time,
not contended here) and actions (:class:`ActionPlan`), then a final think. Three families, every constant a
calibration guess ([G]) aimed at the paper's reported aggregates ([W]):

- ``coding`` (AI coding, SWE-like sandboxes): 10–40 actions per trajectory. 55 % file reads/edits (1 core,
  mean 0.25 s), 25 % scripts (1 core, mean 0.8 s), 20 % builds/tests that are CPU-elastic (1..16 cores,
  Amdahl parallel fraction U(0.6, 0.8), one-core time lognormal mean 8 s, σ 1.0: heavy tail), and a final
  elastic reward test run. Mean action time at the base DoP of 4 cores ≈ 1.1 s; think gaps lognormal with
  mean ``1.0 · (1/0.47 − 1)`` s so the environment is busy ≈ 47 % of a trajectory's life at base DoP.
- ``mopd`` (multi-teacher on-policy distillation): GRPO groups of 16 share a prompt and therefore a teacher
  (9 teachers, Zipf s=1 popularity). Each trajectory makes 1–2 teacher log-prob calls after long
  generations (group-correlated lognormal think, ``think_mean_s`` in total); each call holds a TP-4 replica
  (4 GPUs) for 0.6–0.7 s. Teacher checkpoints are 40 GB in host RAM (restore ≈ 0.4 s at 25 GB/s per GPU); on
  the GPUs a replica takes its 10 GB shard per GPU plus ``reserve_gb`` (default 0: a log-prob call is one
  prefill forward, no KV cache outlives it; its activations use the simulator's per-GPU workspace).
  The think time sets the offered load. Two calibrations (:data:`MOPD_LOADS`):

  - ``"breakdown"`` (default, 1,650 s): the paper's ACT breakdown of its own MOPD deployment (docs/papers.md
    §2.6 [W]: tangram on 10 GPUs, queueing 0.081 s at batch 2,048 and 15.05 s at 3,072). The restore
    overhead in that table (0.2 s a call) only arises when teachers share GPUs, so the table describes the
    10-GPU pool, not the 36. At 1,650 s tangram's queueing on 10 GPUs at batch 3,072 is 6–17 s over seeds
    0–3 (mean 11 s; over seeds 0–2, 1,550 s gives a mean of 28 s and 1,700 s 9 s), and 0.16–0.28 s at 2,048
    (paper 0.081 s: no single think time fits both; the knee is the one fitted).
  - ``"burst"`` (600 s, the earlier default): 2.75× the load, chosen to reproduce "18.1× better than the
    SGLang baseline at batch 2,048" with tangram on the same 36 GPUs; under it the paper's 10-GPU pool
    queues for minutes at batch 2,048, contradicting the breakdown table.
- ``deepsearch``: 2–8 web-search calls per trajectory through a 200 rps API quota (latency lognormal mean
  1.2 s), think gaps lognormal mean 15 s, and a final GPU reward-model call (2 GPUs, 0.35 s) whose arrivals
  are bursty because the 16 samples of a group finish close together.

Also here: :class:`SimConfig`, the whole simulated scenario (workload, batch, cluster, policy) that
:mod:`libra.sim.actions_sim` runs. Pure: generators take a seed and return immutable plans; no I/O.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from libra.policies.actions.gpu_services import ServiceSpec

__all__ = [
    "MODELS",
    "MOPD_LOADS",
    "SCHEDULERS",
    "ActionPlan",
    "SimConfig",
    "SimError",
    "TrajectoryPlan",
    "WORKLOADS",
    "Workload",
    "coding",
    "deepsearch",
    "make_workload",
    "mopd",
]


@dataclass(frozen=True, slots=True)
class ActionPlan:
    """One planned action. ``kind``: ``"cpu"`` (cores on the trajectory's node), ``"gpu"`` (a call to GPU
    service ``service``) or ``"quota"`` (a call through rate limit ``quota``; holds no compute).

    ``base_duration`` is the one-unit time for a CPU-elastic action (``max_units > min_units``), otherwise the
    execution time. ``category`` groups tools for reporting (``env`` or ``reward``).
    """

    tool: str
    kind: str
    base_duration: float
    min_units: int = 1
    max_units: int = 1
    parallel_fraction: float = 0.0
    service: str | None = None
    quota: str | None = None
    category: str = "env"


@dataclass(frozen=True, slots=True)
class TrajectoryPlan:
    """A trajectory: ``steps`` of (think seconds before the action, action), then ``tail_think`` seconds."""

    id: str
    group: int
    steps: tuple[tuple[float, ActionPlan], ...]
    tail_think: float


@dataclass(frozen=True)
class Workload:
    """A generated batch plus the resources its actions name: GPU ``services`` and ``quotas``
    (name → (rate per second, burst))."""

    name: str
    batch: int
    seed: int
    trajectories: tuple[TrajectoryPlan, ...]
    services: tuple[ServiceSpec, ...] = ()
    quotas: dict[str, tuple[float, float]] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    """A lognormal sample with the given *mean* (not median)."""
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2.0, sigma)


def _check(batch: int, seed: int) -> None:
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")


def coding(
    batch: int,
    seed: int = 0,
    *,
    actions: tuple[int, int] = (10, 40),
    duty_cycle: float = 0.47,
    mean_action_s: float = 1.0,
    max_dop: int = 16,
    build_fraction: float = 0.20,
    build_mean_s: float = 8.0,
) -> Workload:
    """AI-coding batch (see the module docstring). Raises ``ValueError`` for a bad parameter."""
    _check(batch, seed)
    if not 0.0 < duty_cycle < 1.0:
        raise ValueError(f"duty_cycle must be in (0, 1), got {duty_cycle!r}")
    rng = random.Random(f"coding/{seed}")
    think_mean = mean_action_s * (1.0 / duty_cycle - 1.0)
    read_p = 0.55 * (1.0 - build_fraction) / 0.80
    trajs = []
    for i in range(batch):
        steps = []
        for _ in range(rng.randint(*actions)):
            u = rng.random()
            if u < read_p:
                act = ActionPlan("edit", "cpu", _lognormal(rng, 0.25, 0.6))
            elif u < 1.0 - build_fraction:
                act = ActionPlan("run", "cpu", _lognormal(rng, 0.8, 0.7))
            else:
                act = ActionPlan(
                    "build_test", "cpu", _lognormal(rng, build_mean_s, 1.0), 1, max_dop, rng.uniform(0.6, 0.8)
                )
            steps.append((_lognormal(rng, think_mean, 0.8), act))
        reward = ActionPlan(
            "reward_tests", "cpu", _lognormal(rng, build_mean_s * 1.25, 0.8), 1, max_dop, rng.uniform(0.6, 0.8),
            category="reward",
        )
        steps.append((_lognormal(rng, think_mean, 0.8), reward))
        trajs.append(TrajectoryPlan(f"c{seed}-{i}", i // 16, tuple(steps), _lognormal(rng, think_mean, 0.8)))
    return Workload(
        "coding", batch, seed, tuple(trajs),
        params={"duty_cycle": duty_cycle, "think_mean_s": think_mean, "max_dop": max_dop, "base_dop": 4},
    )


def _zipf_weights(n: int, s: float) -> list[float]:
    w = [1.0 / (k + 1) ** s for k in range(n)]
    tot = sum(w)
    return [x / tot for x in w]


MOPD_LOADS: dict[str, float] = {"breakdown": 1650.0, "burst": 600.0}
"""MOPD think time (seconds of generation per trajectory, in total) per calibration; see the module docstring."""


def mopd(
    batch: int,
    seed: int = 0,
    *,
    teachers: int = 9,
    zipf_s: float = 1.0,
    tp: int = 4,
    think_mean_s: float = MOPD_LOADS["breakdown"],
    calls: tuple[int, int] = (1, 2),
    exec_s: tuple[float, float] = (0.6, 0.7),
    checkpoint_gb: float = 40.0,
    reserve_gb: float = 0.0,
    group: int = 16,
    group_sigma: float = 0.4,
    jitter_sigma: float = 0.1,
) -> Workload:
    """MOPD batch (see the module docstring). Raises ``ValueError`` for a bad parameter."""
    _check(batch, seed)
    if teachers < 1 or tp not in (1, 2, 4, 8):
        raise ValueError(f"mopd: need teachers >= 1 and tp in 1/2/4/8, got teachers={teachers!r} tp={tp!r}")
    rng = random.Random(f"mopd/{seed}")
    weights = _zipf_weights(teachers, zipf_s)
    names = [f"teacher{k}" for k in range(teachers)]
    trajs = []
    group_teacher: dict[int, str] = {}
    group_scale: dict[int, float] = {}
    for i in range(batch):
        g = i // group
        if g not in group_teacher:
            group_teacher[g] = rng.choices(names, weights)[0]
            group_scale[g] = _lognormal(rng, 1.0, group_sigma)
        teacher = group_teacher[g]
        n = rng.randint(*calls)
        steps = []
        for _ in range(n):
            think = think_mean_s / n * group_scale[g] * _lognormal(rng, 1.0, jitter_sigma)
            act = ActionPlan("teacher_logprobs", "gpu", rng.uniform(*exec_s), tp, tp, service=teacher, category="reward")
            steps.append((think, act))
        trajs.append(TrajectoryPlan(f"m{seed}-{i}", g, tuple(steps), _lognormal(rng, 5.0, 0.5)))
    services = tuple(ServiceSpec(nm, tp, checkpoint_gb, reserve_gb) for nm in names)
    return Workload(
        "mopd", batch, seed, tuple(trajs), services=services,
        params={"teachers": teachers, "zipf_s": zipf_s, "tp": tp, "popularity": weights, "think_mean_s": think_mean_s},
    )


def deepsearch(
    batch: int,
    seed: int = 0,
    *,
    searches: tuple[int, int] = (2, 8),
    think_mean_s: float = 15.0,
    search_latency_s: float = 1.2,
    rps: float = 200.0,
    burst: float = 20.0,
    reward_gpus: int = 2,
    reward_s: float = 0.35,
    reward_checkpoint_gb: float = 65.0,
    group: int = 16,
) -> Workload:
    """DeepSearch batch (see the module docstring). Raises ``ValueError`` for a bad parameter."""
    _check(batch, seed)
    rng = random.Random(f"deepsearch/{seed}")
    trajs = []
    group_scale: dict[int, float] = {}
    for i in range(batch):
        g = i // group
        if g not in group_scale:
            group_scale[g] = _lognormal(rng, 1.0, 0.3)
        steps = []
        for _ in range(rng.randint(*searches)):
            act = ActionPlan("search", "quota", _lognormal(rng, search_latency_s, 0.5), quota="search")
            steps.append((think_mean_s * group_scale[g] * _lognormal(rng, 1.0, 0.3), act))
        reward = ActionPlan("reward_model", "gpu", reward_s * rng.uniform(0.8, 1.2), reward_gpus, reward_gpus,
                            service="reward", category="reward")
        steps.append((think_mean_s * group_scale[g] * _lognormal(rng, 1.0, 0.2), reward))
        trajs.append(TrajectoryPlan(f"d{seed}-{i}", g, tuple(steps), 0.5))
    return Workload(
        "deepsearch", batch, seed, tuple(trajs),
        services=(ServiceSpec("reward", reward_gpus, reward_checkpoint_gb),),
        quotas={"search": (rps, burst)},
        params={"rps": rps, "burst": burst, "reward_gpus": reward_gpus},
    )


WORKLOADS: dict[str, Callable[..., Workload]] = {"coding": coding, "mopd": mopd, "deepsearch": deepsearch}


def make_workload(name: str, batch: int, seed: int = 0, **params: Any) -> Workload:
    """Generate workload ``name``. Raises ``ValueError`` for an unknown name or parameter."""
    gen = WORKLOADS.get(name)
    if gen is None:
        raise ValueError(f"unknown action workload: {name!r} (known: {', '.join(WORKLOADS)})")
    try:
        return gen(batch, seed, **params)
    except TypeError as exc:
        raise ValueError(f"workload {name!r}: {exc}") from None


SCHEDULERS = ("tangram", "per_trajectory", "fixed_dop")


#: How an action simulation runs (``SimConfig.model``): ``broker``, every action through the real broker core
#: and its placement (:mod:`libra.sim.actions_broker`); ``policy``, the scheduling policy alone over a modelled
#: resource pool (:mod:`libra.sim.actions_engine`: NUMA, quotas, GPU memory co-residency, static deployments),
#: which credits mechanisms the broker lacks (each run's ``modelled_only`` lines say which).
MODELS = ("broker", "policy")


class SimError(ValueError):
    """Raised for an invalid simulator configuration (the message names the field)."""


@dataclass(frozen=True)
class SimConfig:
    """One simulation run. ``scheduler_params`` / ``workload_params`` pass extra keyword arguments through.

    ``gpu_mem_gb``: memory per pooled GPU for the placement's co-residency model (80 GB: the paper's
    A800/H800-class GPUs); ``None`` = one replica per cell (exclusive cells, the earlier model).
    ``gpu_workspace_gb``: memory per GPU kept free for the executing call's activations (8 GB [G]: a TP-4
    teacher's chunked log-prob forward over a 16-sample group; one call runs per cell at a time, so one
    workspace per GPU suffices). Resident replicas then share 80 − 8 = 72 GB per GPU: seven 10 GB teacher
    shards. Services may add a per-replica reserve (``ServiceSpec.reserve_gb``; MOPD's ``reserve_gb``).
    ``model``: ``"policy"`` (the default of the library call: the policy over a modelled pool) or ``"broker"``
    (through the broker core; :data:`MODELS`). ``gpu_wait_for_resident``: a call waits for a busy resident replica of its service that is estimated to
    free up sooner than a restore would take (``ServicePlacement(wait_for_resident=True)``; the estimate is
    the service's mean action time learned online); ``False`` restores at once (the earlier behaviour).
    """

    workload: str = "coding"
    batch: int = 1280
    scheduler: str = "tangram"
    seed: int = 0
    steps: int = 1
    cpu_nodes: int = 15
    cores_per_node: int = 256
    numa_domains: int = 2
    gpu_pool: int = 40
    static_replicas: int | None = None
    sandbox_cores: int | str = "peak"
    dop: int = 4
    aoe_overhead_s: float = 0.02
    numa_penalty: float = 0.10
    h2d_gbps: float = 25.0
    gpu_mem_gb: float | None = 80.0
    gpu_workspace_gb: float = 8.0
    gpu_wait_for_resident: bool = True
    scheduler_params: dict[str, Any] = field(default_factory=dict)
    workload_params: dict[str, Any] = field(default_factory=dict)
    model: str = "policy"

    def validate(self) -> None:
        """Raise :class:`SimError` for a bad field."""
        if self.model not in MODELS:
            raise SimError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.scheduler not in SCHEDULERS:
            raise SimError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        if self.static_replicas is not None and (not isinstance(self.static_replicas, int) or self.static_replicas < 1):
            raise SimError(f"static_replicas must be an integer >= 1, got {self.static_replicas!r}")
        for name in ("batch", "steps", "cpu_nodes", "cores_per_node", "numa_domains", "gpu_pool", "dop"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SimError(f"{name} must be an integer >= 1, got {v!r}")
        if self.cores_per_node % self.numa_domains:
            raise SimError(f"cores_per_node ({self.cores_per_node}) must be divisible by numa_domains ({self.numa_domains})")
        sc = self.sandbox_cores
        if sc not in ("peak", "even") and (isinstance(sc, bool) or not isinstance(sc, int) or sc < 1):
            raise SimError(f"sandbox_cores must be 'peak', 'even' or an integer >= 1, got {sc!r}")
        g, w = self.gpu_mem_gb, self.gpu_workspace_gb
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not (g > 0 and math.isfinite(g))):
            raise SimError(f"gpu_mem_gb must be None or a finite number > 0, got {g!r}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (0 <= w < (g if g is not None else math.inf)):
            raise SimError(f"gpu_workspace_gb must be a number >= 0 and below gpu_mem_gb, got {w!r}")
        for name in ("aoe_overhead_s", "numa_penalty"):
            if not getattr(self, name) >= 0:
                raise SimError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def core_budget(self) -> int:
        """Total cores in the CPU pool."""
        return self.cpu_nodes * self.cores_per_node

    @property
    def pooled(self) -> bool:
        """Whether GPUs and quotas are pooled (every policy but ``per_trajectory``)."""
        return self.scheduler != "per_trajectory"

    def sandbox_size(self, peak: int) -> int:
        """``per_trajectory`` sandbox cores: an explicit count, ``"peak"`` (the largest DoP any action of the
        workload can use, ``peak``) or ``"even"`` (the core budget split evenly over the batch)."""
        if self.sandbox_cores == "peak":
            return peak
        if self.sandbox_cores == "even":
            return max(1, self.core_budget // self.batch)
        return int(self.sandbox_cores)
