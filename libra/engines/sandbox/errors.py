"""Errors and limits of the tool sandbox (:mod:`libra.engines.sandbox.pool`).

The error contract, in one place:

- An action whose process ran and exited on its own, with any exit status, is a *result*, never an error:
  the model must see its traceback. A result is the mapping ``{"stdout", "stderr", "exit_code",
  "truncated": {"stdout", "stderr"}, "duration_s", "killed"}`` (typed for callers as
  :class:`~libra.protocol.payloads_tools.ToolResult`).
- Output beyond the per-stream byte cap is also a result, so that the model sees what its code printed: the
  process is killed, what was read up to the cap is kept, ``truncated`` says which stream was cut, the exit
  status is ``-9`` and ``killed`` is ``"output_limit"`` (``None`` for a process that ended on its own).
- Everything else raises a :class:`SandboxError` subclass with a user-readable message and a stable
  ``code``: ``timeout`` (wall clock or CPU time), ``memory`` (the process ran out of its memory limit),
  ``output_limit`` (it hit the file-size limit), ``denied`` (the request itself was refused: unknown
  tool, bad argument, a path outside the workspace), ``crashed`` (the interpreter died of a fatal signal
  such as SIGSEGV/SIGABRT, or the sandbox itself died), ``cancelled`` (the caller revoked the action
  while it ran), ``busy`` (every sandbox slot is in use) and ``unavailable`` (no isolation mechanism
  on this host). Errors raised after the process ran carry the
  partial result in ``.result`` (``None`` otherwise).

Nothing in this module does I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SandboxBusy",
    "SandboxCancelled",
    "SandboxCrashed",
    "SandboxDenied",
    "SandboxError",
    "SandboxLimits",
    "SandboxMemoryExceeded",
    "SandboxOutputLimit",
    "SandboxTimeout",
    "SandboxUnavailable",
]


class SandboxError(RuntimeError):
    """Base of every sandbox failure. ``code`` is stable (see the module docstring); ``result`` holds the
    partial result mapping when the action had started, else ``None``."""

    code = "error"

    def __init__(self, message: str, *, result: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.result = result


class SandboxTimeout(SandboxError):
    """The action ran past its wall-clock timeout or its CPU-time limit and was killed."""

    code = "timeout"


class SandboxMemoryExceeded(SandboxError):
    """The action ran out of memory (``MemoryError`` under the address-space limit, or an OOM kill)."""

    code = "memory"


class SandboxOutputLimit(SandboxError):
    """The action exceeded the file-size limit (``RLIMIT_FSIZE``) and was killed by ``SIGXFSZ``."""

    code = "output_limit"


class SandboxDenied(SandboxError, ValueError):
    """The request was refused before anything ran: unknown tool, bad argument, path outside the workspace.

    Also a ``ValueError``, since it is always bad input."""

    code = "denied"


class SandboxCrashed(SandboxError):
    """The interpreter died of a fatal signal (SIGSEGV, SIGABRT, ...) or the sandbox died under it."""

    code = "crashed"


class SandboxCancelled(SandboxError):
    """The caller's cancel event was set while the action ran; the action was killed."""

    code = "cancelled"


class SandboxBusy(SandboxError):
    """Every sandbox slot is running an action; retry later or raise ``max_sandboxes``."""

    code = "busy"


class SandboxUnavailable(SandboxError):
    """No working isolation on this host (bubblewrap missing or refused to start)."""

    code = "unavailable"


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Per-action limits. All sizes are per process unless noted; ``ValueError`` names a bad field.

    - ``timeout_s``: default wall-clock limit; a call may ask for up to ``max_timeout_s``.
    - ``memory_mb``: ``RLIMIT_AS`` of every process of the action (and ``memory.max`` of its cgroup).
    - ``max_procs``: ``RLIMIT_NPROC`` (processes and threads of the sandbox uid): fork-bomb containment.
    - ``max_open_files``: ``RLIMIT_NOFILE``; ``max_file_mb``: ``RLIMIT_FSIZE`` (largest file written).
    - ``output_bytes``: cap per stream (stdout, stderr) kept by the parent; beyond it the action is killed.
    - ``tmp_mb``: size of the sandbox's private ``/tmp`` tmpfs (for the sandbox's lifetime).
    - ``max_request_bytes``: total size of the ``files``/``code`` a call may send.
    - ``kill_grace_s``: after a kill request, how long to wait before tearing the whole sandbox down.
    """

    timeout_s: float = 30.0
    max_timeout_s: float = 600.0
    memory_mb: int = 2048
    max_procs: int = 256
    max_open_files: int = 1024
    max_file_mb: int = 256
    output_bytes: int = 1 << 20
    tmp_mb: int = 256
    max_request_bytes: int = 16 << 20
    kill_grace_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("timeout_s", "max_timeout_s", "kill_grace_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number of seconds, got {value!r}")
        if self.timeout_s > self.max_timeout_s:
            raise ValueError(
                f"SandboxLimits.timeout_s ({self.timeout_s}) exceeds max_timeout_s ({self.max_timeout_s})"
            )
        minimum = {"memory_mb": 32, "max_procs": 4, "max_open_files": 16, "max_file_mb": 1,
                   "output_bytes": 1, "tmp_mb": 1, "max_request_bytes": 1}
        for name, low in minimum.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"SandboxLimits.{name} must be an integer >= {low}, got {value!r}")

    def rlimits(self, *, cpu_seconds: int) -> dict[str, tuple[int, int]]:
        """The ``resource`` limits an action's process gets, by ``RLIMIT_*`` name: ``(soft, hard)``.

        ``RLIMIT_CPU`` has a one-second gap between soft (SIGXCPU) and hard (SIGKILL) limits."""
        mib = 1 << 20
        return {
            "RLIMIT_AS": (self.memory_mb * mib, self.memory_mb * mib),
            "RLIMIT_CPU": (cpu_seconds, cpu_seconds + 1),
            "RLIMIT_FSIZE": (self.max_file_mb * mib, self.max_file_mb * mib),
            "RLIMIT_NPROC": (self.max_procs, self.max_procs),
            "RLIMIT_NOFILE": (self.max_open_files, self.max_open_files),
            "RLIMIT_CORE": (0, 0),
        }
