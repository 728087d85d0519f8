"""Applying a resource plan: GPU slots → roles, and the order in which actors switch. Pure.

``layout_roles(plan, slots, current)`` turns a :class:`~libra.policies.planner.types.Plan` into one
:class:`Role` per GPU slot: training replicas of ``tp × pp`` GPUs and rollout instances of ``tp`` GPUs,
each TP group inside one node on an aligned block (NVLink locality), preferring blocks whose slots already
hold the same role so that as few actors as possible switch. Unused slots are ``idle``. Raises
:class:`PlanError` when the plan does not fit the slots.

:class:`PlanApplier` sequences the switch so that the cluster is never without a complete training
replica and no slot is ever in two roles: actors *joining* training switch first; actors *leaving*
training switch only while another complete replica stays active until a new one is up (one the target
keeps, or one that no new replica still to come needs); likewise for actors leaving a rollout instance.
A group with no such partner waits while some new group of its kind can come up without its GPUs, and
goes otherwise (then waiting could never end); every other change goes at once. When the waits form a
cycle that no order avoids, the waiting training replicas go first (``gaps`` counts it: training pauses
briefly, rollout keeps an instance).
So a plan never leaves the cluster without a training replica, nor (while the target has rollout
instances) without a rollout instance to route to. Each step is a Directive to one actor; the broker feeds
back which actors finished switching.

The Elastic Hybrid Pool's join protocol is in ``libra.broker.hybrid``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from libra.policies.planner.types import Plan
from libra.policies.routing.interface import BucketSpec

MAX_BUCKET_TOKENS = 1 << 30


class PlanError(ValueError):
    """A plan that cannot be laid out on the given slots (the message says which part and why)."""


@dataclass(frozen=True, slots=True)
class GpuSlot:
    """One GPU actor: its id, its node (host) and its GPU index on that node."""

    actor_id: str
    node: str
    index: int


@dataclass(frozen=True, slots=True)
class Role:
    """What one slot does. ``group`` names its TP group (replica or rollout instance)."""

    kind: str  # "train" | "rollout" | "idle"
    tp: int = 1
    group: str = ""
    bucket: str = ""
    rank: int = 0  # position inside the group
    size: int = 1  # members of the group (tp for rollout, tp × pp for a training replica)

    @property
    def kinds(self) -> list[str]:
        return {"train": ["train", "sync"], "rollout": ["generate", "sync"], "idle": []}[self.kind]

    def config(self) -> dict[str, Any]:
        return {"role": self.kind, "tp": self.tp, "group": self.group, "bucket": self.bucket, "rank": self.rank,
                "size": self.size}


def bucket_specs(plan: Plan) -> list[BucketSpec]:
    """C-MLFQ buckets for the plan's rollout layout (name ``tp<N>``, ascending thresholds)."""
    out = []
    for b in plan.buckets():
        mt = MAX_BUCKET_TOKENS if math.isinf(b.max_tokens) else max(1, int(b.max_tokens))
        if out and mt <= out[-1].max_tokens:
            mt = out[-1].max_tokens + 1
        out.append(BucketSpec(f"tp{b.tp}", b.tp, mt))
    return out


def _blocks(by_node: dict[str, list[GpuSlot]], size: int, taken: set[str]) -> list[list[GpuSlot]]:
    """Free aligned blocks of ``size`` slots inside one node (size ≤ slots per node)."""
    out = []
    for node in sorted(by_node):
        slots = by_node[node]
        for start in range(0, len(slots) - size + 1, size):
            block = slots[start : start + size]
            if all(s.actor_id not in taken for s in block):
                out.append(block)
    return out


def layout_roles(plan: Plan, slots: list[GpuSlot], current: dict[str, Role] | None = None,
                 generation: int = 0) -> dict[str, Role]:
    """One Role per slot for ``plan`` (see the module docstring). Group names carry ``generation`` so
    groups of successive layouts never merge."""
    current = current or {}
    if plan.n_gpus > len(slots):
        raise PlanError(f"plan needs {plan.n_gpus} GPUs but only {len(slots)} GPU actors are connected")
    by_node: dict[str, list[GpuSlot]] = defaultdict(list)
    for s in sorted(slots, key=lambda s: (s.node, s.index)):
        by_node[s.node].append(s)
    requests: list[tuple[str, int, str, str, int]] = []  # (kind, tp, group, bucket, group size)
    if plan.train is not None and plan.n_train:
        t = plan.train
        for r in range(t.dp):
            for stage in range(t.pp):
                requests.append(("train", t.tp, f"g{generation}.replica{r}", f"stage{stage}", t.tp * t.pp))
    elif plan.n_train:
        raise PlanError(f"plan assigns {plan.n_train} training GPUs but no training layout")
    for i, inst in enumerate(sorted(plan.rollout, key=lambda x: -x.tp)):
        requests.append(("rollout", inst.tp, f"g{generation}.rollout{i}", f"tp{inst.tp}", inst.tp))
    requests.sort(key=lambda r: -r[1])  # biggest blocks first: alignment never fails for powers of two
    # Keep one complete current training replica out of the new training blocks unless the new layout
    # reuses it unchanged, so the cluster always has a replica training while the others switch.
    old = train_replicas(current)
    complete_old = [g for g, ms in old.items() if len(ms) == current[next(iter(ms))].size]
    protected = set(old[complete_old[0]]) if complete_old else set()
    new_train_size = plan.train.tp * plan.train.pp if plan.train is not None else 0
    if protected and current[next(iter(protected))].size == new_train_size:
        protected = set()  # same replica shape: it can simply be kept
    taken: set[str] = set()
    roles: dict[str, Role] = {}
    stage_rank: dict[str, int] = defaultdict(int)
    rename: dict[str, str] = {}
    for kind, tp, group, tag, size in requests:
        cands = _blocks(by_node, tp, taken)
        if not cands:
            raise PlanError(f"no free aligned block of {tp} GPUs inside one node for {kind} {group}")
        if kind == "train" and protected:
            cands = [b for b in cands if not protected & {s.actor_id for s in b}] or cands

        def keep(block: list[GpuSlot]) -> tuple[int, int]:
            """Slots that keep their role and TP; then, when the training replicas keep their shape (nothing
            is protected), slots already in rollout for a rollout block, so that a change of rollout TP alone
            (EARL's switch) stays on the rollout GPUs instead of displacing the training replicas."""
            cur = [current.get(s.actor_id) for s in block]
            same = sum(1 for c in cur if c is not None and c.kind == kind and c.tp == tp)
            return same, (0 if protected else sum(1 for c in cur if c is not None and c.kind == kind == "rollout"))

        block = max(cands, key=keep)  # max() keeps the first of equals: lowest node/offset
        olds = {(c.kind, c.tp, c.group, c.size) if (c := current.get(s.actor_id)) else None for s in block}
        if group not in rename:  # an unchanged group keeps its name, so its members do not switch
            o = next(iter(olds)) if len(olds) == 1 else None
            same = o is not None and o[0] == kind and o[1] == tp and o[3] == size
            rename[group] = o[2] if same and o[2] not in rename.values() else group  # type: ignore[index]
        name = rename[group]
        for s in block:
            taken.add(s.actor_id)
            rank = stage_rank[name]
            stage_rank[name] += 1
            roles[s.actor_id] = Role(kind, tp, name, tag if kind == "rollout" else "", rank, size)
    for s in slots:
        roles.setdefault(s.actor_id, Role("idle"))
    check_roles(roles, plan)
    return roles


def check_roles(roles: dict[str, Role], plan: Plan | None = None) -> None:
    """Invariants of a layout; raises PlanError. Each slot has exactly one role (it is a dict), every
    group is complete, and the training GPU count matches the plan."""
    groups: dict[str, list[Role]] = defaultdict(list)
    for r in roles.values():
        if r.kind != "idle":
            groups[r.group].append(r)
    for g, members in groups.items():
        if len({(m.kind, m.tp) for m in members}) != 1:
            raise PlanError(f"group {g} mixes roles")
    n_train = sum(r.kind == "train" for r in roles.values())
    if plan is not None and n_train != plan.n_train:
        raise PlanError(f"layout has {n_train} training GPUs, plan wants {plan.n_train}")
    if plan is not None and plan.n_train and not n_train:
        raise PlanError("layout has no training replica")


def train_replicas(roles: dict[str, Role]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for aid, r in roles.items():
        if r.kind == "train":
            out[r.group].add(aid)
    return out


@dataclass
class PlanApplier:
    """Sequences directives from ``current`` to ``target`` roles (see module docstring).

    ``start()`` and ``on_switched(actor_id)`` return the ``(actor_id, Role)`` directives to send now.
    ``active`` is the role each actor holds right now (absent while it is switching).
    """

    current: dict[str, Role]
    target: dict[str, Role]
    active: dict[str, Role] = field(init=False)
    pending: dict[str, Role] = field(init=False)  # not yet directed
    switching: set[str] = field(init=False, default_factory=set)
    gaps: int = field(init=False, default=0)  # cycles broken by letting a training replica go first
    _force_train: bool = field(init=False, default=False, repr=False)

    def __post_init__(self) -> None:
        if set(self.current) != set(self.target):
            raise PlanError("current and target layouts cover different actors")
        self.active = dict(self.current)
        self.pending = {a: r for a, r in self.target.items() if self.current[a] != r}

    @property
    def done(self) -> bool:
        return not self.pending and not self.switching

    def _complete_replicas(self, exclude: set[str], kind: str = "train") -> int:
        """Groups of ``kind`` (training replicas by default) whose every member is active in that role
        (ignoring ``exclude``)."""
        members: dict[str, int] = defaultdict(int)
        size: dict[str, int] = {}
        for aid, r in self.active.items():
            if r.kind == kind and aid not in exclude:
                members[r.group] += 1
                size[r.group] = r.size
        return sum(1 for g, n in members.items() if n == size[g])

    def _groups(self, roles: dict[str, Role], kind: str) -> dict[str, set[str]]:
        out: dict[str, set[str]] = defaultdict(set)
        for aid, r in roles.items():
            if r.kind == kind:
                out[r.group].add(aid)
        return out

    def _may_leave(self, kind: str, mates: set[str]) -> bool:
        """Whether the ``kind`` group made of ``mates`` may leave now (see the module docstring).

        It may when another complete active group of that kind stays up until the new layout has one:
        a group that the target keeps, or one that some new group still to come does not need. With no
        such group it waits, as long as some new group still to come needs none of its GPUs (so the
        wait ends); otherwise it goes (the layout leaves no way to overlap them)."""
        if not any(r.kind == kind for r in self.target.values()):
            return True
        coming = [ms for ms in self._groups(self.target, kind).values()
                  if any(a in self.pending or a in self.switching for a in ms)]
        for g, ms in self._groups(self.active, kind).items():
            if ms & mates or len(ms) != self.active[next(iter(ms))].size:
                continue
            if all(self.target[a] == self.active[a] for a in ms) or any(not (t & ms) for t in coming):
                return True
        return not any(not (t & mates) for t in coming)

    def _next(self) -> list[tuple[str, Role]]:
        out = []
        for aid, role in sorted(self.pending.items(), key=lambda kv: (self.active.get(kv[0], Role("idle")).kind == "train", kv[0])):
            cur = self.active.get(aid, Role("idle"))
            leaving_train = cur.kind == "train" and (role.kind != "train" or role.group != cur.group)
            if leaving_train or cur.kind == "rollout":
                mates = {a for a, r in self.current.items() if r.kind == cur.kind and r.group == cur.group}
                if not (self._force_train and leaving_train) and not self._may_leave(cur.kind, mates):
                    continue  # wait until another complete group of its kind is up
            out.append((aid, role))
            self.pending.pop(aid)
            self.active.pop(aid, None)  # from now on it holds no role until it has switched
            self.switching.add(aid)
        return out

    def _progress(self) -> list[tuple[str, Role]]:
        """The next wave; if every remaining move waits on another (a cycle no order can avoid, e.g. a new
        replica that needs the rollout node while the new rollout instance needs the last old replica),
        the waiting training replicas go first: a short pause of training, counted in ``gaps``."""
        out = self._next()
        if not out and not self.switching and self.pending:
            self.gaps += 1
            self._force_train = True
            out = self._next()
            self._force_train = False
        return out

    def start(self) -> list[tuple[str, Role]]:
        return self._progress()

    def on_switched(self, actor_id: str) -> list[tuple[str, Role]]:
        if actor_id not in self.switching:
            return []
        self.switching.discard(actor_id)
        self.active[actor_id] = self.target[actor_id]
        return self._progress()
