"""Unified action model for action-level resource scheduling (ARL-Tangram, docs/papers.md §2.3, §4 item 11).

An *action* is one tool call or service call of a trajectory. It is described by:

- a **demand vector** over named resources (``Mapping[str, int]`` of *minimum* units). Names are free-form;
  the convention used across Libra is ``kind`` or ``kind@place``: ``cpu@n03`` (cores of CPU node 3),
  ``gpu``, ``mem_gb@n03``, ``svc:teacher2`` (a named service slot), ``quota:search`` (tokens of a
  rate-limited API). :func:`resource_kind` strips the ``@place`` part.
- at most one **key elastic resource** (:class:`ElasticSpec`): the action can use between its minimum
  (``demand[resource]``) and ``max_units`` units of it, and runs for
  ``duration(m) = T_ori / (E(m) · m)`` where ``T_ori`` (``base_duration``) is the time with one unit and
  ``E(m)`` the parallel efficiency (:class:`Amdahl` by default, or a profiled :class:`TableProfile`).
- quota-type resources are rate limits, modelled by :class:`TokenBucket` (pure: time comes in as ``now``).
  A caller exposes ``floor(bucket.available(now))`` tokens as free units of ``quota:NAME``.

Also here: :class:`Grant` (a scheduling decision). The indexed views a scheduler reads (running actions,
the queue) are in :mod:`libra.policies.actions.views`. Everything is pure data: no I/O, clocks or threads.
Specs are frozen; the mappings inside them must be treated as read-only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple, Union

__all__ = [
    "ActionModelError",
    "ActionSpec",
    "Amdahl",
    "EfficiencyProfile",
    "ElasticSpec",
    "Grant",
    "QuotaError",
    "TableProfile",
    "TokenBucket",
    "check_resources",
    "resource_kind",
    "speedup_table",
]


class ActionModelError(ValueError):
    """Raised for an invalid action spec, efficiency profile or resource vector (the message names the field)."""


class QuotaError(ValueError):
    """Raised for an invalid token-bucket configuration or use (negative take, time going backwards)."""


def resource_kind(name: str) -> str:
    """Return the kind of a resource name: ``"cpu@n03"`` → ``"cpu"``; names without ``@`` are their own kind."""
    return name.split("@", 1)[0]


def check_resources(res: Mapping[str, int], what: str) -> dict[str, int]:
    """Validate a resource vector (non-empty names, integer units ≥ 0) and return a plain ``dict`` copy.

    Raises :class:`ActionModelError` naming ``what`` and the offending entry.
    """
    out: dict[str, int] = {}
    for name, units in res.items():
        if not isinstance(name, str) or not name:
            raise ActionModelError(f"{what}: resource names must be non-empty strings, got {name!r}")
        if isinstance(units, bool) or not isinstance(units, int) or units < 0:
            raise ActionModelError(f"{what}[{name!r}] must be an integer >= 0, got {units!r}")
        out[name] = units
    return out


# --------------------------------------------------------------------------------------------- profiles


@dataclass(frozen=True, slots=True)
class Amdahl:
    """Amdahl's-law efficiency: speedup ``S(m) = 1 / ((1-p) + p/m)``, ``E(m) = S(m)/m``.

    Durations ``T_ori / S(m)`` are convex in ``m``, so greedy unit splitting is exact for these actions.
    Raises :class:`ActionModelError` unless ``0 <= parallel_fraction <= 1``.
    """

    parallel_fraction: float = 0.7

    def __post_init__(self) -> None:
        p = self.parallel_fraction
        if not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ActionModelError(f"Amdahl.parallel_fraction must be in [0, 1], got {p!r}")

    def speedup(self, m: int) -> float:
        """``E(m)·m`` for ``m >= 1`` units."""
        p = self.parallel_fraction
        return 1.0 / ((1.0 - p) + p / m)

    def efficiency(self, m: int) -> float:
        """``E(m)`` in ``(0, 1]``."""
        return self.speedup(m) / m

    @property
    def convex(self) -> bool:
        """Always true: ``1/S(m)`` is convex for Amdahl's law."""
        return True


@dataclass(frozen=True, slots=True)
class TableProfile:
    """A profiled efficiency table: ``efficiency[m-1] = E(m)`` for ``m = 1..len``; beyond the table the speedup
    stays flat (more units do not help).

    Contract (raises :class:`ActionModelError` otherwise): ``E(1) == 1``, ``0 < E(m) <= 1`` and the speedup
    ``E(m)·m`` is non-decreasing (docs/papers.md §2.3: "E(m) decreases with m, but E(m)·m still increases").
    """

    efficiency: tuple[float, ...]

    def __post_init__(self) -> None:
        eff = tuple(float(e) for e in self.efficiency)
        if not eff:
            raise ActionModelError("TableProfile.efficiency must not be empty")
        if abs(eff[0] - 1.0) > 1e-9:
            raise ActionModelError(f"TableProfile.efficiency[0] (E(1)) must be 1.0, got {eff[0]!r}")
        for i, e in enumerate(eff):
            if not 0.0 < e <= 1.0 + 1e-9:
                raise ActionModelError(f"TableProfile.efficiency[{i}] must be in (0, 1], got {e!r}")
            if i and e * (i + 1) < eff[i - 1] * i - 1e-9:
                raise ActionModelError(
                    f"TableProfile: speedup E(m)*m must not decrease, but E({i + 1})*{i + 1}={e * (i + 1):.4g}"
                    f" < E({i})*{i}={eff[i - 1] * i:.4g}"
                )
        object.__setattr__(self, "efficiency", eff)

    def speedup(self, m: int) -> float:
        """``E(m)·m``; flat beyond the table."""
        k = min(m, len(self.efficiency))
        return self.efficiency[k - 1] * k

    @property
    def convex(self) -> bool:
        """Whether ``1/S(m)`` is convex over the table (then greedy splitting is exact)."""
        inv = [1.0 / self.speedup(m) for m in range(1, len(self.efficiency) + 2)]
        return all(inv[i - 1] - 2 * inv[i] + inv[i + 1] >= -1e-12 for i in range(1, len(inv) - 1))


EfficiencyProfile = Union[Amdahl, TableProfile]


@lru_cache(maxsize=8192)
def speedup_table(profile: EfficiencyProfile, max_units: int) -> tuple[float, ...]:
    """``(0.0, S(1), ..., S(max_units))``: speedups indexed by unit count (memoised; profiles are immutable)."""
    return (0.0,) + tuple(profile.speedup(m) for m in range(1, max_units + 1))


@dataclass(frozen=True, slots=True)
class ElasticSpec:
    """The key elastic resource of an action: it may use ``demand[resource] .. max_units`` units of it.

    ``sizes`` optionally restricts the unit counts (e.g. ``(1, 2, 4)`` for GPU cells); ``None`` allows every
    integer in range.
    """

    resource: str
    max_units: int
    profile: EfficiencyProfile = field(default_factory=Amdahl)
    sizes: tuple[int, ...] | None = None


# --------------------------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True, eq=False)
class ActionSpec:
    """One action waiting to be scheduled.

    ``demand`` holds minimum units per resource (for the elastic resource: the minimum DoP).
    ``base_duration`` is ``T_ori``: the duration with **one** unit of the elastic resource, or simply the
    duration of a non-elastic action. ``service`` names the GPU service an action runs on (evict-on-execution),
    if any. Derived fields (``key``, ``min_units``, ``max_units``, ``span``, ``part``, ``part_units``, ``solo``,
    ``items``, ``durations``, ``min_duration``, ``gains``, ``neg_gains``, ``convex``, ``grant``, ``row``) are
    computed once at construction for the scheduler's hot path: ``span = max_units - min_units`` (0: not elastic in practice), ``part``
    the resource a scheduler partitions the action under (its key elastic resource when ``span > 0``, else
    its first demanded resource, ``None`` for an empty demand) and ``part_units = demand[part]``, ``solo`` the
    resource of a single-resource demand (``None`` when the demand names zero or several resources),
    ``durations[m]`` the duration table by unit count (``inf`` where ``m`` is not allowed),
    ``min_duration == durations[min_units]`` (the duration of a non-elastic action),
    ``gains[i]`` the time saved by unit ``min_units + i + 1`` (non-increasing when ``convex``),
    ``neg_gains`` their negations (ascending when ``convex``) and ``grant`` the grant that starts the action
    with exactly its demand (``Grant(id, demand)``, built once: a scheduler returns it as is; its ``units``
    is the spec's own read-only ``demand``). ``row`` is ``(solo, part_units, span, min_duration, convex,
    grant)``: a scheduler reads these columns of a whole window with one attribute read per action and a
    ``zip(*rows)``.

    Raises :class:`ActionModelError` for a bad field (the message names it).
    """

    id: str
    trajectory: str
    tool: str
    demand: Mapping[str, int]
    base_duration: float
    elastic: ElasticSpec | None = None
    submitted_at: float = 0.0
    service: str | None = None
    key: str | None = field(init=False)
    min_units: int = field(init=False)
    max_units: int = field(init=False)
    span: int = field(init=False)
    part: str | None = field(init=False)
    part_units: int = field(init=False)
    solo: str | None = field(init=False)
    items: tuple[tuple[str, int], ...] = field(init=False)
    durations: tuple[float, ...] = field(init=False)
    min_duration: float = field(init=False)
    gains: tuple[float, ...] = field(init=False)
    neg_gains: tuple[float, ...] = field(init=False)
    convex: bool = field(init=False)
    grant: Grant = field(init=False, repr=False)
    row: tuple = field(init=False, repr=False)

    def __post_init__(self) -> None:
        where = f"action {self.id!r}"
        if not isinstance(self.id, str) or not self.id:
            raise ActionModelError(f"action id must be a non-empty string, got {self.id!r}")
        demand = check_resources(self.demand, f"{where}: demand")
        t = self.base_duration
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ActionModelError(f"{where}: base_duration must be a finite number > 0, got {t!r}")
        if not math.isfinite(self.submitted_at):
            raise ActionModelError(f"{where}: submitted_at must be finite, got {self.submitted_at!r}")
        el = self.elastic
        if el is None:
            key, lo, hi = None, 0, 0
            durations: tuple[float, ...] = (float(t),)
            convex = True
        else:
            key = el.resource
            lo = demand.get(key, 0)
            hi = el.max_units
            if lo < 1:
                raise ActionModelError(f"{where}: elastic resource {key!r} needs demand >= 1 (the minimum DoP), got {lo}")
            if isinstance(hi, bool) or not isinstance(hi, int) or hi < lo:
                raise ActionModelError(f"{where}: elastic.max_units must be an integer >= demand[{key!r}]={lo}, got {hi!r}")
            sp = speedup_table(el.profile, hi)
            allowed = None
            if el.sizes is not None:
                allowed = set(el.sizes)
                if lo not in allowed or hi not in allowed or any(not isinstance(s, int) or s < lo or s > hi for s in allowed):
                    raise ActionModelError(
                        f"{where}: elastic.sizes must lie in [{lo}, {hi}] and contain both the minimum {lo} and"
                        f" max_units {hi}, got {el.sizes!r}"
                    )
            durations = tuple(
                (t / sp[m]) if m >= lo and (allowed is None or m in allowed) else math.inf for m in range(hi + 1)
            )
            convex = allowed is None and el.profile.convex
        gains: tuple[float, ...] = ()
        if key is not None and convex:
            gains = tuple(max(durations[m] - durations[m + 1], 0.0) for m in range(lo, hi))
        setattr_ = object.__setattr__
        setattr_(self, "demand", demand)
        setattr_(self, "key", key)
        setattr_(self, "min_units", lo)
        setattr_(self, "max_units", hi)
        items = tuple(demand.items())
        setattr_(self, "items", items)
        setattr_(self, "span", hi - lo)
        part = key if hi > lo else (items[0][0] if items else None)
        setattr_(self, "part", part)
        setattr_(self, "part_units", 0 if part is None else demand[part])
        setattr_(self, "solo", items[0][0] if len(items) == 1 else None)
        setattr_(self, "durations", durations)
        setattr_(self, "min_duration", durations[lo])
        setattr_(self, "gains", gains)
        setattr_(self, "neg_gains", tuple(-g for g in gains))
        setattr_(self, "convex", convex)
        setattr_(self, "grant", grant := Grant(self.id, demand))
        setattr_(self, "row", (self.solo, self.part_units, hi - lo, durations[lo], convex, grant))

    @property
    def elastic_range(self) -> int:
        """How many extra units beyond the minimum the action can use (0 for a non-elastic action)."""
        return self.max_units - self.min_units

    def duration(self, units: int | None = None) -> float:
        """Execution time with ``units`` of the key elastic resource (default: the minimum).

        Raises :class:`ActionModelError` for a unit count outside ``[min, max]`` or not in ``sizes``.
        """
        if self.key is None:
            return self.durations[0]
        m = self.min_units if units is None else units
        if not self.min_units <= m <= self.max_units or math.isinf(self.durations[m]):
            raise ActionModelError(
                f"action {self.id!r}: {m} units of {self.key!r} not allowed (range {self.min_units}..{self.max_units}"
                + (f", sizes {self.elastic.sizes}" if self.elastic and self.elastic.sizes else "")
                + ")"
            )
        return self.durations[m]

    def dop_for(self, granted: Mapping[str, int]) -> int:
        """The DoP this action runs at given a grant: granted units of its elastic kind, capped at ``max_units``
        and rounded down to an allowed size (0 for a non-elastic action).

        The grant may name another place of the same kind (``cpu@n05`` for ``cpu@n03``: a relocated sandbox).
        """
        if self.key is None:
            return 0
        kind = resource_kind(self.key)
        got = granted.get(self.key)
        if got is None:
            got = max((u for r, u in granted.items() if resource_kind(r) == kind), default=0)
        m = min(got, self.max_units)
        while m > self.min_units and math.isinf(self.durations[m]):
            m -= 1
        return max(m, self.min_units)


class Grant(NamedTuple):
    """Start action ``action_id`` now with ``units`` (resource → units, including the chosen elastic DoP).

    ``unit_ids`` optionally names concrete units (core or GPU indices) when the policy chose them; the
    resource manager picks them otherwise. (A ``NamedTuple``: cheap to build on the decision hot path.)
    """

    action_id: str
    units: Mapping[str, int]
    unit_ids: Mapping[str, tuple[int, ...]] | None = None


# --------------------------------------------------------------------------------------------- quotas


@dataclass(slots=True)
class TokenBucket:
    """A rate limit of ``rate`` tokens per second with capacity ``burst`` (quota-type resource).

    Pure: time comes in as ``now``; it must not go backwards (raises :class:`QuotaError`). Starts full.
    Mutation rule: only :meth:`take` (and :meth:`try_take`) and the refill inside :meth:`available` change it.
    """

    rate: float
    burst: float
    tokens: float = field(default=-1.0)
    updated: float = 0.0

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise QuotaError(f"TokenBucket.rate must be a finite number > 0 (tokens per second), got {self.rate!r}")
        if not (self.burst >= 1 and math.isfinite(self.burst)):
            raise QuotaError(f"TokenBucket.burst must be a finite number >= 1, got {self.burst!r}")
        if self.tokens < 0:
            self.tokens = float(self.burst)

    def _refill(self, now: float) -> None:
        if now < self.updated - 1e-9:
            raise QuotaError(f"TokenBucket: time went backwards ({now!r} < {self.updated!r})")
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def available(self, now: float) -> float:
        """Tokens available at ``now`` (fractional)."""
        self._refill(now)
        return self.tokens

    def take(self, now: float, n: float = 1.0) -> None:
        """Consume ``n`` tokens. Raises :class:`QuotaError` if fewer than ``n`` are available."""
        if n < 0:
            raise QuotaError(f"TokenBucket.take: n must be >= 0, got {n!r}")
        self._refill(now)
        if self.tokens + 1e-9 < n:
            raise QuotaError(f"TokenBucket.take: {n} tokens requested, {self.tokens:.3f} available at t={now}")
        self.tokens = max(0.0, self.tokens - n)

    def try_take(self, now: float, n: float = 1.0) -> bool:
        """Consume ``n`` tokens if available; return whether it did."""
        self._refill(now)
        if self.tokens + 1e-9 < n:
            return False
        self.tokens = max(0.0, self.tokens - n)
        return True

    def next_time(self, now: float, n: float = 1.0) -> float:
        """The earliest time ``>= now`` at which ``n`` tokens will be available (``n`` must be ``<= burst``)."""
        if n > self.burst:
            raise QuotaError(f"TokenBucket.next_time: {n} tokens can never be available (burst {self.burst})")
        self._refill(now)
        missing = n - self.tokens
        return now if missing <= 1e-9 else now + missing / self.rate
