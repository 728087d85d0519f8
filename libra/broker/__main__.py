"""``python -m libra.broker --bind tcp://HOST:PORT [--config FILE]``: run the broker.

With ``--replicate-bind`` it also ships its journal to standby brokers; with ``--standby-of`` it is such a
standby: it follows the primary's journal into its own ``--journal`` without binding ``--bind``, and takes over
(binds and serves, as after a restart) when the primary falls silent (docs/failover.md). With ``--metrics-port`` it
serves ``/metrics``, ``/healthz`` and ``/readyz`` from the start, a standby included (``libra.broker.health``)."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from typing import TYPE_CHECKING

from libra.transport import sdnotify
from libra.transport.endpoints import address_problem
from libra.transport.fdlimit import raise_open_files_limit
from libra.config import ConfigError, from_mapping, load_section
from libra.transport.keys import KeyFileError
from libra.logging import configure, get_logger
from libra.transport.security import CurveClient, CurveServer, InsecureBind, require_curve_or_loopback

from .config import BrokerConfig
from .replication import ReplicationStandby
from .server import BrokerServer

if TYPE_CHECKING:  # imported only when --metrics-port switches the HTTP endpoint on
    from .health import HealthEndpoint


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
    p.add_argument("--idle-heartbeat-s", type=float,
                   help="how often the broker beats an actor that holds none of its work (default 3 x heartbeat)")
    p.add_argument("--max-frame-bytes", type=int, help="largest accepted message (default 64 MiB)")
    p.add_argument("--max-retries", type=int, help="lost assignments tolerated per request (default 3)")
    p.add_argument("--log-level", default=None, help="debug|info|warning|error (default info)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this TCP port at /metrics, and the health probes /healthz and "
                        "/readyz (default: off; 0: any free port)")
    p.add_argument("--metrics-host", default="0.0.0.0",
                   help="address for the metrics endpoint (default: %(default)s)")
    p.add_argument("--health-stall-s", type=float, default=10.0,
                   help="the metrics port also answers /healthz (503 once the broker's loop has not turned for this "
                        "many seconds) and /readyz (200 once bound and serving; a standby only after it took over) "
                        "(default: %(default)s)")
    p.add_argument("--curve-secret", help="broker key pair (NAME.key_secret from 'python -m libra keys'): "
                   "encrypt and authenticate every peer with CurveZMQ")
    p.add_argument("--curve-allow", help="directory of public keys (NAME.key) of actors and clients allowed in")
    p.add_argument("--audit-log", metavar="FILE",
                   help="append the audit trail here, a JSON line each (directives, plan changes, job starts and "
                        "cancels, refused messages, revoked keys, with the key's fingerprint and role); without it "
                        "the records go to the log as 'audit' lines only")
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
    p.add_argument("--replicate-bind", metavar="ENDPOINT",
                   help="also serve the journal to standby brokers here, e.g. tcp://0.0.0.0:5556 (needs --journal): "
                        "each pass's replies wait for the in-sync standbys' acks (docs/failover.md)")
    p.add_argument("--standby-of", metavar="ENDPOINT",
                   help="run as a standby of the primary whose --replicate-bind is ENDPOINT (needs --journal): follow "
                        "its journal without binding --bind; take over when it has been silent --takeover-after-s")
    p.add_argument("--standby-primary-key", metavar="FILE",
                   help="the primary's public key (NAME.key) when the two brokers do not share --curve-secret's "
                        "key pair (default: the standby's own public key)")
    p.add_argument("--takeover-after-s", type=float, help="standby: seconds of primary silence before it takes over "
                   "(default 3.0)")
    p.add_argument("--replica-ack-timeout-s", type=float,
                   help="primary: seconds to wait for a standby's ack before replying alone (default 1.0)")
    p.add_argument("--insecure", action="store_true",
                   help="allow plaintext on a non-loopback endpoint (otherwise refused without --curve-secret)")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``prog``: how the usage line names the command (``libra broker`` when run through ``libra``)."""
    args = build_parser(*([prog] if prog else [])).parse_args(argv)
    configure(args.log_level, cache=True)
    try:
        config = load_section(args.config, "broker", BrokerConfig) if args.config else BrokerConfig()
        overrides = {k: v for k, v in {
            "heartbeat_s": args.heartbeat_s, "liveness": args.liveness, "idle_heartbeat_s": args.idle_heartbeat_s,
            "max_frame_bytes": args.max_frame_bytes, "max_retries": args.max_retries,
            "takeover_after_s": args.takeover_after_s, "replica_ack_timeout_s": args.replica_ack_timeout_s,
        }.items() if v is not None}
        if overrides:
            config = from_mapping(BrokerConfig, {**dataclasses.asdict(config), **overrides}, "command line")
    except ValueError as exc:  # ConfigError, or a value BrokerConfig refuses
        print(f"libra.broker: {exc}", file=sys.stderr)
        return 2
    for flag, endpoint, role in (("bind", args.bind, "bind"), ("replicate-bind", args.replicate_bind, "bind"),
                                 ("standby-of", args.standby_of, "connect")):
        problem = address_problem(endpoint, role) if endpoint else None  # a missing scheme, before the CURVE check
        if problem is None and endpoint and flag != "bind" and not args.journal:
            problem = f"--{flag} needs --journal (the journal is what is replicated)"
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
        for endpoint in (args.replicate_bind, args.standby_of):
            if endpoint:
                require_curve_or_loopback(endpoint, curve is not None, args.insecure)
        standby_curve = _standby_curve(args, curve)
    except (KeyFileError, InsecureBind) as exc:
        print(f"libra.broker: {exc}", file=sys.stderr)
        return 2
    for flag, value in (("router-state-interval-s", args.router_state_interval_s),
                        ("health-stall-s", args.health_stall_s)):
        if not value > 0:
            print(f"libra.broker: --{flag} must be > 0, got {value}", file=sys.stderr)
            return 2
    raise_open_files_limit("broker", advise=True)  # one descriptor per connected actor and client
    return _serve(args, config, curve, standby_curve)


def _serve(args: argparse.Namespace, config: BrokerConfig, curve: CurveServer | None,
           standby_curve: CurveClient | None) -> int:
    """Stand by (``--standby-of``) until taking over, then bind and serve until a signal; the exit status."""
    log = get_logger("libra.broker")
    try:  # /healthz, /readyz and /metrics: up before a standby waits or the endpoint is bound
        http = _http_endpoint(args)
    except (ImportError, OSError) as exc:  # prometheus-client missing, port in use
        log.error("metrics_failed", port=args.metrics_port, error=str(exc))
        print(f"libra.broker: cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {exc}", file=sys.stderr)
        return 1
    if args.standby_of:
        if http is not None:
            http.health.set_phase("standby")  # not ready until it takes over
        if not _stand_by(args, config, standby_curve):
            sdnotify.stopping()
            return 0  # stopped while standing by
        if http is not None:
            http.health.set_phase("starting")  # taking over: opening the journal, binding

    def ready(endpoint: str) -> None:  # bound, and the loop is about to serve
        sdnotify.ready(f"listening on {endpoint}")
        if http is not None:
            http.health.set_phase("serving")

    try:
        server = BrokerServer(args.bind, config, curve=curve, journal=args.journal,
                              router_state=args.router_state, router_state_interval_s=args.router_state_interval_s,
                              ipc=not args.no_ipc, io_threads=args.io_threads, replicate_bind=args.replicate_bind,
                              audit_log=args.audit_log, on_ready=ready)
    except ValueError as exc:  # a setting the core rejects: router, buckets, planner table
        print(f"libra.broker: bad configuration: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # zmq.ZMQError: address in use, bad endpoint
        log.error("bind_failed", endpoint=args.bind, error=str(exc))
        print(f"libra.broker: cannot bind {args.bind}: {exc}", file=sys.stderr)
        return 1
    if http is not None:
        from .metrics import BrokerMetrics

        server.metrics = BrokerMetrics(server.state)
        http.attach(server.metrics)
    server.install_signal_handlers()
    server.serve_forever()
    if http is not None:
        http.close()
    sdnotify.stopping()
    return 0


def _http_endpoint(args: argparse.Namespace) -> HealthEndpoint | None:
    """The metrics port's server (``libra.broker.health``), or None without ``--metrics-port``. Raises ImportError
    (prometheus-client missing) or OSError (the port is taken)."""
    if args.metrics_port is None:
        return None
    from . import metrics  # noqa: F401  (prometheus-client is there: said before anything is bound)
    from .health import BrokerHealth, HealthEndpoint

    http = HealthEndpoint(args.metrics_port, args.metrics_host, BrokerHealth(args.health_stall_s))
    get_logger("libra.broker").info("metrics_serving", host=args.metrics_host, port=http.port,
                                    paths="/metrics /healthz /readyz")
    return http


def _standby_curve(args: argparse.Namespace, curve: CurveServer | None) -> CurveClient | None:
    """The standby's CURVE identity towards its primary: the broker key pair, and the primary's public key
    (its own when the pair of brokers shares one, as actors holding one broker key need)."""
    if curve is None or not args.standby_of:
        return None
    server_key = (CurveClient.from_files(args.curve_secret, args.standby_primary_key).server_key
                  if args.standby_primary_key else curve.public_key)
    return CurveClient(curve.public_key, curve.secret_key, server_key)


def _stand_by(args: argparse.Namespace, config: BrokerConfig, curve: CurveClient | None) -> bool:
    """Follow the primary until it falls silent (True: take over) or a signal stops this process (False)."""
    standby = ReplicationStandby(args.standby_of, args.journal, config, curve=curve)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: standby.stop())
    sdnotify.ready(f"standby of {args.standby_of}")
    return standby.follow()


if __name__ == "__main__":
    sys.exit(main())
