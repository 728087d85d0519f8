"""The broker shell's audit log: the core's :class:`~libra.broker.events.Audit` records (``libra.broker.access``:
directives, plan changes, job starts and cancels, refused messages, revoked keys, each with the fingerprint and
role of the key behind it), one JSON line each with the wall-clock time, appended to a file that nothing in
Libra ever rewrites or truncates.

The file is opened with ``O_APPEND`` (mode 0600) and each record goes out in one ``write`` as it is made, so a
broker crash loses none (the kernel has it; a power loss can lose what the disk had not synced). Without a
file (``--audit-log`` not given) the records still go to the broker's log as ``audit`` lines, and the newest
stay in memory for an operator's ``libra status``.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["AuditLog"]


class AuditLog:
    """Appends audit records to ``path`` (created if missing; its directory must exist)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ValueError(f"cannot open the audit log {self.path}: {exc.strerror}") from None
        self.written = 0

    def write(self, record: dict[str, Any]) -> None:
        """Append one record, with ``time`` (UTC, ISO 8601) first."""
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
        line = json.dumps({"time": stamp, **record}, default=str, separators=(",", ":")) + "\n"
        os.write(self._fd, line.encode("utf-8"))
        self.written += 1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
