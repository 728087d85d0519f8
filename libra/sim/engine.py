"""Discrete-event simulator of agentic-RL rollout + asynchronous GRPO training, driving the real broker.

Contract: :class:`Simulator` builds a real :class:`~libra.broker.state.BrokerState` (with the real router
named in :class:`SimConfig`) and feeds it ``PeerMessage``/``Tick`` events on a virtual clock, executing
every ``Send`` it returns by simulating the receiver:

- rollout actors, one per instance of the :class:`~libra.sim.cluster.Layout` (hello with labels
  ``{"role": {"bucket": name}}``, capacity = concurrent sequences that fit the KV cache at the
  planner's per-sequence reserve, ``SimConfig.reserve_tokens`` or :func:`_planner_reserve`: the
  instance itself admits by actual KV, like vLLM, so the credit only caps dispatch), simulated by
  :class:`~libra.sim.instance.SimInstance` (continuous batching, prefill, decode vs KV tokens, KV
  capacity, KV-transfer vs re-prefill migrations), answering ``{"gen_tokens": n}``;
- one tool actor serving every tool, each call taking its trace ``tool_seconds`` and answering
  ``{"payload_tokens": n, "status": s}``;
- one client that replays each trajectory of the trace (generate → action → generate ... →
  ``EndTrajectory``), submitting generate args ``{prompt_id, prompt_tokens, step, true_remaining}``.

GRPO loop: :class:`~libra.sim.batching.BatchFormer` decides which groups start and what each training
step consumes. ``SimConfig.batching = "streaming"`` (default, docs/papers.md §1.7): groups start while the
staleness budget (``eta``) and the concurrency cap allow, and training step ``k`` takes the first complete
groups by creation, as soon as the previous step has finished; ``"barrier"`` (the earlier model): the groups
of step ``k + lag`` start when step ``k`` has trained, and step ``k`` trains when all of its own are done.
A step's time = its train time from :class:`~libra.policies.cost.TrainingCostModel` (best TP/PP/DP layout
of the training GPUs) + ``SimConfig.weight_sync_s``; the wait for data shows as the gap before it.
The ``colocated`` layout (verl's time-sharing mode) also charges, inside each training phase, its two role
switches of every GPU: to training (3.6 s snapshot + 4.4 s restore) and back to rollout (10.8 s), the
measured transition costs of docs/papers.md §1.3.5 (:data:`COLOCATED_SWITCH`).
After training step ``k`` the router hears ``on_step(k + 1)`` (C-MLFQ's tree rebuild).

``noisy_predictor`` is a simulation-only router (docs/papers.md §5.1): the oracle router's length-bucket placement
(``placement="bucket"``) given the true total length times ``exp(predictor_noise · N(0, 1))`` at T=0, never
corrected afterwards. ``oracle`` itself gets the true remaining length at the start and at every tool return.

Metrics (:meth:`Simulator.run` returns a :class:`~libra.sim.metrics.SimResult`): see
``metrics.py``. Deterministic: same trace, config and seed → identical result. No sockets, threads,
wall clocks or I/O.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from libra.broker.events import Command, PeerMessage, Send, Tick
from libra.broker.state import BrokerConfig, BrokerState
from libra.logging import get_logger
from libra.policies.cost import (
    RolloutCostModel,
    TrainingCostModel,
    load_hardware,
    load_model,
)
from libra.policies.cost.training import TrainConfig
from libra.policies.routing.interface import MigrationQuery, bucket_index_for, mode_by_cost
from libra.protocol import messages as m
from libra.sim.batching import BatchFormer
from libra.sim.cluster import InstanceCosts, Layout, SimConfigError, make_layout
from libra.sim.config import SimConfig
from libra.sim.gpus import TransitionCosts
from libra.sim.instance import Seq, SimInstance
from libra.sim.metrics import SimResult, TrajRecord, summarize
from libra.sim.planner import PlannerAllocation, is_planner_allocation
from libra.traces import TrajectorySpec

__all__ = ["SIM_ROUTERS", "SimConfig", "SimConfigError", "Simulator", "simulate"]

log = get_logger(__name__)

SIM_ROUTERS = ("cmlfq", "cmlfq_cost", "round_robin", "least_loaded", "length_aware", "la_mlfq", "predictor", "oracle",
               "noisy_predictor")
CLIENT = b"sim-client"
TOOLS = b"sim-tools"
_FAR = 1e12


@dataclass(slots=True)
class _Traj:
    spec: TrajectorySpec
    k: int  # index of its step in the run
    turn: int = 0
    gen: int = 0
    context: int = 0
    pending_new: int = 0  # tokens not yet in any KV cache (prompt, tool payload)
    kv_home: str | None = None
    first_route: str | None = None
    start: float = 0.0
    migrated_tokens: int = 0
    migrations: int = 0


COLOCATED_SWITCH = TransitionCosts()
"""Role-switch seconds the ``colocated`` layout pays twice per step (docs/papers.md §1.3.5)."""


class Simulator:
    """One simulated run (see the module docstring). Call :meth:`run` once."""

    def __init__(self, trajs: Sequence[TrajectorySpec], config: SimConfig | None = None,
                 layout: Layout | None = None) -> None:
        self.cfg = cfg = config or SimConfig()
        if cfg.router not in SIM_ROUTERS:
            raise SimConfigError(f"unknown router {cfg.router!r} (known: {', '.join(SIM_ROUTERS)})")
        if isinstance(cfg.lag, bool) or not isinstance(cfg.lag, int) or cfg.lag < 1:
            raise SimConfigError(f"lag must be an integer >= 1 (1 = synchronous), got {cfg.lag!r}")
        if not trajs:
            raise SimConfigError("the trace has no trajectories")
        self.alloc = PlannerAllocation(trajs, cfg) if is_planner_allocation(cfg.allocation) else None
        self.layout = layout or (self.alloc.layout if self.alloc is not None else
                                 make_layout(cfg.allocation, cfg.gpus, cfg.bucket_thresholds))
        self.lag = 1 if self.layout.colocated else cfg.lag
        if isinstance(cfg.eta, bool) or not isinstance(cfg.eta, int) or cfg.eta < 0:
            raise SimConfigError(f"eta must be an integer >= 0, got {cfg.eta!r}")
        if cfg.max_concurrent is not None and cfg.max_concurrent < 1:
            raise SimConfigError(f"max_concurrent must be >= 1 or None, got {cfg.max_concurrent!r}")
        if cfg.batching not in ("streaming", "barrier"):
            raise SimConfigError(f"batching must be 'streaming' or 'barrier', got {cfg.batching!r}")
        self.batching = "barrier" if self.layout.colocated else cfg.batching  # colocated is synchronous
        hw, model = load_hardware(cfg.hardware), load_model(cfg.model)
        rcm = RolloutCostModel(hw, model)
        reserve = cfg.reserve_tokens if cfg.reserve_tokens is not None else _planner_reserve(rcm, trajs)
        self.costs = InstanceCosts(rcm, reserve_tokens=reserve)
        self.train_model = TrainingCostModel(hw, model)
        self._train_cfg: TrainConfig | None = None
        self.rng = np.random.default_rng([cfg.seed, 0x51D])
        self.broker = BrokerState(self._broker_config())
        self.instances = {i.id.encode(): SimInstance(i, self.costs) for i in self.layout.instances}
        steps = sorted({t.step for t in trajs})
        self.step_ids = steps
        self.by_step: list[list[TrajectorySpec]] = [[t for t in trajs if t.step == s] for s in steps]
        self.now = 0.0
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._inbox: list[tuple[bytes, Any]] = []
        self._live: dict[str, _Traj] = {}
        self._requests: dict[str, tuple[str, str]] = {}  # request id -> (traj id, kind)
        self._req_ids = itertools.count(1)
        self.records: list[TrajRecord] = []
        self._left = [len(b) for b in self.by_step]
        self.former = BatchFormer(self.by_step, self.batching, cfg.eta, cfg.max_concurrent, self.lag)
        self.trained = 0
        self.training = False
        self.rollout_start: list[float] = [math.nan] * len(steps)
        self.rollout_end: list[float] = [math.nan] * len(steps)
        self.train_start: list[float] = [math.nan] * len(steps)
        self.train_end: list[float] = [math.nan] * len(steps)
        self.kv_moves = 0
        self.reprefill_moves = 0

    # ------------------------------------------------------------------ setup
    def _broker_config(self) -> BrokerConfig:
        cfg = self.cfg
        router = "oracle" if cfg.router == "noisy_predictor" else cfg.router
        params = dict(cfg.router_params)
        params.setdefault("choose_mode", mode_by_cost(self.costs.kv_seconds, self.costs.reprefill_seconds))
        if router in ("cmlfq_cost", "oracle"):
            params.setdefault("costs", self.costs)  # the simulator's own cost arithmetic (pure callbacks)
        if cfg.router == "noisy_predictor":
            params.setdefault("placement", "bucket")  # a T=0 length prediction's bucket, never corrected
        if router in ("cmlfq", "cmlfq_cost"):
            if cfg.size_thresholds is not None:
                params.setdefault("thresholds", {"small": cfg.size_thresholds[0], "medium": cfg.size_thresholds[1]})
            params.setdefault("rebuild_interval", cfg.rebuild_interval)
            params.setdefault("min_visits", cfg.min_visits)
        buckets = [{"name": b.name, "tp": b.tp, "max_tokens": b.max_tokens} for b in self.layout.buckets]
        return BrokerConfig(broker_id="libra-sim", heartbeat_s=_FAR, lease_s=_FAR, client_idle_s=_FAR,
                            router=router,
                            router_params=params, buckets=buckets, max_queued_per_key=10**9)

    def _push(self, t: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def _send(self, peer: bytes, msg: Any) -> None:
        self._inbox.append((peer, msg))

    def _pump(self) -> None:
        """Deliver queued peer messages to the broker and execute what it sends, until quiet."""
        i = 0
        while i < len(self._inbox):
            peer, msg = self._inbox[i]
            i += 1
            for cmd in self.broker.handle(PeerMessage(peer, msg), self.now):
                self._deliver(cmd)
        self._inbox.clear()

    def _deliver(self, cmd: Command) -> None:
        if type(cmd) is not Send:  # Log / JournalWrite / StartPlannerSearch: the simulator has no shell for them
            return
        msg = cmd.msg
        if cmd.peer == CLIENT:
            if isinstance(msg, m.Reply):
                self._on_reply(msg)
            elif isinstance(msg, (m.Disconnect, m.Error)):
                raise RuntimeError(f"simulator: the broker rejected the simulated client: {msg}")
        elif cmd.peer == TOOLS:
            if isinstance(msg, m.Assign):
                self._push(self.now + float(msg.args.get("tool_seconds", 0.0)), "tool", msg)
        elif isinstance(msg, m.Assign):
            self._on_generate(self.instances[cmd.peer], msg)
        elif isinstance(msg, m.Directive) and self.alloc is not None:
            self.alloc.on_directive(cmd.peer, msg)  # a planner re-plan: the GPU actor switches roles
        elif isinstance(msg, (m.Revoke, m.Disconnect, m.Directive)):
            raise RuntimeError(f"simulator: unexpected {type(msg).__name__} to {cmd.peer!r}: {msg}")

    def _hello(self) -> None:
        self._send(CLIENT, m.ClientHello("sim-client", 1))
        self._send(TOOLS, m.ActorHello("sim-tools", "tools", "cpu", 1, {"action": ["*"]}, ["action"], 1 << 30))
        if self.alloc is not None:
            self.alloc.hello(self)  # one actor per GPU, in the plan's roles
        for inst in (self.instances.values() if self.alloc is None else ()):
            caps = {"generate": ["*"]}
            self._send(inst.peer, m.ActorHello(inst.id, inst.spec.node, inst.id, 1, caps, ["generate"],
                                               inst.capacity, {"role": {"bucket": inst.spec.bucket}}))
        self._pump()

    # ------------------------------------------------------------------ rollout instances
    def _on_generate(self, inst: SimInstance, a: m.Assign) -> None:
        tr = self._live[a.trajectory or ""]
        inst.advance(self.now)
        if tr.turn == 1 and tr.first_route is None:
            tr.first_route = str(a.route.get("bucket", inst.spec.bucket))
        turn = tr.spec.turns[tr.turn]
        seq = Seq(tr.spec.id, a.work_id, a.lease, turn.gen_tokens, float(turn.gen_tokens), float(tr.context))
        new = tr.pending_new
        delay = 0.0
        if tr.kv_home is not None and tr.kv_home != inst.id:
            moved = tr.context - new
            tr.migrations += 1
            tr.migrated_tokens += tr.context
            home = self.instances[tr.kv_home.encode()]
            if a.route.get("mode") == "kv":
                self.kv_moves += 1
                delay = self.costs.kv_seconds(MigrationQuery(moved, home.spec.node == inst.spec.node,
                                                             home.tp, inst.tp))
            else:
                self.reprefill_moves += 1
                new = tr.context
        elif tr.kv_home is None:
            new = tr.context
        tr.kv_home = inst.id
        tr.pending_new = 0
        # The prefill (and any instance-serial overhead, 0 in the bundled GPU profiles) stalls the instance; the
        # per-turn serving latency delays only this trajectory (docs/papers.md §1.7).
        inst.charge(self.costs.request_overhead_s + self.costs.prefill(inst.tp, new), new)
        delay += self.costs.turn_latency_s
        if delay > 0:
            self._push(self.now + delay, "join", (inst, seq))
        else:
            inst.enqueue(seq)
            inst.admit()
        self._reschedule(inst)

    def _reschedule(self, inst: SimInstance) -> None:
        inst.version += 1
        t = inst.next_event_time(self.now)
        if t is not None:
            self._push(t, "inst", (inst, inst.version))

    def _join(self, inst: SimInstance, seq: Seq) -> None:
        """A turn delayed by its KV move or the per-turn latency joins its instance."""
        inst.advance(self.now)
        inst.enqueue(seq)
        inst.admit()
        self._reschedule(inst)

    def _on_instance_event(self, inst: SimInstance, version: int) -> None:
        if version != inst.version:
            return
        inst.advance(self.now)
        done = inst.pop_finished()
        inst.admit()
        for q in done:
            self._send(inst.peer, m.WorkResult(q.work_id, q.lease, True, {"gen_tokens": q.gen}))
        self._reschedule(inst)

    # ------------------------------------------------------------------ client (episode runners)
    def _submit(self, tr: _Traj, kind: str, name: str, args: dict[str, Any]) -> None:
        rid = f"q{next(self._req_ids)}"
        self._requests[rid] = (tr.spec.id, kind)
        self._send(CLIENT, m.Submit(rid, kind, name, args, tr.spec.id, _FAR))

    def _true_remaining(self, tr: _Traj) -> int:
        # Response tokens (generated + tool-returned) still to come: the unit of the bucket thresholds.
        return tr.spec.total_response_tokens - (tr.context - tr.spec.prompt_tokens)

    def _start_traj(self, spec: TrajectorySpec, k: int) -> None:
        tr = _Traj(spec, k, context=spec.prompt_tokens, pending_new=spec.prompt_tokens, start=self.now)
        self._live[spec.id] = tr
        total = spec.total_response_tokens
        if self.cfg.router == "noisy_predictor":
            total = round(total * math.exp(self.cfg.predictor_noise * float(self.rng.standard_normal())))
        self._submit(tr, "generate", "", {"prompt_id": spec.prompt_id, "prompt_tokens": spec.prompt_tokens,
                                          "step": spec.step, "true_remaining": max(0, total)})

    def _on_reply(self, r: m.Reply) -> None:
        tid, kind = self._requests.pop(r.request_id)
        tr = self._live[tid]
        if not r.ok and kind == "generate":
            raise RuntimeError(f"simulator: generate turn of {tid} failed: {r.error_code} {r.error}")
        turn = tr.spec.turns[tr.turn]
        if kind == "generate":
            tr.gen += turn.gen_tokens
            tr.context += turn.gen_tokens
            if not turn.has_tool:
                self._end_traj(tr)
                return
            self._submit(tr, "action", turn.tool or "tool", {"payload_tokens": turn.payload_tokens,
                                                             "status": turn.status,
                                                             "tool_seconds": turn.tool_seconds})
            return
        tr.context += turn.payload_tokens or 0
        tr.pending_new += turn.payload_tokens or 0
        tr.turn += 1
        args: dict[str, Any] = {}
        if self.cfg.router == "oracle":
            args["true_remaining"] = self._true_remaining(tr)
        self._submit(tr, "generate", "", args)

    def _end_traj(self, tr: _Traj) -> None:
        spec = tr.spec
        self._send(CLIENT, m.EndTrajectory(spec.id, spec.total_gen_tokens, True))
        del self._live[spec.id]
        truth = None
        if spec.num_tool_calls:
            truth = self.layout.buckets[bucket_index_for(spec.remaining_response_after_returns[0],
                                                         self.layout.buckets)].name
        self.records.append(TrajRecord(spec.id, tr.k, spec.total_tokens, tr.start, self.now, tr.first_route,
                                       truth, tr.migrations, tr.migrated_tokens))
        self._left[tr.k] -= 1
        if self._left[tr.k] == 0:
            self.rollout_end[tr.k] = self.now
        if self.former.done(spec.id):
            self._release()  # a running slot freed (streaming)
            self._maybe_train()

    # ------------------------------------------------------------------ GRPO loop
    def _release(self) -> None:
        f = self.former
        for g in f.admit(self.trained):
            k = f.step_of[g]
            if math.isnan(self.rollout_start[k]):
                self.rollout_start[k] = self.now
            for spec in f.groups[g]:
                self._start_traj(spec, k)

    def _maybe_train(self) -> None:
        k = self.trained
        if self.training or k >= len(self.by_step):
            return
        if self.alloc is not None and not self.alloc.can_train():
            return  # a re-plan left no complete training replica yet: the allocation calls back
        batch = self.former.cut(k)
        if batch is None:
            return  # not enough complete groups yet
        dur = self.train_time([t.total_tokens for t in batch]) + self.cfg.weight_sync_s
        if self.layout.colocated:  # every GPU switches to training and back to rollout each step
            dur += COLOCATED_SWITCH.round_trip_s
        self.training = True
        self.train_start[k] = self.now
        self._push(self.now + dur, "train", k)

    def _on_trained(self, k: int) -> None:
        self.training = False
        self.train_end[k] = self.now
        self.trained = k + 1
        self.broker.rollout.on_step(k + 1)  # the router's per-step hook (C-MLFQ tree rebuild)
        if self.cfg.reserve_tokens is None:
            self._recredit(k)
        if self.alloc is not None:
            self.alloc.on_trained(k)  # planner allocations: re-plan / EHP at the step boundary
        self._release()
        self._maybe_train()

    def _recredit(self, k: int) -> None:
        """Follow the observed lengths: after step ``k`` trains, every rollout instance's broker credit is
        recomputed from the per-sequence reserve of the trajectories step ``k`` consumed (the same formula as the
        first-step profile, :func:`_planner_reserve`) and re-bid when it changed, as a real engine reports
        how many sequences of the current size fit its KV cache. Lengths drift ~4x over an R2E run; a credit
        fixed at step 0 keeps handing small instances trajectories they cannot hold. Instances whose
        actor is switching roles are skipped (their next bid uses the new reserve)."""
        self.costs.reserve_tokens = _planner_reserve(self.costs.cm, self.former.batch_specs(k))
        fleet = self.alloc.fleet if self.alloc is not None else None
        for peer, inst in self._credited():
            cap = self.costs.max_seqs(inst.tp)
            if cap == inst.capacity:
                continue
            if fleet is not None:
                a = fleet.actors.get(peer)
                if a is None or a.pending is not None or a.role is None or a.role.kind != "rollout":
                    continue
                kinds = ["generate", "sync"]
            else:
                kinds = ["generate"]
            inst.capacity = cap
            self._send(peer, m.Bid(kinds, cap))

    def _credited(self) -> list[tuple[bytes, SimInstance]]:
        """The instances whose credit follows the observed lengths (all; a subclass may hold some back)."""
        return list(self.instances.items())

    def train_time(self, lengths: Sequence[int]) -> float:
        """Seconds of one GRPO step on ``lengths`` with the training GPUs (the best layout, chosen on the first
        batch and chosen again when a later batch no longer fits it, as the lengths drift)."""
        if self.alloc is not None:
            return self.alloc.train_time(lengths)  # the deployed plan's complete training replicas
        n = self.layout.train_gpus
        if self._train_cfg is not None:
            t = float(self.train_model.step_time(self._train_cfg, _pad(lengths, self._train_cfg.dp)))
            if math.isfinite(t):
                return t
            self._train_cfg = None  # this batch's longest sequence no longer fits the layout: choose again
        if self._train_cfg is None:
            best, best_t = None, math.inf
            for tp in (8, 4, 2, 1):
                for pp in (1, 2, 4, 5, 8):
                    if n % (tp * pp) or tp > min(n, 8):
                        continue
                    cfg = TrainConfig(tp=tp, pp=pp, dp=n // (tp * pp), micro_batch=1)
                    t = self.train_model.step_time(cfg, _pad(lengths, cfg.dp))
                    if t < best_t:
                        best, best_t = cfg, t
            if best is None:
                raise SimConfigError(f"no training layout of {n} GPUs fits {self.cfg.model} (OOM everywhere)")
            self._train_cfg = best
        return float(self.train_model.step_time(self._train_cfg, _pad(lengths, self._train_cfg.dp)))

    # ------------------------------------------------------------------ main loop
    def run(self) -> SimResult:
        """Run the whole trace; returns the metrics. Raises RuntimeError if the run stalls."""
        self._hello()
        self._release()
        self._pump()
        self._push(self.cfg.tick_s, "tick")
        while self.trained < len(self.by_step):
            if not self._heap or (self._heap[0][2] == "tick" and len(self._heap) == 1):
                raise RuntimeError(f"simulator stalled at t={self.now:.1f}s: {len(self._live)} live trajectories, "
                                   f"{self.trained}/{len(self.by_step)} steps trained")
            t, _, kind, payload = heapq.heappop(self._heap)
            if not math.isfinite(t):
                raise RuntimeError(f"simulator: a {kind} event at t={t} (an infinite cost) after {self.now:.1f}s")
            self.now = t
            if kind == "inst":
                self._on_instance_event(*payload)
            elif kind == "tool":
                a = payload
                self._send(TOOLS, m.WorkResult(a.work_id, a.lease, True,
                                               {"payload_tokens": a.args.get("payload_tokens") or 0,
                                                "status": a.args.get("status") or "success"}))
            elif kind == "join":
                self._join(*payload)
            elif kind == "train":
                self._on_trained(payload)
            elif kind == "call":
                payload()  # a scheduled hook (planner allocations: plan application, role switches)
            elif kind == "tick":
                for cmd in self.broker.handle(Tick(), self.now):
                    self._deliver(cmd)
                if self.trained < len(self.by_step):
                    self._push(self.now + self.cfg.tick_s, "tick")
            self._pump()
        self.broker.validate()
        return summarize(self) if self.alloc is None else self.alloc.summarize()


def _planner_reserve(cm: RolloutCostModel, trajs: Sequence[TrajectorySpec]) -> int:
    """KV tokens one running sequence is expected to hold, as the planner's steady batch counts it
    (``avg_prompt + kv_reserve_gen_fraction * avg_gen``, prompt = prompt + tool payload) over the
    trace's first step (the profiling pass every allocation may use before launch)."""
    first = min(t.step for t in trajs)
    rows = [(t.prompt_tokens + t.total_payload_tokens, t.total_gen_tokens) for t in trajs if t.step == first]
    p = sum(r[0] for r in rows) / len(rows)
    g = sum(r[1] for r in rows) / len(rows)
    return max(1, round(p + cm.cal.kv_reserve_gen_fraction * g))


def _pad(lengths: Sequence[int], dp: int) -> list[int]:
    """Pad a batch with empty sequences so that it splits evenly over ``dp`` replicas."""
    out = list(lengths)
    out.extend([1] * ((-len(out)) % dp))
    return out


def simulate(trajs: Sequence[TrajectorySpec], **config: Any) -> SimResult:
    """Shorthand: ``Simulator(trajs, SimConfig(**config)).run()``."""
    return Simulator(trajs, SimConfig(**config)).run()
