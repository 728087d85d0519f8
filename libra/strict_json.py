"""Strict JSON for commands and benchmarks: no ``Infinity`` or ``NaN``, which ``json.dumps`` would print."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["dumps", "finite"]


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


def dumps(o: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`finite` ``(o)``; raises ``ValueError`` rather than print a non-finite number."""
    return json.dumps(finite(o), allow_nan=False, **kwargs)
