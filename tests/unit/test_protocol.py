"""The codec: every message round-trips; bad frames raise ProtocolError with the right code."""

from __future__ import annotations

import dataclasses
import typing

import msgpack
import pytest

from libra.protocol import ProtocolCode, ProtocolError, decode, decode_many, encode, encode_batch, encode_many
from libra.protocol import messages as m


def _sample(tp: object) -> object:
    origin = typing.get_origin(tp)
    if tp is str:
        return "x"
    if tp is int:
        return 3
    if tp is float:
        return 1.5
    if tp is bool:
        return True
    if origin is list:
        return ["a", "b"]
    if origin is dict:
        return {"k": [1, 2]}
    if origin in (typing.Union, __import__("types").UnionType):
        return _sample(typing.get_args(tp)[0])
    return {"any": [1, "two", None]}


@pytest.mark.parametrize("cls", [c for c in m.MESSAGE_TYPES if c is not m.Batch], ids=lambda c: c.__name__)
def test_every_message_round_trips(cls: type) -> None:
    hints = typing.get_type_hints(cls)
    msg = cls(**{f.name: _sample(hints[f.name]) for f in dataclasses.fields(cls)})
    d = decode(encode(msg, b"raw1", b"raw2"))
    assert d.msg == msg
    assert d.buffers == (b"raw1", b"raw2")


def test_kind_codes_are_unique_bytes() -> None:
    kinds = [c.KIND for c in m.MESSAGE_TYPES]
    assert len(set(kinds)) == len(kinds)


def _err(frames: list[bytes], **kw: int) -> ProtocolError:
    with pytest.raises(ProtocolError) as ei:
        decode(frames, **kw)
    return ei.value


def test_wrong_version() -> None:
    f = encode(m.Heartbeat())
    assert len(f) == 1 and f[0][:6] == b"LIBRA1"  # one frame: VERSION + kind + payload
    assert _err([b"LIBRA0" + f[0][6:]]).code is ProtocolCode.BAD_VERSION
    assert _err([b"LIBRA0", f[0][6:7], f[0][7:]]).code is ProtocolCode.BAD_VERSION  # the three-frame form


def test_both_framings_decode_and_large_payloads_keep_three_frames() -> None:
    from libra.protocol.codec import COMPACT_MAX

    small = m.Submit("r", "action", "echo", {"a": 1})
    one = encode(small, b"raw")
    assert len(one) == 2 and one[1] == b"raw"
    three = [b"LIBRA1", one[0][6:7], one[0][7:], b"raw"]
    for frames in (one, three):
        d = decode(frames)
        assert d.msg == small and d.buffers == (b"raw",)
    big = m.Submit("r", "action", "echo", "x" * (COMPACT_MAX + 1))
    f = encode(big)
    assert len(f) == 3 and f[0] == b"LIBRA1" and decode(f).msg == big
    batch = encode_batch([encode(small), encode(big), three[:3]])  # compact and three-frame inputs mixed
    assert [d.msg for d in decode_many(batch)] == [small, big, small]


def test_unknown_kind_and_bad_kind_frame() -> None:
    assert _err([b"LIBRA1", b"\xee", msgpack.packb([])]).code is ProtocolCode.UNKNOWN_KIND
    assert _err([b"LIBRA1", b"\x01\x02", msgpack.packb([])]).code is ProtocolCode.UNKNOWN_KIND


def test_too_few_frames_and_garbage_payload() -> None:
    assert _err([b"garbage"]).code is ProtocolCode.TOO_FEW_FRAMES
    assert _err([b"LIBRA1", bytes([m.Heartbeat.KIND]), b"\xc1"]).code is ProtocolCode.BAD_PAYLOAD
    assert _err([b"LIBRA1", bytes([m.Heartbeat.KIND]), msgpack.packb({"a": 1})]).code is ProtocolCode.BAD_PAYLOAD


def test_missing_extra_and_mistyped_fields_name_the_field() -> None:
    kind = bytes([m.Submit.KIND])
    e = _err([b"LIBRA1", kind, msgpack.packb(["r1", "action"])])
    assert e.code is ProtocolCode.MISSING_FIELD and "name" in e.message and "args" in e.message
    e = _err([b"LIBRA1", kind, msgpack.packb(["r1", "action", "echo", 1, None, 1.0, 0, "extra"])])
    assert e.code is ProtocolCode.EXTRA_FIELD
    e = _err([b"LIBRA1", kind, msgpack.packb(["r1", 7, "echo", 1])])
    assert e.code is ProtocolCode.BAD_TYPE and "Submit.kind" in e.message and "int" in e.message
    e = _err([b"LIBRA1", bytes([m.Bid.KIND]), msgpack.packb([["action", 3], 2])])
    assert e.code is ProtocolCode.BAD_TYPE and "list[str]" in e.message


def test_bool_is_not_an_int_and_int_is_a_float() -> None:
    e = _err([b"LIBRA1", bytes([m.Bid.KIND]), msgpack.packb([["action"], True])])
    assert e.code is ProtocolCode.BAD_TYPE
    d = decode([b"LIBRA1", bytes([m.Submit.KIND]), msgpack.packb(["r", "action", "echo", None, None, 5])])
    assert d.msg.timeout_s == 5


def test_optional_trailing_fields_default() -> None:
    d = decode([b"LIBRA1", bytes([m.Submit.KIND]), msgpack.packb(["r", "action", "echo", {"a": 1}])])
    assert d.msg == m.Submit("r", "action", "echo", {"a": 1})


def test_oversize() -> None:
    f = encode(m.Submit("r", "action", "echo", "x" * 5000))
    assert _err(f, max_frame_bytes=1000).code is ProtocolCode.OVERSIZE


def test_ext_types_and_non_messages_rejected() -> None:
    payload = msgpack.packb(["r", "action", "echo", msgpack.ExtType(5, b"pickle?")])
    assert _err([b"LIBRA1", bytes([m.Submit.KIND]), payload]).code is ProtocolCode.BAD_PAYLOAD
    with pytest.raises(TypeError):
        encode(object())
    with pytest.raises(TypeError):
        encode(m.Submit("r", "action", "echo", object()))  # never pickled


def test_batch_round_trip_preserves_order_and_single_is_plain() -> None:
    msgs = [m.Heartbeat(), m.Submit("r1", "action", "echo", [1, 2]), m.Bid(["action"], 3)]
    frames = encode_many(msgs)
    assert len(frames) == 1 and frames[0][6:7] == bytes([m.Batch.KIND])
    assert [d.msg for d in decode_many(frames)] == msgs
    assert encode_many(msgs[:1]) == encode(msgs[0])
    assert [d.msg for d in decode_many(encode(msgs[1]))] == [msgs[1]]


def test_bad_batches_are_rejected_whole() -> None:
    kind = bytes([m.Batch.KIND])
    cases = {
        ProtocolCode.BAD_PAYLOAD: [msgpack.packb({"a": 1}), msgpack.packb([[1]]), b"\xc1"],
        ProtocolCode.UNKNOWN_KIND: [msgpack.packb([[0xEE, []]]), msgpack.packb([[m.Batch.KIND, [[]]]])],
        ProtocolCode.BAD_TYPE: [msgpack.packb([[m.Bid.KIND, [["a"], 1]], [m.Bid.KIND, [[1], 1]]])],
    }
    for code, payloads in cases.items():
        for payload in payloads:
            with pytest.raises(ProtocolError) as ei:
                decode_many([b"LIBRA1", kind, payload])
            assert ei.value.code is code, payload
    with pytest.raises(ProtocolError) as ei:
        decode_many([b"LIBRA1", kind, msgpack.packb([[m.Heartbeat.KIND, []]] * 100)], max_frame_bytes=50)
    assert ei.value.code is ProtocolCode.OVERSIZE


@pytest.mark.parametrize("n", [1, 2, 15, 16, 300])
def test_encode_batch_reuses_encoded_payloads_byte_for_byte(n: int) -> None:
    from libra.protocol import encode_batch, encode_many

    msgs = [m.Submit(f"r{i}", "action", "echo", {"i": i, "b": b"x"}, None, 1.0) if i % 3 else m.Heartbeat()
            for i in range(n)]
    frames = encode_batch([encode(x) for x in msgs])
    assert frames == encode_many(msgs)  # the same bytes, without packing the fields again
    assert [d.msg for d in decode_many(frames)] == msgs
    with pytest.raises(ValueError, match="raw buffers"):
        encode_batch([encode(m.Heartbeat()), encode(m.Heartbeat(), b"raw")])
