"""The owner rules (see the package docstring). Each rule is a frozen value; its ``step`` is a pure function
of what it is told, the slot's current state and ``now``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["RULES", "HeadroomRule", "LendingRuleError", "OwnerSignal", "ScheduleRule", "rule_from_options"]


class LendingRuleError(ValueError):
    """A rule's settings are out of range or unknown (the message names the setting)."""


@dataclass(frozen=True, slots=True)
class OwnerSignal:
    """What the owner says now. ``allow``: the slot may bid for rollout work. Not ``allow``: the owner wants
    the GPU back within ``deadline_s`` seconds (counted from when the signal was read); ``reason`` is a
    static snake_case word (``slo_headroom_low``, ``spot_notice``, ``outside_window``, ...)."""

    allow: bool
    deadline_s: float = 0.0
    reason: str = ""

    def __post_init__(self) -> None:
        if not math.isfinite(self.deadline_s) or self.deadline_s < 0:
            raise LendingRuleError(f"OwnerSignal.deadline_s must be finite and >= 0, got {self.deadline_s!r}")


@dataclass(frozen=True, slots=True)
class HeadroomRule:
    """Lend while the owner's serving latency leaves headroom under its target.

    ``step(lent, p99_s, now, since, step_s)``: ``lent`` says whether the slot is lent now, ``p99_s`` is the
    owner's p99 time per output token over its recent window of finished requests (``None``: no reading, e.g.
    no traffic: counts as headroom), ``since`` when ``lent`` last changed, and ``step_s`` (optional) the time
    per token of the batch the owner is decoding now (``None``: idle or not reported). A lent slot is reclaimed
    at once when either reading reaches ``reclaim_above × target_s`` (with ``deadline_s`` to hand back); a
    reclaimed one is lent again only after both stayed under ``lend_below × target_s`` and ``hold_s`` passed
    since the last change (hysteresis: no flapping on a noisy reading).

    Why both: the window's p99 is over requests that *finished*, so it moves only after slowed requests end
    (a request's length plus the window later). The running batch's token time is the same measure taken now:
    it moves on the first slowed decode steps."""

    target_s: float
    lend_below: float = 0.7
    reclaim_above: float = 0.85
    hold_s: float = 30.0
    deadline_s: float = 5.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.target_s) and self.target_s > 0):
            raise LendingRuleError(f"headroom: target_s must be > 0, got {self.target_s!r}")
        if not 0 < self.lend_below <= self.reclaim_above <= 1.0:
            raise LendingRuleError(f"headroom: need 0 < lend_below <= reclaim_above <= 1, got lend_below="
                                   f"{self.lend_below!r}, reclaim_above={self.reclaim_above!r}")
        if self.hold_s < 0 or self.deadline_s < 0:
            raise LendingRuleError("headroom: hold_s and deadline_s must be >= 0")

    def step(self, lent: bool, p99_s: float | None, now: float, since: float,
             step_s: float | None = None) -> OwnerSignal:
        worst = max((x for x in (p99_s, step_s) if x is not None), default=None)
        if lent:
            if worst is not None and worst >= self.reclaim_above * self.target_s:
                return OwnerSignal(False, self.deadline_s, "slo_headroom_low")
            return OwnerSignal(True)
        calm = worst is None or worst < self.lend_below * self.target_s
        if calm and now - since >= self.hold_s:
            return OwnerSignal(True)
        return OwnerSignal(False, self.deadline_s, "slo_headroom_low" if not calm else "holding")


@dataclass(frozen=True, slots=True)
class ScheduleRule:
    """Lend inside ``windows`` (``(start_s, end_s)`` seconds of the day, UTC; a window may wrap midnight),
    reclaimed at each window's end with ``deadline_s`` to hand back. ``step(now)`` takes the wall time."""

    windows: tuple[tuple[float, float], ...]
    deadline_s: float = 30.0

    def __post_init__(self) -> None:
        for w in self.windows:
            if len(w) != 2 or not all(0 <= x <= 86_400 for x in w):
                raise LendingRuleError(f"schedule: each window is (start_s, end_s) within a day, got {w!r}")

    def step(self, now: float) -> OwnerSignal:
        t = now % 86_400
        for a, b in self.windows:
            if (a <= t < b) if a <= b else (t >= a or t < b):
                return OwnerSignal(True)
        return OwnerSignal(False, self.deadline_s, "outside_window")


RULES = ("headroom", "schedule")


def rule_from_options(name: str, options: dict[str, Any]) -> HeadroomRule | ScheduleRule:
    """The rule ``name`` with ``options`` (unknown names or settings raise :class:`LendingRuleError`)."""
    cls = {"headroom": HeadroomRule, "schedule": ScheduleRule}.get(name)
    if cls is None:
        raise LendingRuleError(f"unknown lending rule {name!r} (known: {', '.join(RULES)})")
    fields = set(cls.__dataclass_fields__)
    bad = sorted(set(options) - fields)
    if bad:
        raise LendingRuleError(f"{name}: unknown setting(s) {', '.join(bad)} (known: {', '.join(sorted(fields))})")
    try:
        return cls(**options)
    except TypeError as exc:
        raise LendingRuleError(f"{name}: {exc}") from None
