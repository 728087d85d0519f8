"""Printing a benchmark's result: one JSON object, or its table and wall time."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from libra.strict_json import finite

__all__ = ["emit", "finite", "run_and_emit"]


def emit(out: dict[str, Any], as_json: bool, fmt: Callable[[dict[str, Any]], str]) -> None:
    """Print ``out`` as one strict JSON object (``as_json``), else ``fmt(out)`` and its ``wall_s``."""
    if as_json:
        print(json.dumps(finite(out)))
    else:
        print(fmt(out))
        print(f"(wall {out['wall_s']} s)")


def run_and_emit(run: Callable[[Any], dict[str, Any]], args: Any, fmt: Callable[[dict[str, Any]], str]) -> int:
    """A bench's ``main`` after parsing: ``run(args)`` timed into its ``wall_s``, then :func:`emit` (``args.json``);
    returns the exit status 0."""
    t0 = time.perf_counter()
    res = run(args)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(res, args.json, fmt)
    return 0
