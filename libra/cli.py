"""``python -m libra COMMAND``: the operator's command line.

Commands: ``status`` (actors and queues; ``--watch`` for a live view), ``keys`` (CurveZMQ key pairs), ``demo`` (start a local broker + actors and run a workload
through them), ``run`` (an RL job file), ``tree`` (build, merge or show C-MLFQ prefix-tree files). Each has ``--help``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

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
    lines.append(_counters(stats))
    planner = stats.get("planner")
    if isinstance(planner, dict):
        lines += ["", planner_line(planner)]
    return "\n".join(lines)


def _counters(stats: dict) -> str:
    return "  ".join(f"{k}={v}" for k, v in stats.items() if v and k != "planner")


def planner_line(p: dict) -> str:
    """One line for the broker planner's status (``stats.planner``): allocation, rounds, plans applied,
    the deployed plan and the last decision."""
    plan = p.get("plan")
    deployed = (f"train {plan['n_train']} ({plan['train']}), rollout TP {plan['rollout_tps']}" if plan
                else "no plan deployed")
    last = p.get("decisions") or [{}]
    reason = last[-1].get("reason", "-")
    return (f"PLANNER {p.get('allocation')} ({p.get('hardware')}/{p.get('model')}, every {p.get('interval_s')} s): "
            f"rounds={p.get('rounds')} plans={p.get('plans_applied')} history={p.get('history')}; {deployed}; "
            f"last: {reason}")


_RATE_KEYS = ("submitted", "completed", "failed", "requeued")


def _watch_lines(broker: str, stats: dict, prev_stats: dict | None, dt: float, clock: str,
                 error: str = "") -> tuple[str, str]:
    head = f"libra status --watch  {broker}  {clock}  (Ctrl-C to quit)"
    if error:
        return head, f"!! {error} (retrying)"
    if not prev_stats or dt <= 0:
        return head, "rates/s: (first sample)"
    rates = [f"{k}={(stats.get(k, 0) - prev_stats.get(k, 0)) / dt:.1f}" for k in _RATE_KEYS if k in stats]
    return head, "rates/s: " + "  ".join(rates)


def render_watch(actors: list[dict], queues: dict[str, int], stats: dict, *, broker: str,
                 prev_stats: dict | None = None, dt: float = 0.0, clock: str = "", error: str = "") -> str:
    """One frame of ``status --watch`` as plain text: header, per-second rates since the last frame, table."""
    head, rates = _watch_lines(broker, stats, prev_stats, dt, clock, error)
    return "\n".join([head, rates, "", format_status(actors, queues, stats)])


def render_watch_rich(actors: list[dict], queues: dict[str, int], stats: dict, *, broker: str,
                      prev_stats: dict | None = None, dt: float = 0.0, clock: str = "", error: str = "") -> Any:
    """The same frame as a ``rich`` renderable (used when rich is installed and stdout is a terminal)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head, rates = _watch_lines(broker, stats, prev_stats, dt, clock, error)
    t = Table(title="actors", title_justify="left", expand=False)
    for col, just in (("ACTOR", "left"), ("HOST", "left"), ("SLOT", "left"), ("KINDS", "left"),
                      ("STATE", "left"), ("LOAD", "right"), ("DONE", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    style = {"idle": "green", "busy": "yellow", "draining": "magenta"}
    for a in sorted(actors, key=lambda a: a["id"]):
        t.add_row(a["id"], a["host"], a["slot"], ",".join(a["kinds"]) or "-",
                  Text(a["state"], style=style.get(a["state"], "")), f"{a['load']}/{a['capacity']}",
                  str(a["completed"]))
    q = Table(title="queues", title_justify="left")
    q.add_column("QUEUE")
    q.add_column("DEPTH", justify="right")
    for k, v in sorted(queues.items()):
        q.add_row(k, str(v))
    parts: list[Any] = [Text(head, style="bold"), Text(rates, style="red" if error else "")]
    parts += [t if actors else Text("(no actors connected)"), q if queues else Text("(no queued work)")]
    parts.append(Text(_counters(stats), style="dim"))
    if isinstance(stats.get("planner"), dict):
        parts.append(Text(planner_line(stats["planner"])))
    return Group(*parts)


def _status_watch(args: argparse.Namespace) -> int:
    """Redraw the status every ``--interval`` seconds until Ctrl-C (or ``--count`` frames)."""
    import time

    from libra.client import BrokerUnreachable, Client

    tty = sys.stdout.isatty()
    live: Any = None
    if tty:
        try:
            from rich.live import Live

            live = Live(auto_refresh=False, screen=False)
        except ImportError:
            live = None
    try:
        with Client(args.broker, connect_timeout=args.timeout) as c:
            if live is not None:
                live.start()
            prev: dict | None = None
            t_prev = 0.0
            frames = 0
            while args.count is None or frames < args.count:
                t0 = time.monotonic()
                kw: dict[str, Any] = {"broker": args.broker, "clock": time.strftime("%H:%M:%S")}
                try:
                    snap = c.status(timeout=args.timeout)
                    actors, queues, stats = snap.actors, snap.queues, snap.stats
                    kw.update(prev_stats=prev, dt=t0 - t_prev)
                    prev, t_prev = dict(stats), t0
                except BrokerUnreachable as exc:
                    actors, queues, stats = [], {}, {}
                    kw["error"] = str(exc)
                if live is not None:
                    live.update(render_watch_rich(actors, queues, stats, **kw), refresh=True)
                else:
                    text = render_watch(actors, queues, stats, **kw)
                    print(("\x1b[H\x1b[2J" + text) if tty else text + "\n", flush=True)
                frames += 1
                if args.count is None or frames < args.count:
                    time.sleep(max(0.0, args.interval - (time.monotonic() - t0)))
    except BrokerUnreachable as exc:
        print(f"libra status: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
    return 0


def _keys(args: argparse.Namespace) -> int:
    from libra.keys import KeyFileError, create_keypair

    try:
        kp = create_keypair(args.out, args.name, overwrite=args.force)
    except KeyFileError as exc:
        print(f"libra keys: {exc}", file=sys.stderr)
        return 2
    print(f"public key file: {kp.public_file}  (copy to the broker's allow-list directory)")
    print(f"secret key file: {kp.secret_file}  (mode 0600; keep on this host)")
    print(f"public key: {kp.public_key.decode()}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from libra.demo import run_demo

    return run_demo(calls=args.calls, cpu_slots=args.cpu_slots, port=args.port)


def _run(args: argparse.Namespace) -> int:
    from libra.config import ConfigError
    from libra.rl.config import load_job
    from libra.rl.driver import JobFailed, run_job

    try:
        cfg = load_job(args.job)
    except ConfigError as exc:
        print(f"libra run: {exc}", file=sys.stderr)
        return 2
    if args.run_dir:
        cfg = cfg.with_run_dir(args.run_dir)
    if args.steps:
        import dataclasses

        cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, steps=args.steps))
    try:
        summary = run_job(cfg, args.broker, progress=not args.no_progress)
    except JobFailed as exc:
        print(f"libra run: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_summary(summary, cfg.job.run_dir))
    return 0


def format_summary(s: dict, run_dir: str) -> str:
    """The end-of-run report: reward first vs last quarter, lag, throughput, where the files are."""
    f, l = s.get("first_quarter_reward", {}), s.get("last_quarter_reward", {})
    fa, la = s.get("first_quarter_accuracy", {}), s.get("last_quarter_accuracy", {})
    return "\n".join([
        f"job {s.get('job')}: {s.get('steps')} steps in {s.get('total_wall_s', 0):.1f}s, final weights version "
        f"{s.get('final_version')}",
        f"reward   first quarter {f.get('mean', float('nan')):.3f} ± {f.get('std', float('nan')):.3f} (n={f.get('n')})"
        f"   last quarter {l.get('mean', float('nan')):.3f} ± {l.get('std', float('nan')):.3f} (n={l.get('n')})",
        f"accuracy first quarter {fa.get('mean', float('nan')):.3f}   last quarter {la.get('mean', float('nan')):.3f}",
        f"max policy lag seen {s.get('max_policy_lag_seen')}, mean generated tokens/s "
        f"{s.get('tokens_per_s_mean', 0):.1f}, dropped groups {s.get('dropped_groups')}",
        f"run directory: {run_dir} (metrics.jsonl, reward.png, throughput.png, checkpoints/)",
    ])


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
    s.add_argument("--watch", action="store_true", help="live view, redrawn every --interval seconds until Ctrl-C")
    s.add_argument("--interval", type=float, default=2.0, help="--watch refresh period in seconds (default 2)")
    s.add_argument("--count", type=int, default=None, help="--watch: stop after this many refreshes")
    s.set_defaults(fn=lambda a: _status_watch(a) if a.watch else _status(a))
    k = sub.add_parser("keys", help="create a CurveZMQ key pair (NAME.key public, NAME.key_secret 0600)",
                       description="Create a CurveZMQ key pair as ZeroMQ certificate files.")
    k.add_argument("--out", required=True, help="directory for the key files (created if missing)")
    k.add_argument("--name", required=True, help="base file name, e.g. broker or actor-gpu0")
    k.add_argument("--force", action="store_true", help="replace existing files of that name")
    k.set_defaults(fn=_keys)
    d = sub.add_parser("demo", help="start a local broker and actors and run tool calls through them",
                       description="Start a broker and actors on loopback, run a workload of tool calls, "
                                   "print what happened, and stop.")
    d.add_argument("--calls", type=int, default=2000, help="number of tool calls (default %(default)s)")
    d.add_argument("--cpu-slots", type=int, default=2, help="CPU actor slots (default %(default)s)")
    d.add_argument("--port", type=int, default=0, help="broker TCP port (default: a free one)")
    d.set_defaults(fn=_demo)
    r = sub.add_parser("run", help="run an RL job file (e.g. examples/arith_tiny.toml)",
                       description="Run an agentic RL job: start a broker and actors on loopback (or join "
                                   "--broker), train with GRPO, write metrics, plots and checkpoints to the "
                                   "job's run directory.")
    r.add_argument("job", help="job TOML file")
    r.add_argument("--broker", default=None, help="join this running broker instead of starting one")
    r.add_argument("--run-dir", default=None, help="override [job] run_dir")
    r.add_argument("--steps", type=int, default=None, help="override [job] steps")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    r.set_defaults(fn=_run)
    from libra.plan_cli import add_parser as add_plan_parser
    from libra.tree_cli import add_parser as add_tree_parser

    add_tree_parser(sub)
    add_plan_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure(args.log_level or "warning")
    return int(args.fn(args))
