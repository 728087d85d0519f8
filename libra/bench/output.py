"""Printing a benchmark's result: one JSON object, or its table and wall time."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from libra.strict_json import finite

__all__ = ["emit", "finite"]


def emit(out: dict[str, Any], as_json: bool, fmt: Callable[[dict[str, Any]], str]) -> None:
    """Print ``out`` as one strict JSON object (``as_json``), else ``fmt(out)`` and its ``wall_s``."""
    if as_json:
        print(json.dumps(finite(out)))
    else:
        print(fmt(out))
        print(f"(wall {out['wall_s']} s)")
