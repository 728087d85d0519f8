"""What a lent slot's hello says about the GPU's owner: ``labels["lend"]`` (:class:`LendLabel`).

No I/O. A slot started with ``python -m libra.actors --lend ...`` runs on a GPU that belongs to someone else (a
serving fleet, a spot instance). Its hello labels carry ``{"owner": NAME, "rule": RULE}``; the actor core
(``libra.actors.lending``) and the broker (``libra.broker.lending``) both read it through :func:`lend_label`,
so a slot is lent, or not, by one reading of one field.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from .payloads_base import Payload, PayloadError

__all__ = ["LEND_LABEL", "LendLabel", "lend_label"]

LEND_LABEL = "lend"  # the hello label a lent slot carries


class LendLabel(Payload, frozen=True, kw_only=True):
    """A lent slot's ``owner`` (the name the owner plug-in was given) and its ``rule`` (``headroom``, ``notice``,
    ``schedule``: how the owner decides; for status output only)."""

    WHAT = "lend label"

    owner: Annotated[str, msgspec.Meta(min_length=1)]
    rule: str = ""


def lend_label(labels: object) -> LendLabel | None:
    """The ``lend`` label of a hello's ``labels`` (None: a slot the job owns); raises
    :class:`~libra.protocol.payloads_base.PayloadError` when the label is there but malformed."""
    raw = labels.get(LEND_LABEL) if isinstance(labels, dict) else None
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise PayloadError(LendLabel.WHAT, LEND_LABEL, f"expected a table, got {type(raw).__name__}")
    return LendLabel.from_wire(raw)
