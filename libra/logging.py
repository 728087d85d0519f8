"""The one structlog configuration of Libra.

Every entry point calls :func:`configure` once; library modules only call :func:`get_logger`.
Output is JSON lines when stderr is not a TTY (journald, CI, files) and a readable console
format otherwise. Third-party stdlib loggers (pyzmq, torch, transformers) are routed through the
same processors so every line has one shape. Event names are static snake_case verbs with
key/value fields (``log.info("work_assigned", work_id=..., actor=...)``), never f-strings.
Per-request context (``work_id``, ``trajectory``) is bound with :func:`bind_context`.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import structlog

_configured = False

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


#: Where console log lines go instead of stderr while :func:`console_writer` is active (one line, no newline).
_writer: Callable[[str], None] | None = None
_pending = ""  # a line written in parts (print writes the message, then its newline)


class _Stderr:
    """Writes to whatever ``sys.stderr`` is at write time, not at :func:`configure` time (a test harness or a
    daemoniser may swap it, and a closed captured stream must not break later log lines). Inside
    :func:`console_writer` whole lines go to its writer instead."""

    def write(self, text: str) -> int:
        global _pending
        writer = _writer
        if writer is None:
            return sys.stderr.write(text)
        _pending += text
        *lines, _pending = _pending.split("\n")
        for line in lines:
            writer(line)
        return len(text)

    def flush(self) -> None:
        if _writer is None:
            sys.stderr.flush()


@contextmanager
def console_writer(write: Callable[[str], None]) -> Iterator[None]:
    """Send every log line (structlog's and the stdlib's) to ``write`` (one line, without its newline) inside
    the block instead of to stderr: ``libra run`` passes ``tqdm.write`` while its progress bars are live, so
    a warning prints above the bars instead of breaking into them. Blocks do not nest: the outer writer
    comes back when the inner block ends."""
    global _writer, _pending
    before, _writer = _writer, write
    try:
        yield
    finally:
        if _pending and _writer is write:
            write(_pending)
        _writer, _pending = before, ""


def current_console_writer() -> Callable[[str], None] | None:
    """The writer of the innermost active :func:`console_writer` block, or None."""
    return _writer


def configure(level: str | None = None, *, json: bool | None = None, cache: bool = False) -> None:
    """Configure structlog and stdlib logging. Idempotent: later calls only change the level.

    ``level`` defaults to ``$LIBRA_LOG_LEVEL`` or ``info``; ``json`` defaults to ``$LIBRA_LOG_JSON`` (``0``:
    the console format, ``1``: JSON; ``libra run`` sets 0 for the processes whose stderr it pipes to its
    terminal) or else to "stderr is not a TTY".
    ``cache=True`` is for long-running production entry points only (cached loggers cannot cross
    process boundaries and hide later reconfiguration in tests).
    """
    global _configured
    lvl = _LEVELS.get((level or os.environ.get("LIBRA_LOG_LEVEL", "info")).lower(), logging.INFO)
    if json is None:
        env = os.environ.get("LIBRA_LOG_JSON", "").strip().lower()
        json = env in ("1", "true", "yes", "on") if env else not sys.stderr.isatty()
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,  # ambient ids bound at the I/O edge
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=cache,
    )
    # Foreign (stdlib) records get the same shape.
    handler = logging.StreamHandler(_Stderr())  # type: ignore[arg-type]
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(lvl, logging.WARNING))
    _configured = True


def get_logger(name: str | None = None, **initial: Any) -> Any:
    """A structlog logger; ``name`` is recorded as the ``component`` field."""
    if name:
        initial["component"] = name
    # get_logger(**initial) stays lazy: the configuration in force at first use applies, so module-level
    # loggers created at import time still honour configure() called later by the entry point.
    return structlog.get_logger(**initial)


@contextmanager
def bind_context(**ids: Any) -> Iterator[None]:
    """Bind ids (``work_id``, ``trajectory``, ``actor``) to every log line inside the block."""
    with structlog.contextvars.bound_contextvars(**ids):
        yield
