"""The RL simulator with borrowed GPUs: a serving owner's lending schedule replayed into the real broker.

Role: :class:`BorrowedSimulator` is :class:`~libra.sim.engine.Simulator` (the owned cluster, the real
``BrokerState``, router and GRPO loop) plus the serving owner's GPUs as lent rollout slots, driven by the
schedule :func:`libra.sim.serving_owner.run_owner` decided with the runtime's owner rule:

- a lend: the slot joins ``join_s`` later (its engine woken and the current policy loaded) with an
  ``ActorHello`` whose labels say ``{"lend": {"owner": ..., "rule": "headroom"}}`` and a bucket chosen by
  :func:`libra.policies.planner.borrowed.place_borrowed`; a later lend of the same slot is an ordinary
  ``Bid(["generate"], n)`` (the runtime's lend-again path);
- a reclaim: an ``OwnerReclaim(owner, deadline_s, reason)`` to the broker (``libra.broker.lending``: no more
  work, pinned trajectories moved by KV when it fits the deadline, else re-prefilled); the slot hands back
  (``Handback``) every queued turn and every running one it cannot finish by ``deadline − margin_s`` at its
  current decode rate (the decoded tokens of a handed-back turn are lost: it re-runs elsewhere), finishes
  the rest, and obeys a ``Revoke`` (the broker's take-back past the deadline);
- ``ContextsMoved`` is counted.

With a fixed layout (``config.allocation`` not a planner allocation) each lent slot serves the fixed bucket
``buckets[i]`` from its hello. **Online** (a planner allocation, e.g. ``grp``: the broker's ``PlannerLoop``
re-plans every step, :class:`~libra.sim.planner.PlannerAllocation`) a lent slot says hello as a GPU slot
(``slot_kind: gpu``) accepting nothing, and the broker decides what it does: its rounds count the connected,
not-reclaimed lent slots as borrowed capacity (``plan_borrowed.borrowed_round``), a deployed plan directs them
to TP-1 instances in its buckets (``lent_roles``), and a round that deploys nothing, or a slot's join or
lend-again, places them under the deployed plan (``PlaceLent``). A directed lent slot drains (``finish``) and
switches at no further cost (its TP-1 engine stays up: the join already paid the wake-up and weights).

The broker's ``kv_move_s_per_token`` is the simulator's own cross-node KV move cost for the model. Pure and
deterministic like the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from libra.broker.events import Command, Send
from libra.broker.plan_applier import Role
from libra.broker.state import BrokerConfig
from libra.protocol import messages as m
from libra.protocol.payloads_lend import LEND_LABEL, LendLabel
from libra.sim.cluster import Layout, RolloutInstanceSpec
from libra.sim.config import SimConfig
from libra.sim.engine import Simulator
from libra.sim.gpus import role_from_config
from libra.sim.instance import Seq, SimInstance
from libra.sim.serving_owner import LendEvent
from libra.traces import TrajectorySpec

__all__ = ["BorrowedSimulator", "LentStats"]


@dataclass(slots=True)
class LentStats:
    lends: int = 0
    reclaims: int = 0
    handbacks: int = 0
    revoked: int = 0
    contexts_moved: int = 0
    directives: int = 0  # online: the broker's directives to lent slots
    lent_busy_s: float = 0.0


class BorrowedSimulator(Simulator):
    """See the module docstring. ``events``: the owner's schedule (times from the RL run's start),
    ``buckets[i]``: the bucket of serving GPU ``i``'s instance."""

    def __init__(self, trajs: Sequence[TrajectorySpec], config: SimConfig, events: Sequence[LendEvent],
                 buckets: Sequence[str], *, owner: str = "serving", join_s: float = 0.0, margin_s: float = 1.0,
                 layout: Layout | None = None) -> None:
        super().__init__(trajs, config, layout)
        self.events, self.lent_buckets, self.owner = list(events), list(buckets), owner
        self.join_s, self.margin_s = join_s, margin_s
        self.lent_stats = LentStats()
        self._want: dict[int, int] = {}  # gpu -> generation of the owner's latest decision (lend or reclaim)
        self._joined: set[int] = set()  # slots that said hello
        self._active: set[int] = set()  # slots lent and joined now
        self._gone: set[tuple[str, int]] = set()  # (work id, lease) handed back or revoked: a pending join is dropped
        self._directed: dict[bytes, tuple[int, list[str], Role]] = {}  # online: a lent slot's directive, draining
        self._kinds: dict[bytes, list[str]] = {}  # online: the kinds a lent slot's last directive gave it
        self._on_lent: set[str] = set()  # trajectories with a turn served by a lent slot

    def _broker_config(self) -> BrokerConfig:
        base = super()._broker_config()
        per_token = self.costs.kv_seconds  # the simulator's KV move cost, cross-node (the lent GPUs are elsewhere)
        from libra.policies.routing.interface import MigrationQuery
        s = per_token(MigrationQuery(1_000_000, False, 1, 1)) / 1_000_000
        return replace(base, kv_move_s_per_token=s)

    @staticmethod
    def _peer(gpu: int) -> bytes:
        return f"lent{gpu:02d}".encode()

    def _hello(self) -> None:
        super()._hello()
        for ev in self.events:
            self._push(ev.t, "call", partial(self._owner_event, ev))

    # ------------------------------------------------------------------ the owner's decisions
    def _owner_event(self, ev: LendEvent) -> None:
        gen = self._want.get(ev.gpu, 0) + 1
        self._want[ev.gpu] = gen
        if ev.kind == "lend":
            self._push(self.now + self.join_s, "call", partial(self._join_slot, ev.gpu, gen))
        elif ev.gpu in self._active:
            self._reclaim(ev.gpu, ev.deadline_s, ev.reason)

    def _join_slot(self, gpu: int, gen: int) -> None:
        if self._want.get(gpu) != gen:
            return  # reclaimed before the engine was up
        peer = self._peer(gpu)
        self.lent_stats.lends += 1
        self._active.add(gpu)
        if gpu in self._joined:
            inst = self.instances[peer]
            inst.capacity = self.costs.max_seqs(inst.tp)
            self._send(peer, m.Bid(self._kinds.get(peer, ["generate"]), inst.capacity))
            if self.alloc is not None:
                self._pump()
                self.alloc.place_lent()
            return
        bucket = self.lent_buckets[gpu] if self.alloc is None else ""  # online: the broker's round places it
        spec = RolloutInstanceSpec(peer.decode(), f"serving{gpu // 8}", bucket, 1)
        inst = self.instances[peer] = SimInstance(spec, self.costs)
        inst.t_last = self.now
        self._joined.add(gpu)
        lend = {LEND_LABEL: LendLabel(owner=self.owner, rule="headroom").to_wire()}
        if self.alloc is None:  # a fixed bucket: serves at once
            self._send(peer, m.ActorHello(spec.id, spec.node, spec.id, 1, {"generate": ["*"]}, ["generate"],
                                          inst.capacity, {"role": {"bucket": spec.bucket}, **lend}))
            return
        assert self.alloc.fleet is not None
        self.alloc.fleet.foreign.add(peer)  # a GPU slot the broker may direct, never one of the job's own
        self._send(peer, m.ActorHello(spec.id, spec.node, f"gpu{gpu % 8}", 1, {"generate": ["*"], "sync": ["*"]}, [],
                                      inst.capacity, {"slot_kind": "gpu", **lend}))
        self._pump()
        inst.spec = replace(spec, bucket=self.broker.actors[peer].bucket)  # the broker's until it is directed
        self.alloc.place_lent()

    def _reclaim(self, gpu: int, deadline_s: float, reason: str) -> None:
        peer = self._peer(gpu)
        inst = self.instances[peer]
        self._active.discard(gpu)
        self.lent_stats.reclaims += 1
        self._send(peer, m.OwnerReclaim(self.owner, deadline_s, reason))
        self._pump()
        inst.advance(self.now)
        inst.next_event_time(self.now)  # fixes the current decode step
        cutoff = self.now + max(0.0, deadline_s - self.margin_s)
        back: list[Seq] = list(inst.waiting)
        for q in inst.running:
            if self.now + inst.stall + max(0.0, q.remaining) * inst.step > cutoff:
                back.append(q)
        back.extend(q for q in self._pending_joins(inst) if q not in back)
        for q in back:
            inst.remove(q.work_id)
            self._gone.add((q.work_id, q.lease))
            self.lent_stats.handbacks += 1
            self._send(peer, m.Handback(q.work_id, q.lease, "owner_reclaim"))
        inst.admit()
        self._reschedule(inst)

    def _pending_joins(self, inst: SimInstance) -> list[Seq]:
        return [p[1] for (_, _, kind, p) in self._heap if kind == "join" and p[0] is inst and
                (p[1].work_id, p[1].lease) not in self._gone]

    # ------------------------------------------------------------------ engine hooks
    def _on_generate(self, inst: SimInstance, a: m.Assign) -> None:
        if inst.peer.startswith(b"lent"):
            self._on_lent.add(a.trajectory or "")  # for the diagnosis: did the step's tail run on a lent slot?
        super()._on_generate(inst, a)

    def _join(self, inst: SimInstance, seq: Seq) -> None:
        if (seq.work_id, seq.lease) in self._gone:
            return
        super()._join(inst, seq)

    def _credited(self) -> list[tuple[bytes, SimInstance]]:
        lent = {self._peer(g) for g in self._joined}
        active = {self._peer(g) for g in self._active}
        return [(p, i) for p, i in self.instances.items() if p not in lent or p in active]

    def _deliver(self, cmd: Command) -> None:
        if type(cmd) is Send and cmd.peer.startswith(b"lent"):
            msg: Any = cmd.msg
            if isinstance(msg, m.Revoke):
                inst = self.instances[cmd.peer]
                inst.advance(self.now)
                if inst.remove(msg.work_id) is not None:
                    self.lent_stats.revoked += 1
                self._gone.add((msg.work_id, msg.lease))
                inst.admit()
                self._reschedule(inst)
                return
            if isinstance(msg, m.ContextsMoved):
                self.lent_stats.contexts_moved += 1
                return
            if isinstance(msg, m.Directive):  # online: the broker's round moves the slot (placement, bucket)
                draining = cmd.peer in self._directed  # a newer directive replaces the one still draining
                self._directed[cmd.peer] = (msg.directive_id, list(msg.kinds), role_from_config(msg.config))
                self.lent_stats.directives += 1
                if not draining:
                    self._push(self.now, "call", partial(self._lent_drained, cmd.peer))
                return
        super()._deliver(cmd)

    def _lent_drained(self, peer: bytes) -> None:
        """A directed lent slot switches once it holds no work (``finish``): its TP-1 engine stays up, so a new
        bucket costs nothing more; then ``DirectiveDone`` and, while lent, a ``Bid`` in the new role (a reclaimed
        slot bids when it is lent again)."""
        inst, sess = self.instances[peer], self.broker.actors.get(peer)
        if (sess is not None and sess.held) or inst.load > 0:
            self._push(self.now + 0.5, "call", partial(self._lent_drained, peer))
            return
        did, kinds, role = self._directed.pop(peer)
        inst.advance(self.now)
        inst.spec = replace(inst.spec, bucket=role.bucket if role.kind == "rollout" else "")
        self._kinds[peer] = list(kinds)
        self._send(peer, m.DirectiveDone(did, kinds))
        if int(peer[4:]) in self._active:
            self._send(peer, m.Bid(self._kinds[peer], inst.capacity))
        self._pump()
        assert self.alloc is not None
        self.alloc.place_lent()  # slots that joined while this one switched (the broker's next round places them)

    def _recredit(self, k: int) -> None:
        """Online: the lent slots' credit follows the observed lengths too (the fleet's own re-credit skips
        actors it does not own)."""
        super()._recredit(k)
        if self.alloc is None:
            return
        for g in sorted(self._active):
            peer = self._peer(g)
            inst = self.instances[peer]
            cap = self.costs.max_seqs(inst.tp)
            if cap != inst.capacity and peer not in self._directed and self._kinds.get(peer):
                inst.capacity = cap
                self._send(peer, m.Bid(self._kinds[peer], cap))

    def _tails(self) -> dict[str, Any]:
        """Trajectories with a turn on a lent slot, and the steps whose last trajectory to finish (the step's
        tail) had one."""
        last: dict[int, Any] = {}
        for r in self.records:
            if r.step not in last or r.end > last[r.step].end:
                last[r.step] = r
        return {"trajectories_on_lent": len(self._on_lent), "trajectories": len(self.records),
                "tail_on_lent_steps": sum(r.id in self._on_lent for r in last.values()), "steps": len(last)}

    def lent_summary(self) -> dict[str, Any]:
        st = self.lent_stats
        busy = sum(self.instances[self._peer(g)].busy_s for g in self._joined)
        reply = self.broker.status("sim", self.now)
        lending = reply.stats.get("lending") or {}
        return {"lends": st.lends, "reclaims": st.reclaims, "handbacks": st.handbacks, "revoked": st.revoked,
                "directives": st.directives,
                "contexts_moved": st.contexts_moved, "lent_busy_gpu_s": round(busy, 1), **self._tails(),
                "broker": {k: v for k, v in lending.items() if k != "reclaimed"}}
