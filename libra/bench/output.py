"""Printing a benchmark's result: one JSON object, or its table and wall time."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

__all__ = ["emit", "finite"]


def finite(o: Any) -> Any:
    """``o`` with every non-finite float (``inf``, ``nan``) replaced by ``None``, recursively through
    dicts, lists and tuples: strict JSON has no infinities."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [finite(v) for v in o]
    return o


def emit(out: dict[str, Any], as_json: bool, fmt: Callable[[dict[str, Any]], str]) -> None:
    """Print ``out`` as one strict JSON object (``as_json``), else ``fmt(out)`` and its ``wall_s``."""
    if as_json:
        print(json.dumps(finite(out)))
    else:
        print(fmt(out))
        print(f"(wall {out['wall_s']} s)")
