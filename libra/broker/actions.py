"""Action placement inside the broker (ARL-Tangram). Pure; the dispatcher (``dispatch.py``) asks it.

With ``BrokerConfig.action_scheduler`` set (``tangram``, ``fixed_dop``, ``per_trajectory``), queued
``action`` work is not handed out first-come-first-served by credit: the policy decides which actions
start and how many cores each gets, over the cores that all action actors pool (an actor advertises its
cores in its hello labels, ``{"cores": n}``, default its capacity). A grant is placed on the actor with
the fewest free cores that still fit it (best fit, so large grants stay possible) and travels in
``Assign.route["cores"]``; a grant that fits no single actor stays queued (the policy contract allows it).

Tool declarations (``BrokerConfig.tools``) give each tool its demand and elasticity:
``{"pytest": {"cpu": 1, "max_cpu": 8, "parallel_fraction": 0.7, "duration_s": 2.0}}``. Undeclared tools
take one core, are not elastic, and are estimated at ``duration_s = 1``. Estimates only steer the
policy's completion-time model; actual durations come from the actors.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any

from libra.policies.actions.registry import (
    ActionSpec,
    Amdahl,
    ElasticSpec,
    RunningView,
    make_action_scheduler,
)

from .work import Work

#: The most queued actions one placement round shows the policy (the oldest ones).
WINDOW = 512


@dataclass(frozen=True, slots=True)
class ToolDecl:
    cpu: int = 1
    max_cpu: int = 1
    parallel_fraction: float = 0.7
    duration_s: float = 1.0


class ActionPlacement:
    """Turns queued action work into grants and placements."""

    def __init__(self, scheduler: str, params: dict[str, Any] | None, tools: dict[str, dict[str, Any]]) -> None:
        self.scheduler = make_action_scheduler(scheduler, **(params or {}))
        self.name = scheduler
        self.tools: dict[str, ToolDecl] = {}
        for name, decl in tools.items():
            try:
                self.tools[name] = ToolDecl(**decl)
            except TypeError as exc:
                raise ValueError(f"tool {name!r}: {exc} (fields: cpu, max_cpu, parallel_fraction, duration_s)") from None
        self._specs: dict[str, ActionSpec] = {}
        self.granted: dict[str, tuple[int, float, float]] = {}  # work id -> (cores, started, expected end)

    def spec(self, work_id: str, trajectory: str | None, tool: str, submitted_at: float) -> ActionSpec:
        s = self._specs.get(work_id)
        if s is None:
            d = self.tools.get(tool, ToolDecl())
            elastic = (ElasticSpec("cpu", max(d.max_cpu, d.cpu), Amdahl(d.parallel_fraction))
                       if d.max_cpu > d.cpu else None)
            s = ActionSpec(work_id, trajectory or work_id, tool, {"cpu": max(1, d.cpu)}, d.duration_s, elastic,
                           submitted_at)
            self._specs[work_id] = s
        return s

    def decide(self, queue: list[ActionSpec], free_cores: int, now: float) -> list[tuple[str, int]]:
        running = [RunningView(w, self._specs[w].trajectory if w in self._specs else w, {"cpu": c}, end)
                   for w, (c, _, end) in self.granted.items()]
        grants = self.scheduler.schedule(queue, {"cpu": free_cores}, running, now)
        return [(g.action_id, int(g.units.get("cpu", 1))) for g in grants]

    def grants(self, queues: Iterable[Iterable[Work]], free_cores: int, now: float) -> list[tuple[str, int]]:
        """Which queued actions start now on one actor with ``free_cores`` free, and with how many cores each:
        ``queues`` are the FCFS queues that actor serves (their oldest :data:`WINDOW` actions are shown to
        the policy). Returns ``(work id, cores)`` grants that fit the actor jointly."""
        queued = list(islice(heapq.merge(*queues, key=lambda w: w.seq), WINDOW))
        if not queued:
            return []
        specs = [self.spec(w.work_id, w.trajectory, w.name, w.submitted_at) for w in queued]
        return self.decide(specs, free_cores, now)

    def started(self, work_id: str, cores: int, now: float) -> None:
        s = self._specs.get(work_id)
        est = s.duration(cores) if s is not None and s.elastic is not None else (s.base_duration if s else 1.0)
        self.granted[work_id] = (cores, now, now + est)

    def ended(self, work_id: str) -> int:
        """Forget a finished/lost action; returns the cores it held (0 if none)."""
        self._specs.pop(work_id, None)
        c = self.granted.pop(work_id, None)
        return c[0] if c else 0

    def unstarted(self, work_id: str) -> int:
        """The action goes back to the queue: release its cores, keep its spec."""
        c = self.granted.pop(work_id, None)
        return c[0] if c else 0

    def remembers(self, work_id: str) -> bool:
        """Whether the action ``work_id`` is still tracked (its spec or a grant)."""
        return work_id in self._specs or work_id in self.granted

    def trajectory_finished(self, trajectory: str, now: float) -> None:
        self.scheduler.trajectory_finished(trajectory, now)
