"""Owner plug-ins for lent capacity (``python -m libra.actors ... --lend SPEC``).

A lendable slot's GPU belongs to an owner; the actor shell polls the slot's :class:`Owner` a few times a
second and acts when its :class:`~libra.policies.lending.OwnerSignal` flips. Modules: ``base`` (the
interface, the ``--lend`` grammar, :func:`owner_from_spec`), ``serving`` (a serving process's load under
the headroom rule), ``notice`` (a spot-style revocation notice: file, HTTP callback, signal), ``schedule``
(windows of the day). Documented in ``docs/lending.md`` ("Owners").
"""

from .base import KINDS, LendSpec, LendSpecError, Owner, OwnerError, owner_from_spec, parse_lend_spec
from .notice import NoticeOwner
from .schedule import ScheduleOwner
from .serving import ServingLoadOwner

__all__ = ["KINDS", "LendSpec", "LendSpecError", "NoticeOwner", "Owner", "OwnerError", "ScheduleOwner",
           "ServingLoadOwner", "owner_from_spec", "parse_lend_spec"]
