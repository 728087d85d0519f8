"""``ServingLoadOwner``: lend while the owner's serving process has SLO headroom.

Each ``poll`` reads the serving process's ``GET {url}/load`` (the contract of :mod:`libra.serving`: JSON with
``p99_tpot_s``, ``null`` when no request finished in its window) with a short timeout (``timeout_s``, 0.2 s by
default; stdlib ``urllib``, so an actor needs no HTTP client package) and feeds the p99 time per output token
to :meth:`HeadroomRule.step <libra.policies.lending.HeadroomRule.step>`. It keeps ``lent`` and ``since`` (when
``lent`` last changed) itself.

An owner it cannot read (refused, timed out, not the JSON above) counts as a reclaim with the rule's
deadline and reason ``owner_unreachable``: the owner may be too loaded to answer, and lending into an
overloaded owner is the one mistake this owner must not make. Lending resumes through the rule's hysteresis
(``hold_s`` after the change) once readings come back calm.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

from libra.logging import get_logger
from libra.policies.lending import HeadroomRule, OwnerSignal

__all__ = ["ServingLoadOwner", "read_p99_tpot"]

log = get_logger(__name__)


class LoadReadError(Exception):
    """The load endpoint did not answer with the documented JSON."""


def read_p99_tpot(url: str, timeout_s: float) -> float | None:
    """``p99_tpot_s`` of ``GET {url}/load`` (None: no request in the window); raises :class:`LoadReadError`."""
    try:
        with urllib.request.urlopen(f"{url}/load", timeout=timeout_s) as resp:
            doc = json.loads(resp.read(65536))
    except (OSError, ValueError, urllib.error.URLError) as exc:  # (TimeoutError is an OSError)
        raise LoadReadError(str(exc)) from None
    if not isinstance(doc, dict) or "p99_tpot_s" not in doc:
        raise LoadReadError("no p99_tpot_s in the reading")
    p99 = doc["p99_tpot_s"]
    if p99 is None:
        return None
    if isinstance(p99, bool) or not isinstance(p99, (int, float)) or not math.isfinite(p99) or p99 < 0:
        raise LoadReadError(f"p99_tpot_s is not a duration: {p99!r}")
    return float(p99)


class ServingLoadOwner:
    """See the module docstring. ``url``: the serving process's base (``http://127.0.0.1:8001``)."""

    def __init__(self, name: str, url: str, rule: HeadroomRule, *, timeout_s: float = 0.2) -> None:
        self.name, self.url, self.rule, self.timeout_s = name, url.rstrip("/"), rule, timeout_s
        self.lent = False
        self.since = float("-inf")  # a calm first reading lends at once
        self.last_p99_s: float | None = None
        self.reachable = True

    def poll(self, now: float) -> OwnerSignal:
        try:
            p99 = read_p99_tpot(self.url, self.timeout_s)
        except LoadReadError as exc:
            if self.reachable:
                log.warning("lend_owner_unreachable", owner=self.name, url=self.url, error=str(exc))
            self.reachable = False
            return self._set(False, now, OwnerSignal(False, self.rule.deadline_s, "owner_unreachable"))
        self.reachable, self.last_p99_s = True, p99
        sig = self.rule.step(self.lent, p99, now, self.since)
        return self._set(sig.allow, now, sig)

    def _set(self, allow: bool, now: float, sig: OwnerSignal) -> OwnerSignal:
        if allow != self.lent:
            self.lent, self.since = allow, now
        return sig

    def close(self) -> None:
        return None
