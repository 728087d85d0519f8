"""``ScheduleOwner``: lend inside fixed windows of the day (UTC), over the pure
:class:`~libra.policies.lending.ScheduleRule` (``--lend owner=NAME,kind=schedule,windows=22:00-06:00``)."""

from __future__ import annotations

from libra.policies.lending import OwnerSignal, ScheduleRule

__all__ = ["ScheduleOwner"]


class ScheduleOwner:
    """Reads nothing but the clock: ``poll(now)`` is ``rule.step(now)``."""

    def __init__(self, name: str, rule: ScheduleRule) -> None:
        self.name, self.rule = name, rule

    def poll(self, now: float) -> OwnerSignal:
        return self.rule.step(now)

    def close(self) -> None:
        return None
