"""The codec's generated per-message validator accepts exactly what the field-by-field checks accept."""

from __future__ import annotations

import types
import typing
from typing import Any

import pytest

from libra.protocol import ProtocolError
from libra.protocol.codec import _SPECS

SAMPLES: list[Any] = [None, True, False, 0, 7, 1.5, "s", b"b", [], ["a"], [1], ["a", 1], {}, {"k": 1}, {1: 2}]


def _valid(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return {"any": [1]}
    if origin in (typing.Union, types.UnionType):
        return _valid(typing.get_args(tp)[0])
    if origin is list:
        return []
    if origin is dict:
        return {}
    return {type(None): None, bool: True, int: 3, float: 2.5, str: "x", bytes: b"y"}[tp]


def _slow(spec, values):
    """The field-by-field checks alone (the fast builder switched off)."""
    object.__setattr__(spec, "fast", lambda v: None)
    try:
        from libra.protocol.codec import _build

        return _build(spec, values)
    finally:
        object.__setattr__(spec, "fast", saved[spec.cls])


saved: dict[type, Any] = {}


@pytest.mark.parametrize("kind", sorted(_SPECS))
def test_fast_builder_agrees_with_field_checks(kind: int) -> None:
    spec = _SPECS[kind]
    saved[spec.cls] = spec.fast
    hints = typing.get_type_hints(spec.cls)
    good = [_valid(hints[n]) for n in spec.names]
    cases = [good, good[: spec.required], good + [1], good[: max(0, spec.required - 1)]]
    for i in range(len(good)):
        for s in SAMPLES:
            cases.append(good[:i] + [s] + good[i + 1 :])
    checked = 0
    for values in cases:
        fast = spec.fast(list(values))
        try:
            slow = _slow(spec, list(values))
        except ProtocolError:
            assert fast is None, (spec.cls.__name__, values)
            continue
        assert fast == slow, (spec.cls.__name__, values)
        checked += 1
    assert checked >= 2  # the all-valid and the required-only cases at least
