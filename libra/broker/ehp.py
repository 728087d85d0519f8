"""The broker's Elastic Hybrid Pool (``allocation = "grp_ehp"`` in ``[broker.planner]``). Pure.

Hybrid actors (``--role hybrid``) serve rollout until the pool borrows them: each then joins training as
one more whole data-parallel replica through the join state machine of :mod:`libra.broker.hybrid`
(requested → fetching state → zero-gradient sync → activating → active; cancel or fail → back to rollout)
and leaves again when the pool releases it (docs/papers.md §1.3.5). The core trainer ranks never change.

At every training-step boundary the job host asks :meth:`ElasticPool.plan_step` for the step's group:

1. **Decide** how many hybrid replicas to hold: a forced schedule (``force = [[step, replicas], ...]``:
   from that step on; for tests and operators) or the borrow/release hysteresis of §1.3.4
   (:func:`~libra.policies.planner.online.ehp_signal`: the last step's training and rollout seconds, the
   rollout queue and active pressure, ``min_rollout`` rollout actors kept). Without a finished step the
   pool holds. When the job hands in its measured costs (:class:`~libra.policies.planner.measured.
   MeasuredCosts`: rollout tokens/s per instance, training tokens/s per rank), a borrow the hysteresis asks
   for is kept only if the costs predict the step faster with one more training replica and one fewer
   rollout instance, and a release only if they predict it faster the other way (the reason then ends in
   ``_measured_gain`` or ``_but_measured_no_gain``; :attr:`ElasticPool.prediction` keeps the comparison).
   A forced schedule is never gated.
2. **Reconcile**: borrowing a replica starts its join (a new generation of its ``HybridReplica``) and
   moves the actor to ``train`` with a directive; releasing one cancels its join or membership (so a
   release can cancel an in-flight join) and moves it back to ``generate``.
3. **Advance** joins: a requested replica whose actor has switched to ``train`` (it drained its rollout
   turns and bid again while the core trained the previous step: the role switch is off the core's path)
   begins fetching: it is a zero-gradient member of this step; it joins the group and contributes its zeros
   at once, then loads rank 0's state before applying the step's update, and every member forms the step's
   group on a thread beside its own passes, so the core ranks wait for neither the transfer nor (where
   their passes take longer than the formation) the group (``libra.actors.elastic_train``). A replica
   that fetched the state and contributed zeros for ``zero_steps`` steps activates at this boundary and
   trains with real data from this step on. A replica whose state source (the job's weights ref: rank 0's
   data plane) is not known yet, or whose actor has not switched yet, stays ``requested``.
4. **Members**: the core ranks (the ``world_size`` non-hybrid train actors, fixed at the first step) then
   the replicas fetching, zero-syncing or active. The group **generation** goes up whenever the member
   list changes; every work of the step carries the group, and ranks re-form their gloo group
   (``libra.engines.elastic_dp``) when it changed.

:meth:`ElasticPool.step_done` feeds the step's replies back (a joining member's reply says which state
version it loaded: ``state_fetched`` and its zero step); :meth:`ElasticPool.step_failed` and
:meth:`ElasticPool.actor_left` roll joins back. Moves (directives) are taken with
:meth:`ElasticPool.take_moves`; the broker core turns them into ``Directive`` messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from libra.config import ConfigError, from_mapping
from libra.policies.planner.online import EhpSignal, ehp_signal

from .hybrid import HybridReplica, JoinState

__all__ = ["ALLOCATION", "ActorView", "EhpSettings", "ElasticPool", "StepGroup", "from_planner_config"]

ALLOCATION = "grp_ehp"
TRAIN_ROLE = {"role": "train", "group": "ehp"}
ROLLOUT_ROLE = {"role": "rollout", "bucket": "default"}


@dataclass(frozen=True, slots=True)
class EhpSettings:
    """``[broker.planner.ehp]``: the pool's knobs (every key optional)."""

    min_rollout: int = 1  # rollout-serving actors (rollout and hybrid) the pool never borrows below
    borrow_ratio: float = 1.15  # train/rollout time at or above which the pool borrows (training bottleneck)
    release_ratio: float = 0.90  # ... at or below which it releases (rollout bottleneck)
    protect_pressure: float = 0.80  # rollout queue/active pressure at or above which it releases
    ttl_steps: int = 20
    zero_steps: int = 1  # zero-gradient steps before a joined replica contributes
    # finished steps the pool holds through before it decides: the first step's times hold one-off set-up (the
    # bundled tiny job trained step 1 in 5.08 s, step 2 in 0.06 s: the pool borrowed on it and released a step later)
    warmup_steps: int = 1
    force: list[list[int]] = field(default_factory=list)  # [[step, replicas], ...]: hold this many from step on

    @classmethod
    def from_planner(cls, planner: Mapping[str, Any]) -> EhpSettings:
        """The ``ehp`` sub-table of a ``[broker.planner]`` mapping; raises ``ConfigError`` naming the key."""
        s = from_mapping(cls, dict(planner.get("ehp") or {}), "broker.planner.ehp")
        problems = []
        problems += [f"{k} must be >= 0, got {getattr(s, k)}" for k in ("min_rollout", "warmup_steps")
                     if getattr(s, k) < 0]
        problems += [f"{k} must be >= 1, got {getattr(s, k)}" for k in ("zero_steps", "ttl_steps") if getattr(s, k) < 1]
        if not 0 < s.release_ratio < s.borrow_ratio:
            problems.append(f"need 0 < release_ratio < borrow_ratio, got {s.release_ratio}, {s.borrow_ratio}")
        for entry in s.force:
            if not (isinstance(entry, list) and len(entry) == 2 and all(type(x) is int and x >= 0 for x in entry)):
                problems.append(f"force entries are [step, replicas] of integers >= 0, got {entry!r}")
        if problems:
            raise ConfigError("broker.planner.ehp: " + "; ".join(problems))
        return s


def from_planner_config(planner: Mapping[str, Any]) -> tuple[dict[str, Any], ElasticPool | None]:
    """Split ``[broker.planner]``: under ``allocation = "grp_ehp"``, the GRP rounds (``plan_decider``) plan
    the core layout with ``grp`` and the Elastic Hybrid Pool (``ehp`` sub-table) borrows hybrid actors on
    top of it. Returns ``(the planner loop's settings, the pool or None)``."""
    if planner.get("allocation") != ALLOCATION:
        return dict(planner), None
    pool = ElasticPool(EhpSettings.from_planner(planner))
    rest = {k: v for k, v in planner.items() if k != "ehp"}
    rest["allocation"] = "grp"
    return rest, pool


@dataclass(frozen=True, slots=True)
class ActorView:
    """What the pool needs to know of a connected actor."""

    actor_id: str
    hybrid: bool  # started with --role hybrid
    kinds: tuple[str, ...]  # the kinds it accepts now
    switching: bool = False  # a directive is still draining (its kinds are about to change)


@dataclass(frozen=True, slots=True)
class StepGroup:
    """One training step's elastic DP group."""

    step: int
    generation: int
    members: tuple[str, ...]  # rank order: core first
    zero: tuple[str, ...]  # contribute zero gradients (no trajectories)
    joining: tuple[str, ...]  # load the core's state (after their zero all-reduce, before the update)
    snapshot: str | None  # the name rank 0 publishes its state under (when someone joins)

    @property
    def trainers(self) -> tuple[str, ...]:
        """Members that train on data this step (the dispatch's ranks), in rank order."""
        return tuple(m for m in self.members if m not in self.zero)


class ElasticPool:
    """See the module docstring. ``world_size``: the job's core trainer ranks."""

    def __init__(self, settings: EhpSettings) -> None:
        self.settings = settings
        self.replicas: dict[str, HybridReplica] = {}  # hybrid actor id -> its join state (one-actor replicas)
        self.core: tuple[str, ...] = ()
        self.generation = 0
        self.signal: EhpSignal | None = None
        self.decisions: list[dict[str, Any]] = []
        self.actors: list[ActorView] = []
        self.pressure = (0.0, 0.0)  # (queue, active) pressure of the rollout pool, set by the core
        self._timed, self._timed_step = 0, -1  # step boundaries seen with a finished step's times (warmup_steps)
        self.prediction: dict[str, Any] | None = None  # the measured-cost comparison behind the last move
        self._members: tuple[str, ...] = ()
        self._moves: list[tuple[str, list[str], dict[str, Any]]] = []
        self._order: list[str] = []  # borrowed replicas, oldest first (released newest first)

    # ------------------------------------------------------------------ inputs from the core
    def observe(self, actors: Sequence[ActorView], queue_pressure: float, active_pressure: float) -> None:
        """The connected actors and the rollout pool's pressure, refreshed before each job pump."""
        self.actors = list(actors)
        self.pressure = (queue_pressure, active_pressure)

    def observe_sessions(self, sessions: Iterable[Any], queued_generate: int) -> None:
        """:meth:`observe` from the broker's actor sessions (``actor_id``, ``labels``, ``accepting``,
        ``capacity``, ``held``): the rollout pressure is computed as for the planner's rounds. Lent slots (``lent_owner``)
        count in the pressure but are not the pool's actors: it never borrows them."""
        sessions = list(sessions)
        gen = [x for x in sessions if "generate" in x.accepting]
        cap = max(1, sum(x.capacity for x in gen))
        views = [ActorView(x.actor_id, x.labels.get("engine_role") == "hybrid", tuple(x.accepting),
                           x.directive is not None) for x in sessions
                 if not getattr(x, "lent_owner", "")]  # a lent slot is never borrowed for training nor a core rank
        self.observe(views, min(1.0, queued_generate / cap), min(1.0, sum(len(x.held) for x in gen) / cap))

    def ready(self, world_size: int) -> bool:
        """Whether the core ranks are known (or enough non-hybrid train actors are connected to fix them)."""
        return bool(self.core) or len(self._core_candidates()) >= world_size

    def _core_candidates(self) -> list[str]:
        return sorted(a.actor_id for a in self.actors if not a.hybrid and "train" in a.kinds)

    # ------------------------------------------------------------------ the step boundary
    def plan_step(self, step: int, world_size: int, source_known: bool, rollout_s: float | None,
                  train_s: float | None, *, costs: Any = None, instances: int = 0) -> StepGroup:
        """The group of training step ``step`` (see the module docstring). ``source_known``: the job has
        published weights, so rank 0's data plane (the joiners' state source) is known. ``costs``: the job's
        :class:`~libra.policies.planner.measured.MeasuredCosts` (a borrow or release needs its prediction to
        agree, :meth:`_measured_gate`); ``instances``: rollout instances serving now (0: count the actors)."""
        if not self.core:
            cands = self._core_candidates()
            if len(cands) < world_size:
                raise RuntimeError(f"ehp: {len(cands)} core train actors connected, the job needs {world_size}")
            self.core = tuple(cands[:world_size])
        desired, reason = self._desired(step, rollout_s, train_s)
        if reason != "forced" and costs is not None:
            desired, reason = self._measured_gate(desired, reason, costs, instances)
        self._reconcile(step, desired, reason)
        snapshot = None
        joining = []
        for aid in self._order:
            rep = self.replicas[aid]
            gen = rep.generation
            if rep.state is JoinState.REQUESTED and source_known and self._switched(aid):
                rep.begin_fetch(gen)
            if rep.state is JoinState.FETCHING_STATE:
                joining.append(aid)
                snapshot = f"ehp/state/s{step}"
            elif rep.state is JoinState.ZERO_SYNC and rep.zero_steps >= self.settings.zero_steps:
                rep.activate(gen)
                rep.activated(gen, step, step - 1)
        zero = [a for a in self._order if self.replicas[a].state in (JoinState.FETCHING_STATE, JoinState.ZERO_SYNC)]
        members = self.core + tuple(a for a in self._order if a in zero or self.replicas[a].state is JoinState.ACTIVE)
        if members != self._members:
            self.generation += 1
            self._members = members
        return StepGroup(step, self.generation, members, tuple(zero), tuple(joining), snapshot)

    def _switched(self, aid: str) -> bool:
        view = next((a for a in self.actors if a.actor_id == aid), None)
        pending = any(m[0] == aid for m in self._moves)
        return (view is not None and not view.switching and not pending and "train" in view.kinds
                and "generate" not in view.kinds)

    def _desired(self, step: int, rollout_s: float | None, train_s: float | None) -> tuple[int, str]:
        held = len(self._order)
        forced = [n for at, n in self.settings.force if at <= step]
        if self.settings.force:
            return (forced[-1], "forced") if forced else (0, "forced")
        if rollout_s is None or train_s is None:
            return held, "no_step_yet"
        if step != self._timed_step:  # a retried step's group is planned on the same times: counted once
            self._timed_step, self._timed = step, self._timed + 1
        if self._timed <= self.settings.warmup_steps:
            return held, "warmup"
        s = self.settings
        rollout = [a for a in self.actors if "generate" in a.kinds or a.actor_id in self._order]
        self.signal = ehp_signal(step=step, train_time=train_s, rollout_time=rollout_s,
                                 queue_pressure=self.pressure[0], active_pressure=self.pressure[1],
                                 rollout_gpus=len(rollout), min_rollout_gpus=s.min_rollout, replica_gpus=1,
                                 current_replicas=held, borrow_ratio=s.borrow_ratio, release_ratio=s.release_ratio,
                                 protect_pressure=s.protect_pressure, ttl_steps=s.ttl_steps)
        return self.signal.desired_replicas, self.signal.reason

    def _measured_gate(self, desired: int, reason: str, costs: Any, instances: int) -> tuple[int, str]:
        """Keep a borrow (release) the hysteresis asked for only if the measured costs predict the step
        faster with one more (fewer) training replica and one fewer (more) rollout instance; without a
        prediction (fewer than one measured step) the hysteresis decides alone. ``self.prediction`` keeps the
        comparison for the step record."""
        held = len(self._order)
        if desired == held:
            return desired, reason
        serving = sum(1 for a in self.actors if "generate" in a.kinds and a.actor_id not in self._order) or instances
        ranks = len(self.core) + held
        move = 1 if desired > held else -1
        gain = costs.move_gain(serving, ranks, move)
        now, then = costs.predict(serving, ranks), costs.predict(serving - move, ranks + move)
        self.prediction = None if gain is None else {
            "move": "borrow" if move > 0 else "release", "instances": serving, "ranks": ranks,
            "step_s_now": now.step_s, "step_s_after": then.step_s, "gain_s": gain}
        if gain is None:
            return desired, reason
        if gain <= 0:
            return held, f"{reason}_but_measured_no_gain"
        return desired, f"{reason}_measured_gain"

    def _reconcile(self, step: int, desired: int, reason: str) -> None:
        free = sorted(a.actor_id for a in self.actors
                      if a.hybrid and a.actor_id not in self._order and a.actor_id not in self.core)
        while len(self._order) < desired and free:
            aid = free.pop(0)
            rep = self.replicas.setdefault(aid, HybridReplica((aid,)))
            rep.request()
            self._order.append(aid)
            self._moves.append((aid, ["train"], dict(TRAIN_ROLE)))
            self._decide(step, "borrow", aid, reason)
        while len(self._order) > desired:
            aid = self._order.pop()
            rep = self.replicas[aid]
            rep.cancel(rep.generation, "released")
            self._moves.append((aid, ["generate"], dict(ROLLOUT_ROLE)))
            self._decide(step, "release", aid, reason)

    def _decide(self, step: int, what: str, aid: str, reason: str) -> None:
        self.decisions.append({"step": step, "action": what, "actor": aid, "reason": reason})

    def step_done(self, group: StepGroup, outs: Mapping[str, Mapping[str, Any]]) -> None:
        """The step's replies by member: joiners that loaded the state move to zero-sync; zero steps count."""
        for aid in group.zero:
            rep = self.replicas.get(aid)
            if rep is None or aid not in self._order:
                continue
            out = outs.get(aid) or {}
            if rep.state is JoinState.FETCHING_STATE and isinstance(out.get("restored_version"), int):
                rep.state_fetched(rep.generation, out["restored_version"])
            rep.zero_step(rep.generation, group.step)

    def step_failed(self, group: StepGroup) -> None:
        """The step failed: every replica that was joining in it goes back to rollout (its join failed), and
        the step's generation is spent: the next step forms a new group even with the same members."""
        for aid in group.zero:
            if aid in self._order:
                self._decide(group.step, "release", aid, "step_failed")
            self._fail(aid, "step_failed")
        if group.generation == self.generation:
            self._members = ()

    def actor_left(self, actor_id: str) -> None:
        """A hybrid actor disconnected: its join or membership ends (atomically for its replica)."""
        if actor_id in self._order:
            rep = self.replicas[actor_id]
            rep.member_failed(actor_id, rep.generation)
            self._order.remove(actor_id)

    def _fail(self, aid: str, why: str) -> None:
        if aid in self._order:
            rep = self.replicas[aid]
            rep.cancel(rep.generation, why)
            self._order.remove(aid)
            self._moves.append((aid, ["generate"], dict(ROLLOUT_ROLE)))

    def take_moves(self) -> list[tuple[str, list[str], dict[str, Any]]]:
        """Role moves to send as directives: ``(actor id, kinds, directive config)``."""
        out, self._moves = self._moves, []
        return out

    def view(self) -> dict[str, Any]:
        """The pool's state for step records and status."""
        return {"generation": self.generation, "core": list(self.core),
                "replicas": {a: {"state": r.state.value, "generation": r.generation, "history": list(r.history)}
                             for a, r in self.replicas.items()},
                "signal": None if self.signal is None else self.signal.reason, "prediction": self.prediction}
