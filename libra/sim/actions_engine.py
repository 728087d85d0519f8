"""The event loop of the action-level scheduling simulator (ARL-Tangram, docs/papers.md §5.2): :class:`ActionSim`.

Trajectories from :mod:`libra.sim.action_workloads` alternate LLM think gaps (fixed time) and actions; the
actions are served by an external-resource pool under one scheduler from
:func:`libra.policies.actions.registry.make_action_scheduler`, on a virtual clock (event heap). Nothing sleeps,
opens sockets or reads the wall clock except to report how long the simulation itself took.

Resources (defaults = the paper's clusters):

- **CPU**: ``cpu_nodes`` × ``cores_per_node`` cores (15 × 256 = 3,840), each node split in ``numa_domains``.
  Trajectory ``i`` lives on node ``i mod cpu_nodes`` (its container is pre-created there) and its actions
  demand ``cpu@nNN``. Cores are picked inside one NUMA domain when possible (best fit); an action spread
  over domains runs ``numa_penalty`` slower. Pooled schedulers pay ``aoe_overhead_s`` per action for the
  allocate-on-execution cgroup update.
- **GPU**: pooled mode (``tangram``, ``fixed_dop``): a pool of ``gpu_pool`` GPUs (nodes of 8) holding service
  replicas through :class:`~libra.policies.actions.gpu_services.ServicePlacement` (evict-on-execution, LRU, Multi-Level
  Cell cells); a call on an evicted service pays the restore time as overhead. With ``gpu_mem_gb`` (default
  80 GB, the paper's A800/H800-class GPUs) the placement models GPU memory: replicas of several services stay
  resident on the same cell while their shards plus reserves fit in ``gpu_mem_gb − gpu_workspace_gb`` (8 GB
  per GPU kept for the executing call's activations), a cell executes one call at a time, and eviction
  happens only when memory is short; ``gpu_mem_gb=None`` gives each replica its cell exclusively
  (an idle replica must be evicted before another service can use the cell). Static mode
  (``per_trajectory``): a dedicated deployment of ``static_replicas`` replicas per service (SGLang-like),
  one call at a time per replica, never evicted.
- **Quota** (API rate limits): pooled mode shares one token bucket per API; static mode gives each
  trajectory its own bucket with ``rate / batch`` and burst 1.

``per_trajectory`` also reserves a CPU sandbox per live trajectory from its first action to its end,
sized ``sandbox_cores``: ``"peak"`` (default: the largest DoP any action of the workload can use, i.e. sized
for the peak demand; with the fixed pool, trajectories then wait for a whole sandbox), ``"even"`` (the core
budget divided by the batch: every trajectory gets one at once) or a count. Metrics: ACT (= queueing +
execution + overhead) mean/p50/p99 with the breakdown and per category, ``cores_used`` (time average of
reserved cores: cores held by running actions, plus idle sandboxes for ``per_trajectory``), ``gpus_used``
(provisioned GPUs), ``gpus_busy_mean``, and the step time (a step ends when its last trajectory ends).

The run's configuration, :class:`~libra.sim.action_workloads.SimConfig`, sits with the workloads.

:func:`libra.sim.actions_sim.run_sim` runs one :class:`ActionSim`; that module also has the command line.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from libra.policies.actions.gpu_cells import MultiLevelCellAllocator
from libra.policies.actions.gpu_services import ServicePlacement
from libra.policies.actions.registry import (
    ActionQueue,
    ActionSpec,
    Amdahl,
    ElasticSpec,
    PerTrajectoryScheduler,
    RunningSet,
    RunningView,
    TokenBucket,
    make_action_scheduler,
    resource_kind,
)
from libra.sim.action_workloads import ActionPlan, SimConfig, SimError, TrajectoryPlan, make_workload

__all__ = ["ActionSim"]

_SUBMIT, _DONE, _END, _WAKE = 0, 1, 2, 3


@dataclass(slots=True)
class _Traj:
    plan: TrajectoryPlan
    node: str
    step: int = 0


@dataclass(slots=True)
class _Run:
    spec: ActionSpec
    traj: int
    units: dict[str, int]
    numa: list[tuple[int, int]] | None
    placement: int | None
    gpus: int


def percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class ActionSim:
    """One run: state + event loop. Mutation happens only inside :meth:`run`."""

    def __init__(self, cfg: SimConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self._first = make_workload(cfg.workload, cfg.batch, cfg.seed * 100_003, **cfg.workload_params)
        peak = max((a.max_units for t in self._first.trajectories for _th, a in t.steps if a.kind == "cpu"), default=1)
        self.sandbox_cores = cfg.sandbox_size(peak)
        params = dict(cfg.scheduler_params)
        if cfg.scheduler == "fixed_dop":
            params.setdefault("dop", cfg.dop)
        elif cfg.scheduler == "per_trajectory":
            params.setdefault("sandbox", {"cpu": self.sandbox_cores})
        try:
            self.sched = make_action_scheduler(cfg.scheduler, **params)
        except ValueError as exc:
            raise SimError(str(exc)) from None
        self.free: dict[str, int] = {}
        self.numa: dict[str, list[int]] = {}
        per_domain = cfg.cores_per_node // cfg.numa_domains
        self.node_names = [f"cpu@n{n:02d}" for n in range(cfg.cpu_nodes)]
        for name in self.node_names:
            self.free[name] = cfg.cores_per_node
            self.numa[name] = [per_domain] * cfg.numa_domains
        self.running = RunningSet()
        self.queue = ActionQueue()
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.now = 0.0
        self.placement: ServicePlacement | None = None
        self.gpus_provisioned = 0
        self.buckets: dict[str, TokenBucket] = {}
        self.quota_waiting: dict[str, int] = {}
        self.wake_at = math.inf
        # metrics
        self.acts: list[tuple[float, float, float, str]] = []
        self.area_cores = 0.0
        self.area_gpus = 0.0
        self.cores_now = 0
        self.gpus_busy = 0
        self.last_t = 0.0
        self.numa_splits = 0
        self.quota_starts: list[float] = []
        self.retries = 0
        self.decisions = 0
        self.sched_wall = 0.0

    # ---------------------------------------------------------------------------------------- helpers

    def _push(self, t: float, kind: int, data: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    def _advance(self, t: float) -> None:
        dt = t - self.last_t
        if dt > 0:
            self.area_cores += self.cores_now * dt
            self.area_gpus += self.gpus_busy * dt
            self.last_t = t
        self.now = t

    def _reserved_cores(self) -> int:
        if isinstance(self.sched, PerTrajectoryScheduler):
            return sum(u for r, u in self.sched.reserved_units().items() if r.startswith("cpu"))
        return sum(self.running.held(n) for n in self.node_names)

    def _setup_step(self, wl_services: Sequence[Any], quotas: dict[str, tuple[float, float]], batch: int) -> None:
        cfg = self.cfg
        if wl_services and self.placement is None and cfg.pooled:
            sizes = [8] * (cfg.gpu_pool // 8) + ([cfg.gpu_pool % 8] if cfg.gpu_pool % 8 else [])
            self.placement = ServicePlacement(
                MultiLevelCellAllocator(sizes), wl_services, h2d_gbps=cfg.h2d_gbps, gpu_mem_gb=cfg.gpu_mem_gb,
                workspace_gb=cfg.gpu_workspace_gb, wait_for_resident=cfg.gpu_wait_for_resident,
            )
            self.free["gpu"] = cfg.gpu_pool
            self.gpus_provisioned = cfg.gpu_pool
        elif wl_services and not cfg.pooled and not self.gpus_provisioned:
            # Static deployments: the pool split evenly over the services, at least one replica each.
            replicas = cfg.static_replicas or max(1, cfg.gpu_pool // sum(s.gpus for s in wl_services))
            for s in wl_services:
                self.free[f"svc:{s.name}"] = replicas
                self.gpus_provisioned += replicas * s.gpus
            self.service_gpus = {f"svc:{s.name}": s.gpus for s in wl_services}
        self.quota_cfg = quotas
        for q, (rate, burst) in quotas.items():
            self.buckets.setdefault(f"quota:{q}", TokenBucket(rate, burst, updated=self.now))

    def _spec(self, t: _Traj, k: int, act: ActionPlan) -> ActionSpec:
        cfg = self.cfg
        aid = f"{t.plan.id}/{k}"
        el = None
        if act.kind == "cpu":
            demand = {t.node: act.min_units}
            if act.max_units > act.min_units:
                el = ElasticSpec(t.node, act.max_units, Amdahl(act.parallel_fraction))
        elif act.kind == "gpu":
            demand = {"gpu": act.min_units} if cfg.pooled else {f"svc:{act.service}": 1}
        elif act.kind == "quota":
            # The provider's limit always applies; the static baseline also splits it per trajectory.
            demand = {f"quota:{act.quota}": 1}
            if not cfg.pooled:
                res = f"quota:{act.quota}#{t.plan.id}"
                if res not in self.buckets:
                    rate, _burst = self.quota_cfg[act.quota]  # type: ignore[index]
                    self.buckets[res] = TokenBucket(rate / self.cfg.batch, 1.0, updated=self.now)
                demand[res] = 1
            for res in demand:
                self.quota_waiting[res] = self.quota_waiting.get(res, 0) + 1
        else:
            raise SimError(f"action {aid}: unknown kind {act.kind!r}")
        return ActionSpec(aid, t.plan.id, act.tool, demand, act.base_duration, el, self.now, act.service)

    def _take_cores(self, res: str, m: int) -> tuple[list[tuple[int, int]], bool]:
        doms = self.numa[res]
        best = -1
        for i, f in enumerate(doms):
            if f >= m and (best < 0 or f < doms[best]):
                best = i
        if best >= 0:
            doms[best] -= m
            return [(best, m)], False
        taken = []
        for i in sorted(range(len(doms)), key=lambda i: -doms[i]):
            got = min(doms[i], m)
            if got:
                doms[i] -= got
                taken.append((i, got))
                m -= got
            if not m:
                break
        return taken, len(taken) > 1

    # ---------------------------------------------------------------------------------------- decisions

    def _decide(self, trajs: list[_Traj], index: dict[str, int]) -> None:
        now = self.now
        for res in self.quota_waiting:
            self.free[res] = int(self.buckets[res].available(now) + 1e-9)
        t0 = time.perf_counter()
        grants = self.sched.schedule(self.queue, self.free, self.running, now)
        self.sched_wall += time.perf_counter() - t0
        self.decisions += 1
        cfg = self.cfg
        for g in grants:
            spec = self.queue.get(g.action_id)
            if spec is None:
                raise SimError(f"scheduler {self.cfg.scheduler!r} granted unknown or already started action {g.action_id!r}")
            units = dict(g.units)
            overhead = 0.0
            placement_id = None
            numa = None
            gpus = 0
            if spec.service is not None and cfg.pooled:
                assert self.placement is not None
                pl = self.placement.acquire(spec.service, now)
                if pl is None:
                    self.retries += 1
                    continue
                placement_id, overhead, gpus = pl.instance, pl.restore_s, len(pl.alloc.gpus)
            elif spec.service is not None:
                gpus = self.service_gpus[next(iter(units))]
            exec_s = spec.durations[0]
            for r, u in units.items():
                kind = resource_kind(r)
                if kind == "cpu":
                    numa, split = self._take_cores(r, u)
                    if spec.key is not None:
                        exec_s = spec.durations[spec.dop_for(units)]
                    if split:
                        exec_s *= 1.0 + cfg.numa_penalty
                        self.numa_splits += 1
                    if cfg.pooled:
                        overhead += cfg.aoe_overhead_s
                elif r.startswith("quota:"):
                    self.buckets[r].take(now, u)
                    left = self.quota_waiting[r] - 1
                    if left:
                        self.quota_waiting[r] = left
                    else:
                        del self.quota_waiting[r]
                self.free[r] -= u
            end = now + overhead + exec_s
            for r, u in units.items():
                if self.free[r] < 0 and not r.startswith("quota:"):
                    raise SimError(f"scheduler {cfg.scheduler!r} over-committed {r}: free {self.free[r]} after {g}")
            if any(r.startswith("quota:") for r in units):
                self.quota_starts.append(now)
            self.queue.remove(spec.id)
            self.running.add(RunningView(spec.id, spec.trajectory, units, end))
            ti = index[spec.trajectory]
            self._runs[spec.id] = _Run(spec, ti, units, numa, placement_id, gpus)
            self.acts.append((now - spec.submitted_at, exec_s, overhead, trajs[ti].plan.steps[trajs[ti].step][1].category))
            self.gpus_busy += gpus
            self._push(end, _DONE, spec.id)
        self.cores_now = self._reserved_cores()
        # Quota-blocked actions: wake up when the earliest needed token arrives.
        wake = math.inf
        for res in self.quota_waiting:
            wake = min(wake, self.buckets[res].next_time(now, 1.0))
        if wake < math.inf and wake != self.wake_at and wake > now:
            self.wake_at = wake
            self._push(wake, _WAKE, None)

    # ---------------------------------------------------------------------------------------- main loop

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self._runs: dict[str, _Run] = {}
        step_times = []
        wall0 = time.perf_counter()
        n_traj = 0
        for step in range(cfg.steps):
            wl = self._first if step == 0 else make_workload(
                cfg.workload, cfg.batch, cfg.seed * 100_003 + step, **cfg.workload_params
            )
            self._setup_step(wl.services, wl.quotas, wl.batch)
            t_start = self.now
            trajs = [_Traj(p, self.node_names[i % cfg.cpu_nodes]) for i, p in enumerate(wl.trajectories)]
            index = {t.plan.id: i for i, t in enumerate(trajs)}
            for i, t in enumerate(trajs):
                self._push(t_start + t.plan.steps[0][0], _SUBMIT, i)
            remaining = len(trajs)
            last_end = t_start
            while remaining:
                now = self.events[0][0]
                self._advance(now)
                dirty = False
                while self.events and self.events[0][0] == now:
                    _t, _s, kind, data = heapq.heappop(self.events)
                    if kind == _SUBMIT:
                        t = trajs[data]
                        spec = self._spec(t, t.step, t.plan.steps[t.step][1])
                        self.queue.add(spec)
                        dirty = True
                    elif kind == _DONE:
                        self._finish(data, trajs)
                        dirty = True
                    elif kind == _END:
                        self.sched.trajectory_finished(trajs[data].plan.id, now)
                        remaining -= 1
                        last_end = now
                        dirty = True
                    else:
                        dirty = True
                if dirty:
                    if self.queue:
                        self._decide(trajs, index)
                    else:
                        self.cores_now = self._reserved_cores()
            n_traj += len(trajs)
            step_times.append(last_end - t_start)
        return self._report(step_times, n_traj, time.perf_counter() - wall0)

    def _finish(self, aid: str, trajs: list[_Traj]) -> None:
        run = self._runs.pop(aid)
        self.running.remove(aid)
        for r, u in run.units.items():
            if not r.startswith("quota:"):
                self.free[r] += u
        if run.numa:
            doms = self.numa[next(r for r in run.units if r.startswith("cpu"))]
            for i, u in run.numa:
                doms[i] += u
        if run.placement is not None:
            assert self.placement is not None
            self.placement.release(run.placement, self.now)
        self.gpus_busy -= run.gpus
        t = trajs[run.traj]
        t.step += 1
        if t.step < len(t.plan.steps):
            self._push(self.now + t.plan.steps[t.step][0], _SUBMIT, run.traj)
        else:
            self._push(self.now + t.plan.tail_think, _END, run.traj)

    def _report(self, step_times: list[float], n_traj: int, wall: float) -> dict[str, Any]:
        cfg = self.cfg
        out = action_report(cfg, self.acts, step_times, n_traj, max(self.last_t, 1e-9), self.area_cores,
                            self.area_gpus, self.gpus_provisioned, self.numa_splits)
        out.update({
            "decisions": self.decisions,
            "placement_retries": self.retries,
            "sim_wall_s": wall,
            "sched_wall_s": self.sched_wall,
        })
        if cfg.scheduler == "per_trajectory":
            out["sandbox_cores"] = self.sandbox_cores
        if self.placement is not None:
            st = self.placement.stats
            out["gpu_restores"] = st.restores
            out["gpu_evictions"] = st.evictions
            out["gpu_hits"] = st.hits
            out["gpu_restore_s"] = st.restore_s
            out["gpu_waits"] = st.waits
            out["gpu_mem_gb"] = cfg.gpu_mem_gb
            out["gpu_workspace_gb"] = cfg.gpu_workspace_gb if cfg.gpu_mem_gb is not None else None
        return out


def action_report(cfg: Any, acts4: Sequence[tuple[float, float, float, str]], step_times: list[float], n_traj: int,
                  horizon: float, area_cores: float, area_gpus: float, gpus_used: float,
                  numa_splits: int) -> dict[str, Any]:
    """The figures every action simulator reports: ACT (mean, p50, p99, breakdown, by category), cores and
    GPUs used over ``horizon``, step times and trajectories per second. ``acts4`` holds (queue, exec,
    overhead, category) per action."""
    acts = [q + e + o for q, e, o, _c in acts4]
    n = max(len(acts), 1)
    cats: dict[str, list[float]] = {}
    for q, e, o, c in acts4:
        cats.setdefault(c, []).append(q + e + o)
    total = sum(step_times)
    return {
        "workload": cfg.workload, "scheduler": cfg.scheduler, "batch": cfg.batch, "seed": cfg.seed,
        "steps": cfg.steps, "actions": len(acts),
        "act_mean_s": sum(acts) / n, "act_p50_s": percentile(acts, 0.50), "act_p99_s": percentile(acts, 0.99),
        "act_breakdown_s": {"queue": sum(a[0] for a in acts4) / n, "exec": sum(a[1] for a in acts4) / n,
                            "overhead": sum(a[2] for a in acts4) / n},
        "act_by_category_s": {c: sum(v) / len(v) for c, v in sorted(cats.items())},
        "core_budget": cfg.core_budget, "cores_used": area_cores / horizon,
        "gpus_used": gpus_used, "gpus_busy_mean": area_gpus / horizon,
        "step_time_s": {"mean": total / len(step_times), "p50": percentile(step_times, 0.5),
                        "p99": percentile(step_times, 0.99)},
        "trajectories_per_s": n_traj / total if total > 0 else 0.0,
        "numa_split_fraction": numa_splits / n,
    }
