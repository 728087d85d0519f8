"""The dashboard's web app (Starlette): the page, its static files, ``/api/status`` and ``/api/events``.

- ``GET /``: the page (``static/index.html``: plain HTML, a script and uPlot, vendored; no build step);
- ``GET /api/status``: the latest view as JSON (:meth:`libra.dashboard.history.History.view`);
- ``GET /api/events``: Server-Sent Events, one ``data:`` event per poll with the same JSON (the newest view
  first, at once); a page that reads slowly loses old events, never the newest;
- ``GET /static/...``: the page's script, style and the charting library (public: no cluster data).

With a token every route but ``/static/`` needs it (:class:`~libra.dashboard.guard.TokenGuard`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from .poller import Poller

__all__ = ["STATIC", "build_app"]

STATIC = Path(__file__).resolve().parent / "static"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_app(poller: Poller, token: str | None = None) -> Any:
    """The ASGI app over ``poller`` (its history and its subscribers), behind the token when one is given."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import FileResponse, Response, StreamingResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    from .guard import TokenGuard

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def status(request: Request) -> Response:
        return Response(poller.latest, media_type="application/json", headers={"Cache-Control": "no-cache"})

    async def events(request: Request) -> Response:
        q = poller.subscribe()

        async def stream() -> AsyncIterator[str]:
            try:
                yield f"retry: 2000\ndata: {poller.latest}\n\n"
                while (data := await q.get()) is not None:  # None: the server is stopping
                    yield f"data: {data}\n\n"
            finally:
                poller.unsubscribe(q)

        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

    app = Starlette(routes=[Route("/", index), Route("/api/status", status), Route("/api/events", events),
                            Mount("/static", StaticFiles(directory=STATIC), name="static")])
    return TokenGuard(app, token) if token else app
