"""The weights file: one weights version as a single file, for weights on shared storage (e.g. a checkpoint)
when no data-plane route to a trainer exists (the documented fallback of a ``WeightsRef`` with a ``path``).

Layout: an 8-byte little-endian header length, the stream header of :mod:`libra.weights.format`, then its
chunks end to end. Written atomically (a temporary name, then ``os.replace``); read back through the same
checks as a streamed transfer (CRC per chunk, names, dtypes, shapes), so a truncated or corrupted file is a
:class:`~libra.weights.format.WeightsFormatError`. torch is imported only when a file is written or read.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

__all__ = ["read_weights_file", "write_weights_file"]


def write_weights_file(path: Path, state_dict: Any, version: int) -> Path:
    """Write ``state_dict`` as weights version ``version`` to ``path`` atomically."""
    from .format import pack_state_dict

    header, chunks = pack_state_dict(state_dict, version=version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as fh:
        fh.write(struct.pack("<Q", len(header)))
        fh.write(header)
        for c in chunks:
            fh.write(c)
    os.replace(tmp, path)
    return path


def read_weights_file(path: str | Path) -> tuple[dict[str, Any], int]:
    """Read a file from :func:`write_weights_file`; returns ``(state_dict, version)``."""
    from .format import read_header, unpack_state_dict

    data = Path(path).read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = data[8 : 8 + n]
    hdr = read_header(header)
    stream = memoryview(data)[8 + n :]
    chunks = [stream[i : i + hdr.chunk_size] for i in range(0, hdr.total_bytes, hdr.chunk_size)]
    sd, hdr = unpack_state_dict(header, chunks)
    return sd, int(hdr.version or 0)
