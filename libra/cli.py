"""``python -m libra COMMAND``: the operator's command line.

Commands: ``status`` (actors and queues), ``demo`` (start a local broker + actors and run a workload
through them). Each has ``--help``.
"""

from __future__ import annotations

import argparse
import json
import sys

from libra.logging import configure


def _status(args: argparse.Namespace) -> int:
    from libra.client import BrokerUnreachable, Client

    try:
        with Client(args.broker, connect_timeout=args.timeout) as c:
            snap = c.status(timeout=args.timeout)
    except BrokerUnreachable as exc:
        print(f"libra status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"actors": snap.actors, "queues": snap.queues, "stats": snap.stats}, indent=None))
        return 0
    print(format_status(snap.actors, snap.queues, snap.stats))
    return 0


def format_status(actors: list[dict], queues: dict[str, int], stats: dict) -> str:
    """Human-readable status table."""
    lines = [f"{'ACTOR':<28} {'HOST':<14} {'SLOT':<6} {'KINDS':<18} {'STATE':<9} {'LOAD':>9} {'DONE':>8}"]
    for a in sorted(actors, key=lambda a: a["id"]):
        load = f"{a['load']}/{a['capacity']}"
        lines.append(f"{a['id']:<28} {a['host']:<14} {a['slot']:<6} {','.join(a['kinds']) or '-':<18} "
                     f"{a['state']:<9} {load:>9} {a['completed']:>8}")
    if not actors:
        lines.append("(no actors connected)")
    lines.append("")
    lines.append("QUEUE" + " " * 29 + "DEPTH")
    for k, v in sorted(queues.items()):
        lines.append(f"{k:<34} {v:>5}")
    if not queues:
        lines.append("(no queued work)")
    lines.append("")
    lines.append("  ".join(f"{k}={v}" for k, v in stats.items() if v))
    return "\n".join(lines)


def _demo(args: argparse.Namespace) -> int:
    from libra.demo import run_demo

    return run_demo(calls=args.calls, cpu_slots=args.cpu_slots, port=args.port)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m libra", description="Libra: resource manager and runtime "
                                "for agentic RL post-training.")
    p.add_argument("--log-level", default=None, help="debug|info|warning|error")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", help="show actors (slot, kinds, state, load) and queue depths",
                       description="Show the actors connected to a broker and its queue depths.")
    s.add_argument("--broker", default="tcp://127.0.0.1:5555", help="broker endpoint (default: %(default)s)")
    s.add_argument("--json", action="store_true", help="print one JSON object with 'actors', 'queues', 'stats'")
    s.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
    s.set_defaults(fn=_status)
    d = sub.add_parser("demo", help="start a local broker and actors and run tool calls through them",
                       description="Start a broker and actors on loopback, run a workload of tool calls, "
                                   "print what happened, and stop.")
    d.add_argument("--calls", type=int, default=2000, help="number of tool calls (default %(default)s)")
    d.add_argument("--cpu-slots", type=int, default=2, help="CPU actor slots (default %(default)s)")
    d.add_argument("--port", type=int, default=0, help="broker TCP port (default: a free one)")
    d.set_defaults(fn=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure(args.log_level or "warning")
    return int(args.fn(args))
