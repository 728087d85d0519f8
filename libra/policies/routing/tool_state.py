"""Tool-return state extraction: the causal signal of C-MLFQ (docs/papers.md §1.4.1).

After every tool call, the router reduces what the tool returned to a small discrete *state*, the triple
``(tool_type, payload_size_class, execution_status)``, written as the key ``"{tool}:{size}:{status}"``
(e.g. ``"bash:large:failure"``). Sequences of these keys index the causal prefix tree
(:mod:`libra.policies.routing.prefix_tree`).

Contracts:

- ``tool_type`` is the tool name given by the workflow (``bash``, ``python``, ``search``); when the
  workflow gives none, a mapping output may name it (``tool``/``tool_type`` key), else it is ``"text"``.
- ``payload_size_class`` is ``small`` if size <= ``small`` threshold, ``medium`` if <= ``medium``
  threshold, else ``large``. The unit is ``payload_tokens`` when the workflow gives it, otherwise
  characters of the output (defaults 500/5000; the R2E configuration uses 1000/12000).
- ``execution_status``, checked in this order:

  1. an explicit ``status`` argument (from the workflow or a trace) is authoritative;
  2. ``failure`` if the output contains ``"error"`` (case-insensitive; for a mapping, any of its string
     values), or a mapping has an ``error``/``exception``/``traceback`` key (a key whose value is falsy -- ``None``,
     ``""``, ``0``, ``False`` -- counts as absent: JSON APIs send ``"error": null`` on success), or its
     ``status`` field is one of ``error``/``failure``/``failed``;
  3. ``timeout`` if the mapping's ``status`` field is ``timeout``/``timed_out``;
  4. else ``success``.

Pure functions only; nothing here does I/O or keeps state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = [
    "DEFAULT_THRESHOLDS",
    "R2E_THRESHOLDS",
    "SizeThresholds",
    "Status",
    "ToolState",
    "ToolStateError",
    "execution_status",
    "extract_tool_state",
    "payload_size",
    "size_class",
]

Status = Literal["success", "failure", "timeout"]
SizeClass = Literal["small", "medium", "large"]

_FAILURE_STATUSES: Final = frozenset({"error", "failure", "failed"})
_TIMEOUT_STATUSES: Final = frozenset({"timeout", "timed_out"})
_SUCCESS_STATUSES: Final = frozenset({"success", "succeeded", "ok", "completed", "done"})
_ERROR_KEYS: Final = ("error", "exception", "traceback")
_TOOL_KEYS: Final = ("tool_type", "tool")


class ToolStateError(ValueError):
    """A tool return could not be reduced to a state (bad threshold, size, status or tool name)."""


@dataclass(frozen=True, slots=True)
class SizeThresholds:
    """Payload size-class boundaries: ``small`` if size <= ``small``, ``medium`` if <= ``medium``.

    Raises :class:`ToolStateError` unless ``0 <= small < medium``.
    """

    small: int = 500
    medium: int = 5000

    def __post_init__(self) -> None:
        if not (isinstance(self.small, int) and isinstance(self.medium, int)):
            raise ToolStateError(f"size thresholds must be integers, got small={self.small!r} medium={self.medium!r}")
        if not 0 <= self.small < self.medium:
            raise ToolStateError(
                f"size thresholds need 0 <= small < medium, got small={self.small} medium={self.medium}"
            )


DEFAULT_THRESHOLDS: Final = SizeThresholds(500, 5000)
R2E_THRESHOLDS: Final = SizeThresholds(1000, 12000)


@dataclass(frozen=True, slots=True)
class ToolState:
    """One tool-return state. ``key`` is the ``"{tool}:{size}:{status}"`` string the prefix tree uses."""

    tool: str
    size: SizeClass
    status: Status

    @property
    def key(self) -> str:
        return f"{self.tool}:{self.size}:{self.status}"


def size_class(size: int, thresholds: SizeThresholds = DEFAULT_THRESHOLDS) -> SizeClass:
    """Size class of a payload of ``size`` units. Raises :class:`ToolStateError` for a negative size."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ToolStateError(f"payload size must be a non-negative integer, got {size!r}")
    if size <= thresholds.small:
        return "small"
    if size <= thresholds.medium:
        return "medium"
    return "large"


def _text_leaves(value: Any) -> list[str]:
    """Every string inside ``value`` (mapping values and sequence items, recursively)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, bytes):
        return [value.decode("utf-8", errors="replace")]
    if isinstance(value, Mapping):
        out: list[str] = []
        for v in value.values():
            out.extend(_text_leaves(v))
        return out
    if isinstance(value, Sequence):
        out = []
        for v in value:
            out.extend(_text_leaves(v))
        return out
    return []


def _scalar_chars(value: Any) -> int:
    """Characters of ``value`` rendered as text: strings as they are, containers summed over leaves."""
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value)
    if isinstance(value, bytes):
        return len(value.decode("utf-8", errors="replace"))
    if isinstance(value, Mapping):
        return sum(_scalar_chars(v) for v in value.values())
    if isinstance(value, Sequence):
        return sum(_scalar_chars(v) for v in value)
    return len(str(value))


def payload_size(
    output: Any = None, *, payload_tokens: int | None = None, payload_chars: int | None = None
) -> int:
    """Size of a tool payload in the unit the size classes use.

    ``payload_tokens`` wins when given; then ``payload_chars``; then a ``payload_tokens`` entry of a mapping
    output; else the characters of the output (a mapping or list counts the characters of its values, not its
    keys). Raises :class:`ToolStateError` for a negative or non-integer explicit size.
    """
    for name, value in (("payload_tokens", payload_tokens), ("payload_chars", payload_chars)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ToolStateError(f"{name} must be a non-negative integer, got {value!r}")
            return value
    if isinstance(output, Mapping):
        tokens = output.get("payload_tokens")
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
            return tokens
    return _scalar_chars(output)


def _normalise_status(value: Any) -> str:
    return str(value).strip().lower().replace("-", "_").replace(" ", "_")


def execution_status(output: Any = None, *, status: str | None = None) -> Status:
    """Execution status of a tool return by the rules in the module docstring.

    Raises :class:`ToolStateError` when an explicit ``status`` is not a known success, failure or timeout word.
    """
    if status is not None:
        norm = _normalise_status(status)
        if norm in _FAILURE_STATUSES:
            return "failure"
        if norm in _TIMEOUT_STATUSES:
            return "timeout"
        if norm in _SUCCESS_STATUSES:
            return "success"
        known = sorted(_FAILURE_STATUSES | _TIMEOUT_STATUSES | _SUCCESS_STATUSES)
        raise ToolStateError(f"unknown tool status: {status!r} (known: {', '.join(known)})")
    field_status = ""
    if isinstance(output, Mapping):
        if any(output.get(k) for k in _ERROR_KEYS):
            return "failure"
        if output.get("status") is not None:
            field_status = _normalise_status(output["status"])
        if field_status in _FAILURE_STATUSES:
            return "failure"
    if any("error" in text.lower() for text in _text_leaves(output)):
        return "failure"
    if field_status in _TIMEOUT_STATUSES:
        return "timeout"
    return "success"


def _tool_type(tool: str | None, output: Any) -> str:
    if tool is None and isinstance(output, Mapping):
        for k in _TOOL_KEYS:
            if isinstance(output.get(k), str) and output[k].strip():
                tool = output[k]
                break
    if tool is None:
        return "text"
    if not isinstance(tool, str) or not tool.strip():
        raise ToolStateError(f"tool name must be a non-empty string, got {tool!r}")
    name = tool.strip()
    if ":" in name:
        # The key is ':'-separated; a colon in the tool name would make keys ambiguous.
        raise ToolStateError(f"tool name must not contain ':', got {tool!r}")
    return name


def extract_tool_state(
    tool: str | None,
    output: Any = None,
    *,
    status: str | None = None,
    payload_tokens: int | None = None,
    payload_chars: int | None = None,
    thresholds: SizeThresholds = DEFAULT_THRESHOLDS,
) -> ToolState:
    """Reduce one tool return to its :class:`ToolState` (see the module docstring for the rules).

    Raises :class:`ToolStateError` for a bad tool name, size or status.
    """
    size = payload_size(output, payload_tokens=payload_tokens, payload_chars=payload_chars)
    return ToolState(
        tool=_tool_type(tool, output),
        size=size_class(size, thresholds),
        status=execution_status(output, status=status),
    )
