"""Simulated GPU actors that change roles: plan layouts, directives, transition costs, training replicas.

Role: the receiver of the broker's role ``Directive`` messages in :mod:`libra.sim.engine` when the
allocation is planner-driven (:mod:`libra.sim.planner`). Every GPU is one actor (id ``n<node>/gpu<i>``,
host ``n<node>``, slot ``gpu<i>``, label ``slot_kind: gpu``), exactly what
:meth:`~libra.broker.state.BrokerState.apply_plan` lays plans out on. A role is a
:class:`~libra.broker.plan_applier.Role`:

- ``rollout``: a TP group of ``tp`` GPUs is one simulated rollout instance
  (:class:`~libra.sim.instance.SimInstance`) served by its rank-0 actor, which bids ``generate``
  with the instance's sequence credit; the other members bid ``sync`` only (they are the same engine);
- ``train``: a member of a training replica (``tp × pp`` GPUs, group = replica); training itself is
  simulated by the engine one step at a time with the complete, active replicas (:meth:`train_time`);
- ``idle``: nothing.

Directive contract (``finish`` mode, as an actor runtime does): a directed actor first drains its
old role, then pays the transition, then answers ``DirectiveDone`` + ``Bid`` with its new role:

- drain: a rollout group drains when its instance holds no work (the broker gives a directed actor
  none); every member of the group waits for that, and the instance is then torn down (the KV caches
  it held are gone: those trajectories re-prefill wherever they go next). A training member that is
  part of the running training step waits for the step to end. Nothing else waits.
- transition (virtual seconds, docs/papers.md §1.3.5): into ``rollout`` ``to_rollout_s`` (10.8 s,
  dominated by vLLM activation); into ``train`` ``snapshot_s + restore_s`` (3.6 s background snapshot
  + 4.4 s state restore); into ``idle`` 0. A role change inside the same kind (another TP group or
  replica) costs the same as entering that kind.

Every switch is logged as a :class:`Switch` (directed, drained, active times), so tests can check the
charges. Invariant checks (:meth:`check`): no GPU holds two roles (a switching GPU holds none), and a
training step never starts without a complete training replica (:class:`FleetError`). A step whose batch
outgrew the deployed layout (out of memory even at micro-batch 1) regroups the same GPUs to the fastest larger
TP / PP that fits (:attr:`GpuFleet.regroups`; the allocation charges the regroup and re-plans at once) and
raises :class:`FleetError` only if none does.

Pure simulation state on the engine's virtual clock; the engine owns the event heap (``schedule``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from libra.broker.plan_applier import Role
from libra.policies.cost.training import TrainConfig
from libra.protocol import messages as m
from libra.sim.cluster import NODE_GPUS, RolloutInstanceSpec
from libra.sim.host import SimHost
from libra.sim.instance import SimInstance

__all__ = ["FleetError", "GpuActor", "GpuFleet", "Switch", "TransitionCosts", "gpu_id"]

CAPS = {"generate": ["*"], "train": ["*"], "sync": ["*"]}


class FleetError(RuntimeError):
    """A broken invariant of the simulated fleet (a GPU in two roles, no training replica)."""


@dataclass(frozen=True, slots=True)
class TransitionCosts:
    """Virtual seconds a GPU spends switching (docs/papers.md §1.3.5) and the drain poll period."""

    to_rollout_s: float = 10.8
    snapshot_s: float = 3.6
    restore_s: float = 4.4
    drain_poll_s: float = 0.5

    @property
    def round_trip_s(self) -> float:
        """Rollout → training → rollout: what time-sharing (verl's colocated mode) pays every step."""
        return self.snapshot_s + self.restore_s + self.to_rollout_s

    def seconds(self, old: Role, new: Role) -> float:
        """Transition time from ``old`` to ``new`` (0 when the role does not change)."""
        if old == new or new.kind == "idle":
            return 0.0
        if new.kind == "rollout":
            return self.to_rollout_s
        return self.snapshot_s + self.restore_s


@dataclass(slots=True)
class Switch:
    """One GPU's role change: when it was directed, when it had drained, when it bid in its new role."""

    actor: str
    old: str
    new: str
    directed: float
    drained: float = math.nan
    active: float = math.nan
    cost_s: float = 0.0


@dataclass(slots=True)
class GpuActor:
    """One simulated GPU actor. ``role`` is None while it switches (it then holds no role)."""

    id: str
    node: str
    index: int
    role: Role | None
    pending: tuple[int, list[str], Role] | None = None
    prev: Role | None = None  # the role it left, while switching
    switch: Switch | None = None

    @property
    def peer(self) -> bytes:
        return self.id.encode()


def gpu_id(node: int, index: int) -> str:
    """Actor id of GPU ``index`` of node ``node``."""
    return f"n{node}/gpu{index}"


def role_from_config(cfg: dict[str, Any]) -> Role:
    """The :class:`Role` a directive's ``config`` (``Role.config()``) describes."""
    kind = cfg.get("role")
    if kind not in ("train", "rollout"):
        return Role("idle")
    keys = ("tp", "group", "bucket", "rank", "size")
    return Role(kind, **{k: cfg[k] for k in keys if k in cfg})


@dataclass(slots=True)
class _Step:
    members: frozenset[str] = frozenset()
    replicas: frozenset[str] = frozenset()
    gpus: int = 0


class GpuFleet:
    """The GPU actors of one simulated cluster (see the module docstring)."""

    def __init__(self, sim: SimHost, gpus: int, costs: TransitionCosts | None = None,
                 on_switched: Callable[[], None] | None = None) -> None:
        self.sim = sim
        self.on_switched = on_switched
        self.costs = costs or TransitionCosts()
        self.actors: dict[bytes, GpuActor] = {}
        for i in range(gpus):
            a = GpuActor(gpu_id(i // NODE_GPUS, i % NODE_GPUS), f"n{i // NODE_GPUS}", i % NODE_GPUS, Role("idle"))
            self.actors[a.peer] = a
        self.switches: list[Switch] = []
        self.retired: list[SimInstance] = []
        self.foreign: set[bytes] = set()  # instances of actors the fleet does not own (lent slots: libra.sim.borrowed)
        self.step = _Step()
        self.train_gpu_seconds = 0.0
        self.train_steps: list[tuple[float, float, int, int]] = []  # (start, duration, gpus, replicas)
        self.regroups: list[tuple[float, TrainConfig, TrainConfig]] = []  # (time, deployed, regrouped): OOM path back
        self._waiting_group: dict[str, list[GpuActor]] = defaultdict(list)  # old rollout group -> members
        self._waiting_step: list[GpuActor] = []
        self._polling: set[str] = set()
        self._leaders: dict[str, bytes] = {}  # rollout group -> its instance's (rank-0) actor

    # ------------------------------------------------------------------ start-up
    def hello(self, roles: dict[str, Role]) -> None:
        """Connect every GPU actor with its initial role (no transition cost: the cluster starts so)."""
        for a in self.actors.values():
            a.role = roles.get(a.id, Role("idle"))
            kinds, capacity = self._kinds(a, a.role)
            if a.role.kind == "rollout" and a.role.rank == 0:
                self._new_instance(a, a.role)
            self.sim._send(a.peer, m.ActorHello(a.id, a.node, f"gpu{a.index}", 1, CAPS, kinds, capacity,
                                                {"slot_kind": "gpu", "role": a.role.config()}))

    def _kinds(self, a: GpuActor, role: Role) -> tuple[list[str], int]:
        if role.kind == "rollout":
            if role.rank == 0:
                return ["generate", "sync"], self.sim.costs.max_seqs(role.tp)
            return ["sync"], 0
        if role.kind == "train":
            return ["train", "sync"], 1
        return [], 0

    def _new_instance(self, a: GpuActor, role: Role) -> SimInstance:
        if a.peer in self.sim.instances:
            raise FleetError(f"{a.id} would run two rollout instances")
        inst = SimInstance(RolloutInstanceSpec(a.id, a.node, role.bucket, role.tp), self.sim.costs)
        inst.t_last = self.sim.now
        self.sim.instances[a.peer] = inst
        self._leaders[role.group] = a.peer
        return inst

    # ------------------------------------------------------------------ views
    def roles(self) -> dict[str, Role | None]:
        """Actor id -> active role (None while switching)."""
        return {a.id: a.role for a in self.actors.values()}

    def instance_specs(self) -> list[RolloutInstanceSpec]:
        """The live rollout instances (including draining ones)."""
        return [i.spec for i in self.sim.instances.values()]

    def replicas(self) -> dict[str, list[GpuActor]]:
        """Complete training replicas whose every member is active in training: group -> members."""
        groups: dict[str, list[GpuActor]] = defaultdict(list)
        for a in self.actors.values():
            if a.role is not None and a.role.kind == "train":
                groups[a.role.group].append(a)
        return {g: ms for g, ms in groups.items() if len(ms) == ms[0].role.size}  # type: ignore[union-attr]

    def check(self) -> None:
        """Raise :class:`FleetError` if a GPU holds a role while switching or an instance has no leader."""
        for a in self.actors.values():
            if a.role is not None and a.pending is not None:
                raise FleetError(f"{a.id} holds role {a.role.kind} while switching")
        for peer in self.sim.instances:
            if peer in self.foreign:
                continue
            a = self.actors[peer]
            if a.role is not None and (a.role.kind != "rollout" or a.role.rank != 0):
                raise FleetError(f"instance {a.id} runs but its actor holds role {a.role.kind}")

    # ------------------------------------------------------------------ directives
    def on_directive(self, peer: bytes, d: m.Directive) -> None:
        """A role directive from the broker: drain, pay the transition, then bid in the new role."""
        a = self.actors[peer]
        if a.pending is not None or a.role is None:
            raise FleetError(f"{a.id} got directive {d.directive_id} while still switching")
        old, new = a.role, role_from_config(d.config)
        a.pending = (d.directive_id, list(d.kinds), new)
        a.prev = old
        a.switch = Switch(a.id, old.kind, new.kind, self.sim.now)
        self.switches.append(a.switch)
        a.role = None
        if old.kind == "rollout":
            self._waiting_group[old.group].append(a)
            if old.group not in self._polling:
                self._polling.add(old.group)
                self.sim._push(self.sim.now, "call", lambda g=old.group: self._poll_drain(g))
        elif old.kind == "train" and a.id in self.step.members:
            self._waiting_step.append(a)
        else:
            self._drained(a)

    def _poll_drain(self, group: str) -> None:
        """Tear the rollout group's instance down once it holds no work; then its members switch."""
        leader = self._leaders.get(group)
        inst = self.sim.instances.get(leader) if leader is not None else None
        if leader is not None and inst is not None:
            sess = self.sim.broker.actors.get(leader)
            if sess is not None and sess.directive is None:
                raise FleetError(f"rollout group {group} is being torn down but its leader was not directed")
            if (sess is not None and sess.held) or inst.load > 0:
                self.sim._push(self.sim.now + self.costs.drain_poll_s, "call", lambda: self._poll_drain(group))
                return
            inst.advance(self.sim.now)
            del self.sim.instances[leader]
            self.retired.append(inst)
            for tr in self.sim._live.values():
                if tr.kv_home == inst.id:
                    tr.kv_home = None  # its KV cache is gone with the instance
        self._leaders.pop(group, None)
        self._polling.discard(group)
        for a in self._waiting_group.pop(group, []):
            self._drained(a)

    def _drained(self, a: GpuActor) -> None:
        assert a.pending is not None and a.switch is not None and a.prev is not None
        new = a.pending[2]
        cost = self.costs.seconds(a.prev, new) if (a.prev.kind, a.prev.group) != (new.kind, new.group) else 0.0
        a.switch.drained = self.sim.now
        a.switch.cost_s = cost
        self.sim._push(self.sim.now + cost, "call", lambda: self._activate(a))

    def _activate(self, a: GpuActor) -> None:
        assert a.pending is not None and a.switch is not None
        did, kinds, role = a.pending
        a.pending = None
        a.prev = None
        a.role = role
        a.switch.active = self.sim.now
        if role.kind == "rollout" and role.rank == 0:
            self._new_instance(a, role)
        bid_kinds, capacity = self._kinds(a, role)
        self.sim._send(a.peer, m.DirectiveDone(did, kinds))
        self.sim._send(a.peer, m.Bid(bid_kinds, capacity))
        if self.on_switched is not None:
            self.sim._pump()
            self.on_switched()

    # ------------------------------------------------------------------ training
    def train_step(self, lengths: Sequence[int], model: Any, micro_batch: Callable[[int, int], int],
                   replicas: Iterable[str] | None = None) -> tuple[float, TrainConfig, frozenset[str]]:
        """Start one training step on the complete active replicas (or the given subset).

        The replicas of the most common shape ``(tp, pp)`` (most GPUs) train as one ``dp`` group;
        ``micro_batch(tp, pp)`` gives the deployed micro-batch. Returns (seconds, layout, replica
        groups). Raises :class:`FleetError` if there is no complete replica.
        """
        reps = self.replicas()
        if replicas is not None:
            keep = set(replicas)
            reps = {g: ms for g, ms in reps.items() if g in keep}
        if not reps:
            raise FleetError(f"training step at t={self.sim.now:.1f}s has no complete training replica")
        t, cfg, groups, old = self._pick(reps, lengths, model, micro_batch)
        if old is not None:
            self.regroups.append((self.sim.now, old, cfg))
        if not math.isfinite(t):
            raise FleetError(f"training layout tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} runs out of memory, and so does "
                             "every regrouping of its GPUs and every other complete replica")
        members = frozenset(a.id for g in groups for a in reps[g])
        self.step = _Step(members, frozenset(groups), len(members))
        self.train_gpu_seconds += t * len(members)
        self.train_steps.append((self.sim.now, t, len(members), len(groups)))
        return t, cfg, frozenset(groups)

    def step_seconds(self, lengths: Sequence[int], model: Any, micro_batch: Callable[[int, int], int],
                     replicas: Iterable[str]) -> float:
        """Seconds a training step on the given complete replicas would take (as :meth:`train_step` would run it,
        recording nothing); ``inf`` when none of them is complete or nothing holds the batch."""
        keep = set(replicas)
        reps = {g: ms for g, ms in self.replicas().items() if g in keep}
        return self._pick(reps, lengths, model, micro_batch)[0] if reps else math.inf

    def holds(self, lengths: Sequence[int], model: Any, replicas: Iterable[str] | None = None) -> bool:
        """Whether the complete replicas (or the given subset) can train ``lengths`` now (regrouped if need be)."""
        reps = self.replicas()
        if replicas is not None:
            keep = set(replicas)
            reps = {g: ms for g, ms in reps.items() if g in keep}
        return bool(reps) and math.isfinite(self._pick(reps, lengths, model, lambda tp, pp: 1)[0])

    def _pick(self, reps: dict[str, list[GpuActor]], lengths: Sequence[int], model: Any,
              micro_batch: Callable[[int, int], int]) -> tuple[float, TrainConfig, list[str], TrainConfig | None]:
        """``(seconds, layout, replica groups, the layout it regrouped or None)`` of the step: the replicas of
        the shape with the most GPUs as one ``dp`` group; if the batch outgrew it even at micro-batch 1, the
        same GPUs regrouped to a larger TP / PP; then the other shapes. ``inf`` seconds if nothing holds it."""
        shapes: dict[tuple[int, int], list[str]] = defaultdict(list)
        for g, ms in reps.items():
            r = ms[0].role
            assert r is not None
            shapes[(r.tp, r.size // r.tp)].append(g)
        order = sorted(shapes.items(), key=lambda kv: (len(kv[1]) * kv[0][0] * kv[0][1], kv[0]), reverse=True)
        per_node = int(getattr(model.hardware, "gpus_per_node", NODE_GPUS))
        first: tuple[float, TrainConfig, list[str], TrainConfig | None] | None = None
        for (tp, pp), groups in order:
            dp = len(groups)
            padded = _padded(lengths, dp)
            t, cfg = math.inf, TrainConfig(tp=tp, pp=pp, dp=dp, micro_batch=1)
            for mb in dict.fromkeys((micro_batch(tp, pp), 1)):
                cfg = TrainConfig(tp=tp, pp=pp, dp=dp, micro_batch=mb)
                t = float(model.step_time(cfg, padded))
                if math.isfinite(t):
                    return t, cfg, groups, None
            old = TrainConfig(tp=tp, pp=pp, dp=dp, micro_batch=1)
            t, cfg = _regrouped(model, lengths, tp, pp, dp, per_node)
            if math.isfinite(t):
                return t, cfg, groups, old
            first = first or (math.inf, old, groups, None)
        assert first is not None
        return first

    def step_done(self) -> None:
        """The running training step ended: members waiting to leave training drain now."""
        self.step = _Step()
        waiting, self._waiting_step = self._waiting_step, []
        for a in waiting:
            self._drained(a)

    # ------------------------------------------------------------------ accounting
    def rollout_gpu_seconds(self) -> float:
        """Σ busy seconds × TP over every fleet instance that ever ran (live and retired; not the foreign ones)."""
        live = [i for p, i in self.sim.instances.items() if p not in self.foreign]
        return sum(i.busy_s * i.tp for i in [*live, *self.retired])


def _regrouped(model: Any, lengths: Sequence[int], tp: int, pp: int, dp: int,
               gpus_per_node: int) -> tuple[float, TrainConfig]:
    """The fastest layout of the same ``tp * pp * dp`` training GPUs with a larger model-parallel group
    (TP up to a node, then PP) that fits ``lengths`` at micro-batch 1: the path back when a step's batch
    outgrew the deployed layout (the caller charges the regroup and re-plans). ``(inf, the old layout)`` if none fits."""
    n = tp * pp * dp
    layers = int(getattr(getattr(model, "model", None), "n_layers", 0)) or n
    best: tuple[float, TrainConfig] = (math.inf, TrainConfig(tp=tp, pp=pp, dp=dp, micro_batch=1))
    for t2 in (x for x in (1, 2, 4, 8, 16) if tp <= x <= gpus_per_node):
        for p2 in (x for x in range(pp, n + 1) if n % (t2 * x) == 0 and layers % x == 0):
            if t2 * p2 <= tp * pp:
                continue
            d2 = n // (t2 * p2)
            c = TrainConfig(tp=t2, pp=p2, dp=d2, micro_batch=1)
            secs = float(model.step_time(c, _padded(lengths, d2)))
            if secs < best[0]:
                best = (secs, c)
    return best


def _padded(lengths: Sequence[int], dp: int) -> list[int]:
    """``lengths`` padded with 1-token sequences to a multiple of ``dp`` (every data-parallel rank a share)."""
    return list(lengths) + [1] * ((-len(lengths)) % dp)
