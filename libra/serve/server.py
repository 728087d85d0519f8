"""Run the endpoint's app with uvicorn on an asyncio loop the sessions share.

:class:`EndpointServer` binds ``host:port`` itself (port 0: a free one, known before the first request),
then serves on the *calling* event loop (``await start()``), so the endpoint and the sessions' broker client
(:class:`~libra.client.aio.AsyncClient`) live on one loop; or on a loop thread of its own
(``start_in_thread()``), for callers without one. ``shared_endpoint()`` is the one loopback endpoint of an
episode-runner process (one per event loop, started on first use) that :mod:`libra.envs.openai_agent` uses.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

from libra.web_exit import clean_sigterm_server

from .trajectories import TrajectoryRegistry

__all__ = ["EndpointServer", "shared_endpoint"]


class EndpointServer:
    def __init__(self, registry: TrajectoryRegistry | None = None, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        self.registry = registry if registry is not None else TrajectoryRegistry()
        self.host, self.port, self.log_level = host, port, log_level
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def _bind(self) -> socket.socket:
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only then (without it, a
        # response written in two parts waits for the client's delayed ACK: +40 ms per request)
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM,
                             socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = int(sock.getsockname()[1])
        return sock

    def _config(self) -> Any:
        import uvicorn

        from .app import build_app

        return uvicorn.Config(build_app(self.registry), log_config=None, log_level=self.log_level,
                              access_log=False, lifespan="off", timeout_graceful_shutdown=5)

    async def start(self, timeout: float = 30.0) -> str:
        """Serve on the running loop; returns the base URL (``http://HOST:PORT/v1``) once it accepts."""
        import uvicorn

        self.loop = asyncio.get_running_loop()
        self._server = clean_sigterm_server(uvicorn.Server)(self._config())  # SIGTERM: exit 0
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._bind()]))
        deadline = self.loop.time() + timeout
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the reason it stopped
                raise RuntimeError("the endpoint stopped while starting")
            if self.loop.time() > deadline:
                raise TimeoutError("the endpoint did not start")
            await asyncio.sleep(0.01)
        return self.base_url

    async def serve_forever(self, announce: Any = None) -> None:
        """Serve on the running loop until the server is told to exit (SIGINT/SIGTERM in the main thread);
        ``announce(base_url)`` is called once the port is bound."""
        import uvicorn

        self.loop = asyncio.get_running_loop()
        self._server = clean_sigterm_server(uvicorn.Server)(self._config())  # SIGTERM: exit 0
        sock = self._bind()
        if announce is not None:
            announce(self.base_url)
        await self._server.serve(sockets=[sock])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            await self._task

    def start_in_thread(self, timeout: float = 30.0) -> str:
        """Serve on a loop thread of its own; returns the base URL. Run coroutines there with :meth:`call`."""
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="libra-endpoint", daemon=True)
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self.start(timeout), self.loop).result(timeout + 5)

    def call(self, coro: Any, timeout: float | None = None) -> Any:
        """Run ``coro`` on the endpoint's loop thread and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Stop a ``start_in_thread`` server and its loop thread."""
        if self._thread is None or self.loop is None:
            return
        try:
            self.call(self.stop(), 15.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10.0)
            if not self._thread.is_alive():
                self.loop.close()
            self._thread = None


_shared: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Lock, list[EndpointServer]]] = {}


async def shared_endpoint() -> EndpointServer:
    """This loop's loopback endpoint (random port), started on the first call."""
    loop = asyncio.get_running_loop()
    got = _shared.get(id(loop))
    if got is None or got[0] is not loop:  # (a closed loop's id may be reused)
        got = _shared[id(loop)] = (loop, asyncio.Lock(), [])
    _, lock, held = got
    async with lock:
        if not held:
            ep = EndpointServer()
            await ep.start()
            held.append(ep)
    return held[0]
