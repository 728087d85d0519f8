"""The owner plug-in interface and the ``--lend`` spec.

:class:`Owner` is what the actor shell polls (a few times a second, ``poll(time.time())``): each owner reads
its owner's signal (a serving process's load, a notice, the time of day) and answers the pure
:class:`~libra.policies.lending.OwnerSignal`. :func:`parse_lend_spec` turns the text after ``--lend`` into a
typed :class:`LendSpec`; :func:`owner_from_spec` builds the owner it names.

Spec grammar (comma-separated ``key=value``; keys are unique; values hold no comma)::

    spec     = "owner=" NAME "," "kind=" KIND { "," key "=" value }
    serving  : url=http://HOST:PORT (required), target_ms=FLOAT > 0 (required), lend_below=0.7,
               reclaim_above=0.85, hold_s=30, deadline_s=5, timeout_ms=200
    notice   : at least one of file=PATH, http=PORT (0: a free one, loopback only), signal=USR1|USR2
               (the reclaim signal; the other one of the pair lends again); deadline_s=30
    schedule : windows=HH:MM-HH:MM[;HH:MM-HH:MM...] (UTC; a window may wrap midnight) (required),
               deadline_s=30

Anything else (an unknown key, a repeated key, a bad value) raises :class:`LendSpecError` naming the key.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from libra.policies.lending import OwnerSignal
from libra.protocol.payloads_lend import LendLabel

from .errors import LendSpecError, OwnerError

__all__ = ["KINDS", "LendSpec", "LendSpecError", "Owner", "OwnerError", "owner_from_spec", "parse_lend_spec"]

KINDS = ("serving", "notice", "schedule")
#: The owner rule each kind reports in the actor's hello labels (``labels["lend"]["rule"]``).
RULE_OF_KIND = {"serving": "headroom", "notice": "notice", "schedule": "schedule"}

_KEYS = {
    "serving": {"url", "target_ms", "lend_below", "reclaim_above", "hold_s", "deadline_s", "timeout_ms"},
    "notice": {"file", "http", "signal", "deadline_s"},
    "schedule": {"windows", "deadline_s"},
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HHMM = re.compile(r"^(\d{1,2}):(\d{2})$")
SIGNALS = ("USR1", "USR2")


@runtime_checkable
class Owner(Protocol):
    """An owner plug-in. ``poll`` is cheap and never blocks for more than about 0.2 s."""

    name: str

    def poll(self, now: float) -> OwnerSignal: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class LendSpec:
    """The parsed ``--lend`` text: the owner's ``name``, its ``kind`` and the kind's settings (typed: floats,
    ints, strings; ``windows`` as ``(start_s, end_s)`` seconds of the day)."""

    owner: str
    kind: str
    options: dict[str, object] = field(default_factory=dict)

    @property
    def rule(self) -> str:
        """The rule name for the hello labels (``headroom``, ``notice``, ``schedule``)."""
        return RULE_OF_KIND[self.kind]

    def label(self) -> dict[str, str]:
        """``labels["lend"]`` of the actor's hello (:class:`~libra.protocol.payloads_lend.LendLabel`)."""
        return LendLabel(owner=self.owner, rule=self.rule).to_wire()


def _float(key: str, text: str, *, positive: bool = False, unit: bool = False) -> float:
    try:
        v = float(text)
    except ValueError:
        raise LendSpecError(f"--lend {key}: not a number: {text!r}") from None
    if not math.isfinite(v) or v < 0 or (positive and v == 0) or (unit and v > 1):
        want = "in (0, 1]" if unit else "> 0" if positive else ">= 0"
        raise LendSpecError(f"--lend {key}: must be finite and {want}, got {text!r}")
    return v


def _port(key: str, text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise LendSpecError(f"--lend {key}: a TCP port 0..65535, got {text!r}")
    return int(text)


def parse_windows(text: str) -> tuple[tuple[float, float], ...]:
    """``22:00-06:00;12:00-13:00`` as ``((79200, 21600), (43200, 46800))``; raises :class:`LendSpecError`."""
    out = []
    for part in text.split(";"):
        ends = part.strip().split("-")
        if len(ends) != 2:
            raise LendSpecError(f"--lend windows: each window is HH:MM-HH:MM, got {part!r}")
        secs = []
        for end in ends:
            m = _HHMM.match(end.strip())
            if m is None or int(m[1]) > 24 or int(m[2]) > 59 or (int(m[1]) == 24 and int(m[2]) != 0):
                raise LendSpecError(f"--lend windows: {end!r} is not a time of day HH:MM (00:00..24:00)")
            secs.append(float(int(m[1]) * 3600 + int(m[2]) * 60))
        if secs[0] == secs[1]:
            raise LendSpecError(f"--lend windows: the window {part!r} is empty")
        out.append((secs[0], secs[1]))
    return tuple(out)


def _value(kind: str, key: str, text: str) -> object:
    if key in ("target_ms",):
        return _float(key, text, positive=True)
    if key in ("lend_below", "reclaim_above"):
        return _float(key, text, positive=True, unit=True)
    if key in ("hold_s", "deadline_s"):
        return _float(key, text)
    if key == "timeout_ms":
        return _float(key, text, positive=True)
    if key == "http":
        return _port(key, text)
    if key == "signal":
        name = text.upper().removeprefix("SIG")
        if name not in SIGNALS:
            raise LendSpecError(f"--lend signal: one of {', '.join(SIGNALS)}, got {text!r}")
        return name
    if key == "windows":
        return parse_windows(text)
    if key == "url":
        if not re.match(r"^https?://[^/\s]+", text):
            raise LendSpecError(f"--lend url: an http:// or https:// address, got {text!r}")
        return text.rstrip("/")
    if not text:
        raise LendSpecError(f"--lend {key}: empty value")
    return text  # file


def _pairs(spec: str) -> dict[str, str]:
    if not isinstance(spec, str) or not spec.strip():
        raise LendSpecError("--lend: empty spec (want owner=NAME,kind=serving|notice|schedule,...)")
    pairs: dict[str, str] = {}
    for item in spec.split(","):
        key, eq, val = item.partition("=")
        key, val = key.strip(), val.strip()
        if not eq or not key:
            raise LendSpecError(f"--lend: {item.strip()!r} is not key=value")
        if key in pairs:
            raise LendSpecError(f"--lend {key}: given twice")
        pairs[key] = val
    return pairs


def parse_lend_spec(spec: str) -> LendSpec:
    """The typed :class:`LendSpec` of ``spec`` (see the module docstring); raises :class:`LendSpecError`."""
    pairs = _pairs(spec)
    owner, kind = pairs.pop("owner", None), pairs.pop("kind", None)
    if owner is None:
        raise LendSpecError("--lend owner: missing (owner=NAME)")
    if not _NAME.match(owner):
        raise LendSpecError(f"--lend owner: a name of letters, digits, '_', '.', '-' (<= 64), got {owner!r}")
    if kind not in KINDS:
        raise LendSpecError(f"--lend kind: one of {', '.join(KINDS)}, got {kind!r}")
    unknown = sorted(set(pairs) - _KEYS[kind])
    if unknown:
        raise LendSpecError(f"--lend {unknown[0]}: unknown key for kind={kind} (known: "
                            f"{', '.join(sorted(_KEYS[kind]))})")
    options = {k: _value(kind, k, v) for k, v in pairs.items()}
    need = {"serving": ("url", "target_ms"), "schedule": ("windows",)}.get(kind, ())
    for key in need:
        if key not in options:
            raise LendSpecError(f"--lend {key}: required for kind={kind}")
    if kind == "notice" and not {"file", "http", "signal"} & set(options):
        raise LendSpecError("--lend file: kind=notice needs at least one of file=PATH, http=PORT, signal=USR1")
    if kind == "serving" and options.get("lend_below", 0.7) > options.get("reclaim_above", 0.85):  # type: ignore[operator]
        raise LendSpecError("--lend lend_below: must be <= reclaim_above")
    return LendSpec(owner, kind, options)


def owner_from_spec(spec: str | LendSpec) -> Owner:
    """The owner plug-in ``spec`` names (text after ``--lend``, or a parsed :class:`LendSpec`). Raises
    :class:`LendSpecError` for a bad spec and :class:`OwnerError` when the owner cannot start."""
    s = spec if isinstance(spec, LendSpec) else parse_lend_spec(spec)
    o = dict(s.options)
    if s.kind == "serving":
        from libra.policies.lending import HeadroomRule

        from .serving import ServingLoadOwner

        url, timeout_s = o.pop("url"), float(o.pop("timeout_ms", 200.0)) / 1000.0  # type: ignore[arg-type]
        rule = HeadroomRule(target_s=float(o.pop("target_ms")) / 1000.0, **o)  # type: ignore[arg-type]
        return ServingLoadOwner(s.owner, str(url), rule, timeout_s=timeout_s)
    if s.kind == "schedule":
        from libra.policies.lending import ScheduleRule

        from .schedule import ScheduleOwner

        return ScheduleOwner(s.owner, ScheduleRule(**o))  # type: ignore[arg-type]
    from .notice import NoticeOwner

    return NoticeOwner(s.owner, file=o.get("file"), http_port=o.get("http"), signal_name=o.get("signal"),  # type: ignore[arg-type]
                       deadline_s=float(o.get("deadline_s", 30.0)))  # type: ignore[arg-type]
