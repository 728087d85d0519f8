"""Who may read the dashboard: the bind rule and the token check.

The dashboard shows the whole cluster (actors, jobs, the audit trail's key fingerprints), so it binds to loopback
by default, and a bind to any other address (``--host 0.0.0.0``, a LAN address, a host name that resolves to
one) needs a token (``--token`` or ``LIBRA_DASHBOARD_TOKEN``, at least :data:`MIN_TOKEN_CHARS` characters):
without one the command refuses to start (:func:`bind_problem`). With a token, every request but the packaged
static files (the charting library, the page's script and style: no cluster data) must carry it, as
``Authorization: Bearer TOKEN`` or ``?token=TOKEN`` (how a browser opens the page; the page passes it on to
``/api/status`` and ``/api/events``); anything else is answered 401 (:class:`TokenGuard`).
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from typing import Any
from urllib.parse import parse_qs

__all__ = ["MIN_TOKEN_CHARS", "TokenGuard", "bind_problem", "is_loopback"]

MIN_TOKEN_CHARS = 16
TOKEN_HINT = "python3 -c 'import secrets; print(secrets.token_urlsafe(24))'"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is a loopback address; a name must resolve to loopback only
    (one that does not resolve is not loopback)."""
    h = host.strip("[]")
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(h, None)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%", 1)[0]).is_loopback for i in infos)


def bind_problem(host: str, token: str | None) -> str | None:
    """Why the dashboard must not start on ``host`` with ``token`` (None: it may)."""
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        return (f"the dashboard token must be at least {MIN_TOKEN_CHARS} characters (got {len(token)}); "
                f"make one with: {TOKEN_HINT}")
    if token is None and not is_loopback(host):
        return (f"--host {host} is not a loopback address, and the dashboard shows the whole cluster: give it a token "
                f"(--token or LIBRA_DASHBOARD_TOKEN; make one with: {TOKEN_HINT}), or bind to 127.0.0.1 and "
                "reach it through an SSH tunnel")
    return None


class TokenGuard:
    """ASGI middleware: 401 for a request without the token (see the module docstring)."""

    def __init__(self, app: Any, token: str, public_prefix: str = "/static/") -> None:
        self.app, self.token, self.public_prefix = app, token.encode(), public_prefix

    def allowed(self, scope: dict[str, Any]) -> bool:
        given = b""
        for name, value in scope.get("headers") or ():
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
        if not given:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            given = (query.get("token") or [""])[0].encode()
        return bool(given) and hmac.compare_digest(given, self.token)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"].startswith(self.public_prefix) or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        from starlette.responses import PlainTextResponse

        response = PlainTextResponse("401: this dashboard needs its token: open /?token=TOKEN in a browser, or send "
                                     "'Authorization: Bearer TOKEN'\n", status_code=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
