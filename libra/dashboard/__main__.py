"""``libra dashboard``: a live web dashboard over a broker's status (its own process, a read-only client).

::

    libra dashboard --broker tcp://HOST:5555 [--host 127.0.0.1] [--port 8265] [--token T | $LIBRA_DASHBOARD_TOKEN]

It asks the broker for its status every ``--interval`` seconds (and a running job for its new step records when
the job's summary changed), keeps the last ``--history`` polls in memory and serves the page on
``http://HOST:PORT/``, the latest view on ``/api/status`` (JSON) and one Server-Sent Event per poll on
``/api/events``. CurveZMQ keys come from ``LIBRA_CURVE_SECRET`` / ``LIBRA_BROKER_KEY`` as for ``libra status``;
the timeline of role switches and re-plans needs the broker's audit trail, which an operator's key sees (and a
key of the flat layout, and every peer without CURVE); with a client key the jobs' decision records stand in.
It binds to loopback unless told otherwise, and refuses a non-loopback ``--host`` without a token
(:mod:`libra.dashboard.guard`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys

__all__ = ["build_parser", "main"]

EXTRA_HINT = "pip install 'libra[dashboard]' (starlette and uvicorn)"


class MissingExtra(ImportError):
    """The web server's packages (the ``dashboard`` extra) are not installed."""


def build_parser(prog: str = "libra dashboard") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve a live web dashboard over a broker's status: actors "
                                "by host and slot, queue depths, a timeline of role switches and re-plans, C-MLFQ "
                                "buckets, the action scheduler's cores and the jobs' reward and throughput curves.")
    p.add_argument("--broker", default="tcp://127.0.0.1:5555",
                   help="broker endpoint, or a comma-separated list (a primary and standbys) (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default %(default)s; any other needs --token)")
    p.add_argument("--port", type=int, default=8265, help="port (default %(default)s; 0: a free one)")
    p.add_argument("--token", default=None,
                   help="the token every request must carry (?token= or Authorization: Bearer; default: "
                        "$LIBRA_DASHBOARD_TOKEN); required for a non-loopback --host")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between status polls (default %(default)s)")
    p.add_argument("--history", type=int, default=600, help="polls kept for the charts (default %(default)s)")
    p.add_argument("--log-level", default="warning", help="debug|info|warning|error")
    return p


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    return sock


def _web() -> tuple[object, object]:
    try:
        import starlette
        import uvicorn
    except ImportError as exc:
        raise MissingExtra(f"libra dashboard needs {exc.name}: {EXTRA_HINT}") from None
    return starlette, uvicorn


async def serve(args: argparse.Namespace, token: str | None, curve: object = None) -> None:
    """Poll and serve until SIGINT/SIGTERM (``curve``: the client's CurveZMQ keys, or None)."""
    _, uvicorn = _web()
    from libra.client.aio import AsyncClient
    from libra.web_exit import clean_sigterm_server

    from .app import build_app
    from .history import History
    from .poller import Poller

    sock = _bind(args.host, args.port)
    client = AsyncClient(args.broker, curve=curve)  # type: ignore[arg-type]
    poller = Poller(client, History(args.broker, args.interval, max(2, args.history)), args.interval)
    config = uvicorn.Config(build_app(poller, token), log_config=None, log_level=args.log_level,  # type: ignore[attr-defined]
                            access_log=False, lifespan="off", timeout_graceful_shutdown=2)

    class Server(clean_sigterm_server(uvicorn.Server)):  # type: ignore[attr-defined,misc]  # SIGTERM: exit 0
        async def shutdown(self, sockets: object = None) -> None:
            poller.close()  # end the event streams first: uvicorn waits for open responses to finish
            await super().shutdown(sockets)  # type: ignore[arg-type]

    server = Server(config)
    polling = asyncio.ensure_future(poller.run())
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"libra dashboard: http://{shown}:{port}/{' (open it with ?token=TOKEN)' if token else ''} "
          f"(broker {args.broker}, a status poll every {args.interval:g} s)", flush=True)
    try:
        await server.serve(sockets=[sock])
    finally:
        polling.cancel()
        await asyncio.gather(polling, return_exceptions=True)
        await client.close()


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``prog``: how the usage line names the command (``libra dashboard`` or ``python -m libra.dashboard``)."""
    parser = build_parser(*([prog] if prog else []))
    args = parser.parse_args(argv)
    if not args.interval > 0 or args.history < 2:
        parser.error("--interval must be > 0 and --history at least 2")
    from libra.logging import configure
    from libra.transport.endpoints import endpoints_problem

    from .guard import bind_problem

    name = "libra dashboard"  # as every libra command names itself in its messages
    token = args.token if args.token is not None else (os.environ.get("LIBRA_DASHBOARD_TOKEN") or None)
    problem = endpoints_problem(args.broker) or bind_problem(args.host, token)
    if problem is not None:
        print(f"{name}: {problem}", file=sys.stderr)
        return 2
    from libra.transport.keys import KeyFileError
    from libra.transport.security import CurveClient

    try:
        _web()
        curve = CurveClient.from_env()
    except (MissingExtra, KeyFileError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    configure(args.log_level)
    try:
        asyncio.run(serve(args, token, curve))
    except OSError as exc:  # the port is taken, the address is not this host's
        print(f"{name}: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
