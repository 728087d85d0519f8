"""Weights transport: a state dict as a msgpack header plus raw byte chunks, and back. No pickle.

Role: move a trainer's weights to rollout engines over ZeroMQ frames, peer to peer (the broker never
sees them). The format is self-describing and validated on the way in, so a truncated, reordered or
corrupted transfer is an error, never a silently wrong model.

Format (version ``libra-weights/1``):

- ``header``: msgpack map ``{"format", "version", "chunk_size", "total_bytes", "tensors": [{"name",
  "dtype", "shape", "offset", "nbytes"}, ...], "chunk_crc32": [...], "metadata": {...}}``. Tensors are
  laid end to end, in state-dict order, in one logical little-endian byte stream; ``offset``/
  ``nbytes`` locate each one in it. ``version`` is the weights version (an int) or ``None``. A tied
  weight's second name is an entry ``{"name", "dtype", "shape", "alias"}`` naming the earlier entry whose
  bytes it shares (same dtype and shape), with no bytes of its own.
- ``chunks``: that stream cut into pieces of ``chunk_size`` bytes (the last one may be shorter), each
  checked by the CRC-32 at the same index of ``chunk_crc32`` (a transmission check, not a security
  measure: authenticate the peer at the socket layer).
- ``to_frames``/``from_frames`` put the header first and the chunks after it, ready for
  ``socket.send_multipart``/``recv_multipart``.

Contracts: ``unpack_state_dict(*pack_state_dict(sd))`` returns tensors equal bit for bit to ``sd``'s
(same names, order, dtypes, shapes), on CPU and contiguous. Any inconsistency raises
:class:`WeightsFormatError` (a ``ValueError``) naming what is wrong.

Not in this module: sockets and deciding who sends to whom: ``libra.dataplane`` serves these streams
peer to peer (chunk by chunk, credit-based) and ``libra.actors.roles`` decides what is published and
fetched.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FORMAT",
    "WeightsFormatError",
    "WeightsHeader",
    "chunk_bytes",
    "from_frames",
    "pack_state_dict",
    "read_header",
    "tie_like",
    "to_frames",
    "unpack_state_dict",
    "verify_chunks",
]

FORMAT = "libra-weights/1"
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024  # 4 MiB: well under ZeroMQ's comfortable frame sizes

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class WeightsFormatError(ValueError):
    """A weights header or chunk list is malformed, inconsistent or corrupted."""


@dataclass(frozen=True, slots=True)
class WeightsHeader:
    """The decoded, validated header: what :func:`read_header` returns."""

    version: int | None
    chunk_size: int
    total_bytes: int
    tensors: list[dict[str, Any]]
    chunk_crc32: list[int]
    metadata: dict[str, Any]


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise WeightsFormatError("weights transport requires a little-endian host")
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


def _view_identity(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors the same view of the same memory (tied weights), or None for an empty one."""
    if not t.numel() or hasattr(t, "full_tensor"):  # empty, or a DTensor (sharded: no single memory)
        return None
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def tie_like(model_state: Mapping[str, torch.Tensor], copies: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``copies`` (copies of ``model_state``'s tensors under the same names) with every weight tied in
    ``model_state`` (one memory under two names) tied again: the later name gets the earlier name's copy, so
    :func:`pack_state_dict` ships it once. Returns ``copies``, changed in place."""
    first: dict[tuple[Any, ...], str] = {}
    for name, t in model_state.items():
        ident = _view_identity(t)
        if ident is None or name not in copies:
            continue
        if ident in first and first[ident] in copies:
            copies[name] = copies[first[ident]]
        else:
            first[ident] = name
    return copies


def pack_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    *,
    version: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    metadata: Mapping[str, Any] | None = None,
) -> tuple[bytes, list[bytes]]:
    """Serialise ``state_dict`` into ``(header, chunks)`` (see the module docstring); each tensor's bytes are
    copied once, into the chunks.

    Tensors may live on any device and be non-contiguous; they are copied to CPU. A name whose tensor is the
    same view of the same memory as an earlier name's (a tied weight, e.g. ``lm_head.weight`` and
    ``model.embed_tokens.weight``) is shipped once: its entry says ``"alias"`` (the earlier name) and holds no
    bytes. ``metadata`` must be
    msgpack-serialisable. Raises :class:`WeightsFormatError` for an unsupported dtype and
    ``ValueError`` for ``chunk_size < 1``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    entries: list[dict[str, Any]] = []
    offset = 0
    seen: dict[tuple[Any, ...], str] = {}  # a tensor's view identity -> the first name it was packed under

    def tensor_bytes() -> Iterator[memoryview]:  # lazily: a tensor's CPU copy is dropped once it is chunked
        nonlocal offset
        for name, tensor in state_dict.items():
            if not isinstance(tensor, torch.Tensor):
                raise WeightsFormatError(f"state_dict[{name!r}] is a {type(tensor).__name__}, not a tensor")
            dtype_name = _DTYPE_NAMES.get(tensor.dtype)
            if dtype_name is None:
                raise WeightsFormatError(f"state_dict[{name!r}] has unsupported dtype {tensor.dtype}")
            ident = _view_identity(tensor)
            if ident is not None and ident in seen:  # a tied weight: the same bits again, shipped once
                entries.append({"name": name, "dtype": dtype_name, "shape": list(tensor.shape),
                                "alias": seen[ident]})
                continue
            if ident is not None:
                seen[ident] = name
            data = _tensor_bytes(tensor)
            entries.append({"name": name, "dtype": dtype_name, "shape": list(tensor.shape), "offset": offset,
                            "nbytes": data.nbytes})
            offset += data.nbytes
            yield data

    chunks = chunk_bytes(tensor_bytes(), chunk_size)
    header = {
        "format": FORMAT,
        "version": version,
        "chunk_size": chunk_size,
        "total_bytes": offset,
        "tensors": entries,
        "chunk_crc32": [zlib.crc32(c) for c in chunks],
        "metadata": dict(metadata or {}),
    }
    return msgpack.packb(header, use_bin_type=True), chunks



def chunk_bytes(views: Iterable[memoryview], chunk_size: int) -> list[bytes]:
    """The bytes of ``views`` end to end, cut into chunks of ``chunk_size`` (the last may be shorter); each byte
    is copied once, by the join that builds its chunk. ``views`` is consumed lazily."""
    chunks: list[bytes] = []
    parts: list[memoryview] = []  # the pieces that make up the next chunk
    filled = 0
    for data in views:
        pos = 0
        while pos < data.nbytes:
            take = min(chunk_size - filled, data.nbytes - pos)
            parts.append(data[pos : pos + take])
            filled, pos = filled + take, pos + take
            if filled == chunk_size:
                chunks.append(b"".join(parts))
                parts, filled = [], 0
    if parts:
        chunks.append(b"".join(parts))
    return chunks

def _check_alias(i: int, e: dict[str, Any], owners: Mapping[str, tuple[str, list[int]]]) -> None:
    """An alias entry must name an earlier entry that holds bytes, with the same dtype and shape."""
    try:
        name, dtype_name, shape, target = e["name"], e["dtype"], e["shape"], e["alias"]
    except KeyError as exc:
        raise WeightsFormatError(f"weights header tensor #{i} (an alias) lacks field {exc}") from exc
    if target not in owners:
        raise WeightsFormatError(f"tensor {name!r}: alias of {target!r}, which is not an earlier tensor with bytes")
    if owners[target] != (dtype_name, shape):
        raise WeightsFormatError(f"tensor {name!r}: {dtype_name} {shape} as an alias of {target!r}, which is "
                                 f"{owners[target][0]} {owners[target][1]}")


def read_header(header: bytes) -> WeightsHeader:
    """Decode and validate a header on its own (e.g. to check the version before receiving chunks).

    Raises :class:`WeightsFormatError` for a wrong format tag, a missing field, an unknown dtype, a shape
    that does not match ``nbytes``, or tensors that do not tile ``[0, total_bytes)`` end to end.
    """
    try:
        raw = msgpack.unpackb(header, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WeightsFormatError(f"weights header is not valid msgpack: {exc}") from exc
    if not isinstance(raw, dict):
        raise WeightsFormatError(f"weights header must be a map, got {type(raw).__name__}")
    if raw.get("format") != FORMAT:
        raise WeightsFormatError(f"weights header format is {raw.get('format')!r}, expected {FORMAT!r}")
    for key in ("chunk_size", "total_bytes", "tensors", "chunk_crc32"):
        if key not in raw:
            raise WeightsFormatError(f"weights header lacks field {key!r}")
    chunk_size, total = raw["chunk_size"], raw["total_bytes"]
    if not isinstance(chunk_size, int) or chunk_size < 1 or not isinstance(total, int) or total < 0:
        raise WeightsFormatError(f"weights header has bad chunk_size {chunk_size!r} or total_bytes {total!r}")
    expect = 0
    owners: dict[str, tuple[str, list[int]]] = {}  # names holding bytes: (dtype, shape), for aliases to name
    for i, e in enumerate(raw["tensors"]):
        if isinstance(e, dict) and "alias" in e:
            _check_alias(i, e, owners)
            continue
        try:
            name, dtype_name, shape, off, nbytes = e["name"], e["dtype"], e["shape"], e["offset"], e["nbytes"]
        except (KeyError, TypeError) as exc:
            raise WeightsFormatError(f"weights header tensor #{i} lacks field {exc}") from exc
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise WeightsFormatError(f"tensor {name!r}: unknown dtype {dtype_name!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise WeightsFormatError(f"tensor {name!r}: bad shape {shape!r}")
        owners[name] = (dtype_name, shape)
        numel = 1
        for d in shape:
            numel *= d
        if numel * dtype.itemsize != nbytes:
            raise WeightsFormatError(f"tensor {name!r}: shape {shape} x {dtype_name} != {nbytes} bytes")
        if off != expect:
            raise WeightsFormatError(f"tensor {name!r}: offset {off}, expected {expect}")
        expect += nbytes
    if expect != total:
        raise WeightsFormatError(f"tensors cover {expect} bytes but total_bytes is {total}")
    n_chunks = -(-total // chunk_size)
    if len(raw["chunk_crc32"]) != n_chunks:
        raise WeightsFormatError(f"header lists {len(raw['chunk_crc32'])} chunk checksums, expected {n_chunks}")
    return WeightsHeader(
        version=raw.get("version"),
        chunk_size=chunk_size,
        total_bytes=total,
        tensors=list(raw["tensors"]),
        chunk_crc32=list(raw["chunk_crc32"]),
        metadata=dict(raw.get("metadata") or {}),
    )


def unpack_state_dict(
    header: bytes, chunks: Sequence[bytes | bytearray | memoryview]
) -> tuple[dict[str, torch.Tensor], WeightsHeader]:
    """Rebuild the state dict from ``(header, chunks)``; returns ``(state_dict, header)``.

    Checks the chunk count, every chunk's length and CRC-32 before building tensors. The returned
    tensors are CPU, contiguous, and share one private buffer (no copy per tensor). Raises
    :class:`WeightsFormatError` naming the first bad chunk or field.
    """
    hdr = read_header(header)
    views = verify_chunks(hdr, chunks)
    buf = bytearray(hdr.total_bytes)
    pos = 0
    for view in views:
        buf[pos : pos + view.nbytes] = view
        pos += view.nbytes
    whole = torch.frombuffer(buf, dtype=torch.uint8) if hdr.total_bytes else torch.empty(0, dtype=torch.uint8)
    out: dict[str, torch.Tensor] = {}
    for e in hdr.tensors:
        if "alias" in e:  # a tied weight: the very tensor of the name it aliases
            out[e["name"]] = out[e["alias"]]
            continue
        dtype = _DTYPES[e["dtype"]]
        if not e["nbytes"]:
            out[e["name"]] = torch.empty(e["shape"], dtype=dtype)
            continue
        part = whole[e["offset"] : e["offset"] + e["nbytes"]]
        if e["offset"] % dtype.itemsize:  # a view needs an element-aligned offset; copy the odd ones
            part = part.clone()
        out[e["name"]] = part.view(dtype).reshape(e["shape"])
    return out, hdr


def verify_chunks(hdr: WeightsHeader, chunks: Sequence[bytes | bytearray | memoryview]) -> list[memoryview]:
    """Check the chunk count and every chunk's length and CRC-32 against ``hdr``; the chunks as byte views.
    Raises :class:`WeightsFormatError` naming the first bad chunk."""
    if len(chunks) != len(hdr.chunk_crc32):
        raise WeightsFormatError(f"received {len(chunks)} chunks, header announces {len(hdr.chunk_crc32)}")
    views, pos = [], 0
    for i, (chunk, crc) in enumerate(zip(chunks, hdr.chunk_crc32)):
        view = memoryview(chunk).cast("B")
        want = min(hdr.chunk_size, hdr.total_bytes - pos)
        if view.nbytes != want:
            raise WeightsFormatError(f"chunk {i} has {view.nbytes} bytes, expected {want}")
        if zlib.crc32(view) != crc:
            raise WeightsFormatError(f"chunk {i} failed its CRC-32 check (corrupted in transit?)")
        views.append(view)
        pos += want
    return views


def to_frames(header: bytes, chunks: Sequence[bytes]) -> list[bytes]:
    """The multipart message for ZeroMQ: ``[header, *chunks]``."""
    return [header, *chunks]


def from_frames(frames: Sequence[bytes | bytearray | memoryview]) -> tuple[dict[str, torch.Tensor], WeightsHeader]:
    """Inverse of :func:`to_frames` followed by :func:`unpack_state_dict`."""
    if not frames:
        raise WeightsFormatError("no frames: a weights message needs at least the header frame")
    return unpack_state_dict(bytes(frames[0]), frames[1:])
