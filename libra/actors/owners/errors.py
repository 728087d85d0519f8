"""The owners' typed errors (a leaf module: every owner module imports it, it imports none)."""

from __future__ import annotations

__all__ = ["LendSpecError", "OwnerError"]


class LendSpecError(ValueError):
    """The ``--lend`` text is malformed: an unknown or repeated key, a missing one, a bad value (named)."""


class OwnerError(RuntimeError):
    """An owner cannot start as asked (e.g. a signal owner outside the main thread, a port in use)."""
