"""Action-level scheduling inside the broker (ARL-Tangram). Pure; owned by ``BrokerState``.

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
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any

from libra.policies.actions.registry import ActionSpec, Amdahl, ElasticSpec, RunningView, make_action_scheduler

if TYPE_CHECKING:
    from .events import Command
    from .state import BrokerState


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

    def trajectory_finished(self, trajectory: str, now: float) -> None:
        self.scheduler.trajectory_finished(trajectory, now)


def schedule_actions(self: BrokerState, now: float, out: list[Command]) -> None:
    """Let the action policy start queued actions (see ``broker/actions.py``).

    One round per action actor, most free cores first: the policy decides over that actor's free
    cores and the actions it serves, so every grant of the round fits on it jointly.
    """
    assert self.actions is not None
    eligible = [s for s in self.actors.values() if "action" in s.accepting and s.free > 0
                and s.cores > s.cores_used]
    if not eligible or not any(q for (k, _), q in self.queues.items() if k == "action"):
        return
    for sess in sorted(eligible, key=lambda s: (s.cores_used - s.cores, s.actor_id)):
        # each queue is FCFS already: merge their heads instead of sorting everything queued (hot under load)
        queues = [q for (k, name), q in self.queues.items() if k == "action" and q and sess.serves(k, name)]
        queued = list(islice(heapq.merge(*((self.works[wid] for wid in q) for q in queues), key=lambda w: w.seq), 512))
        if not queued:
            continue
        specs = [self.actions.spec(w.work_id, w.trajectory, w.name, w.submitted_at) for w in queued]
        for wid, cores in self.actions.decide(specs, sess.cores - sess.cores_used, now):
            if sess.free <= 0:
                break  # out of work slots: the rest stays queued
            w = self.works[wid]
            self.queues[w.key].remove(wid)
            w.route = {"cores": cores}
            self._assign(w, sess, now, out)
