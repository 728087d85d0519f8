"""Action-level scheduling policies (ARL-Tangram): the public surface and the registry.

Other code imports from here only. The pieces live in:

- :mod:`libra.policies.actions.model`: :class:`ActionSpec` (demand vector, key elastic resource,
  ``duration(m) = T_ori / (E(m)·m)``), efficiency profiles (:class:`Amdahl`, :class:`TableProfile`),
  :class:`TokenBucket` for quota-type resources, :class:`Grant`;
- :mod:`libra.policies.actions.views`: :class:`RunningView`, :class:`RunningSet` and :class:`ActionQueue`
  (indexed views that make decisions cheaper; any ``Sequence`` works);
- :mod:`libra.policies.actions.tangram`: :class:`ElasticScheduler` (``tangram``, the default);
- :mod:`libra.policies.actions.baselines`: :class:`FixedDoPScheduler` (``fixed_dop``, alias
  ``fifo_fixed_dop``) and :class:`PerTrajectoryScheduler` (``per_trajectory``).

Every scheduler implements :class:`ActionScheduler`; pick one by name with :func:`make_action_scheduler`.
Contract of ``schedule(queue, free, running, now)``: ``queue`` is read once in FCFS order (an
:class:`ActionQueue` lets a policy skip actions whose primary resource has nothing free); ``free`` is the
units no running action holds (quota resources: whole tokens available now); the grants returned fit
``free`` jointly, name each action at most once, and the caller starts exactly those actions (a caller that
cannot place a grant leaves the action queued). Pure: no I/O, clocks or threads.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Protocol, runtime_checkable

from libra.policies.actions.baselines import FixedDoPScheduler, PerTrajectoryScheduler
from libra.policies.actions.model import (
    ActionModelError,
    ActionSpec,
    Amdahl,
    EfficiencyProfile,
    ElasticSpec,
    Grant,
    QuotaError,
    TableProfile,
    TokenBucket,
    check_resources,
    resource_kind,
)
from libra.policies.actions.tangram import ElasticScheduler, split_units, split_units_dp
from libra.policies.actions.views import (
    ActionQueue,
    RunningSet,
    RunningView,
    held_units,
    release_list,
    scan_order,
)

__all__ = [
    "ACTION_SCHEDULERS",
    "ActionModelError",
    "ActionQueue",
    "ActionScheduler",
    "ActionSpec",
    "Amdahl",
    "EfficiencyProfile",
    "ElasticScheduler",
    "ElasticSpec",
    "FixedDoPScheduler",
    "Grant",
    "PerTrajectoryScheduler",
    "QuotaError",
    "RunningSet",
    "RunningView",
    "TableProfile",
    "TokenBucket",
    "check_resources",
    "held_units",
    "make_action_scheduler",
    "release_list",
    "resource_kind",
    "scan_order",
    "split_units",
    "split_units_dp",
]


@runtime_checkable
class ActionScheduler(Protocol):
    """An action-scheduling policy (see the module docstring for the ``schedule`` contract)."""

    name: str

    def schedule(
        self,
        queue: Sequence[ActionSpec],
        free: Mapping[str, int],
        running: Sequence[RunningView],
        now: float,
    ) -> list[Grant]:
        """Return the actions to start now and the units each gets."""
        ...

    def trajectory_finished(self, trajectory: str, now: float) -> None:
        """Tell the policy a trajectory ended (releases any per-trajectory reservation)."""
        ...


ACTION_SCHEDULERS: dict[str, Callable[..., ActionScheduler]] = {
    "tangram": ElasticScheduler,
    "fixed_dop": FixedDoPScheduler,
    "fifo_fixed_dop": FixedDoPScheduler,
    "per_trajectory": PerTrajectoryScheduler,
}


def make_action_scheduler(name: str, **params: Any) -> ActionScheduler:
    """Build the action scheduler called ``name`` with keyword ``params``.

    Raises ``ValueError`` for an unknown name (listing the known ones), an unknown parameter (listing the
    accepted ones) or a bad parameter value.
    """
    factory = ACTION_SCHEDULERS.get(name)
    if factory is None:
        raise ValueError(f"unknown action scheduler: {name!r} (known: {', '.join(ACTION_SCHEDULERS)})")
    accepted = [p for p in inspect.signature(factory).parameters if p != "self"]
    for key in params:
        if key not in accepted:
            raise ValueError(
                f"action scheduler {name!r}: unknown parameter {key!r} (accepted: {', '.join(sorted(accepted))})"
            )
    return factory(**params)
