"""Owner rules for lent capacity: when may a slot whose GPU belongs to someone else bid for rollout work.

Pure (no sockets, clocks or logging): the actor's owner plug-ins (``libra.actors.owners``) feed them what
they read from the owner (a serving process's latency, the time of day) and act on the signal; the
simulator feeds them its serving model. Chosen by name (:data:`RULES`).

- :class:`OwnerSignal`: the one answer every rule gives (``allow``; when not, the seconds the owner gives
  before the GPU must be back and why).
- :class:`HeadroomRule` (``headroom``): the serving owner's SLO headroom rule with hysteresis.
- :class:`ScheduleRule` (``schedule``): lend inside fixed windows of the day.
"""

from .rules import RULES, HeadroomRule, LendingRuleError, OwnerSignal, ScheduleRule, rule_from_options

__all__ = ["RULES", "HeadroomRule", "LendingRuleError", "OwnerSignal", "ScheduleRule", "rule_from_options"]
