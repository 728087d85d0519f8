"""Weights transport (libra.weights.format): exact round trips and loud failures on bad input."""

from __future__ import annotations

import zlib

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.weights.format import (
    FORMAT,
    WeightsFormatError,
    from_frames,
    pack_state_dict,
    read_header,
    to_frames,
    unpack_state_dict,
)


def mixed_state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "flags": torch.tensor([True, False, True]),  # 3 bytes: misaligns everything after it
        "w": torch.randn(5, 7, generator=gen),
        "w_t": torch.randn(4, 6, generator=gen).to(torch.bfloat16).t(),  # non-contiguous bf16
        "half": torch.randn(3, generator=gen).half(),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "ids": torch.arange(-3, 8, dtype=torch.int64),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "i16": torch.tensor([1, -2], dtype=torch.int16),
        "i32": torch.tensor([[7]], dtype=torch.int32),
        "f64": torch.randn(2, 2, generator=gen, dtype=torch.float64),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
    }


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)  # names and order
    for k, x in a.items():
        y = b[k]
        assert x.dtype == y.dtype, k
        assert x.shape == y.shape, k
        # bitwise equality (NaN-safe, distinguishes -0.0)
        assert torch.equal(x.contiguous().view(-1).view(torch.uint8) if x.numel() else x.reshape(0),
                           y.contiguous().view(-1).view(torch.uint8) if y.numel() else y.reshape(0)), k


@pytest.mark.parametrize("chunk_size", [1, 5, 64, 4 * 1024 * 1024])
def test_round_trip_is_bit_exact(chunk_size):
    sd = mixed_state_dict()
    header, chunks = pack_state_dict(sd, version=12, chunk_size=chunk_size, metadata={"model": "tiny"})
    out, hdr = unpack_state_dict(header, chunks)
    assert_same(sd, out)
    assert hdr.version == 12 and hdr.metadata == {"model": "tiny"}
    assert all(len(c) <= chunk_size for c in chunks)
    assert sum(len(c) for c in chunks) == hdr.total_bytes
    assert all(t.is_contiguous() for t in out.values())


def test_frames_round_trip_and_header_is_plain_msgpack():
    sd = mixed_state_dict()
    frames = to_frames(*pack_state_dict(sd, version=3, chunk_size=16))
    raw = msgpack.unpackb(frames[0])
    assert raw["format"] == FORMAT and [t["name"] for t in raw["tensors"]] == list(sd)
    out, hdr = from_frames([memoryview(f) for f in frames])
    assert_same(sd, out)
    assert hdr.version == 3


def test_empty_state_dict():
    header, chunks = pack_state_dict({})
    assert chunks == []
    out, hdr = unpack_state_dict(header, chunks)
    assert out == {} and hdr.total_bytes == 0


def test_unpacked_tensors_are_independent_of_the_frames():
    sd = {"w": torch.ones(8)}
    header, chunks = pack_state_dict(sd, chunk_size=8)
    frames = [bytearray(c) for c in chunks]
    out, _ = unpack_state_dict(header, frames)
    frames[0][:] = b"\x00" * len(frames[0])
    assert torch.equal(out["w"], torch.ones(8))


@given(
    st.lists(
        st.tuples(
            st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]),
            st.lists(st.integers(0, 5), min_size=0, max_size=3),
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 40),
)
@settings(max_examples=60, deadline=None)
def test_round_trip_property(specs, chunk_size):
    gen = torch.Generator().manual_seed(len(specs) * 31 + chunk_size)
    sd = {}
    for i, (dtype, shape) in enumerate(specs):
        base = torch.randn(tuple(shape), generator=gen) * 100
        sd[f"t{i}"] = base > 0 if dtype == torch.bool else base.to(dtype)
    out, _ = unpack_state_dict(*pack_state_dict(sd, chunk_size=chunk_size))
    assert_same(sd, out)


def test_corrupted_chunk_is_named():
    header, chunks = pack_state_dict(mixed_state_dict(), chunk_size=32)
    bad = list(chunks)
    flipped = bytearray(bad[2])
    flipped[5] ^= 0x01
    bad[2] = bytes(flipped)
    with pytest.raises(WeightsFormatError, match="chunk 2 failed its CRC-32"):
        unpack_state_dict(header, bad)


def test_missing_extra_and_truncated_chunks_are_rejected():
    header, chunks = pack_state_dict(mixed_state_dict(), chunk_size=32)
    with pytest.raises(WeightsFormatError, match="received"):
        unpack_state_dict(header, chunks[:-1])
    with pytest.raises(WeightsFormatError, match="received"):
        unpack_state_dict(header, [*chunks, b"x"])
    with pytest.raises(WeightsFormatError, match="chunk 0 has 31 bytes, expected 32"):
        unpack_state_dict(header, [chunks[0][:-1], *chunks[1:]])


def test_reordered_chunks_fail_the_checksum():
    header, chunks = pack_state_dict({"a": torch.arange(64, dtype=torch.int64)}, chunk_size=64)
    with pytest.raises(WeightsFormatError, match="CRC-32"):
        unpack_state_dict(header, [chunks[1], chunks[0], *chunks[2:]])


def _header_with(**changes) -> bytes:
    header, _ = pack_state_dict({"w": torch.zeros(2, 2)}, chunk_size=8)
    raw = msgpack.unpackb(header)
    raw.update(changes)
    return msgpack.packb(raw)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb([1, 2]), "must be a map"),
        (_header_with(format="other/9"), "format is 'other/9'"),
        (_header_with(tensors=[{"name": "w", "dtype": "complex64", "shape": [2, 2], "offset": 0, "nbytes": 16}]),
         "unknown dtype 'complex64'"),
        (_header_with(tensors=[{"name": "w", "dtype": "float32", "shape": [3, 2], "offset": 0, "nbytes": 16}]),
         "!= 16 bytes"),
        (_header_with(tensors=[{"name": "w", "dtype": "float32", "shape": [2, 2], "offset": 4, "nbytes": 16}]),
         "offset 4, expected 0"),
        (_header_with(total_bytes=32), "total_bytes is 32"),
        (_header_with(chunk_crc32=[0]), "chunk checksums"),
        (_header_with(tensors=[{"name": "w"}]), "lacks field"),
    ],
)
def test_malformed_headers_raise_clear_errors(header, message):
    with pytest.raises(WeightsFormatError, match=message):
        read_header(header)


def test_pack_rejects_unsupported_values():
    with pytest.raises(WeightsFormatError, match="unsupported dtype"):
        pack_state_dict({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(WeightsFormatError, match="not a tensor"):
        pack_state_dict({"x": [1, 2, 3]})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="chunk_size"):
        pack_state_dict({"w": torch.zeros(1)}, chunk_size=0)


def test_checksums_are_crc32_of_each_chunk():
    header, chunks = pack_state_dict({"w": torch.arange(10, dtype=torch.float32)}, chunk_size=16)
    assert read_header(header).chunk_crc32 == [zlib.crc32(c) for c in chunks]
