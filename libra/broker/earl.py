"""EARL's parallelism selector in the broker: the rollout TP follows the average context of the generate turns.

Role: docs/papers.md §3.2.1 / §4 item 17, run live. With ``parallelism = "earl"`` in ``[broker.planner]`` the
broker's rollout routing records the context length of every generate turn it routes (the larger of its own
count, prompt + generated + tool tokens, and the turn's stated length); every ``interval_s`` the broker asks
:meth:`EarlLoop.decide` for the rollout TP, given the average context of the last ``window`` turns, the load
(live trajectories), the GPU actors in rollout roles and the largest TP their engines serve. The decision is the
:class:`~libra.policies.parallelism.selector.ParallelismSelector`'s over a profile table built from the planner's
cost model for its ``hardware`` / ``model`` (``source = "cost_model"``, the exact OOM guard) or the EARL Fig. 3
table (``source = "earl_fig3"``, TP 4 and 8). A switch is applied by ``plan_rounds.Planning`` as a plan (:func:`
earl_plan`) through role directives, the same path as the planner's plans.

Rules:

- Switch only when the average enters a new range of the table, and only once it is ``hysteresis`` (a
  fraction, default 0.1) past the range's boundary: an average that hovers at a boundary does not flap.
  The OOM guard overrides the hysteresis: a TP that would run out of memory at the current average is left at
  once, for the next larger one that fits.
- Never above ``max_tp`` (the smallest ``max_tp`` the GPU actors report: 1 for HF engines) nor above the rollout
  GPUs: the table is profiled over those configs only, so its OOM guard can only pick among them.
- ``min_turns`` turns since the last decision are needed to decide at all.

Settings (``[broker.planner.earl]``, all optional): ``source``, ``interval_s`` (30), ``window`` (256),
``min_turns`` (16), ``hysteresis`` (0.1), ``configs`` ([1, 2, 4, 8]), ``loads`` ([8, 16, 32, 64, 128]).

Pure: no clock (``now`` comes in), no I/O, no logging; decisions are kept in :attr:`EarlLoop.decisions` for the
core to log. Building a table runs the cost model (about 0.2 s) once per (rollout GPUs, configs).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from libra.config import from_mapping
from libra.policies.cost import RolloutCostModel
from libra.policies.parallelism.selector import ParallelismSelector, make_selector
from libra.policies.planner.types import Plan, RolloutInstance

__all__ = ["EarlLoop", "EarlSettings", "earl_plan"]

SOURCES = ("cost_model", "earl_fig3")


@dataclass(frozen=True, slots=True)
class EarlSettings:
    """The ``[broker.planner.earl]`` table (see the module docstring)."""

    source: str = "cost_model"
    interval_s: float = 30.0
    window: int = 256
    min_turns: int = 16
    hysteresis: float = 0.1
    configs: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    loads: list[int] = field(default_factory=lambda: [8, 16, 32, 64, 128])

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EarlSettings:
        """Validate (strict types, no unknown keys). Raises ``ValueError`` naming the bad key or value."""
        s = from_mapping(cls, dict(d), "broker planner earl")
        if s.source not in SOURCES:
            raise ValueError(f"broker planner earl: unknown source {s.source!r} (known: {', '.join(SOURCES)})")
        if not s.interval_s > 0:
            raise ValueError(f"broker planner earl: interval_s must be > 0, got {s.interval_s!r}")
        if s.window < 1 or s.min_turns < 1:
            raise ValueError(f"broker planner earl: window and min_turns must be >= 1, got {s.window}, {s.min_turns}")
        if not 0.0 <= s.hysteresis < 1.0:
            raise ValueError(f"broker planner earl: hysteresis must be within [0, 1), got {s.hysteresis!r}")
        bad = [c for c in s.configs if c < 1 or c & (c - 1)]
        if not s.configs or bad:
            raise ValueError(f"broker planner earl: configs must be powers of two >= 1, got {s.configs!r}")
        if not s.loads or min(s.loads) < 1:
            raise ValueError(f"broker planner earl: loads must be >= 1, got {s.loads!r}")
        return s


class EarlLoop:
    """The selector's state between decisions. Mutation rule: :meth:`observe`, :meth:`due` (starts the clock),
    :meth:`decide` and :meth:`rejected` change state."""

    def __init__(self, settings: EarlSettings, rollout_model: RolloutCostModel) -> None:
        self.settings = settings
        self._model = rollout_model
        self.contexts: deque[int] = deque(maxlen=settings.window)
        self.seen = 0  # turns observed since the last decision
        self.last_t: float | None = None
        self.switches = 0
        self.decisions: deque[dict[str, Any]] = deque(maxlen=16)
        self.recorded = 0
        self._sel: ParallelismSelector | None = None
        self._key: tuple[int, tuple[int, ...]] | None = None

    def observe(self, context: int) -> None:
        """One routed generate turn with ``context`` tokens."""
        if context > 0:
            self.contexts.append(int(context))
            self.seen += 1

    def due(self, now: float) -> bool:
        """Whether a decision is due (the first ``interval_s`` after the first call)."""
        if self.last_t is None:
            self.last_t = now
            return False
        return now - self.last_t >= self.settings.interval_s

    @property
    def average(self) -> float | None:
        return sum(self.contexts) / len(self.contexts) if self.contexts else None

    def decide(self, now: float, *, n_gpus: int, load: int, max_tp: int | None, current_tp: int) -> int | None:
        """The rollout TP to switch to now, or None to keep ``current_tp`` (the decision is recorded either way).
        ``n_gpus``: GPUs in rollout roles; ``load``: concurrent trajectories; ``max_tp``: the engines' cap."""
        self.last_t = now
        s = self.settings
        if self.seen < s.min_turns:
            return self._record(now, "too_few_turns", turns=self.seen)
        self.seen = 0
        avg, load = float(self.average or 0.0), max(1, int(load))
        cap = min(n_gpus, max_tp if max_tp is not None else n_gpus)
        configs = tuple(sorted({c for c in s.configs if c <= cap}))
        base = {"avg_context": round(avg, 1), "load": load, "current_tp": current_tp, "max_tp": max_tp,
                "rollout_gpus": n_gpus}
        if not configs:
            return self._record(now, "no_config_fits", **base)
        if len(configs) == 1:  # one TP is allowed: go there if not already
            return self._switch(now, configs[0], "only_config", **base) if configs[0] != current_tp else \
                self._record(now, "only_config", tp=current_tp, **base)
        sel = self._selector(n_gpus, configs)
        if sel is None:
            return self._record(now, "table_exceeds_max_tp", **base)
        sel.current = current_tp if current_tp in sel.table.configs else None
        where = sel.range_of(avg, load)
        if sel.range is not None and where != sel.range and sel.current is not None \
                and not sel.ooms(sel.current, avg, load):
            h = s.hysteresis
            if sel.range_of(avg / (1 + h), load) != where or sel.range_of(avg * (1 + h), load) != where:
                return self._record(now, "hysteresis", tp=current_tp, **base)
        pick = sel.select(avg, load)
        if pick.tp != current_tp:
            return self._switch(now, pick.tp, pick.reason, range_lo=pick.range_lo, range_hi=pick.range_hi,
                                oom=pick.oom, **base)
        return self._record(now, pick.reason, tp=current_tp, range_lo=pick.range_lo, range_hi=pick.range_hi, **base)

    def rejected(self, error: str) -> None:
        """The switch just decided could not be laid out: say so in its record."""
        if self.decisions:
            self.decisions[-1]["reason"] = "apply_failed"
            self.decisions[-1]["error"] = error

    def new_decisions(self, since: int) -> list[dict[str, Any]]:
        """The decisions recorded after the first ``since`` (those :attr:`decisions` still keeps)."""
        n = min(self.recorded - since, len(self.decisions))
        return list(self.decisions)[len(self.decisions) - n:] if n > 0 else []

    def summary(self) -> dict[str, Any]:
        return {"source": self.settings.source, "average_context": self.average, "switches": self.switches,
                "decisions": list(self.decisions)}

    # -- internals -------------------------------------------------------------------------------
    def _selector(self, n_gpus: int, configs: tuple[int, ...]) -> ParallelismSelector | None:
        key = (n_gpus, configs)
        if key != self._key:
            s = self.settings
            if s.source == "earl_fig3":
                sel = make_selector(source="earl_fig3")
                if max(sel.table.configs) > max(configs):
                    return None  # the paper's table is TP 4 vs 8: it cannot choose below that cap
            else:
                sel = make_selector(self._model, n_gpus, configs=configs, loads=tuple(sorted(set(s.loads))))
            self._sel, self._key = sel, key
        return self._sel

    def _switch(self, now: float, tp: int, why: str, **extra: Any) -> int:
        self.switches += 1
        self._record(now, "switch", tp=tp, why=why, **extra)
        return tp

    def _record(self, now: float, reason: str, **extra: Any) -> None:
        self.decisions.append({"t": round(now, 3), "reason": reason,
                               **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                  for k, v in extra.items()}})
        self.recorded += 1
        return None


def earl_plan(base: Plan | None, rollout_gpus: int, tp: int) -> Plan:
    """A plan with every rollout GPU in TP-``tp`` instances (a remainder in the largest smaller powers of two,
    so no rollout GPU idles) and ``base``'s training layout unchanged (none without a base plan: then only the
    rollout GPUs are planned). Raises ``ValueError`` for ``tp < 1`` or no rollout GPUs."""
    n = base.n_gpus - base.n_train if base is not None else rollout_gpus
    if tp < 1 or n < 1:
        raise ValueError(f"earl plan needs tp >= 1 and rollout GPUs >= 1, got tp={tp}, rollout GPUs={n}")
    sizes = [tp] * (n // tp)
    rest = n - tp * len(sizes)
    while rest:
        sizes.append(1 << (rest.bit_length() - 1))
        rest -= sizes[-1]
    rollout = tuple(RolloutInstance(t, 0.0, math.inf, 0.0, 0.0) for t in sizes)
    if base is None:
        return Plan(n, 0, None, rollout, 0.0, 0.0, allocator="earl")
    return Plan(base.n_gpus, base.n_train, base.train, rollout, base.t_train, base.t_rollout, allocator="earl",
                t_chain=base.t_chain, overlap_steps=base.overlap_steps, throughput=base.throughput)
