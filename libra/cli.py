"""``python -m libra COMMAND``: the operator's command line.

Commands: ``status`` (actors and queues; ``--watch`` for a live view), ``keys`` (CurveZMQ key pairs), ``demo`` (start a local broker + actors and run a workload
through them), ``run`` (an RL job file), ``tree`` (build, merge or show C-MLFQ prefix-tree files), ``serve`` (the
OpenAI-compatible endpoint over a running cluster, ``libra.commands.serve``), ``dashboard`` (a live web dashboard over a
broker's status, ``libra.dashboard``). Each has ``--help``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from libra.commands.status import format_status, render_watch, render_watch_rich
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
    from libra.transport.keys import KeyFileError, create_keypair

    if args.role and not args.allow:
        print("libra keys: --role needs --allow (it says where in the allow directory the key goes)", file=sys.stderr)
        return 2
    from libra.transport.scopes import ROLE_DIRS, fingerprint, job_dir_ok

    if args.job is not None and (args.role != "client" or not job_dir_ok(args.job)):
        print("libra keys: --job needs --allow --role client and a job name (no '/', ':' or ',', not starting "
              f"with '.'), got {args.job!r}", file=sys.stderr)
        return 2
    try:
        kp = create_keypair(args.out, args.name, overwrite=args.force)
    except KeyFileError as exc:
        print(f"libra keys: {exc}", file=sys.stderr)
        return 2
    import shutil
    from pathlib import Path

    allowed = Path(args.out) / "allowed"  # the broker's --curve-allow directory (it refuses to start without one)
    allowed.mkdir(parents=True, exist_ok=True)
    place = allowed / ROLE_DIRS[args.role] if args.role else allowed
    if args.job is not None:
        place = place / args.job  # a job-scoped client key: that job's work, rows and data only
    if args.allow:
        place.mkdir(parents=True, exist_ok=True)
        shutil.copy(kp.public_file, place / kp.public_file.name)
    print(f"public key file: {kp.public_file}  "
          + (f"(allowed as {args.role or 'any role'}{f' of job {args.job}' if args.job else ''}: copied to {place}/)"
             if args.allow
             else f"(to let it in, copy it to the broker's allow directory, e.g. {allowed}/)"))
    print(f"secret key file: {kp.secret_file}  (mode 0600; keep on this host)")
    print(f"allow directory: {allowed}  (the broker's --curve-allow)")
    print(f"public key: {kp.public_key.decode()}  "
          f"(fingerprint {fingerprint(kp.public_key)}, as the broker's audit log names it)")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from libra.commands.demo import run_demo

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
    import signal

    def _terminate(signum: int, _frame: object) -> None:
        # SIGTERM (systemd, kill, a CI timeout) unwinds like Ctrl-C: the job is cancelled and the local
        # broker and actors this command started are stopped, instead of outliving it.
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _terminate)
    try:
        summary = run_job(cfg, args.broker, progress=not args.no_progress, resume=args.resume)
    except (JobFailed, ConfigError) as exc:
        print(f"libra run: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_summary(summary, cfg.job.run_dir))
    return 0


def _quarter_lines(q: dict) -> list[str]:
    """Per-episode figures of the first and last quarter (mean ± std, n) as the summary's ``quarters``
    holds them; none for a summary without them."""
    if not q:
        return []
    nan = float("nan")

    def cell(d: dict) -> str:
        return f"{d.get('mean', nan):.3f} ± {d.get('std', nan):.3f} (n={d.get('n', 0)})"

    out = ["per episode            first quarter           last quarter"]
    for key, label in (("tool_calls_per_episode", "tool calls/episode"), ("tool_success_rate", "tool success rate"),
                       ("accuracy", "accuracy"), ("reward", "reward")):
        out.append(f"  {label:<20} {cell(q.get('first', {}).get(key, {})):<23} {cell(q.get('last', {}).get(key, {}))}")
    return out


def format_summary(s: dict, run_dir: str) -> str:
    """The end-of-run report: each figure once (the per-episode quarters with n, lag, throughput), and
    where the files are."""
    return "\n".join([
        f"job {s.get('job')}: {s.get('steps')} steps in {s.get('total_wall_s', 0):.1f}s, final weights version "
        f"{s.get('final_version')}",
        *_quarter_lines(s.get("quarters") or {}),
        f"max policy lag seen {s.get('max_policy_lag_seen')}, mean generated tokens/s "
        f"{s.get('tokens_per_s_mean', 0):.1f}, dropped groups {s.get('dropped_groups')}",
        *_eval_lines(s.get("eval") or {}),
        f"run directory: {run_dir} (metrics.jsonl, reward.png, throughput.png, checkpoints/)",
        *(["trackers ([job] loggers): " + ", ".join(f"{k} {v}" for k, v in s["loggers"].items())]
          if s.get("loggers") else []),
    ])


def _eval_lines(ev: dict) -> list[str]:
    """The first and the last eval round of ``summary["eval"]`` (libra.rl.evals.eval_summary), if any."""
    if not ev:
        return []

    def cell(d: dict) -> str:
        return ", ".join(f"{k} {v:.3f}" for k, v in d.items() if k != "step" and isinstance(v, (int, float)))

    head = f"eval ({ev.get('rounds')} rounds, {ev.get('prompts')} prompts, eval.png): "
    first, last = ev["first"], ev["last"]
    if first.get("step") == last.get("step"):  # one round: say it once
        return [f"{head}step {last['step']}: {cell(last)}"]
    return [f"{head}step {first['step']}: {cell(first)}; step {last['step']}: {cell(last)}"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("libra")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def build_parser(prog: str = "libra") -> argparse.ArgumentParser:
    from libra.transport.scopes import ROLE_DIRS  # pure text: no zmq for 'libra --help'

    p = argparse.ArgumentParser(prog=prog, description="Libra: resource manager and runtime "
                                "for agentic RL post-training.")
    p.add_argument("--version", action="version", version=f"libra {_version()}")
    p.add_argument("--log-level", default=None, help="debug|info|warning|error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, text) in DELEGATES.items():
        sub.add_parser(name, help=text, add_help=False)  # parsed by the component itself (see main)
    s = sub.add_parser("status", help="show actors (slot, kinds, state, load) and queue depths",
                       description="Show the actors connected to a broker and its queue depths.")
    s.add_argument("--broker", default="tcp://127.0.0.1:5555",
                   help="broker endpoint, or a comma-separated list (a primary and standbys) (default: %(default)s)")
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
    k.add_argument("--allow", action="store_true",
                   help="also put the public key in OUT/allowed/ (the directory the broker's --curve-allow reads)")
    k.add_argument("--role", choices=tuple(ROLE_DIRS),
                   help="with --allow: the key's role, in OUT/allowed/{actors,clients,operators}/ (an actor key may "
                        "only serve, a client key only call, an operator key call and direct slots); without "
                        "it the key may do anything")
    k.add_argument("--job", help="with --allow --role client: bind the key to this job (OUT/allowed/clients/JOB/): it "
                                 "may submit, poll and cancel only that job and fetch only its data")
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
    r.add_argument("--no-progress", action="store_true",
                   help="no progress bars (none from transformers either, here or in the job's processes)")
    r.add_argument("--resume", action="store_true",
                   help="continue the job in its run directory from its last checkpoint, in the same data order")
    r.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    r.set_defaults(fn=_run)
    from libra.commands.plan import add_parser as add_plan_parser
    from libra.commands.tree import add_parser as add_tree_parser

    add_tree_parser(sub)
    add_plan_parser(sub)
    return p


#: Subcommands that hand the rest of the command line to a component's own entry point (its ``main(argv)``),
#: imported only when chosen, so ``libra status`` never loads the broker, the simulator or the benchmarks.
DELEGATES: dict[str, tuple[str, str]] = {
    "broker": ("libra.broker.__main__", "run a broker (python -m libra.broker; see 'libra broker --help')"),
    "actors": ("libra.actors.__main__", "run this host's actor supervisor (python -m libra.actors)"),
    "sim": ("libra.sim.__main__", "simulate a cluster in virtual time (python -m libra.sim)"),
    "bench": ("libra.bench.__main__", "run a benchmark against its baseline (python -m libra.bench)"),
    "serve": ("libra.commands.serve", "serve an OpenAI-compatible endpoint over a running cluster (see 'libra serve --help')"),
    "dashboard": ("libra.dashboard.__main__", "serve a live web dashboard over a broker's status (see 'libra dashboard --help')"),
}


def _delegate(module: str, argv: list[str], prog: str) -> int:
    import importlib

    return int(importlib.import_module(module).main(argv, prog=prog) or 0)


def _bad_broker(command: str, address: str | None) -> int | None:
    """2, with one line saying why, when ``--broker`` is not an address a client can connect to."""
    from libra.client.errors import BadAddress
    from libra.transport.endpoints import parse_endpoints

    try:
        if address is not None:
            parse_endpoints(address)  # one address, or a comma-separated list (a primary and standbys)
    except BadAddress as exc:
        print(f"libra {command}: {exc}", file=sys.stderr)
        return 2
    return None


def main(argv: list[str] | None = None, prog: str = "libra") -> int:
    """The ``libra`` console script; ``python -m libra`` passes ``prog="python -m libra"`` (usage lines
    say how the command was run). Output cut short by its reader (``libra bench --list | head``) is not a
    failure: the rest is dropped quietly and the exit status stays 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in DELEGATES:
            rc = _delegate(DELEGATES[argv[0]][0], argv[1:], f"{prog} {argv[0]}")
        else:
            args = build_parser(prog).parse_args(argv)
            configure(args.log_level or "warning")
            bad = _bad_broker(args.command, getattr(args, "broker", None))
            rc = bad if bad is not None else int(args.fn(args))
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return rc
    except BrokenPipeError:
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return 0
