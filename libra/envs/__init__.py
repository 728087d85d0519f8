"""Bundled environments. ``get_env(name)`` returns the module-level environment (``arith``)."""

from __future__ import annotations

from typing import Any

__all__ = ["get_env"]


def get_env(name: str) -> Any:
    """The environment called ``name``; raises ValueError listing the known ones."""
    if name == "arith":
        from libra.envs import arith

        return arith
    raise ValueError(f"unknown environment {name!r} (known: 'arith')")
