"""The broker core's planning rounds and their application: a planner's plan → GPU actors' roles →
directives, and the periodic planning round of the broker's own planner (``plan_decider``). Pure: the
directives and log lines come back as commands, and a round's search is either run inline or handed to the
shell as a :class:`~libra.broker.events.StartPlannerSearch` command. The layout and ordering rules are in
``plan_applier``, the round's decision in ``plan_decider``.

Lent slots (``ActorSession.lent_owner`` non-empty: capacity an owner lends and takes back) are never among the
plan's GPU slots (:meth:`Planning.gpu_slots`): no training layout, no EARL TP group and no engine cap is ever
laid on them. The connected, not-reclaimed ones (:meth:`Planning.lent_slots`) are the round's borrowed capacity
(``libra.broker.plan_borrowed``) and serve TP-1 rollout instances in the deployed plan's buckets, directed like
any other role; a change in them makes the next round due at once (:meth:`Planning.capacity_changed`)."""

from __future__ import annotations

from collections import deque
from typing import Any

from libra.policies.cost import RolloutCostModel, load_hardware, load_model
from libra.policies.planner.engine_caps import cluster_max_tp

from .earl import EarlLoop, EarlSettings, earl_plan
from .events import Command, Log, StartPlannerSearch
from .plan_decider import PlanJob, PlannerLoop
from .plan_applier import GpuSlot, PlanApplier, PlanError, Role, bucket_specs, layout_roles
from .plan_borrowed import lent_roles
from .rollout import RolloutRouting
from .sessions import SessionRegistry

__all__ = ["Planning"]


_ENGINE_DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32")


def check_engine_settings(engines: dict[str, Any]) -> dict[str, Any]:
    """The ``[broker.engines]`` table, checked: ``dtype`` (auto, bf16, fp16, fp32) and ``gpu_memory_fraction``
    (0 to 1; 0: automatic). Raises ``ValueError`` naming the bad key or value."""
    unknown = sorted(set(engines) - {"dtype", "gpu_memory_fraction"})
    if unknown:
        raise ValueError(f"[broker.engines]: unknown key(s) {', '.join(unknown)} (known: dtype, gpu_memory_fraction)")
    if "dtype" in engines and engines["dtype"] not in _ENGINE_DTYPES:
        raise ValueError(f"[broker.engines] dtype must be one of {', '.join(_ENGINE_DTYPES)}, got {engines['dtype']!r}")
    frac = engines.get("gpu_memory_fraction", 0.0)
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
        raise ValueError(f"[broker.engines] gpu_memory_fraction must be within [0, 1], got {frac!r}")
    return dict(engines)


def _make_earl(loop: PlannerLoop | None) -> EarlLoop | None:
    """EARL's selector when ``[broker.planner]`` says ``parallelism = "earl"`` (the planner's cost model)."""
    if loop is None or loop.settings.parallelism != "earl":
        return None
    s = loop.settings
    return EarlLoop(EarlSettings.from_dict(s.earl), RolloutCostModel(load_hardware(s.hardware), load_model(s.model)))


class Planning:
    """Applies plans to the connected GPU actors and runs the broker planner's rounds.

    ``offload``: False, a round's search runs inline (tests, the simulator); True (the server), it comes
    out as a ``StartPlannerSearch`` command and its result back as a ``PlannerDone`` event (:meth:`done`).
    """

    def __init__(self, loop: PlannerLoop | None, sessions: SessionRegistry, rollout: RolloutRouting,
                 offload: bool = False, engines: dict[str, Any] | None = None) -> None:
        self.engines = check_engine_settings(engines or {})  # [broker.engines]: rides along in each directive
        self.loop = loop
        self.offload = offload
        self.applier: PlanApplier | None = None  # the plan being applied (or the last one)
        self.notes: list[tuple[str, str, dict[str, Any]]] = []  # decisions for the jobs' records (take_notes)
        self._generation = 0
        self._lent_seen: tuple[str, ...] = ()  # the lent slots the last round counted
        self._sessions = sessions
        self._rollout = rollout
        self.earl = _make_earl(loop)  # [broker.planner] parallelism = "earl": the rollout TP follows the context
        if self.earl is not None:
            rollout.turn_contexts = deque(maxlen=4096)
            loop.earl = self.earl  # type: ignore[union-attr]  # shown in the planner's status summary

    @property
    def applying(self) -> bool:
        """Whether a plan is still being applied (directives of later waves pending)."""
        return self.applier is not None and not self.applier.done

    def _owned_gpu_sessions(self) -> list[Any]:
        return [s for s in self._sessions.actors.values()
                if s.labels.get("slot_kind") == "gpu" and s.slot[3:].isdigit() and not s.lent_owner]

    def gpu_slots(self) -> list[GpuSlot]:
        """The connected GPU actors the job owns as plan slots (labels ``slot_kind == "gpu"``, slot ``gpuN``;
        never a lent slot)."""
        return [GpuSlot(s.actor_id, s.host, int(s.slot[3:])) for s in self._owned_gpu_sessions()]

    def lent_slots(self) -> list[str]:
        """The connected lent GPU slots whose owners have not reclaimed them, in the order they connected:
        the borrowed capacity."""
        return [s.actor_id for s in self._sessions.actors.values()
                if s.lent_owner and not s.reclaimed_until and s.labels.get("slot_kind") == "gpu"]

    def capacity_changed(self, actor_id: str, why: str, now: float) -> list[Command]:
        """The borrowed capacity changed (``actor_id`` was reclaimed, lent again, joined or left: ``why``): the
        next round is due at once and plans with the lent slots then connected. Rounds also notice a change
        themselves (:meth:`due`), so calling this only makes the log say why."""
        if self.loop is None:
            return []
        self.loop.capacity_changed()
        return [Log("borrowed_capacity_changed", {"actor": actor_id, "why": why, "lent": len(self.lent_slots())},
                    "info", "libra.broker.plan_rounds")]

    def max_rollout_tp(self) -> int | None:
        """The largest rollout TP group every connected owned GPU actor's engine can serve (the smallest
        ``max_tp`` of their hello labels: 1 where an HF engine runs); None when no actor says. Lent slots
        serve TP 1 anyway and never cap the owned layout."""
        return cluster_max_tp(s.labels for s in self._owned_gpu_sessions())

    # ------------------------------------------------------------------ applying a plan
    def apply(self, plan: Any, now: float, placement: str | None = None) -> list[Command]:
        """Move GPU actors to the roles of ``plan`` (a planner ``Plan``) without stopping anything.

        Lays the plan out on the connected GPU actors (raises ``PlanError`` if it does not fit), sets
        the rollout buckets, and sends the first wave of directives; later waves follow as actors
        finish switching (:meth:`switched`), ordered so that a complete training replica stays active
        throughout. The lent slots serve TP-1 instances in its buckets (``placement``: :meth:`place_lent`'s).
        """
        slots, lent = self.gpu_slots(), self.lent_slots()
        current = self._roles_now([s.actor_id for s in slots] + lent)
        self._generation += 1
        target = layout_roles(plan, slots, {a: current[a] for a in current if a not in lent}, self._generation)
        target.update(lent_roles(plan, lent, placement or self._placement()))
        for aid, role in target.items():  # refused at plan time, not when the engine is built
            cap = self._sessions.actor_by_id(aid).labels.get("max_tp")  # type: ignore[union-attr]
            if role.kind == "rollout" and isinstance(cap, int) and role.tp > cap:
                engine = self._sessions.actor_by_id(aid).labels.get("engine", "?")  # type: ignore[union-attr]
                raise PlanError(f"plan puts {aid} in a TP-{role.tp} rollout group but its {engine} engine serves "
                                f"TP <= {cap}")
        if any(target[a].kind == "train" for a in lent):  # never: lent capacity holds no training state
            raise PlanError("plan puts a lent slot in training")
        self.applier = PlanApplier(current, target)
        summary = {"lent_gpus": len(lent), "n_gpus": plan.n_gpus, "n_train": plan.n_train, "rollout_tps": list(plan.rollout_tps),
                   "t_rollout_s": plan.t_rollout, "t_train_s": plan.t_train, "generation": self._generation}
        self.notes.append(("plan", f"plan {self._generation} applied: {plan.n_train} of {plan.n_gpus} GPUs train, "
                           f"rollout TPs {list(plan.rollout_tps)}", summary))
        before = [(b.name, b.tp, b.max_tokens) for b in self._rollout.buckets]
        self._rollout.set_buckets(bucket_specs(plan))
        after = [(b.name, b.tp, b.max_tokens) for b in self._rollout.buckets]
        if after != before:
            self.notes.append(("buckets", "C-MLFQ buckets: " + ", ".join(f"{n} <= {t} tokens" for n, _, t in after),
                               {"before": [list(b) for b in before], "after": [list(b) for b in after]}))
        return self._direct(self.applier.start(), now)

    def _roles_now(self, actor_ids: list[str]) -> dict[str, Role]:
        """The role each of ``actor_ids`` was last directed to (``idle`` when none)."""
        out: dict[str, Role] = {}
        keys = ("tp", "group", "bucket", "rank", "size")
        for aid in actor_ids:
            cfg = self._sessions.actor_by_id(aid).directive_config  # type: ignore[union-attr]
            out[aid] = (Role(cfg["role"], **{k: cfg[k] for k in keys if k in cfg})
                        if cfg.get("role") in ("train", "rollout") else Role("idle"))
        return out

    def _placement(self) -> str:
        return self.loop.settings.borrowed_placement if self.loop is not None else "proportional"

    def place_lent(self, now: float, plan: Any = None, placement: str | None = None) -> list[Command]:
        """Direct the lent slots to their TP-1 rollout instances under the deployed plan (those already placed
        stay), without re-laying the owned GPUs; nothing while a plan is being applied or none is deployed.
        ``plan`` / ``placement``: the deployed plan and the buckets' policy when a shell runs the rounds itself
        (default: this broker planner's plan and ``borrowed_placement``)."""
        plan = plan if plan is not None else (self.loop.plan if self.loop is not None else None)
        lent = self.lent_slots()
        if plan is None or self.applying or not lent:
            return []
        current, target = self._roles_now(lent), lent_roles(plan, lent, placement or self._placement())
        if current == target:
            return []
        self.applier = PlanApplier(current, target)
        return self._direct(self.applier.start(), now)

    def switched(self, actor_id: str, now: float) -> list[Command]:
        """Actor ``actor_id`` finished switching (it bid after a directive): the next wave's directives."""
        if self.applier is None:
            return []
        return self._direct(self.applier.on_switched(actor_id), now)

    def actor_left(self, actor_id: str, why: str, now: float) -> list[Command]:
        """An actor left (``why``). If it is part of the plan being applied, stop sequencing the plan: actors
        already told keep switching and bid with their new roles; the rest keep theirs. The broker's
        planner (if any) forgets the plan, so its next round plans afresh for the actors still connected."""
        if not self.applying or actor_id not in self.applier.target:  # type: ignore[union-attr]
            return []
        self.applier = None
        out: list[Command] = [Log("plan_abandoned", {"actor": actor_id, "why": why}, "warning",
                                  "libra.broker.plan_rounds")]
        if self.loop is not None:
            since = self.loop.recorded
            self.loop.abandoned(actor_id, why, now)
            out.extend(self._decision_logs(since))
        return out

    def _direct(self, moves: list[tuple[str, Role]], now: float) -> list[Command]:
        for aid, role in moves:
            self.notes.append(("role_switch", f"{aid} -> {role.kind} (tp {role.tp})",
                               {"actor": aid, "kinds": role.kinds, **role.config(), "by": "plan"}))
        return [self._sessions.direct(aid, role.kinds, now, "finish", {**role.config(), **self.engines})
                for aid, role in moves]

    def take_notes(self) -> list[tuple[str, str, dict[str, Any]]]:
        """The decisions made since the last call (``(what, text, detail)``: ``plan``, ``buckets``,
        ``role_switch``), for the running jobs' decision records (``JobBoard.note``)."""
        out, self.notes = self.notes, []
        return out

    def job_feedback(self, train_ooms: int, costs: Any) -> None:
        """What the jobs measured since the last pump: ``train_ooms`` training steps that ran out of memory
        (each makes the next round due at once: :meth:`train_out_of_memory`) and the newest job's measured
        costs (``MeasuredCosts`` or None), handed to the planner loop (:meth:`PlannerLoop.measured`)."""
        for _ in range(train_ooms):
            self.train_out_of_memory()
        if self.loop is not None and costs is not None:
            self.loop.measured(costs)

    # ------------------------------------------------------------------ the planner's rounds
    def observe(self, prompt_tokens: int, generated: int, turns: int, tool_seconds: float) -> None:
        """A trajectory finished (see ``PlannerLoop.observe``); ignored without a broker planner."""
        if self.loop is not None:
            self.loop.observe(prompt_tokens, generated, turns, tool_seconds)

    def train_out_of_memory(self) -> None:
        """A training step's batch no longer fit the deployed layout (a trainer's ``oom`` failure): the next
        round is due at once and re-plans (``PlannerLoop.train_out_of_memory``); ignored without a planner."""
        if self.loop is not None:
            self.loop.train_out_of_memory()

    def due(self, now: float) -> bool:
        """Whether a round of the broker's planner is due and no plan is still being applied (a change in the
        lent slots since the last round makes it due at once: :meth:`capacity_changed`)."""
        if self.loop is not None and tuple(self.lent_slots()) != self._lent_seen:
            self.loop.capacity_changed()
        return self.loop is not None and self.loop.due(now) and not self.applying

    def start(self, now: float, *, queue_pressure: float, active_pressure: float, rejected_total: int,
              rollout_time: float | None, train_time: float | None) -> list[Command]:
        """Start a due round on the connected GPU actors. Inline, the search runs here and its plan is
        applied at once; offloaded, the search comes out as a ``StartPlannerSearch`` command."""
        loop = self.loop
        assert loop is not None
        since = loop.recorded
        loop.cap_rollout_tp(self.max_rollout_tp())  # no TP group larger than the engines can serve
        if self.earl is not None:  # EARL owns the rollout TP: the planner's round must not undo its switch
            loop.pin_rollout_tp(self.rollout_tp_now())
        self._lent_seen = tuple(self.lent_slots())
        job = loop.start(len(self.gpu_slots()), now, queue_pressure=queue_pressure, active_pressure=active_pressure,
                         rejected_total=rejected_total, rollout_time=rollout_time, train_time=train_time,
                         borrowed=len(self._lent_seen))
        out = self._decision_logs(since)
        if job is None:
            return out
        if self.offload:
            out.append(StartPlannerSearch(job))
            return out
        return out + self.done(job.run(), now)

    def done(self, job: PlanJob, now: float) -> list[Command]:
        """A round's search finished: apply the plan it decided on, if any. A plan that does not fit the
        actors connected now (``PlanError``: some left meanwhile) is recorded as ``apply_failed``."""
        loop = self.loop
        if loop is None:
            return []
        since = loop.recorded
        plan = loop.finish(job, now)
        out = self._decision_logs(since)
        if plan is None:
            return out + self.place_lent(now)
        try:
            out.extend(self.apply(plan, now))
        except PlanError as exc:
            loop.rejected(plan, str(exc))
        return out

    # ------------------------------------------------------------------ EARL's rollout TP
    def earl_round(self, now: float) -> list[Command]:
        """When EARL's decision is due (no plan being applied, no planner search in flight): feed it the turns
        routed since, and apply a switch of the rollout TP as a plan (:func:`~libra.broker.earl.earl_plan`) on
        the GPU actors in rollout roles, keeping the deployed plan's training layout. Without a deployed plan it
        plans only when no GPU actor trains (it would otherwise idle the trainers)."""
        e = self.earl
        if e is None:
            return []
        seen = self._rollout.turn_contexts
        while seen:
            e.observe(seen.popleft())
        if self.applying or (self.loop is not None and self.loop.searching) or not e.due(now):
            return []
        roles, rollout = self._gpu_roles()
        base = self.loop.plan if self.loop is not None else None
        if not rollout or (base is None and any(r == "train" or (r is None and "train" in s.accepting)
                                                 for s, r in roles)):
            return []
        current = _common_tp(rollout)
        since = e.recorded
        tp = e.decide(now, n_gpus=len(rollout), load=len(self._rollout.trajs), max_tp=self.max_rollout_tp(),
                      current_tp=current)
        out: list[Command] = []
        if tp is not None:
            try:
                out = self.apply(earl_plan(base, len(rollout), tp), now)
            except (PlanError, ValueError) as exc:
                e.rejected(str(exc))
        return [Log("earl_decision", d, "info", "libra.broker.earl") for d in e.new_decisions(since)] + out

    def _gpu_roles(self) -> tuple[list[tuple[Any, Any]], list[Any]]:
        """The GPU actors with their directed roles, and those of them serving rollout."""
        roles = [(s, s.directive_config.get("role")) for s in self._owned_gpu_sessions()]
        return roles, [s for s, r in roles if r == "rollout" or (r is None and "generate" in s.accepting)]

    def rollout_tp_now(self) -> int:
        """The TP most rollout GPU actors run now (1 when none serves rollout)."""
        return _common_tp(self._gpu_roles()[1])

    def _decision_logs(self, since: int) -> list[Command]:
        assert self.loop is not None
        return [Log("planner_round", {k: v for k, v in entry.items() if k != "plan"}, "info",
                    "libra.broker.plan_decider") for entry in self.loop.new_decisions(since)]


def _common_tp(rollout: list[Any]) -> int:
    """The TP most of the ``rollout`` GPU actors run (their directed ``tp``; 1 when there are none)."""
    tps = [int(s.directive_config.get("tp", 1) or 1) for s in rollout]
    return max(set(tps), key=tps.count) if tps else 1
