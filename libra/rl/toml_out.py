"""TOML values written back: the resolved job file (``RUN/config.toml``) and broker table (``RUN/broker.toml``)."""

from __future__ import annotations

from typing import Any

__all__ = ["toml_value"]


def toml_value(v: Any) -> str:
    """``v`` (bool, number, string, list or table) as a TOML value."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f'"{k}" = {toml_value(x)}' for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")
