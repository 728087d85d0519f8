"""``NoticeOwner``: a spot-style revocation notice, from a file, an HTTP callback or a POSIX signal.

Each source holds at most one notice ``(received_at, deadline_s, reason)``; the owner reclaims while any
source holds one, with the least time left (``deadline_s - (now - received_at)``, never below 0: the deadline
counts from when the notice arrived, not from when the actor polled). Sources:

- ``file=PATH``: the file present is a notice (received at its mtime); its optional JSON body
  ``{"deadline_s": 30, "reason": "..."}`` sets the deadline and reason; a body that is not that JSON counts
  as a notice with the default deadline (the safe side) and is logged. Removing the file lends again.
- ``http=PORT``: a stdlib ``http.server`` on ``127.0.0.1:PORT`` (0: a free one, :attr:`NoticeOwner.http_port`)
  on a daemon thread: ``POST /reclaim`` (optional JSON body as above), ``POST /lend``, ``GET /`` (the state
  as JSON). Closed by :meth:`NoticeOwner.close`.
- ``signal=USR1``: that signal is a notice with the default deadline; the other of USR1/USR2 lends again.
  Python installs signal handlers only in the main thread: building the owner elsewhere raises
  :class:`~.base.OwnerError`. :meth:`close` restores the previous handlers.

A reason from the owner is kept when it is a snake_case word (``[a-z0-9_]``, up to 64), else ``spot_notice``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from libra.logging import get_logger
from libra.policies.lending import OwnerSignal

from .errors import OwnerError

__all__ = ["NoticeOwner"]

log = get_logger(__name__)

_REASON = re.compile(r"^[a-z0-9_]{1,64}$")
Notice = tuple[float, float, str]  # (received_at, deadline_s, reason)


def notice_from_body(body: bytes, received_at: float, default_deadline_s: float) -> Notice:
    """The notice a JSON body describes; raises ``ValueError`` for a body that is not the documented JSON."""
    if not body.strip():
        return (received_at, default_deadline_s, "spot_notice")
    doc = json.loads(body)
    if not isinstance(doc, dict) or set(doc) - {"deadline_s", "reason"}:
        raise ValueError('want a JSON object {"deadline_s": seconds, "reason": "word"}')
    d = doc.get("deadline_s", default_deadline_s)
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not (0 <= d < float("inf")):
        raise ValueError(f"deadline_s must be a number >= 0, got {d!r}")
    r = doc.get("reason", "spot_notice")
    return (received_at, float(d), r if isinstance(r, str) and _REASON.match(r) else "spot_notice")


class NoticeOwner:
    """See the module docstring. ``file``, ``http_port``, ``signal_name``: the sources (at least one)."""

    def __init__(self, name: str, *, file: str | os.PathLike[str] | None = None, http_port: int | None = None,
                 signal_name: str | None = None, deadline_s: float = 30.0) -> None:
        if file is None and http_port is None and signal_name is None:
            raise OwnerError("NoticeOwner: give at least one of file, http_port, signal_name")
        self.name, self.deadline_s = name, float(deadline_s)
        self.file = None if file is None else os.fspath(file)
        self._file_seen: tuple[int, int] | None = None  # (mtime_ns, size) of the file last read
        self._file_notice: Notice | None = None
        self._http_notice: Notice | None = None  # written by the HTTP thread (one assignment: atomic)
        self._signal_notice: Notice | None = None  # written by the signal handler (one assignment)
        self._old_handlers: dict[int, Any] = {}
        self._server: ThreadingHTTPServer | None = None
        self.http_port: int | None = None
        if signal_name is not None:
            self._install_signals(signal_name)
        if http_port is not None:
            try:
                self._start_http(http_port)
            except BaseException:
                self.close()
                raise

    # -- sources -----------------------------------------------------------------------------------

    def _install_signals(self, name: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise OwnerError("NoticeOwner signal=: Python installs signal handlers only in the main thread; "
                             "build this owner there (or use file= or http=)")
        if name not in ("USR1", "USR2"):
            raise OwnerError(f"NoticeOwner signal_name: USR1 or USR2, got {name!r}")
        reclaim = signal.Signals[f"SIG{name}"]
        lend = signal.SIGUSR2 if reclaim == signal.SIGUSR1 else signal.SIGUSR1

        def on_reclaim(signum: int, frame: Any) -> None:
            self._signal_notice = (time.time(), self.deadline_s, "spot_notice")

        def on_lend(signum: int, frame: Any) -> None:
            self._signal_notice = None

        self._old_handlers[reclaim] = signal.signal(reclaim, on_reclaim)
        self._old_handlers[lend] = signal.signal(lend, on_lend)

    def _start_http(self, port: int) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
                return

            def _reply(self, status: int, doc: dict[str, Any]) -> None:
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path != "/":
                    return self._reply(404, {"error": f"unknown path {self.path}"})
                self._reply(200, owner.state(time.time()))

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/lend":
                    owner._http_notice = None
                elif self.path == "/reclaim":
                    try:
                        owner._http_notice = notice_from_body(body, time.time(), owner.deadline_s)
                    except ValueError as exc:
                        return self._reply(400, {"error": f"bad notice body: {exc}"})
                else:
                    return self._reply(404, {"error": f"unknown path {self.path}"})
                self._reply(200, owner.state(time.time()))

        try:
            self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        except OSError as exc:
            raise OwnerError(f"NoticeOwner http={port}: cannot listen on 127.0.0.1:{port}: {exc}") from None
        self._server.daemon_threads = True
        self.http_port = int(self._server.server_address[1])
        threading.Thread(target=self._server.serve_forever, name=f"lend-notice-{self.name}", daemon=True).start()

    def _read_file(self) -> Notice | None:
        assert self.file is not None
        try:
            st = os.stat(self.file)
        except FileNotFoundError:
            self._file_seen = self._file_notice = None
            return None
        except OSError as exc:  # unreadable: the safe side is a notice
            log.warning("lend_notice_file_unreadable", owner=self.name, file=self.file, error=str(exc))
            return (time.time(), self.deadline_s, "spot_notice")
        seen = (st.st_mtime_ns, st.st_size)
        if seen != self._file_seen:
            self._file_seen = seen
            try:
                with open(self.file, "rb") as f:
                    body = f.read(65536)
                self._file_notice = notice_from_body(body, st.st_mtime, self.deadline_s)
            except (OSError, ValueError) as exc:
                log.warning("lend_notice_file_bad", owner=self.name, file=self.file, error=str(exc))
                self._file_notice = (st.st_mtime, self.deadline_s, "spot_notice")
        return self._file_notice

    # -- Owner ---------------------------------------------------------------------------------------

    def notices(self) -> list[Notice]:
        """The notices held now, one per source at most."""
        got = [self._read_file() if self.file is not None else None, self._http_notice, self._signal_notice]
        return [n for n in got if n is not None]

    def poll(self, now: float) -> OwnerSignal:
        held = self.notices()
        if not held:
            return OwnerSignal(True)
        left, reason = min((max(0.0, d - max(0.0, now - at)), r) for at, d, r in held)
        return OwnerSignal(False, left, reason)

    def state(self, now: float) -> dict[str, Any]:
        """What ``GET /`` answers: the owner, whether it lends, and the deadline and reason when not."""
        sig = self.poll(now)
        return {"owner": self.name, "allow": sig.allow, "deadline_s": sig.deadline_s, "reason": sig.reason}

    def close(self) -> None:
        """Stop the HTTP server and restore the signal handlers (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for signum, old in list(self._old_handlers.items()):
            if threading.current_thread() is threading.main_thread():
                signal.signal(signum, old)
            del self._old_handlers[signum]
