"""Delta weight sync's codec: what changed from one packed weights version to the next, and applying it.

Role: a rollout slot that holds version ``M`` catches up to version ``N`` by fetching only what changed
(``weights/v{N}/from/v{M}`` on the trainer's data-plane server, :mod:`libra.weights.dataplane`) instead of the
whole model. Pure: numpy, zlib and msgpack on bytes already in memory; no I/O.

Format (``libra-weights-delta/1``), a header plus CRC-checked chunks like :mod:`libra.weights.format`'s:

- ``header``: msgpack map ``{"format", "version": N, "base_version": M, "base_digest", "full_header",
  "chunk_size", "total_bytes", "chunk_crc32", "tensors": [{"name", "enc", "offset", "nbytes", "count",
  "width", "crc32"}, ...]}``. ``full_header`` is version ``N``'s own stream header (names, dtypes, shapes,
  ties, chunk CRCs); ``base_digest`` identifies the base by its header's bytes (which hold every chunk's
  CRC-32), so a slot whose ``v{M}`` came from another trainer is refused. ``tensors`` has one record per
  tensor of ``full_header`` that holds bytes (tied names travel in ``full_header``), in its order; ``offset``
  and ``nbytes`` locate the record's payload in the chunks' byte stream.
- Encodings (``enc``), chosen per tensor by comparing bit patterns (unsigned integers of the dtype's width,
  never float values, so ``-0.0``/``0.0`` and NaN payloads count as changes) in the exported dtype:
  ``same`` (no payload: the base's bytes), ``bitmap`` (a little-endian bit per element, then the ``count``
  new values of the set bits), ``gaps`` (the changed positions delta-coded: ``count`` gaps of ``width``
  bytes each, the first one the index plus one, then the new values) or ``dense`` (the tensor's whole new
  bytes). The smallest sparse form is taken when it is smaller than ``dense``; a tensor the base lacks, or
  holds with another dtype or shape, is ``dense``.
- ``crc32``: the CRC-32 of the tensor's resulting full bytes.

Contracts: ``apply_delta(base, *encode_delta(base, new)[:2])`` returns a
:class:`~libra.weights.packed.PackedWeights` equal bit for bit to ``new``, with ``new``'s header. A delta
that does not fit its base (another version, another trainer's bytes, a base lacking a tensor a record
needs), a corrupted or malformed delta, or a result whose CRC-32 (per tensor, then per chunk of the full
header) differs raises :class:`DeltaMismatch` (a :class:`~libra.weights.format.WeightsFormatError`), so a
wrongly applied delta is an error, never a silently wrong model. The caller falls back to the full object.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from .format import _DTYPES, DEFAULT_CHUNK_SIZE, WeightsFormatError, chunk_bytes, read_header, verify_chunks
from .packed import PackedWeights, span_bytes

__all__ = ["DELTA_ENV", "DELTA_FORMAT", "ENCODINGS", "DeltaHeader", "DeltaMismatch", "DeltaSummary", "apply_delta",
           "delta_enabled", "delta_name", "encode_delta", "header_digest", "read_delta_header"]

DELTA_FORMAT = "libra-weights-delta/1"
ENCODINGS = ("same", "dense", "bitmap", "gaps")
DELTA_ENV = "LIBRA_WEIGHTS_DELTA"  # "0" turns delta sync off (trainer: publish none; rollout: keep no host copy)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeltaMismatch(WeightsFormatError):
    """A weights delta that does not apply to the base at hand, is malformed or corrupted, or whose result
    fails its checksum."""


def delta_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether delta sync is on: ``$LIBRA_WEIGHTS_DELTA`` unset or ``1`` (default on), ``0`` off; anything
    else raises ``ValueError``."""
    raw = (os.environ if environ is None else environ).get(DELTA_ENV, "").strip().lower()
    if raw in ("", "1", "true", "on", "yes"):
        return True
    if raw in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{DELTA_ENV}={raw!r}: expected 1 (delta weight sync on) or 0 (off)")


def delta_name(version: int, base_version: int) -> str:
    """The data-plane name of the delta from ``base_version`` to ``version``."""
    return f"weights/v{version}/from/v{base_version}"


def header_digest(header_bytes: bytes) -> str:
    """What identifies a packed version's exact bytes: a BLAKE2b digest of its header (which holds every
    chunk's CRC-32)."""
    return hashlib.blake2b(header_bytes, digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class DeltaHeader:
    """A decoded, validated delta header (:func:`read_delta_header`)."""

    version: int
    base_version: int
    base_digest: str
    full_header: bytes
    chunk_size: int
    total_bytes: int
    chunk_crc32: list[int]
    tensors: list[dict[str, Any]]


@dataclass(slots=True)
class DeltaSummary:
    """What :func:`encode_delta` found: tensors and elements (with bytes, tied names once) and how many were
    unchanged, the delta's bytes (header + payload) against the full object's, and the encodings used."""

    tensors: int = 0
    unchanged_tensors: int = 0
    elements: int = 0
    unchanged_elements: int = 0
    delta_bytes: int = 0
    full_bytes: int = 0
    encodings: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ENCODINGS, 0))


def _itemsize(e: Mapping[str, Any]) -> int:
    return int(_DTYPES[e["dtype"]].itemsize)


def _base_raw(base: PackedWeights, e: Mapping[str, Any]) -> np.ndarray | None:
    """The base's bytes of tensor ``e`` when the base holds it with the same dtype and shape, else None."""
    name = e["name"]
    if name not in base:
        return None
    b = base.entry(base.alias_of(name) or name)
    if b["dtype"] != e["dtype"] or list(b["shape"]) != list(e["shape"]):
        return None
    return base.raw(name)


def _encode(old: np.ndarray | None, new: np.ndarray, size: int) -> tuple[str, list[np.ndarray], int, int, int]:
    """``(enc, payload parts, changed elements, gap width, payload bytes)`` of one tensor (module docstring)."""
    n = new.nbytes // size if size else 0
    if old is None:
        return "dense", [new], n, 0, new.nbytes
    if not n:
        return "same", [], 0, 0, 0
    a, b = old.view(_UINT[size]), new.view(_UINT[size])
    mask = a != b
    k = int(np.count_nonzero(mask))
    if k == 0:
        return "same", [], 0, 0, 0
    bitmap = -(-n // 8) + k * size
    if k * (1 + size) < min(new.nbytes, bitmap):  # delta-coded positions may win: find them
        idx = np.flatnonzero(mask)
        gaps = np.diff(idx, prepend=-1)
        width = next(w for w in (1, 2, 4, 8) if int(gaps.max()) < 1 << (8 * w))
        if k * (width + size) < min(new.nbytes, bitmap):
            return "gaps", [gaps.astype(_UINT[width]), b[idx]], k, width, k * (width + size)
    if bitmap < new.nbytes:
        return "bitmap", [np.packbits(mask, bitorder="little"), b[mask]], k, 0, bitmap
    return "dense", [new], k, 0, new.nbytes


def _chunked(parts: Sequence[np.ndarray], chunk_size: int) -> list[bytes]:
    """The parts' bytes end to end, cut into chunks of ``chunk_size`` (each byte copied once)."""
    return chunk_bytes((memoryview(np.ascontiguousarray(p)).cast("B") for p in parts), chunk_size)


def encode_delta(base: PackedWeights, new: PackedWeights, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 ) -> tuple[bytes, list[bytes], DeltaSummary]:
    """The delta from ``base`` to ``new`` as ``(header, chunks, summary)`` (see the module docstring). Both
    need their encoded header (:attr:`PackedWeights.header_bytes`) and an int version."""
    if base.header_bytes is None or new.header_bytes is None:
        raise ValueError("encode_delta needs both versions' encoded headers")
    if not isinstance(base.version, int) or not isinstance(new.version, int):
        raise ValueError(f"encode_delta needs int versions, got {base.version!r} and {new.version!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    s = DeltaSummary(full_bytes=new.nbytes())
    records: list[dict[str, Any]] = []
    parts: list[np.ndarray] = []
    offset = 0
    for e in new.header.tensors:
        if "alias" in e:
            continue
        size, raw = _itemsize(e), new.raw(e["name"])
        enc, payload, changed, width, nbytes = _encode(_base_raw(base, e), raw, size)
        n = raw.nbytes // size if size else 0
        s.tensors += 1
        s.unchanged_tensors += enc == "same"
        s.elements += n
        s.unchanged_elements += n - (changed if enc != "same" else 0)
        s.encodings[enc] += 1
        records.append({"name": e["name"], "enc": enc, "offset": offset, "nbytes": nbytes, "count": changed,
                        "width": width, "crc32": zlib.crc32(raw)})
        parts += payload
        offset += nbytes
    chunks = _chunked(parts, chunk_size)
    header = msgpack.packb({"format": DELTA_FORMAT, "version": new.version, "base_version": base.version,
                            "base_digest": header_digest(base.header_bytes), "full_header": new.header_bytes,
                            "chunk_size": chunk_size, "total_bytes": offset,
                            "chunk_crc32": [zlib.crc32(c) for c in chunks], "tensors": records}, use_bin_type=True)
    s.delta_bytes = len(header) + offset
    return header, chunks, s


def read_delta_header(header: bytes) -> DeltaHeader:
    """Decode and validate a delta header; :class:`DeltaMismatch` naming what is wrong."""
    try:
        raw = msgpack.unpackb(header, raw=False)
    except Exception as exc:  # noqa: BLE001  (msgpack raises several unrelated types)
        raise DeltaMismatch(f"weights delta header is not valid msgpack: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format") != DELTA_FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise DeltaMismatch(f"weights delta header format is {got!r}, expected {DELTA_FORMAT!r}")
    try:
        d = DeltaHeader(int(raw["version"]), int(raw["base_version"]), str(raw["base_digest"]),
                        bytes(raw["full_header"]), int(raw["chunk_size"]), int(raw["total_bytes"]),
                        [int(c) for c in raw["chunk_crc32"]], list(raw["tensors"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise DeltaMismatch(f"weights delta header lacks or garbles field {exc}") from None
    if d.chunk_size < 1 or d.total_bytes < 0 or len(d.chunk_crc32) != -(-d.total_bytes // d.chunk_size):
        raise DeltaMismatch(f"weights delta header: bad chunk_size {d.chunk_size}, total_bytes {d.total_bytes} "
                            f"or {len(d.chunk_crc32)} chunk checksums")
    expect = 0
    for i, t in enumerate(d.tensors):
        ok = isinstance(t, dict) and t.get("enc") in ENCODINGS and isinstance(t.get("name"), str) and all(
            type(t.get(k)) is int and t[k] >= 0 for k in ("offset", "nbytes", "count", "width", "crc32"))
        if not ok or t["offset"] != expect:
            raise DeltaMismatch(f"weights delta header: tensor record #{i} is malformed or misplaced: {t!r:.200}")
        expect += t["nbytes"]
    if expect != d.total_bytes:
        raise DeltaMismatch(f"weights delta records cover {expect} bytes, total_bytes is {d.total_bytes}")
    return d


def _apply_one(base: PackedWeights, e: Mapping[str, Any], t: Mapping[str, Any], dest: np.ndarray,
               payload: np.ndarray) -> None:
    """Write tensor ``e``'s new bytes into ``dest`` from its record ``t`` and ``payload`` (may raise
    :class:`DeltaMismatch`)."""
    name, enc, size, k = e["name"], t["enc"], _itemsize(e), t["count"]
    n = dest.nbytes // size if size else 0
    if enc == "dense":
        if payload.nbytes != dest.nbytes:
            raise DeltaMismatch(f"tensor {name!r}: dense payload of {payload.nbytes} bytes, expected {dest.nbytes}")
        dest[:] = payload
        return
    old = _base_raw(base, e)
    if old is None:
        raise DeltaMismatch(f"tensor {name!r}: the base holds no {e['dtype']} {e['shape']} tensor of that name")
    dest[:] = old
    if enc == "same":
        return
    head = -(-n // 8) if enc == "bitmap" else k * t["width"]
    if payload.nbytes != head + k * size or (enc == "gaps" and t["width"] not in _UINT):
        raise DeltaMismatch(f"tensor {name!r}: {enc} payload of {payload.nbytes} bytes does not fit {k} changes")
    values = payload[head:].view(_UINT[size])
    if enc == "bitmap":
        where: Any = np.unpackbits(payload[:head], count=n, bitorder="little").view(bool)
        if int(np.count_nonzero(where)) != k:
            raise DeltaMismatch(f"tensor {name!r}: bitmap sets {int(np.count_nonzero(where))} bits, record says {k}")
    else:
        gaps = payload[:head].view(_UINT[t["width"]]).astype(np.int64)
        if k and (int(gaps.min()) < 1 or int(gaps.sum()) > n):
            raise DeltaMismatch(f"tensor {name!r}: changed positions out of range")
        where = np.cumsum(gaps) - 1
    dest.view(_UINT[size])[where] = values


def apply_delta(base: PackedWeights, header: bytes, chunks: Sequence[bytes | bytearray | memoryview],
                ) -> PackedWeights:
    """Version ``N`` from ``base`` (version ``M``) and the delta ``(header, chunks)``; see the module
    contracts (:class:`DeltaMismatch` on any inconsistency)."""
    d = read_delta_header(header)
    digest = header_digest(base.header_bytes) if base.header_bytes is not None else None
    if d.base_version != base.version or d.base_digest != digest:
        raise DeltaMismatch(f"the delta to version {d.version} applies to version {d.base_version} "
                            f"({d.base_digest[:12]}), the base held is version {base.version} ({str(digest)[:12]})")
    try:
        views = [np.frombuffer(v, dtype=np.uint8) for v in verify_chunks(d, chunks)]  # type: ignore[arg-type]
        full = read_header(d.full_header)
    except WeightsFormatError as exc:
        raise DeltaMismatch(f"weights delta to version {d.version}: {exc}") from None
    owners = [e for e in full.tensors if "alias" not in e]
    if [e["name"] for e in owners] != [t["name"] for t in d.tensors]:
        raise DeltaMismatch(f"weights delta to version {d.version}: its records do not name the version's tensors")
    out = bytearray(full.total_bytes)
    whole = np.frombuffer(out, dtype=np.uint8)
    for e, t in zip(owners, d.tensors):
        dest = whole[e["offset"] : e["offset"] + e["nbytes"]]
        _apply_one(base, e, t, dest, span_bytes(views, d.chunk_size, t["offset"], t["offset"] + t["nbytes"]))
        if zlib.crc32(dest) != t["crc32"]:
            raise DeltaMismatch(f"tensor {e['name']!r}: the delta's result fails its CRC-32 (wrong base or "
                                f"corrupted delta)")
    cs, mv = full.chunk_size, memoryview(out)
    try:
        return PackedWeights(d.full_header, [mv[i : i + cs] for i in range(0, full.total_bytes, cs)])
    except WeightsFormatError as exc:
        raise DeltaMismatch(f"weights delta to version {d.version}: the result {exc}") from None
