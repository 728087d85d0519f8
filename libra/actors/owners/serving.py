"""``ServingLoadOwner``: lend while the owner's serving process has SLO headroom.

Each ``poll`` reads the serving process's ``GET {url}/load`` (the contract of :mod:`libra.serving`: JSON with
``p99_tpot_s``, ``null`` when no request finished in its window, and optionally ``step_tpot_s``, the running
batch's time per token) with a short timeout (``timeout_s``, 0.2 s by default; stdlib ``urllib``, so an actor
needs no HTTP client package) and feeds both to :meth:`HeadroomRule.step
<libra.policies.lending.HeadroomRule.step>`. A serving process that reports no ``step_tpot_s`` is read by its
p99 alone. It keeps ``lent`` and ``since`` (when ``lent`` last changed) itself.

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

__all__ = ["ServingLoadOwner", "read_load"]

log = get_logger(__name__)


class LoadReadError(Exception):
    """The load endpoint did not answer with the documented JSON."""


def _duration(doc: dict, key: str) -> float | None:
    v = doc.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise LoadReadError(f"{key} is not a duration: {v!r}")
    return float(v)


def read_load(url: str, timeout_s: float) -> tuple[float | None, float | None]:
    """``(p99_tpot_s, step_tpot_s)`` of ``GET {url}/load`` (None: no request in the window, or no batch
    running / not reported); raises :class:`LoadReadError`."""
    try:
        with urllib.request.urlopen(f"{url}/load", timeout=timeout_s) as resp:
            doc = json.loads(resp.read(65536))
    except (OSError, ValueError, urllib.error.URLError) as exc:  # (TimeoutError is an OSError)
        raise LoadReadError(str(exc)) from None
    if not isinstance(doc, dict) or "p99_tpot_s" not in doc:
        raise LoadReadError("no p99_tpot_s in the reading")
    return _duration(doc, "p99_tpot_s"), _duration(doc, "step_tpot_s")


class ServingLoadOwner:
    """See the module docstring. ``url``: the serving process's base (``http://127.0.0.1:8001``)."""

    def __init__(self, name: str, url: str, rule: HeadroomRule, *, timeout_s: float = 0.2) -> None:
        self.name, self.url, self.rule, self.timeout_s = name, url.rstrip("/"), rule, timeout_s
        self.lent = False
        self.since = float("-inf")  # a calm first reading lends at once
        self.last_p99_s: float | None = None
        self.last_step_s: float | None = None
        self.reachable = True

    def poll(self, now: float) -> OwnerSignal:
        try:
            p99, step = read_load(self.url, self.timeout_s)
        except LoadReadError as exc:
            if self.reachable:
                log.warning("lend_owner_unreachable", owner=self.name, url=self.url, error=str(exc))
            self.reachable = False
            return self._set(False, now, OwnerSignal(False, self.rule.deadline_s, "owner_unreachable"))
        self.reachable, self.last_p99_s, self.last_step_s = True, p99, step
        sig = self.rule.step(self.lent, p99, now, self.since, step)
        return self._set(sig.allow, now, sig)

    def _set(self, allow: bool, now: float, sig: OwnerSignal) -> OwnerSignal:
        if allow != self.lent:
            self.lent, self.since = allow, now
        return sig

    def close(self) -> None:
        return None
