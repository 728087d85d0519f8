"""The action simulator's ``broker`` model: the workload's tool calls go through the real broker core.

:class:`BrokerActionSim` runs the same workloads and :class:`~libra.sim.action_workloads.SimConfig` as the
policy-level :class:`~libra.sim.actions_engine.ActionSim`, but nothing here decides where or with how many
cores an action runs: every action is a ``Submit(kind="action")`` from a simulated client to
:class:`~libra.broker.state.BrokerState` configured with ``action_scheduler = cfg.scheduler``, and the
broker's own placement (``broker/actions.py``: the policy over every actor's cores, best fit inside NUMA
nodes, the trajectory's home actor, GPU services by evict-on-execution over each GPU actor's cells) sends
the ``Assign``. The simulator only plays the peers on a virtual clock:

- **CPU action actors**, one per node (``cpu_nodes``), each saying hello with ``cores_per_node`` CPU ids
  split into ``numa_domains`` NUMA nodes (``ActorResources`` labels) and bidding for the CPU tools;
- **GPU action actors**, one per 8 GPUs of ``gpu_pool``, with ``gpus`` labels, serving the service tools;
- one **client** submitting each trajectory's actions after its think gaps and ending each trajectory
  (``EndTrajectory``: the policy's per-trajectory state is released).

An actor runs an ``Assign`` for the time the action really takes with the cores of its route (Amdahl on the
action's own one-core time and parallel fraction), ``numa_penalty`` slower when the route's core ids span
NUMA nodes, plus ``aoe_overhead_s`` for a pooled scheduler (allocate on execution); a service call that the
route says is restored first pays ``checkpoint_gb / (gpus × h2d_gbps)``. Then it sends ``WorkResult`` and
the broker's ``Reply`` is what ends the action for the trajectory.

What the broker knows is what a deployment declares: each tool's demand and elasticity and its **mean**
duration (``BrokerConfig.tools``, from the first step's actions), not each call's duration, which the
policy-level model hands its scheduler.

Refused here (typed :class:`SimError`): workloads with API-quota actions (``deepsearch``): the broker has no
rate-limit mechanism (issue #19). :meth:`BrokerActionSim.modelled_only` lists what the policy-level model
has that the broker does not, and the report carries it.
"""

from __future__ import annotations

import heapq
import time
from collections import defaultdict
from typing import Any

from libra.broker.config import BrokerConfig
from libra.broker.events import Command, PeerMessage, Send
from libra.broker.state import BrokerState
from libra.policies.actions.registry import ActionSpec, Amdahl, ElasticSpec
from libra.protocol import messages as m
from libra.sim.action_workloads import ActionPlan, SimConfig, SimError, TrajectoryPlan, Workload, make_workload
from libra.sim.actions_engine import action_report

__all__ = ["BrokerActionSim"]

_SUBMIT, _DONE, _END = 0, 1, 2
_CLIENT = b"sim-client"


def tool_table(wl: Workload, memory: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """``BrokerConfig.tools`` for ``wl``: per tool its demand, elasticity and mean one-unit duration, and for a
    GPU-service tool the ``services`` it calls (gpus, checkpoint, reserve) and ``memory`` (``gpu_mem_gb``,
    ``workspace_gb``, ``wait_for_resident``: the GPU memory model and wait-or-restore rule)."""
    acts: dict[str, list[ActionPlan]] = defaultdict(list)
    for t in wl.trajectories:
        for _think, a in t.steps:
            acts[a.tool].append(a)
    specs = {s.name: s for s in wl.services}
    out: dict[str, dict[str, Any]] = {}
    for tool, xs in sorted(acts.items()):
        mean = sum(a.base_duration for a in xs) / len(xs)
        if xs[0].kind == "gpu":
            used = sorted({a.service for a in xs if a.service is not None})
            out[tool] = {"duration_s": mean, "services": {
                s: {"gpus": specs[s].gpus, "checkpoint_gb": specs[s].checkpoint_gb, "reserve_gb": specs[s].reserve_gb}
                for s in used}, **(memory or {})}
            continue
        lo, hi = min(a.min_units for a in xs), max(a.max_units for a in xs)
        pf = sum(a.parallel_fraction for a in xs) / len(xs)
        out[tool] = {"cpu": lo, "max_cpu": hi, "parallel_fraction": pf if hi > lo else 0.7, "duration_s": mean}
    return out


class BrokerActionSim:
    """One run of the broker model (see the module docstring). Mutation happens only inside :meth:`run`."""

    def __init__(self, cfg: SimConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self._first = make_workload(cfg.workload, cfg.batch, cfg.seed * 100_003, **cfg.workload_params)
        if any(a.kind == "quota" for t in self._first.trajectories for _th, a in t.steps):
            raise SimError(f"--model broker: workload {cfg.workload!r} makes API-quota calls and the broker has no "
                           "rate-limit (quota) mechanism yet (#19); run it with --model policy (modelled only)")
        params = dict(cfg.scheduler_params)
        if cfg.scheduler == "fixed_dop":
            params.setdefault("dop", cfg.dop)
        elif cfg.scheduler == "per_trajectory":
            peak = max((a.max_units for t in self._first.trajectories for _th, a in t.steps if a.kind == "cpu"),
                       default=1)
            params.setdefault("sandbox", {"cpu": cfg.sandbox_size(peak)})
        memory = ({"gpu_mem_gb": cfg.gpu_mem_gb, "workspace_gb": cfg.gpu_workspace_gb}
                  if cfg.gpu_mem_gb is not None else {})
        self.tools = tool_table(self._first, {**memory, "wait_for_resident": cfg.gpu_wait_for_resident})
        try:
            self.broker = BrokerState(BrokerConfig(action_scheduler=cfg.scheduler, action_scheduler_params=params,
                                                   tools=self.tools))
        except ValueError as exc:
            raise SimError(f"broker config: {exc}") from None
        self.now = 0.0
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.per_domain = cfg.cores_per_node // cfg.numa_domains
        self.actor_gpus: dict[bytes, int] = {}
        self.running: dict[str, tuple[bytes, int, str, int, int]] = {}  # work id -> (peer, lease, aid, cores, gpus)
        self.pending: dict[str, tuple[int, float]] = {}  # action id -> (trajectory index, submitted at)
        self.started: dict[str, float] = {}  # action id -> its start
        self.acts: list[tuple[float, float, float, str]] = []
        self.area_cores = self.area_gpus = 0.0
        self.cores_now = self.gpus_busy = 0
        self.last_t = 0.0
        self.numa_splits = self.restores = self.hits = 0
        self.restore_s = 0.0
        self._exec: dict[str, tuple[float, float, str]] = {}  # action id -> (exec s, overhead s, category)

    # ---------------------------------------------------------------------------------------- the peers
    def _push(self, t: float, kind: int, data: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    def _send(self, peer: bytes, msg: Any) -> None:
        """Deliver ``msg`` from ``peer`` to the broker and execute what it sends, until quiet."""
        todo: list[Command] = list(self.broker.handle(PeerMessage(peer, msg), self.now))
        while todo:
            cmd = todo.pop(0)
            if isinstance(cmd, Send):
                todo.extend(self._deliver(cmd))

    def _deliver(self, cmd: Send) -> list[Command]:
        msg = cmd.msg
        if isinstance(msg, m.Assign):
            self._start(cmd.peer, msg)
        elif isinstance(msg, m.Reply):
            if not msg.ok:
                raise SimError(f"broker failed action {msg.request_id}: {msg.error_code} {msg.error}")
            self._answered(msg.request_id)
        elif isinstance(msg, (m.Error, m.Disconnect)):
            raise SimError(f"broker refused a simulated peer: {msg}")
        return []  # Welcome, Heartbeat and the rest need no answer from a simulated peer

    def _hello(self, wl: Workload) -> None:
        cfg = self.cfg
        cpu_tools = sorted(t for t, d in self.tools.items() if "services" not in d)
        gpu_tools = sorted(t for t, d in self.tools.items() if "services" in d)
        self._send(_CLIENT, m.ClientHello("sim-client", 1))
        for n in range(cfg.cpu_nodes):
            peer = f"cpu{n:02d}".encode()
            cpus = list(range(cfg.cores_per_node))
            labels = {"cores": cfg.cores_per_node, "cpus": cpus, "numa": [c // self.per_domain for c in cpus]}
            self._send(peer, m.ActorHello(f"n{n:02d}/cpu", f"n{n:02d}", "cpu", 1, {"action": cpu_tools}, ["action"],
                                          cfg.cores_per_node, labels))
            self._send(peer, m.Bid(["action"], cfg.cores_per_node))
        if gpu_tools:
            sizes = [8] * (cfg.gpu_pool // 8) + ([cfg.gpu_pool % 8] if cfg.gpu_pool % 8 else [])
            for i, g in enumerate(sizes):
                peer = f"gpu{i:02d}".encode()
                self.actor_gpus[peer] = g
                self._send(peer, m.ActorHello(f"g{i:02d}/gpu", f"g{i:02d}", "gpu0", 1, {"action": gpu_tools},
                                              ["action"], g, {"gpus": g}))
                self._send(peer, m.Bid(["action"], g))

    # ---------------------------------------------------------------------------------------- actions
    def _submit(self, trajs: list[TrajectoryPlan], steps: list[int], i: int) -> None:
        t = trajs[i]
        act = t.steps[steps[i]][1]
        aid = f"{t.id}/{steps[i]}"
        self.pending[aid] = (i, self.now)
        args: dict[str, Any] = {"aid": aid}
        if act.service is not None:
            args["service"] = act.service
        self._send(_CLIENT, m.Submit(aid, "action", act.tool, args, t.id, timeout_s=1e9))

    def _start(self, peer: bytes, a: m.Assign) -> None:
        cfg = self.cfg
        aid = a.args["aid"]
        i, submitted = self.pending[aid]
        traj = self._trajs[i]
        act = traj.steps[self._steps[i]][1]
        route = a.route or {}
        overhead, cores, gpus = 0.0, 0, 0
        svc = route.get("service")
        if svc:
            spec = next(s for s in self._wl.services if s.name == svc["service"])
            gpus = spec.gpus
            if svc.get("restore"):
                overhead = spec.checkpoint_gb / (spec.gpus * cfg.h2d_gbps)
                self.restores += 1
                self.restore_s += overhead
            else:
                self.hits += 1
            exec_s = act.base_duration
        else:
            cores = int(route.get("cores", 1))
            el = (ElasticSpec("cpu", act.max_units, Amdahl(act.parallel_fraction))
                  if act.max_units > act.min_units else None)
            spec_ = ActionSpec(aid, traj.id, act.tool, {"cpu": act.min_units}, act.base_duration, el, submitted)
            exec_s = spec_.durations[min(max(cores, act.min_units), act.max_units)] if el else act.base_duration
            ids = route.get("core_ids") or []
            if len({c // self.per_domain for c in ids}) > 1:
                exec_s *= 1.0 + cfg.numa_penalty
                self.numa_splits += 1
            if cfg.pooled:
                overhead += cfg.aoe_overhead_s
        self.running[a.work_id] = (peer, a.lease, aid, cores, gpus)
        self._exec[aid] = (exec_s, overhead, act.category)
        self.started[aid] = self.now
        self.cores_now += cores
        self.gpus_busy += gpus
        self._push(self.now + overhead + exec_s, _DONE, a.work_id)

    def _done(self, work_id: str) -> None:
        peer, lease, aid, cores, gpus = self.running.pop(work_id)
        self.cores_now -= cores
        self.gpus_busy -= gpus
        exec_s, overhead, _cat = self._exec[aid]
        self._send(peer, m.WorkResult(work_id, lease, True, {"ok": True}, duration_s=exec_s + overhead))

    def _answered(self, aid: str) -> None:
        i, submitted = self.pending.pop(aid)
        exec_s, overhead, cat = self._exec.pop(aid)
        start = self.started.pop(aid)
        self.acts.append((start - submitted, exec_s, overhead, cat))
        t = self._trajs[i]
        self._steps[i] += 1
        if self._steps[i] < len(t.steps):
            self._push(self.now + t.steps[self._steps[i]][0], _SUBMIT, i)
        else:
            self._push(self.now + t.tail_think, _END, i)

    def _advance(self, t: float) -> None:
        dt = t - self.last_t
        if dt > 0:
            self.area_cores += self.cores_now * dt
            self.area_gpus += self.gpus_busy * dt
            self.last_t = t
        self.now = t

    # ---------------------------------------------------------------------------------------- main loop
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        wall0 = time.perf_counter()
        step_times, n_traj = [], 0
        for step in range(cfg.steps):
            wl = self._first if step == 0 else make_workload(cfg.workload, cfg.batch, cfg.seed * 100_003 + step,
                                                             **cfg.workload_params)
            self._wl = wl
            if step == 0:
                self._hello(wl)
            t0 = self.now
            self._trajs = list(wl.trajectories)
            self._steps = [0] * len(self._trajs)
            for i, t in enumerate(self._trajs):
                self._push(t0 + t.steps[0][0], _SUBMIT, i)
            remaining, last_end = len(self._trajs), t0
            while remaining:
                if not self.events:
                    raise SimError(f"broker model stalled with {remaining} trajectories unfinished "
                                   f"(queued: {sum(len(q) for q in self.broker.queues.values())})")
                t, _s, kind, data = heapq.heappop(self.events)
                self._advance(t)
                if kind == _SUBMIT:
                    self._submit(self._trajs, self._steps, data)
                elif kind == _DONE:
                    self._done(data)
                else:
                    self._send(_CLIENT, m.EndTrajectory(self._trajs[data].id))
                    remaining -= 1
                    last_end = self.now
            n_traj += len(self._trajs)
            step_times.append(last_end - t0)
        self.broker.validate()
        return self._report(step_times, n_traj, time.perf_counter() - wall0)

    def modelled_only(self) -> list[str]:
        """What the policy-level model (``--model policy``) has that this run, through the broker, does not."""
        out = ["per-call durations: the broker's policy sees each tool's declared mean duration (the policy-level "
               "model hands its scheduler every call's own duration)"]
        if self._first.services:
            if not self.cfg.pooled:
                out.append("static per-service GPU deployments of per_trajectory: modelled only in --model policy; "
                           "here the broker places service calls by evict-on-execution for every scheduler")
        if not self.cfg.pooled:
            out.append("per_trajectory sandboxes: cores_used counts the cores of running actions, not idle "
                       "reserved sandboxes")
        return out

    def _report(self, step_times: list[float], n_traj: int, wall: float) -> dict[str, Any]:
        out: dict[str, Any] = {"model": "broker"}
        out.update(action_report(self.cfg, self.acts, step_times, n_traj, max(self.last_t, 1e-9), self.area_cores,
                                 self.area_gpus, sum(self.actor_gpus.values()), self.numa_splits))
        out.update({
            "broker_stats": {k: v for k, v in self.broker.stats.items() if v},
            "sim_wall_s": wall,
            "modelled_only": self.modelled_only(),
        })
        if self.actor_gpus:
            out.update(gpu_restores=self.restores, gpu_hits=self.hits, gpu_restore_s=self.restore_s)
        return out
