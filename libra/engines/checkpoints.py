"""Checkpoint directories of a training run: which to keep."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

__all__ = ["prune_checkpoints"]


def prune_checkpoints(directory: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Remove all but the newest ``keep_last`` checkpoints ``step<N>`` in ``directory`` (newest: largest
    ``N``); other entries are left alone. Returns the removed paths."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    found = []
    for p in Path(directory).iterdir():
        m = _STEP_DIR.fullmatch(p.name)
        if m is not None and p.is_dir():
            found.append((int(m.group(1)), p))
    found.sort()
    removed = [p for _, p in found[:-keep_last]]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


_STEP_DIR = re.compile(r"step(\d+)")
