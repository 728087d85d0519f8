"""From what happened to an action to what the caller gets: a result mapping or a typed error (pure).

Role: :func:`interpret_outcome` applies the contract documented in :mod:`libra.engines.sandbox.errors`
to a :class:`~libra.engines.sandbox.proc.RawOutcome`. Order of precedence: the pool's wall-clock kill
(timeout) first, then the caller's cancellation, then a sandbox that died under the action (crashed), then output over the cap (a
truncated *result* with ``killed = "output_limit"``), then the way the process ended: ``SIGXCPU`` (CPU-time limit: timeout), ``SIGXFSZ``
(file-size limit: output_limit), ``SIGKILL`` with the cgroup's OOM counter raised (memory), a fatal
signal such as ``SIGSEGV``/``SIGABRT`` (crashed); a nonzero exit whose stderr ends in ``MemoryError``
(memory, for tools that run Python); anything else is a result, including other nonzero exits and
other signals (``exit_code`` is then ``-signum``, as in :mod:`subprocess`).
"""

from __future__ import annotations

import os
import signal
from typing import Any

from libra.engines.sandbox.errors import (
    SandboxCancelled,
    SandboxCrashed,
    SandboxLimits,
    SandboxMemoryExceeded,
    SandboxOutputLimit,
    SandboxTimeout,
)
from libra.engines.sandbox.proc import RawOutcome
from libra.engines.sandbox.tools import ToolCall

__all__ = ["FATAL_SIGNALS", "interpret_outcome"]

FATAL_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE,
                           signal.SIGSYS, signal.SIGTRAP})


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _ends_with_memory_error(stderr: str) -> bool:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return bool(lines) and lines[-1].startswith("MemoryError")


def interpret_outcome(tool: str, call: ToolCall, out: RawOutcome, limits: SandboxLimits) -> dict[str, Any]:
    """The result mapping for ``out``, or raise the matching :class:`SandboxError` (module docstring).

    Every error raised here carries the (partial) result mapping in ``.result``."""
    result: dict[str, Any] = {
        "stdout": out.stdout.decode("utf-8", errors="replace"),
        "stderr": out.stderr.decode("utf-8", errors="replace"),
        "exit_code": None,
        "truncated": dict(out.truncated),
        "duration_s": out.duration_s,
        "killed": None,
    }
    if out.status is not None:
        result["exit_code"] = -os.WTERMSIG(out.status) if os.WIFSIGNALED(out.status) else os.WEXITSTATUS(out.status)
    if out.killed == "timeout":
        raise SandboxTimeout(f"{tool} action exceeded its {call.timeout_s:g} s wall-clock timeout and was killed "
                             "(partial output in .result)", result=result)
    if out.killed == "cancelled":
        raise SandboxCancelled(f"{tool} action was cancelled by the caller and killed", result=result)
    if out.sandbox_died or out.status is None:
        raise SandboxCrashed(f"the sandbox died while running the {tool} action (it will be restarted; the "
                             "workspace is kept)", result=result)
    if out.killed == "output_limit":
        # The documented contract for output over the cap: a truncated result (the model sees what the
        # code printed), marked as killed so that nobody mistakes it for a run that finished.
        result["killed"] = "output_limit"
        return result
    if os.WIFSIGNALED(out.status):
        sig = os.WTERMSIG(out.status)
        if sig == signal.SIGXCPU:
            raise SandboxTimeout(f"{tool} action used up its CPU-time limit and was killed (SIGXCPU)", result=result)
        if sig == signal.SIGXFSZ:
            raise SandboxOutputLimit(f"{tool} action wrote a file larger than {limits.max_file_mb} MiB and was "
                                     "killed (SIGXFSZ)", result=result)
        if sig == signal.SIGKILL and out.oom_killed:
            raise SandboxMemoryExceeded(f"{tool} action was killed by the out-of-memory killer (limit "
                                        f"{limits.memory_mb} MiB)", result=result)
        if sig in FATAL_SIGNALS:
            raise SandboxCrashed(f"{tool} action crashed: the process died of {_signal_name(sig)}", result=result)
    elif result["exit_code"] != 0 and call.memory_hint and _ends_with_memory_error(result["stderr"]):
        raise SandboxMemoryExceeded(f"{tool} action ran out of memory (limit {limits.memory_mb} MiB address "
                                    "space per process)", result=result)
    return call.finish(result) if call.finish is not None else result
