"""Typed payloads of the built-in sandbox tools (``action`` work named ``python``, ``bash``, ``pytest``):
their args (:class:`PythonArgs`, :class:`BashArgs`, :class:`PytestArgs`) and replies
(:class:`ToolResult`, :class:`PytestResult` with its :class:`PytestSummary`).

No I/O. These are the caller's view of the contract; the sandbox (``libra.engines.sandbox.tools``) checks
the same args again against its own limits (request size, maximum timeout, file paths) and refuses what
does not fit with ``SandboxDenied``. A tool that fails (timeout, memory, crash) answers with a typed
error (``libra.engines.sandbox.errors``) instead of a result; a non-zero exit code is a result.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .payloads_base import Payload

__all__ = ["BashArgs", "PytestArgs", "PytestResult", "PytestSummary", "PythonArgs", "ToolResult"]

Timeout = Annotated[float, msgspec.Meta(gt=0.0)]


class _ToolArgs(Payload, frozen=True, kw_only=True, forbid_unknown_fields=True):
    OMIT_DEFAULT = ("timeout_s", "files")

    timeout_s: Timeout | None = None
    """Wall-clock limit in seconds (at most the sandbox's maximum); None: the sandbox's default."""
    files: dict[str, Any] | None = None
    """``{relative path: text or bytes}`` written into the workspace before the command runs."""

    def __post_init__(self) -> None:
        for path, content in (self.files or {}).items():
            if not isinstance(content, (str, bytes)):
                raise ValueError(f"field `files`: the content of {path!r} must be text or bytes, "
                                 f"got {type(content).__name__}")


class PythonArgs(_ToolArgs, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``python``: run ``code`` with the sandbox's interpreter (``python -c code``)."""

    WHAT = "python tool args"

    code: str
    """The program's source."""


class BashArgs(_ToolArgs, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``bash``: run ``command`` with ``/bin/bash -c``."""

    WHAT = "bash tool args"

    command: str
    """The shell command."""


class PytestArgs(_ToolArgs, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``pytest``: run the workspace's tests, in parallel over the granted cores when pytest-xdist exists."""

    WHAT = "pytest tool args"
    OMIT_DEFAULT = ("timeout_s", "files", "args", "workers")

    args: list[str] = msgspec.field(default_factory=list)
    """Extra pytest command-line arguments."""
    workers: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Parallel workers; None: the number of granted cores (elastic degree of parallelism)."""


class ToolResult(Payload, frozen=True, kw_only=True):
    """What a tool answers when its command ran (whatever its exit code)."""

    WHAT = "tool result"

    stdout: str
    """Standard output (decoded as UTF-8 with replacement; cut at the sandbox's output limit)."""
    stderr: str
    """Standard error (same)."""
    exit_code: int | None
    """The exit status, or minus the signal number that ended the process."""
    truncated: dict[str, Any] = msgspec.field(default_factory=dict)
    """Which streams were cut at the output limit."""
    duration_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    """Wall-clock seconds the command ran."""
    killed: Literal["output_limit"] | None = None
    """Why the sandbox killed a command that still has a result: ``"output_limit"`` when its output went over
    the cap (the output up to the cap is kept); None when the command ended on its own."""


class PytestSummary(Payload, frozen=True, kw_only=True):
    """Counts parsed from pytest's final summary line (0 for kinds it does not mention)."""

    WHAT = "pytest summary"

    passed: Annotated[int, msgspec.Meta(ge=0)] = 0
    failed: Annotated[int, msgspec.Meta(ge=0)] = 0
    errors: Annotated[int, msgspec.Meta(ge=0)] = 0
    skipped: Annotated[int, msgspec.Meta(ge=0)] = 0


class PytestResult(ToolResult, frozen=True, kw_only=True):
    """The ``pytest`` tool's result: a :class:`ToolResult` plus the parsed summary."""

    WHAT = "pytest result"

    summary: PytestSummary = msgspec.field(default_factory=PytestSummary)
    """pytest's counts."""
    workers: Annotated[int, msgspec.Meta(ge=1)] = 1
    """The degree of parallelism actually used."""
