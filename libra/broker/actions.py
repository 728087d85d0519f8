"""Action placement inside the broker (ARL-Tangram). Pure; the dispatcher (``dispatch.py``) asks it.

With ``BrokerConfig.action_scheduler`` set (``tangram``, ``fixed_dop``, ``per_trajectory``), queued
``action`` work is not handed out first-come-first-served by credit. One placement round (:meth:`place`):

1. **GPU services.** Calls of a service tool (``reward_model``, or any tool declared with a ``services``
   table) go to the GPU actors that serve it when there are any: evict-on-execution over each GPU actor's
   multi-level cells (``service_pools.py``). The route names the replica, its cell, whether it is restored
   and which cells' idle replicas were evicted first; the actor's service engine obeys it.
2. **CPU actions.** The policy decides once over the cores of *every* action actor with a free work slot
   (``core_pools.py``: actors report their CPU ids and NUMA nodes in their hello labels; actors of one host
   share them; ``{"cores": n}`` alone gives a private pool): which queued actions start now and with how
   many cores each (the degree of parallelism; several cores of one actor when they are free). Each grant,
   largest first, is then placed **best fit**: the trajectory's home actor (its sandbox's workspace) if it
   fits, inside one NUMA node if possible, on the actor left with the fewest free cores; a grant that fits
   no single actor shrinks to the widest free actor (elastic DoP) or stays queued. The grant travels in
   ``Assign.route`` (:class:`~libra.protocol.payloads_actions.ActionRoute`: ``cores`` and, when the actor
   reported its CPUs, the exact ``core_ids`` its sandbox pins to; for a sandbox tool call, ``release``: the
   finished trajectories whose sandboxes that actor should retire, see ``sandbox_release.py``).

Tool declarations (``BrokerConfig.tools``) give each tool its demand and elasticity:
``{"pytest": {"cpu": 1, "max_cpu": 8, "parallel_fraction": 0.7, "duration_s": 2.0}}``. Undeclared tools
take one core, are not elastic, and are estimated at ``duration_s = 1``. Estimates only steer the
policy's completion-time model; actual durations come from the actors. A service tool's declaration may
carry ``services = {name = {gpus, checkpoint_gb, reserve_gb}}``, ``gpu_mem_gb``/``workspace_gb`` (the GPU
memory model: several services' replicas co-resident on a cell, see ``service_pools.py``) and
``wait_for_resident`` (a call waits for a busy resident replica that frees before a restore would end).

Tools of a user's own (``libra/actors/tools.py``) are declared by the action actors that offer them, in
their hello labels (:class:`~libra.protocol.payloads_actions.ToolDeclaration`, read at each placement round
for each new session): a tool no ``BrokerConfig.tools`` entry names takes its declared ``cores`` (not
elastic: ``cpu = max_cpu = cores``), and one that declares a ``gpu_service`` is a service call of that
service (its args need not name it). The broker's own table wins over an actor's declaration; two actors
declaring one tool differently: the most recently connected one's declaration counts. Labels that do not
parse are reported like bad resource labels (:meth:`ActionPlacement.unparsed_labels`) and the actor's tools
run as undeclared.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from libra.policies.actions.gpu_cells import GpuCellError
from libra.policies.actions.registry import (
    ActionSpec,
    Amdahl,
    ElasticSpec,
    RunningView,
    make_action_scheduler,
)
from libra.protocol.payloads_actions import TOOL_DECLS_LABEL, ActionRoute, tool_declarations
from libra.protocol.payloads_base import PayloadError

from .core_pools import CorePools
from .sandbox_release import SANDBOX_TOOLS, SandboxReleases
from .service_pools import ServicePools, service_specs
from .sessions import ActorSession
from .work import Work

#: The most queued actions one placement round shows the policy (the oldest ones).
WINDOW = 512
#: Tools that are GPU-service calls even when undeclared (their args name the ``service``).
SERVICE_TOOLS = frozenset({"reward_model"})
#: Trajectories whose home actor is remembered (the oldest are forgotten first).
HOMES = 100_000


@dataclass(frozen=True, slots=True)
class ToolDecl:
    cpu: int = 1
    max_cpu: int = 1
    parallel_fraction: float = 0.7
    duration_s: float = 1.0
    services: dict[str, Any] = field(default_factory=dict)
    gpu_mem_gb: float | None = None
    workspace_gb: float = 0.0
    wait_for_resident: bool = False
    gpu_service: str | None = None  # an actor-declared user tool: its calls are calls of this service


_DEFAULT = ToolDecl()


class ActionPlacement:
    """Turns queued action work into grants and placements (see the module docstring)."""

    def __init__(self, scheduler: str, params: dict[str, Any] | None, tools: dict[str, dict[str, Any]]) -> None:
        self.scheduler = make_action_scheduler(scheduler, **(params or {}))
        self.name = scheduler
        self.tools: dict[str, ToolDecl] = {}
        for name, decl in tools.items():
            try:
                self.tools[name] = ToolDecl(**decl)
            except TypeError as exc:
                raise ValueError(f"tool {name!r}: {exc} (fields: cpu, max_cpu, parallel_fraction, duration_s, "
                                 "services, gpu_mem_gb, workspace_gb, wait_for_resident)") from None
        specs = {}
        memory = {(d.gpu_mem_gb, d.workspace_gb, d.wait_for_resident) for d in self.tools.values()
                  if d.services or d.gpu_mem_gb}
        if len(memory) > 1:
            raise ValueError("service tools declare different gpu_mem_gb/workspace_gb/wait_for_resident: "
                             f"{sorted(memory, key=str)}")
        for name, d in self.tools.items():
            specs.update(service_specs(d.services))
        self.service_tools = SERVICE_TOOLS | {n for n, d in self.tools.items() if d.services}
        self.cores = CorePools()
        gpu_mem_gb, workspace_gb, wait = memory.pop() if memory else (None, 0.0, False)
        try:
            self.services = ServicePools(specs, gpu_mem_gb, workspace_gb, wait)
        except GpuCellError as exc:
            raise ValueError(f"GPU services: {exc}") from None
        self._specs: dict[str, ActionSpec] = {}
        self.granted: dict[str, tuple[int, float, float]] = {}  # work id -> (cores, started, expected end)
        self._running: dict[str, RunningView] = {}  # work id -> what the policy sees of it (kept with granted)
        self._home: OrderedDict[str, str] = OrderedDict()  # trajectory -> actor id of its sandbox
        self.declared: dict[str, ToolDecl] = {}  # user tools as the action actors declared them
        self._declared_by: dict[bytes, ActorSession] = {}  # sessions whose declarations were read
        self.releases = SandboxReleases()  # which actor holds which trajectory's sandbox; what each must release
        self.sandboxed = set(SANDBOX_TOOLS)  # tools whose calls run in the trajectory's sandbox

    def learn_declarations(self, actors: Sequence[ActorSession]) -> None:
        """Read the user-tool declarations of every session not read yet (see the module docstring)."""
        for s in actors:
            if TOOL_DECLS_LABEL not in s.labels or self._declared_by.get(s.peer) is s:
                continue
            self._declared_by[s.peer] = s
            try:
                decls = tool_declarations(s.labels)
            except PayloadError as exc:
                self.cores.unparsed.append((s.actor_id, str(exc)))
                continue
            for name, d in decls.items():
                if d.sandboxed:
                    self.sandboxed.add(name)
                if name in self.tools:
                    continue
                self.declared[name] = ToolDecl(cpu=d.cores, max_cpu=d.cores, gpu_service=d.gpu_service)
                if d.gpu_service:
                    self.service_tools = self.service_tools | {name}
        if len(self._declared_by) > 2 * len(actors) + 64:  # sessions gone: forget them
            live = {s.peer for s in actors}
            self._declared_by = {p: s for p, s in self._declared_by.items() if p in live}

    def decl(self, tool: str) -> ToolDecl:
        """The declaration of ``tool``: the broker's table, else an actor's, else the default."""
        return self.tools.get(tool) or self.declared.get(tool) or _DEFAULT

    def summary(self) -> dict[str, Any]:
        """For status: the policy, the running grants, every action actor's cores (free and busy) and the
        GPU services' resident replicas per actor."""
        return {"scheduler": self.name, "running": len(self.granted), "cores": self.cores.summary(),
                "services": self.services.resident()}

    def spec(self, work_id: str, trajectory: str | None, tool: str, submitted_at: float) -> ActionSpec:
        s = self._specs.get(work_id)
        if s is None:
            d = self.decl(tool)
            elastic = (ElasticSpec("cpu", max(d.max_cpu, d.cpu), Amdahl(d.parallel_fraction))
                       if d.max_cpu > d.cpu else None)
            s = ActionSpec(work_id, trajectory or work_id, tool, {"cpu": max(1, d.cpu)}, d.duration_s, elastic,
                           submitted_at)
            self._specs[work_id] = s
        return s

    def decide(self, queue: list[ActionSpec], free_cores: int, now: float) -> list[tuple[str, int]]:
        grants = self.scheduler.schedule(queue, {"cpu": free_cores}, list(self._running.values()), now)
        return [(g.action_id, int(g.units.get("cpu", 1))) for g in grants]

    def grants(self, queues: Iterable[Iterable[Work]], free_cores: int, now: float) -> list[tuple[str, int]]:
        """Which queued actions start now over ``free_cores`` free cores, and with how many cores each:
        ``queues`` are FCFS queues (their oldest :data:`WINDOW` actions are shown to the policy). Returns
        ``(work id, cores)`` grants that fit ``free_cores`` jointly."""
        queued = list(islice(heapq.merge(*queues, key=lambda w: w.seq), WINDOW))
        if not queued:
            return []
        specs = [self.spec(w.work_id, w.trajectory, w.name, w.submitted_at) for w in queued]
        return self.decide(specs, free_cores, now)

    # ------------------------------------------------------------------ one placement round
    def place(self, actors: Sequence[ActorSession], queues: Mapping[tuple[str, str], Sequence[str]],
              works: Mapping[str, Work], now: float) -> list[tuple[str, ActorSession, dict[str, Any]]]:
        """One round over every connected actor (``actors``) and the action queues: returns ``(work id, actor,
        route)`` for each action to start now (the caller takes it off its queue and assigns it)."""
        self.cores.forget(s.peer for s in actors)
        self.learn_declarations(actors)
        self.services.forget(s.peer for s in actors)
        slots = {s.peer: s.free for s in actors if "action" in s.accepting and s.free > 0}
        eligible = [s for s in actors if s.peer in slots]
        out: list[tuple[str, ActorSession, dict[str, Any]]] = []
        if not eligible:
            return out
        gpu = [(s, self.cores.actor(s).gpus) for s in eligible]
        gpu = [(s, g) for s, g in gpu if g > 0]
        routed: set[tuple[str, str]] = set()
        for key, q in queues.items():
            if key[0] != "action" or not q or key[1] not in self.service_tools:
                continue
            serving = [(s, g) for s, g in gpu if s.serves(*key)]
            if not serving:
                continue  # no GPU actor offers it: CPU actors run it like any tool (their engine decides)
            routed.add(key)
            blocked: set[str] = set()  # services that found no cell this round: their later calls wait too
            for wid in islice(q, WINDOW):  # FCFS, the oldest WINDOW calls
                w = works[wid]
                service = self.decl(key[1]).gpu_service or (w.args.get("service") if isinstance(w.args, dict)
                                                             else None)
                free = [(s, g) for s, g in serving if slots[s.peer] > 0]
                if not free:
                    break
                if not isinstance(service, str):  # malformed args: the actor's tool refuses them (typed)
                    slots[free[0][0].peer] -= 1
                    out.append((wid, free[0][0], ActionRoute().to_wire()))
                    continue
                if service in blocked:
                    continue
                placed = self.services.place(wid, service, free, now)
                if placed is None:
                    blocked.add(service)
                    continue
                sess, route = placed
                slots[sess.peer] -= 1
                out.append((wid, sess, ActionRoute(service=route).to_wire()))
        cpu = [s for s in eligible if slots[s.peer] > 0 and self.cores.free_count(s) > 0]
        mine = [q for key, q in queues.items() if key[0] == "action" and q and key not in routed
                and any(s.serves(*key) for s in cpu)]
        if not mine:
            return out
        heads = [(works[wid] for wid in q) for q in mine]  # each queue is FCFS: merged lazily
        grants = self.grants(heads, self.cores.total_free(cpu), now)
        for wid, n in sorted(grants, key=lambda g: -g[1]):
            w = works[wid]
            cands = [s for s in cpu if slots[s.peer] > 0 and s.serves("action", w.name)]
            pick = self.cores.best_fit(cands, n, self._specs[wid].demand.get("cpu", 1),
                                       self._home.get(w.trajectory) if w.trajectory else None)
            if pick is None:
                continue
            sess, ids = pick
            self.cores.take(wid, sess, ids)
            slots[sess.peer] -= 1
            route = ActionRoute(cores=len(ids), core_ids=list(ids) if self.cores.real_ids(sess) else None,
                                release=self.releases.take(sess.actor_id) if w.name in self.sandboxed else None)
            out.append((wid, sess, route.to_wire()))
        return out

    def unparsed_labels(self) -> list[tuple[str, str]]:
        """``(actor id, why)`` of each action actor seen since the last call whose hello labels (cores, CPU ids,
        NUMA nodes, GPUs) did not parse: it runs on the fallback (its session's ``cores``, a private pool).
        The caller logs them; this core does not log."""
        return self.cores.take_unparsed()

    def hold(self, w: Work, sess: ActorSession, now: float) -> None:
        """``w`` was assigned to (or adopted by) ``sess`` with ``w.route``: count its cores as used (a
        GPU-service call holds a replica, counted by the service pools, and no cores)."""
        route = w.route if isinstance(w.route, dict) else {}
        if route.get("service"):
            return
        cores = route.get("cores", 1)
        cores = cores if type(cores) is int and cores > 0 else 1
        if not self.cores.holds(w.work_id):  # adopted, or assigned outside a round: take its cores if free
            ids = route.get("core_ids")
            self.cores.take(w.work_id, sess, ids if isinstance(ids, list) else self.cores.free_ids(sess)[:cores])
        sess.cores_used += cores
        self.started(w.work_id, cores, now)
        if w.trajectory:
            if w.name in self.sandboxed:
                self.releases.ran(w.trajectory, sess.actor_id)
            self._home[w.trajectory] = sess.actor_id
            self._home.move_to_end(w.trajectory)
            if len(self._home) > HOMES:
                self._home.popitem(last=False)

    def started(self, work_id: str, cores: int, now: float) -> None:
        s = self._specs.get(work_id)
        est = s.duration(cores) if s is not None and s.elastic is not None else (s.base_duration if s else 1.0)
        self.granted[work_id] = (cores, now, now + est)
        self._running[work_id] = RunningView(work_id, s.trajectory if s is not None else work_id, {"cpu": cores},
                                             now + est)

    def ended(self, work_id: str) -> int:
        """Forget a finished/lost action; returns the cores it held (0 if none)."""
        self._specs.pop(work_id, None)
        return self.unstarted(work_id)

    def unstarted(self, work_id: str, failed: bool = False, now: float | None = None) -> int:
        """The action stopped running (done, failed, handed back or lost): release its cores and its GPU
        service replica (``failed``: evicting a replica it restored), keep its spec; returns its cores."""
        self.cores.give_back(work_id)
        self.services.release(work_id, failed, now)
        c = self.granted.pop(work_id, None)
        self._running.pop(work_id, None)
        return c[0] if c else 0

    def remembers(self, work_id: str) -> bool:
        """Whether the action ``work_id`` is still tracked (its spec or a grant)."""
        return work_id in self._specs or work_id in self.granted

    def trajectory_finished(self, trajectory: str, now: float) -> None:
        self.scheduler.trajectory_finished(trajectory, now)
        self._home.pop(trajectory, None)
        self.releases.finished(trajectory)  # its sandboxes: released with the next sandbox call on their actors
