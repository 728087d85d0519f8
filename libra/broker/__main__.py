"""``python -m libra.broker --bind tcp://HOST:PORT [--config FILE]``: run the broker."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from libra.transport import sdnotify
from libra.transport.endpoints import address_problem
from libra.config import ConfigError, from_mapping, load_section
from libra.transport.keys import KeyFileError
from libra.logging import configure, get_logger
from libra.transport.security import CurveServer, InsecureBind, require_curve_or_loopback

from .config import BrokerConfig
from .server import BrokerServer


def build_parser(prog: str = "python -m libra.broker") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run the Libra broker: actors and clients connect to its one ROUTER endpoint.",
    )
    p.add_argument("--bind", default="tcp://127.0.0.1:5555",
                   help="ZeroMQ endpoint to bind, e.g. tcp://0.0.0.0:5555 (default: %(default)s)")
    p.add_argument("--config", help="TOML file with a [broker] table of BrokerConfig fields")
    p.add_argument("--heartbeat-s", type=float, help="heartbeat interval in seconds (default 1.0)")
    p.add_argument("--liveness", type=int, help="missed heartbeats before a peer is dead (default 3)")
    p.add_argument("--max-frame-bytes", type=int, help="largest accepted message (default 64 MiB)")
    p.add_argument("--max-retries", type=int, help="lost assignments tolerated per request (default 3)")
    p.add_argument("--log-level", default=None, help="debug|info|warning|error (default info)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this TCP port at /metrics (default: off; 0: any free port)")
    p.add_argument("--metrics-host", default="0.0.0.0",
                   help="address for the metrics endpoint (default: %(default)s)")
    p.add_argument("--curve-secret", help="broker key pair (NAME.key_secret from 'python -m libra keys'): "
                   "encrypt and authenticate every peer with CurveZMQ")
    p.add_argument("--curve-allow", help="directory of public keys (NAME.key) of actors and clients allowed in")
    p.add_argument("--journal", help="SQLite file journaling accepted work and replies: after a crash and restart, "
                   "unanswered work is re-queued and retried request ids get their original reply")
    p.add_argument("--router-state", metavar="FILE",
                   help="JSON file keeping the rollout router's learned state (C-MLFQ's causal prefix trees): loaded "
                        "at start when present (an unreadable one is moved aside), saved every --router-state-interval-s "
                        "and at shutdown, atomically")
    p.add_argument("--router-state-interval-s", type=float, default=60.0,
                   help="seconds between router-state saves (default: %(default)s)")
    p.add_argument("--no-ipc", action="store_true",
                   help="bind no Unix socket beside the TCP endpoint (by default, peers on this host given a "
                        "loopback endpoint use one; LIBRA_IPC=0 does the same)")
    p.add_argument("--io-threads", type=int, default=1,
                   help="libzmq I/O threads (default %(default)s: one is enough up to tens of thousands of "
                        "messages/s; add one per ~2 busy cores beyond)")
    p.add_argument("--insecure", action="store_true",
                   help="allow plaintext on a non-loopback endpoint (otherwise refused without --curve-secret)")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``prog``: how the usage line names the command (``libra broker`` when run through ``libra``)."""
    args = build_parser(*([prog] if prog else [])).parse_args(argv)
    configure(args.log_level, cache=True)
    log = get_logger("libra.broker")
    try:
        config = load_section(args.config, "broker", BrokerConfig) if args.config else BrokerConfig()
        overrides = {k: v for k, v in {
            "heartbeat_s": args.heartbeat_s, "liveness": args.liveness,
            "max_frame_bytes": args.max_frame_bytes, "max_retries": args.max_retries,
        }.items() if v is not None}
        if overrides:
            config = from_mapping(BrokerConfig, {**dataclasses.asdict(config), **overrides}, "command line")
    except ConfigError as exc:
        print(f"libra.broker: {exc}", file=sys.stderr)
        return 2
    problem = address_problem(args.bind, "bind")  # a missing scheme is said as such, before the CURVE check
    if problem is not None:
        print(f"libra.broker: {problem}", file=sys.stderr)
        return 2
    try:
        # systemd Type=notify: READY once bound and serving (a no-op outside systemd)
        curve = None
        if args.curve_secret or args.curve_allow:
            if not (args.curve_secret and args.curve_allow):
                print("libra.broker: --curve-secret and --curve-allow go together", file=sys.stderr)
                return 2
            curve = CurveServer.from_files(args.curve_secret, args.curve_allow)
        require_curve_or_loopback(args.bind, curve is not None, args.insecure)
    except (KeyFileError, InsecureBind) as exc:
        print(f"libra.broker: {exc}", file=sys.stderr)
        return 2
    if not args.router_state_interval_s > 0:
        print(f"libra.broker: --router-state-interval-s must be > 0, got {args.router_state_interval_s}", file=sys.stderr)
        return 2
    try:
        server = BrokerServer(args.bind, config, curve=curve, journal=args.journal,
                              router_state=args.router_state, router_state_interval_s=args.router_state_interval_s,
                              ipc=not args.no_ipc, io_threads=args.io_threads,
                              on_ready=lambda ep: sdnotify.ready(f"listening on {ep}"))
    except ValueError as exc:  # a setting the core rejects: router, buckets, planner table
        print(f"libra.broker: bad configuration: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # zmq.ZMQError: address in use, bad endpoint
        log.error("bind_failed", endpoint=args.bind, error=str(exc))
        print(f"libra.broker: cannot bind {args.bind}: {exc}", file=sys.stderr)
        return 1
    if args.metrics_port is not None:
        try:
            from .metrics import BrokerMetrics

            server.metrics = BrokerMetrics(server.state)
            port = server.metrics.serve(args.metrics_port, args.metrics_host)
        except (ImportError, OSError) as exc:  # prometheus-client missing, port in use
            log.error("metrics_failed", port=args.metrics_port, error=str(exc))
            print(f"libra.broker: cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {exc}",
                  file=sys.stderr)
            return 1
        log.info("metrics_serving", host=args.metrics_host, port=port)
    server.install_signal_handlers()
    server.serve_forever()
    sdnotify.stopping()
    return 0


if __name__ == "__main__":
    sys.exit(main())
