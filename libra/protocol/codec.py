"""The one codec: frames ↔ typed messages. Decoding *is* validation.

``encode(msg, *buffers) -> list[bytes]`` and ``decode(frames) -> Decoded``. A frame list that is not
``[VERSION, kind byte, msgpack array, *buffers]`` with known kind, the right number of fields and the
right field types raises :class:`~libra.protocol.errors.ProtocolError` with a code and a readable
message. Raw buffers travel as extra frames untouched (bulk tensors, never pickled). No pickle, no
msgpack extension types: ``ext`` data is rejected.
"""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from dataclasses import dataclass
from typing import Any, Sequence

import msgpack

from .errors import ProtocolCode, ProtocolError
from .messages import MESSAGE_TYPES, Batch

VERSION = b"LIBRA1"
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded frame list: the message and any raw buffers that followed it."""

    msg: Any
    buffers: tuple[bytes, ...] = ()


def _checker(tp: Any) -> tuple[str, Any]:
    """Build a (type name, predicate) pair for a field annotation. Shallow for containers except
    list[str] / dict[str, ...] keys, which are checked element-wise (cheap and catches real bugs)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return "any", lambda v: True
    if origin in (typing.Union, types.UnionType):
        parts = [_checker(a) for a in typing.get_args(tp)]
        name = " | ".join(p[0] for p in parts)
        preds = [p[1] for p in parts]
        return name, lambda v: any(p(v) for p in preds)
    if tp is type(None):
        return "None", lambda v: v is None
    if tp is bool:
        return "bool", lambda v: v is True or v is False
    if tp is int:
        return "int", lambda v: type(v) is int
    if tp is float:
        return "float", lambda v: type(v) is float or type(v) is int
    if tp is str:
        return "str", lambda v: type(v) is str
    if tp is bytes:
        return "bytes", lambda v: type(v) is bytes
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        if arg is str:
            return "list[str]", lambda v: type(v) is list and all(type(x) is str for x in v)
        if arg is int:
            return "list[int]", lambda v: type(v) is list and all(type(x) is int for x in v)
        return "list", lambda v: type(v) is list
    if origin is dict:
        return "map", lambda v: type(v) is dict and all(type(k) is str for k in v)
    raise TypeError(f"unsupported field type in a wire message: {tp!r}")


def _expr(tp: Any, v: str) -> str | None:
    """The same test as :func:`_checker`'s predicate, as one Python expression over the variable ``v``
    (None: no test, for ``Any``)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return None
    if origin in (typing.Union, types.UnionType):
        parts = [_expr(a, v) for a in typing.get_args(tp)]
        return None if any(p is None for p in parts) else "(" + " or ".join(parts) + ")"  # type: ignore[arg-type]
    if tp is type(None):
        return f"{v} is None"
    if tp is bool:
        return f"({v} is True or {v} is False)"
    simple = {int: "int", str: "str", bytes: "bytes"}
    if tp in simple:
        return f"type({v}) is {simple[tp]}"
    if tp is float:
        return f"(type({v}) is float or type({v}) is int)"
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        if arg in (str, int):
            name = simple[arg]
            return f"(type({v}) is list and (not {v} or all(type(x) is {name} for x in {v})))"
        return f"type({v}) is list"
    if origin is dict:
        return f"(type({v}) is dict and (not {v} or all(type(k) is str for k in {v})))"
    raise TypeError(f"unsupported field type in a wire message: {tp!r}")


def _fast_builder(cls: type, hints: dict[str, Any], names: tuple[str, ...], required: int) -> Any:
    """A function ``values -> message or None``: all of :func:`_build`'s checks as one straight-line function
    (a call per field and a generator per union made decoding the larger part of a hop's Python time). It
    answers None for anything :func:`_build` would refuse, which then says why."""
    lines = ["def build(values):", "    n = len(values)", f"    if n < {required} or n > {len(names)}:",
             "        return None"]
    for i, name in enumerate(names):
        e = _expr(hints[name], f"v{i}")
        if e is None:
            continue
        if i < required:
            lines += [f"    v{i} = values[{i}]", f"    if not {e}:", "        return None"]
        else:
            lines += [f"    if n > {i}:", f"        v{i} = values[{i}]", f"        if not {e}:", "            return None"]
    lines.append("    return cls(*values)")
    scope: dict[str, Any] = {"cls": cls}
    exec(compile("\n".join(lines), f"<codec {cls.__name__}>", "exec"), scope)  # noqa: S102 - code built from types
    return scope["build"]


@dataclass(frozen=True, slots=True)
class _Spec:
    cls: type
    names: tuple[str, ...]
    required: int
    checks: tuple[tuple[str, Any], ...]
    fast: Any = None
    fields: Any = None  # message -> tuple of its field values in order (operator.attrgetter: one C call)


def _field_getter(names: tuple[str, ...]) -> Any:
    """``message -> tuple of its fields`` (msgpack packs a tuple as the same array as a list)."""
    if len(names) > 1:
        return operator.attrgetter(*names)
    if names:
        one = operator.attrgetter(names[0])
        return lambda msg: (one(msg),)
    return lambda msg: ()


def _build_specs() -> dict[int, _Spec]:
    specs: dict[int, _Spec] = {}
    for cls in MESSAGE_TYPES:
        hints = typing.get_type_hints(cls)
        flds = [f for f in dataclasses.fields(cls)]
        names = tuple(f.name for f in flds)
        required = sum(
            1 for f in flds if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        kind = cls.KIND  # type: ignore[attr-defined]
        if kind in specs or not 0 <= kind <= 255:
            raise TypeError(f"duplicate or invalid KIND {kind:#x} on {cls.__name__}")
        specs[kind] = _Spec(cls, names, required, tuple(_checker(hints[n]) for n in names),
                            _fast_builder(cls, hints, names, required), _field_getter(names))
    return specs


_SPECS = {k: v for k, v in _build_specs().items() if k != Batch.KIND}  # Batch is framing, decoded below
_KIND_BYTES = {k: bytes([k]) for k in _SPECS}
assert all(k < 0x80 for k in _SPECS), "encode_batch relies on every kind packing as one msgpack byte"
_BY_CLASS = {spec.cls: spec for spec in _SPECS.values()}


def kind_name(kind: int) -> str:
    spec = _SPECS.get(kind)
    return spec.cls.__name__ if spec else f"unknown({kind:#x})"


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(ProtocolCode.BAD_PAYLOAD, f"msgpack extension type {code} is not allowed")


def encode(msg: Any, *buffers: bytes) -> list[bytes]:
    """Frames for ``msg`` (without routing identity). Raises TypeError for a non-message or for a
    field value msgpack cannot carry (never falls back to pickle)."""
    spec = _BY_CLASS.get(type(msg))
    if spec is None:
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    payload = msgpack.packb(spec.fields(msg), use_bin_type=True)
    return _frames(_KIND_BYTES[spec.cls.KIND], payload, buffers)  # type: ignore[attr-defined]


_BATCH_KIND = bytes([Batch.KIND])
_HEAD = len(VERSION)
COMPACT_MAX = 64 * 1024
"""Payloads up to this size travel in one frame, ``VERSION + kind + payload``: each extra frame cost about
3 µs to send and receive, and a call crosses four sockets. Larger payloads keep three frames, which saves
copying them into one."""


def _frames(kind: bytes, payload: bytes, buffers: Sequence[bytes] = ()) -> list[bytes]:
    if len(payload) <= COMPACT_MAX:
        return [VERSION + kind + payload, *buffers]
    return [VERSION, kind, payload, *buffers]


def _split(frames: Sequence[bytes]) -> tuple[Any, Any, Sequence[bytes]] | None:
    """``(kind frame, payload, buffers)`` of a compact message, or None when ``frames`` is not one."""
    head = frames[0] if frames else b""
    if len(head) > _HEAD + 1 and head[:_HEAD] == VERSION:
        view = memoryview(head)
        return view[_HEAD:_HEAD + 1], view[_HEAD + 1:], frames[1:]
    return None


def encode_many(msgs: Sequence[Any]) -> list[bytes]:
    """One frame set for several messages to the same peer (a plain message when there is one).
    Messages with raw buffers cannot be batched; send those with :func:`encode`."""
    if len(msgs) == 1:
        return encode(msgs[0])
    items = []
    for msg in msgs:
        spec = _BY_CLASS.get(type(msg))
        if spec is None:
            raise TypeError(f"not a wire message: {type(msg).__name__}")
        items.append((spec.cls.KIND, spec.fields(msg)))  # type: ignore[attr-defined]
    return _frames(_BATCH_KIND, msgpack.packb(items, use_bin_type=True))


def _array_header(n: int) -> bytes:
    """The msgpack header of an array of ``n`` items."""
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def encode_batch(encoded: Sequence[list[bytes]]) -> list[bytes]:
    """What :func:`encode_many` gives for these messages, from the frames :func:`encode` already made for
    each (the same bytes): their payloads are reused, not packed again. Messages with raw buffers cannot be
    batched."""
    if len(encoded) == 1:
        return list(encoded[0])
    parts = [_array_header(len(encoded))]
    for frames in encoded:
        kind, payload, buffers = _parts(frames)
        if buffers:
            raise ValueError("a message with raw buffers cannot be batched")
        parts += (b"\x92", kind, payload)  # [kind, fields]: a kind below 0x80 packs as its own byte
    return _frames(_BATCH_KIND, b"".join(parts))


def _build(spec: _Spec, values: Any) -> Any:
    if type(values) is list:
        msg = spec.fast(values)
        if msg is not None:
            return msg
    if type(values) is not list:
        raise ProtocolError(
            ProtocolCode.BAD_PAYLOAD, f"{spec.cls.__name__} payload must be a msgpack array of fields"
        )
    n = len(values)
    if n < spec.required:
        missing = ", ".join(spec.names[n : spec.required])
        raise ProtocolError(ProtocolCode.MISSING_FIELD, f"{spec.cls.__name__} is missing field(s): {missing}")
    if n > len(spec.names):
        raise ProtocolError(
            ProtocolCode.EXTRA_FIELD,
            f"{spec.cls.__name__} has {n} fields, at most {len(spec.names)} are defined",
        )
    checks = spec.checks
    for i in range(n):
        tname, pred = checks[i]
        if not pred(values[i]):
            raise ProtocolError(
                ProtocolCode.BAD_TYPE,
                f"{spec.cls.__name__}.{spec.names[i]} must be {tname}, got {type(values[i]).__name__}",
            )
    return spec.cls(*values)


def _bad_version(head: bytes) -> ProtocolError:
    return ProtocolError(ProtocolCode.BAD_VERSION,
                         f"protocol header {head[:16]!r} is not {VERSION!r} (wrong peer or version)")


def _parts(frames: Sequence[bytes]) -> tuple[Any, Any, Sequence[bytes]]:
    """``(kind frame, payload, buffers)`` of either framing (see :func:`decode`); ProtocolError otherwise."""
    compact = _split(frames)
    if compact is not None:
        return compact
    if len(frames) < 3:
        head = bytes(frames[0][:_HEAD]) if frames else b""
        if head[:5] == VERSION[:5] and head != VERSION and len(frames[0]) > _HEAD + 1:
            raise _bad_version(head)  # one frame from a peer of another version
        raise ProtocolError(
            ProtocolCode.TOO_FEW_FRAMES,
            f"expected [version, kind, payload, *buffers] or [version+kind+payload, *buffers], "
            f"got {len(frames)} frame(s)",
        )
    if bytes(frames[0]) != VERSION:
        raise _bad_version(bytes(frames[0]))
    return frames[1], frames[2], frames[3:]


def _check_size(frames: Sequence[bytes], max_frame_bytes: int) -> None:
    total = 0
    for f in frames:
        total += len(f)
    if total > max_frame_bytes:
        raise ProtocolError(
            ProtocolCode.OVERSIZE, f"message of {total} bytes exceeds the limit of {max_frame_bytes} bytes"
        )


def decode_many(frames: Sequence[bytes], max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> list[Decoded]:
    """Like :func:`decode`, but also unpacks a Batch into its messages (in order)."""
    kind_frame, body, buffers = _parts(frames)
    _check_size(frames, max_frame_bytes)
    if kind_frame == _BATCH_KIND and not buffers:
        try:
            items = msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_no_ext, use_list=True)
        except ProtocolError:
            raise
        except Exception as exc:
            raise ProtocolError(ProtocolCode.BAD_PAYLOAD, f"Batch payload is not valid msgpack: {exc}") from None
        if type(items) is not list:
            raise ProtocolError(ProtocolCode.BAD_PAYLOAD, "Batch payload must be an array of [kind, fields]")
        out = []
        for item in items:
            if type(item) is not list or len(item) != 2 or type(item[0]) is not int:
                raise ProtocolError(ProtocolCode.BAD_PAYLOAD, "Batch items must be [kind, fields] pairs")
            spec = _SPECS.get(item[0])
            if spec is None:
                raise ProtocolError(ProtocolCode.UNKNOWN_KIND, f"unknown message kind {item[0]!r} in a Batch")
            out.append(Decoded(_build(spec, item[1])))
        return out
    return [_decode_parts(kind_frame, body, buffers)]


def decode(frames: Sequence[bytes], max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Decoded:
    """Validate and decode. Raises ProtocolError (never anything else) for bad input. Takes both framings:
    ``[VERSION + kind + payload, *buffers]`` (what :func:`encode` sends up to :data:`COMPACT_MAX`) and
    ``[VERSION, kind, payload, *buffers]``."""
    kind_frame, payload, buffers = _parts(frames)
    _check_size(frames, max_frame_bytes)
    return _decode_parts(kind_frame, payload, buffers)


def _decode_parts(kind_frame: Any, payload: Any, buffers: Sequence[bytes]) -> Decoded:
    if len(kind_frame) != 1:
        raise ProtocolError(ProtocolCode.UNKNOWN_KIND, f"kind frame must be 1 byte, got {len(kind_frame)}")
    kind = kind_frame[0]
    spec = _SPECS.get(kind)
    if spec is None:
        raise ProtocolError(ProtocolCode.UNKNOWN_KIND, f"unknown message kind {kind:#04x}")
    try:
        values = msgpack.unpackb(
            payload, raw=False, strict_map_key=True, ext_hook=_no_ext, use_list=True
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(
            ProtocolCode.BAD_PAYLOAD, f"{spec.cls.__name__} payload is not valid msgpack: {exc}"
        ) from None
    msg = _build(spec, values)
    if buffers:
        return Decoded(msg, tuple(bytes(b) for b in buffers))
    return Decoded(msg)
