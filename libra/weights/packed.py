"""A received weights version kept as its verified chunks: a lazy state dict that decodes straight into a
model's own tensors.

Role: the rollout side of the data-plane weights transport. :func:`~libra.weights.format.unpack_state_dict`
builds fresh tensors (one copy of the whole stream) that a rollout engine then copies into its model (a
second copy); :class:`PackedWeights` skips the first: :meth:`PackedWeights.copy_into` writes a tensor's
bytes from the received chunks into the destination tensor directly.

Contracts:

- Construction checks the header (:func:`~libra.weights.format.read_header`) and every chunk's length and
  CRC-32 (:func:`~libra.weights.format.verify_chunks`) before anything can be read, so a corrupted transfer
  raises :class:`~libra.weights.format.WeightsFormatError` and never reaches a model.
- It is a ``Mapping[str, torch.Tensor]`` in header order: ``pw[name]`` decodes one tensor (CPU, contiguous,
  cached, so an engine that reads every item, e.g. vLLM's, pays one copy per tensor); a tied name
  (:meth:`alias_of`) returns its target's tensor.
- :meth:`copy_into` gives ``dest`` exactly the tensor's bits when ``dest`` is a contiguous CPU tensor of the
  same dtype and shape (no intermediate tensor), and ``dest.copy_(pw[name])`` (a dtype/device conversion)
  otherwise; a shape mismatch raises :class:`ValueError` naming the tensor.
- :meth:`raw` reads a tensor's stream bytes (a view when they lie in one chunk); :meth:`fresh` is another
  :class:`PackedWeights` over the same verified chunks with no decoded tensors cached (what a delta sync
  keeps in host memory, :mod:`libra.weights.host_copy`, while an engine decodes its own);
  :meth:`from_verified` wraps chunks this process packed itself, without checking them again.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from libra.weights.format import _DTYPES, WeightsHeader, read_header, verify_chunks

__all__ = ["PackedWeights", "span_bytes"]


def span_bytes(views: Sequence[np.ndarray], chunk_size: int, start: int, end: int) -> np.ndarray:
    """Bytes ``[start, end)`` of a stream cut into ``views`` of ``chunk_size`` bytes: a view of one chunk when
    the range lies in it, else a new array joining the pieces."""
    if end <= start:
        return np.empty(0, dtype=np.uint8)
    i, within = divmod(start, chunk_size)
    if within + (end - start) <= chunk_size:
        return views[i][within : within + (end - start)]
    out = np.empty(end - start, dtype=np.uint8)
    pos = start
    while pos < end:
        i, within = divmod(pos, chunk_size)
        take = min(chunk_size - within, end - pos)
        out[pos - start : pos - start + take] = views[i][within : within + take]
        pos += take
    return out


class PackedWeights(Mapping[str, torch.Tensor]):
    """A verified ``(header, chunks)`` weights message read as a state dict (see the module contracts).
    ``header_bytes`` is the encoded header when it was given as bytes (None otherwise)."""

    def __init__(self, header: bytes | WeightsHeader, chunks: Sequence[bytes | bytearray | memoryview]) -> None:
        self.header_bytes = None if isinstance(header, WeightsHeader) else bytes(header)
        self.header = header if isinstance(header, WeightsHeader) else read_header(header)
        self._views = [np.frombuffer(v, dtype=np.uint8) for v in verify_chunks(self.header, chunks)]
        self._entries = {e["name"]: e for e in self.header.tensors}
        self._decoded: dict[str, torch.Tensor] = {}

    @classmethod
    def from_verified(cls, header_bytes: bytes, chunks: Sequence[bytes | bytearray | memoryview | np.ndarray],
                      header: WeightsHeader | None = None) -> PackedWeights:
        """Wrap chunks already checked against ``header_bytes`` (packed by this process, or another
        :class:`PackedWeights`' chunks): the header is decoded (unless given), the CRCs are not recomputed."""
        self = cls.__new__(cls)
        self.header_bytes = bytes(header_bytes)
        self.header = header if header is not None else read_header(header_bytes)
        self._views = [c if isinstance(c, np.ndarray) else np.frombuffer(c, dtype=np.uint8) for c in chunks]
        self._entries = {e["name"]: e for e in self.header.tensors}
        self._decoded = {}
        return self

    def fresh(self) -> PackedWeights:
        """The same verified chunks with no decoded tensor cached (needs :attr:`header_bytes`)."""
        if self.header_bytes is None:
            raise ValueError("PackedWeights.fresh needs the encoded header (built from a WeightsHeader)")
        return PackedWeights.from_verified(self.header_bytes, self._views, self.header)

    def entry(self, name: str) -> dict[str, Any]:
        """The header entry of ``name`` (``KeyError`` if none)."""
        return self._entries[name]

    def raw(self, name: str) -> np.ndarray:
        """The stream bytes of tensor ``name`` (a tied name: its target's) as ``uint8``; read-only use."""
        e = self._entries[self.alias_of(name) or name]
        return span_bytes(self._views, self.header.chunk_size, e["offset"], e["offset"] + e["nbytes"])

    @property
    def version(self) -> int | None:
        return self.header.version

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, without decoding it."""
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self._entries[name]["dtype"]]

    def alias_of(self, name: str) -> str | None:
        """The name whose bytes ``name`` shares (a tied weight shipped once), or None."""
        return self._entries[name].get("alias")

    def nbytes(self) -> int:
        """Bytes the message carried (tied weights once)."""
        return self.header.total_bytes

    def __getitem__(self, name: str) -> torch.Tensor:
        target = self.alias_of(name) or name
        got = self._decoded.get(target)
        if got is None:
            got = torch.empty(self.shape(target), dtype=self.dtype(target))
            self._write(target, got)
            self._decoded[target] = got
        return got

    def copy_into(self, name: str, dest: torch.Tensor) -> None:
        """Give ``dest`` the tensor ``name`` (see the module contracts)."""
        if tuple(dest.shape) != self.shape(name):
            raise ValueError(f"tensor {name!r} has shape {self.shape(name)}, the destination {tuple(dest.shape)}")
        target = self.alias_of(name) or name
        if dest.device.type == "cpu" and dest.dtype == self.dtype(target) and dest.is_contiguous() \
                and target not in self._decoded:
            self._write(target, dest)
        else:
            dest.copy_(self[name])

    def _write(self, name: str, dest: torch.Tensor) -> None:
        """Copy the stream bytes of ``name`` (an entry with bytes) into ``dest`` (CPU, contiguous, its dtype)."""
        e = self._entries[name]
        if not e["nbytes"]:
            return
        out: Any = dest.detach().reshape(-1).view(torch.uint8).numpy()
        cs, pos, end = self.header.chunk_size, e["offset"], e["offset"] + e["nbytes"]
        while pos < end:  # the tensor's bytes may span several chunks
            i, within = divmod(pos, cs)
            take = min(cs - within, end - pos)
            out[pos - e["offset"] : pos - e["offset"] + take] = self._views[i][within : within + take]
            pos += take
