"""The base of Libra's typed work payloads: :class:`Payload` and :class:`PayloadError`.

No I/O. A payload is what travels *inside* a message (``Submit.args``, ``Assign.args``,
``WorkResult.output``, ``Reply.output``): on the wire it stays a plain mapping (msgpack map), so peers
that build or read the mappings by hand keep working. In a process a payload is a frozen
``msgspec.Struct``:

- ``Cls.from_wire(obj)`` validates a mapping (required fields, field types, ranges) at C speed and
  returns the struct, or raises :class:`PayloadError` whose message names the payload and the field
  (``"bad generate args: `max_new_tokens`: Expected `int` >= 1"``). Fields the schema does not name are
  ignored unless the class forbids them (``forbid_unknown_fields=True``), so a newer peer may add fields.
- ``obj.to_wire()`` returns the mapping again. Fields listed in ``OMIT_DEFAULT`` are left out while
  they hold their default (the mapping then looks like the one peers built by hand before the structs).

Integers are never accepted for strings, nor booleans for integers; an integer is accepted for a float.
"""

from __future__ import annotations

import re
import threading
from typing import Any, ClassVar, Self

import msgspec

__all__ = ["Payload", "PayloadError"]

_AT = re.compile(r"^(?P<detail>.*?) - at `\$\.?(?P<path>[^`]*)`$", re.S)
_FIELD = re.compile(r"field `(?P<name>[^`]+)`")


class PayloadError(ValueError):
    """A payload mapping that does not fit its schema. ``payload`` names the payload (``generate args``),
    ``field`` the offending field as a path (``weights.version``, ``prompt_ids[3]``; ``""`` for the whole
    payload) and ``detail`` what is wrong with it."""

    def __init__(self, payload: str, field: str, detail: str) -> None:
        self.payload, self.field, self.detail = payload, field, detail
        super().__init__(f"bad {payload}: `{field}`: {detail}" if field else f"bad {payload}: {detail}")


def _error(payload: str, exc: msgspec.ValidationError) -> PayloadError:
    text = str(exc)
    m = _AT.match(text)
    detail, path = (m.group("detail"), m.group("path")) if m else (text, "")
    named = _FIELD.search(detail)  # a missing field, or a __post_init__ check naming its field
    if named:
        path = f"{path}.{named.group('name')}" if path else named.group("name")
        if detail.startswith(named.group(0) + ": "):  # a __post_init__ check: "field `x`: what is wrong"
            detail = detail[len(named.group(0)) + 2:]
    return PayloadError(payload, path, detail)


def _wire(value: Any) -> Any:
    if isinstance(value, Payload):
        return value.to_wire()
    if type(value) is list and value and isinstance(value[0], (Payload, list)):
        return [_wire(v) for v in value]
    return value


_FIRST_CONVERSION = threading.Lock()
_CONVERTED: set[type] = set()  # payload types msgspec has converted once (their type information is built)


class Payload(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every typed payload (see the module docstring)."""

    WHAT: ClassVar[str] = "payload"  # how error messages name this payload
    OMIT_DEFAULT: ClassVar[tuple[str, ...]] = ()  # fields left out of to_wire() while at their default

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        """Validate ``obj`` (a mapping) into this struct; raises :class:`PayloadError` naming the field."""
        try:
            if cls in _CONVERTED:
                return msgspec.convert(obj, cls)
            # msgspec builds a struct's type information on its first conversion, and two threads doing
            # that at once for the same struct crash the process (SIGSEGV, seen in rollout actors whose
            # worker threads decoded their first GenerateArgs together): the first one runs alone
            with _FIRST_CONVERSION:
                try:
                    return msgspec.convert(obj, cls)
                finally:
                    _CONVERTED.add(cls)
        except msgspec.ValidationError as exc:
            raise _error(cls.WHAT, exc) from None

    def to_wire(self) -> dict[str, Any]:
        """The plain mapping peers exchange (nested payloads as mappings too)."""
        skip = self.OMIT_DEFAULT
        out: dict[str, Any] = {}
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if skip and name in skip and value == _default(type(self), name):
                continue
            out[name] = _wire(value)
        return out


_DEFAULTS: dict[tuple[type, str], Any] = {}


def _default(cls: type, name: str) -> Any:
    key = (cls, name)
    if key not in _DEFAULTS:
        f = next(f for f in msgspec.structs.fields(cls) if f.name == name)
        _DEFAULTS[key] = f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
    return _DEFAULTS[key]
