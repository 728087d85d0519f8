"""The broker's health endpoints, on the metrics port beside ``/metrics``: what probes and load balancers ask.

- ``GET /healthz`` (liveness): 200 while the broker's loop turns. Once it serves, the loop's timer ticks every
  quarter second (the metrics tick records the time: :attr:`libra.broker.metrics.BrokerMetrics.last_tick`); no
  tick for ``stall_s`` seconds is a stuck loop: 503. Before the loop starts (loading the journal, a standby
  following its primary) it answers 200: the process is up and no loop of its own can be stuck yet.
- ``GET /readyz`` (readiness): 200 only while the broker serves: its ROUTER endpoint is bound and the loop runs
  it (the ``on_ready`` moment, when systemd is told ``READY=1``) and is not stuck; 503 while it starts, while a
  standby (``--standby-of``) has not taken over, and once it stops.
- Bodies are one small JSON object: ``{"status": "ok"|"starting"|"standby"|"stalled"|"stopping", "phase",
  "last_tick_s"}`` (seconds since the loop's last tick, null before the loop ran). Any other path is the
  Prometheus exposition (``/metrics``) once the broker serves, 503 before.

:class:`BrokerHealth` is the decision (a clock in, answers out: no I/O); :class:`HealthEndpoint` is the HTTP
server, one daemon thread per request (wsgiref), which only reads what the main thread last wrote.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

if TYPE_CHECKING:
    from .metrics import BrokerMetrics

__all__ = ["BrokerHealth", "HealthEndpoint", "PHASES"]

#: The broker's phases, in order; the shell moves them (``__main__``).
PHASES = ("starting", "standby", "serving", "stopping")


class BrokerHealth:
    """What ``/healthz`` and ``/readyz`` answer, from the phase the shell set and the loop's last tick."""

    def __init__(self, stall_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not stall_s > 0:
            raise ValueError(f"stall_s must be > 0, got {stall_s}")
        self.stall_s = stall_s
        self.clock = clock
        self.phase = "starting"
        self.beat: Callable[[], float | None] = lambda: None  # the loop's last tick (its monotonic clock)
        self._serving_since: float | None = None

    def set_phase(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {', '.join(PHASES)}")
        if phase == "serving":
            self._serving_since = self.clock()
        self.phase = phase

    def _since_tick(self, now: float) -> float | None:
        last = self.beat()
        if last is None:  # bound, the first tick not yet due: count from the moment it began serving
            last = self._serving_since
        return None if last is None else max(0.0, now - last)

    def _body(self, status: str, since: float | None) -> dict[str, Any]:
        return {"status": status, "phase": self.phase, "last_tick_s": None if since is None else round(since, 3)}

    def healthz(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of the liveness probe."""
        since = self._since_tick(self.clock()) if self.phase == "serving" else None
        if since is not None and since > self.stall_s:
            return 503, self._body("stalled", since)
        return 200, self._body("ok", since)

    def readyz(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of the readiness probe."""
        if self.phase != "serving":
            return 503, self._body(self.phase, None)
        return self.healthz()


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds the process at exit


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        """Probes every few seconds are not worth a log line each."""


class HealthEndpoint:
    """An HTTP server on ``host:port`` answering ``/healthz``, ``/readyz`` and, once :meth:`attach` gave it the
    broker's metrics, the Prometheus exposition on every other path. Started at construction (``port=0``: any
    free port, see :attr:`port`); raises ``OSError`` when the port cannot be bound."""

    def __init__(self, port: int, host: str = "0.0.0.0", health: BrokerHealth | None = None) -> None:
        self.health = health or BrokerHealth()
        self._metrics_app: Callable[..., Iterable[bytes]] | None = None

        class Server(_Server):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self.server = make_server(host, port, self._app, Server, handler_class=_Quiet)
        self.port = int(self.server.server_port)
        self._thread = threading.Thread(target=self.server.serve_forever, name="libra-http", daemon=True)
        self._thread.start()

    def attach(self, metrics: BrokerMetrics) -> None:
        """Serve ``metrics``' registry, and take the loop's ticks from it."""
        from prometheus_client import make_wsgi_app

        self.health.beat = lambda: metrics.last_tick
        self._metrics_app = make_wsgi_app(metrics.registry)

    def close(self) -> None:
        self.health.set_phase("stopping")
        self.server.shutdown()
        self.server.server_close()

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path in ("/healthz", "/readyz"):
            code, body = self.health.healthz() if path == "/healthz" else self.health.readyz()
            return _json(start_response, code, body)
        app = self._metrics_app
        if app is None:
            return _json(start_response, 503, {"status": self.health.phase, "phase": self.health.phase,
                                               "error": "no metrics before the broker serves"})
        return app(environ, start_response)


def _json(start_response: Callable[..., Any], code: int, body: dict[str, Any]) -> list[bytes]:
    data = json.dumps(body).encode() + b"\n"
    start_response(f"{code} {HTTPStatus(code).phrase}", [("Content-Type", "application/json"),
                                                         ("Content-Length", str(len(data))),
                                                         ("Cache-Control", "no-store")])
    return [data]
