"""Built-in sandbox tools: argument validation and the command each tool runs.

Everything here is pure except :func:`xdist_available`, which asks the interpreter once per pool, and
:mod:`libra.engines.sandbox.handlers` hands these tools to an actor as work handlers.

Role: a tool turns the caller's ``args`` mapping into a :class:`ToolCall` (argv, environment, files to
write, timeout) and optionally post-processes the result. Tools are selected by name through
:func:`get_tool`, which raises ``ValueError("unknown tool: 'x' (known: ...)")``.

Tools and their arguments (anything else is refused with :class:`SandboxDenied` naming the argument; callers
have the same contract as typed payloads in :mod:`libra.protocol.payloads_tools`):

- ``python``: ``code`` (str), optional ``timeout_s``, optional ``files`` ``{relative path: str | bytes}``
  written into the workspace first. Runs ``python -c code`` with the pool's interpreter.
- ``bash``: ``command`` (str), optional ``timeout_s``, ``files``. Runs ``bash -c command``.
- ``pytest``: optional ``files``, ``args`` (list of str), ``workers`` (int), ``timeout_s``. Runs
  ``python -m pytest`` in the workspace with plugin autoloading off; with ``workers > 1`` and
  ``pytest-xdist`` importable it adds ``-p xdist -n workers`` (``workers`` defaults to the number of
  granted cores: elastic degree of parallelism), otherwise runs sequentially. The result gains
  ``summary`` ``{"passed", "failed", "errors", "skipped"}`` parsed from pytest's last line, and
  ``workers`` (the degree of parallelism actually used).

Environment of every action: ``PATH`` (the interpreter's ``bin`` first), ``HOME`` = the workspace,
``LANG``/``LC_ALL`` = ``C.UTF-8``, ``TMPDIR=/tmp``, and ``OMP_NUM_THREADS``/``OPENBLAS_NUM_THREADS``/
``MKL_NUM_THREADS``/``LIBRA_CORES`` = the number of granted cores.
"""

from __future__ import annotations

import base64
import importlib.util
import math
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from libra.engines.sandbox.errors import SandboxDenied, SandboxLimits

__all__ = ["TOOLS", "ToolCall", "ToolContext", "get_tool", "parse_pytest_summary",
           "validate_files", "xdist_available"]

_INLINE_CODE_MAX = 64 * 1024  # larger code goes through a file: one argv string may not exceed 128 KiB


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a tool may know about where it runs."""

    python: str
    workspace: str
    n_cores: int
    limits: SandboxLimits
    xdist: bool = False


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A validated action: what to exec, with which extra environment and files, for how long.

    ``files`` are in wire form (``{path: {"text": str} | {"b64": str}}``); relative paths are under the
    workspace. ``memory_hint`` says a trailing ``MemoryError`` on stderr means the limit was hit.
    ``finish`` post-processes the result mapping."""

    argv: tuple[str, ...]
    timeout_s: float
    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    memory_hint: bool = True
    finish: Callable[[dict[str, Any]], dict[str, Any]] | None = None


def _deny(tool: str, message: str) -> SandboxDenied:
    return SandboxDenied(f"{tool}: {message}")


def _check_keys(tool: str, args: Mapping[str, Any], known: tuple[str, ...]) -> None:
    if not isinstance(args, Mapping):
        raise _deny(tool, f"arguments must be a mapping, got {type(args).__name__}")
    extra = sorted(set(args) - set(known))
    if extra:
        raise _deny(tool, f"unknown argument {extra[0]!r} (known: {', '.join(known)})")


def _text_arg(tool: str, args: Mapping[str, Any], name: str) -> str:
    if name not in args:
        raise _deny(tool, f"missing required argument {name!r} (a string)")
    value = args[name]
    if not isinstance(value, str):
        raise _deny(tool, f"argument {name!r} must be a string, got {type(value).__name__}")
    if "\x00" in value:
        raise _deny(tool, f"argument {name!r} contains a NUL character")
    return value


def _timeout(tool: str, args: Mapping[str, Any], limits: SandboxLimits) -> float:
    value = args.get("timeout_s")
    if value is None:
        return limits.timeout_s
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _deny(tool, f"timeout_s must be a positive number of seconds, got {value!r}")
    if value > limits.max_timeout_s:
        raise _deny(tool, f"timeout_s={value} exceeds this sandbox's maximum of {limits.max_timeout_s} s")
    return float(value)


def validate_files(tool: str, files: Any, limit_bytes: int) -> dict[str, dict[str, str]]:
    """Check ``files`` (``{relative path: str | bytes}``) and return it in wire form.

    Raises :class:`SandboxDenied` for a non-mapping, an absolute path, ``..``, an empty or NUL-containing
    path, a non-str/bytes content, or more than ``limit_bytes`` in total."""
    if files is None:
        return {}
    if not isinstance(files, Mapping):
        raise _deny(tool, f"files must be a mapping of relative path to content, got {type(files).__name__}")
    wire: dict[str, dict[str, str]] = {}
    total = 0
    for raw_path, content in files.items():
        if not isinstance(raw_path, str) or not raw_path or "\x00" in raw_path:
            raise _deny(tool, f"file path {raw_path!r} must be a non-empty string without NUL")
        path = PurePosixPath(raw_path)
        if path.is_absolute() or ".." in path.parts or str(path) in (".", ""):
            raise _deny(tool, f"file path {raw_path!r} must stay inside the workspace (relative, no '..')")
        if isinstance(content, str):
            total += len(content.encode())
            wire[str(path)] = {"text": content}
        elif isinstance(content, (bytes, bytearray, memoryview)):
            data = bytes(content)
            total += len(data)
            wire[str(path)] = {"b64": base64.b64encode(data).decode()}
        else:
            raise _deny(tool, f"content of file {raw_path!r} must be str or bytes, got {type(content).__name__}")
        if total > limit_bytes:
            raise _deny(tool, f"files total more than the {limit_bytes}-byte request limit")
    return wire


def _base_env(ctx: ToolContext) -> dict[str, str]:
    n = str(max(1, ctx.n_cores))
    return {
        "PATH": f"{os.path.dirname(ctx.python)}:/usr/local/bin:/usr/bin:/bin",
        "HOME": ctx.workspace,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TMPDIR": "/tmp",
        "OMP_NUM_THREADS": n,
        "OPENBLAS_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
        "LIBRA_CORES": n,
    }


def python_tool(args: Mapping[str, Any], ctx: ToolContext) -> ToolCall:
    """``python``: run ``code`` with the pool's interpreter (see the module docstring)."""
    _check_keys("python", args, ("code", "files", "timeout_s"))
    code = _text_arg("python", args, "code")
    size = len(code.encode())
    if size > ctx.limits.max_request_bytes:
        raise _deny("python", f"code is larger than the {ctx.limits.max_request_bytes}-byte request limit")
    files = validate_files("python", args.get("files"), ctx.limits.max_request_bytes - size)
    if size <= _INLINE_CODE_MAX:
        argv: tuple[str, ...] = (ctx.python, "-c", code)
    else:
        script = f"/tmp/.libra-code-{uuid.uuid4().hex}.py"
        files = {**files, script: {"text": code}}
        argv = (ctx.python, script)
    return ToolCall(argv=argv, timeout_s=_timeout("python", args, ctx.limits), env=_base_env(ctx), files=files)


def bash_tool(args: Mapping[str, Any], ctx: ToolContext) -> ToolCall:
    """``bash``: run ``command`` with ``/bin/bash -c`` (see the module docstring)."""
    _check_keys("bash", args, ("command", "files", "timeout_s"))
    command = _text_arg("bash", args, "command")
    if len(command.encode()) > _INLINE_CODE_MAX:
        raise _deny("bash", f"command is longer than {_INLINE_CODE_MAX} bytes; put it in a file via 'files'")
    files = validate_files("bash", args.get("files"), ctx.limits.max_request_bytes)
    return ToolCall(argv=("/bin/bash", "-c", command), timeout_s=_timeout("bash", args, ctx.limits),
                    env=_base_env(ctx), files=files)


_SUMMARY_ITEM = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)\b")
_SUMMARY_LINE = re.compile(r"\bin \d+(\.\d+)?s\b")


def parse_pytest_summary(stdout: str) -> dict[str, int] | None:
    """Counts from pytest's final summary line (``"3 passed, 1 failed in 0.12s"``), or ``None``.

    Returns ``{"passed", "failed", "errors", "skipped"}`` (missing kinds are 0)."""
    for line in reversed(stdout.splitlines()):
        if not _SUMMARY_LINE.search(line) and "no tests ran" not in line:
            continue
        counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
        for number, kind in _SUMMARY_ITEM.findall(line):
            key = "errors" if kind.startswith("error") else kind
            if key in counts:
                counts[key] = int(number)
        return counts
    return None


def pytest_tool(args: Mapping[str, Any], ctx: ToolContext) -> ToolCall:
    """``pytest``: run the workspace's tests, in parallel over the granted cores when xdist exists."""
    _check_keys("pytest", args, ("args", "files", "timeout_s", "workers"))
    extra = args.get("args", [])
    if not isinstance(extra, (list, tuple)) or not all(isinstance(a, str) and "\x00" not in a for a in extra):
        raise _deny("pytest", f"args must be a list of strings, got {extra!r}")
    workers = args.get("workers", max(1, ctx.n_cores))
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise _deny("pytest", f"workers must be a positive integer, got {workers!r}")
    files = validate_files("pytest", args.get("files"), ctx.limits.max_request_bytes)
    parallel = ctx.xdist and workers > 1
    used = workers if parallel else 1
    argv = [ctx.python, "-m", "pytest"]
    if parallel:
        argv += ["-p", "xdist", "-n", str(workers)]
    argv += list(extra)
    env = {**_base_env(ctx), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}

    def finish(result: dict[str, Any]) -> dict[str, Any]:
        summary = parse_pytest_summary(result["stdout"])
        result["summary"] = summary or {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
        result["workers"] = used
        return result

    return ToolCall(argv=tuple(argv), timeout_s=_timeout("pytest", args, ctx.limits), env=env, files=files,
                    memory_hint=False, finish=finish)


TOOLS: dict[str, Callable[[Mapping[str, Any], ToolContext], ToolCall]] = {
    "bash": bash_tool,
    "pytest": pytest_tool,
    "python": python_tool,
}


def get_tool(name: str) -> Callable[[Mapping[str, Any], ToolContext], ToolCall]:
    """The builder of tool ``name``; ``ValueError("unknown tool: 'x' (known: bash, pytest, python)")``."""
    try:
        return TOOLS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown tool: {name!r} (known: {', '.join(sorted(TOOLS))})") from None


def xdist_available(python: str) -> bool:
    """Whether ``pytest-xdist`` is importable by ``python`` (checked in-process for this interpreter)."""
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        return importlib.util.find_spec("xdist") is not None
    try:
        probe = subprocess.run([python, "-c", "import xdist"], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0
