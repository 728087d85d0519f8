"""A simulated rollout instance: continuous batching on a virtual clock (fluid between events).

Role: the receiver of ``generate`` assignments in :mod:`libra.sim.engine`. One instance is one vLLM-like
server of TP degree ``tp``. Model (per :class:`~libra.sim.cluster.InstanceCosts`):

- every running sequence decodes one token per step; a step takes ``decode_step(tp, running, kv_tokens)``
  (constant between events, evaluated at the segment's mid-point KV size); contexts grow as they decode;
- a new turn first pays, serialised on the instance (it stalls decoding, as a prefill does), the
  prefill of the tokens not in its KV cache here (plus the profile's instance-serial
  ``per_request_overhead_s``, 0 in the bundled GPU profiles): the new tokens (prompt or tool payload) when
  its cache lives here, the whole context after a re-prefill migration or a first placement; a ``kv``
  migration instead delays only that sequence by the KV transfer time and then prefills the new tokens;
  the per-turn serving latency (``per_turn_latency_s``) delays only that sequence, never the instance
  (the engine joins it late, docs/papers.md §1.7);
- KV capacity: a sequence is admitted to the running batch while the running contexts fit in the
  instance's token capacity (FCFS), otherwise it waits on the instance.

Pure arithmetic on explicit times; the engine owns the event heap and calls :meth:`advance`,
:meth:`admit`, :meth:`next_event_time` and :meth:`pop_finished`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from libra.sim.cluster import InstanceCosts, RolloutInstanceSpec

__all__ = ["Seq", "SimInstance"]

_DONE_EPS = 1e-6


@dataclass(slots=True)
class Seq:
    """One generate turn on an instance."""

    traj: str
    work_id: str
    lease: int
    gen: int  # tokens this turn generates
    remaining: float  # tokens left to decode
    context: float  # KV tokens it holds (grows while decoding)


class SimInstance:
    """State of one simulated rollout instance (see the module docstring)."""

    def __init__(self, spec: RolloutInstanceSpec, costs: InstanceCosts) -> None:
        self.spec = spec
        self.id = spec.id
        self.peer = spec.id.encode()
        self.tp = spec.tp
        self.costs = costs
        self.capacity = costs.max_seqs(spec.tp)
        self.token_capacity = costs.token_capacity(spec.tp)
        self.running: list[Seq] = []
        self.waiting: deque[Seq] = deque()
        self.kv_tokens = 0.0
        self.stall = 0.0
        self.step = 0.0
        self.t_last = 0.0
        self.version = 0
        self.busy_s = 0.0
        self.decoded = 0.0
        self.prefilled = 0.0

    def advance(self, now: float) -> None:
        """Move the instance's state to ``now`` (stall first, then decode at the current step time)."""
        dt = now - self.t_last
        self.t_last = now
        if dt <= 0:
            return
        if self.stall > 0:
            s = min(self.stall, dt)
            self.stall -= s
            dt -= s
            self.busy_s += s
        if dt > 0 and self.running and self.step > 0:
            n = dt / self.step
            for q in self.running:
                q.remaining -= n
                q.context += n
            self.kv_tokens += n * len(self.running)
            self.decoded += n * len(self.running)
            self.busy_s += dt

    def charge(self, seconds: float, prefill_tokens: float = 0.0) -> None:
        """Serialised work on the instance (serving overhead, prefill): stalls decoding."""
        self.stall += seconds
        self.prefilled += prefill_tokens

    def enqueue(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def admit(self) -> None:
        """Move waiting sequences into the running batch while their KV fits (always at least one)."""
        while self.waiting:
            q = self.waiting[0]
            if self.running and self.kv_tokens + q.context > self.token_capacity:
                return
            self.waiting.popleft()
            self.running.append(q)
            self.kv_tokens += q.context

    def next_event_time(self, now: float) -> float | None:
        """When the next running sequence finishes (``None`` when idle); fixes the segment's step time."""
        if not self.running:
            self.step = 0.0
            return now + self.stall if self.stall > 0 and self.waiting else None
        b = len(self.running)
        min_rem = max(0.0, min(q.remaining for q in self.running))
        self.step = self.costs.decode_step(self.tp, b, self.kv_tokens + 0.5 * b * min_rem)
        return now + self.stall + min_rem * self.step

    def pop_finished(self) -> list[Seq]:
        """Remove and return the sequences that have decoded all their tokens."""
        done = [q for q in self.running if q.remaining <= _DONE_EPS]
        if done:
            self.running = [q for q in self.running if q.remaining > _DONE_EPS]
            for q in done:
                self.kv_tokens -= q.context
            if not self.running:
                self.kv_tokens = 0.0
        return done

    def remove(self, work_id: str) -> Seq | None:
        """Take the turn ``work_id`` off the instance (handed back or revoked; its decoded tokens are lost)."""
        for q in self.running:
            if q.work_id == work_id:
                self.running.remove(q)
                self.kv_tokens = max(0.0, self.kv_tokens - q.context) if self.running else 0.0
                return q
        for q in self.waiting:
            if q.work_id == work_id:
                self.waiting.remove(q)
                return q
        return None

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)
