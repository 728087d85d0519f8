"""What ``python -m libra status`` prints: the actor table, queue depths, counters and the planner line."""

from __future__ import annotations

from typing import Any


def format_status(actors: list[dict], queues: dict[str, int], stats: dict) -> str:
    """Human-readable status table."""
    lines = [f"{'ACTOR':<28} {'HOST':<14} {'SLOT':<6} {'KINDS':<18} {'STATE':<9} {'LOAD':>9} {'DONE':>8}  TOOLS"]
    for a in sorted(actors, key=lambda a: a["id"]):
        load = f"{a['load']}/{a['capacity']}"
        lent = a.get("lent")
        state = a["state"] if not lent else ("reclaimed" if lent.get("reclaimed_in_s") is not None else "lent")
        lines.append(f"{a['id']:<28} {a['host']:<14} {a['slot']:<6} {','.join(a['kinds']) or '-':<18} "
                     f"{state:<9} {load:>9} {a['completed']:>8}  {tools_of(a)}")
    if not actors:
        lines.append("(no actors connected)")
    lines.append("")
    lines.append("QUEUE" + " " * 29 + "DEPTH")
    for k, v in sorted(queues.items()):
        lines.append(f"{k:<34} {v:>5}")
    if not queues:
        lines.append("(no queued work)")
    gpu = gpu_lines(actors)
    if gpu:
        lines += ["", *gpu]
    lines.append("")
    lines.append(_counters(stats))
    lines += detail_lines(stats)
    planner = stats.get("planner")
    if isinstance(planner, dict):
        lines += ["", planner_line(planner)]
    return "\n".join(lines)


def gpu_lines(actors: list[dict]) -> list[str]:
    """One line per GPU actor that reports NVML samples: its GPU, memory used / total and utilisation."""
    rows = [a for a in sorted(actors, key=lambda a: a["id"]) if a.get("gpu")]
    if not rows:
        return []
    out = [f"{'GPU ACTOR':<28} {'GPU':>3} {'MEMORY USED':>20} {'UTIL':>5}"]
    for a in rows:
        g = a["gpu"]
        used, total = g.get("memory_used_bytes", 0.0) / 2**30, g.get("memory_total_bytes", 0.0) / 2**30
        out.append(f"{a['id']:<28} {int(g.get('index', -1)):>3} {f'{used:.1f}/{total:.1f} GiB':>20} "
                   f"{g.get('utilization_pct', 0.0):>4.0f}%")
    return out


def tools_of(actor: dict) -> str:
    """The tools an actor offers (its ``action`` capability), comma-separated; ``-`` for none."""
    names = (actor.get("capabilities") or {}).get("action") or []
    return ",".join(sorted(names)) or "-"


def _counters(stats: dict) -> str:
    """The plain counters on one line; the nested tables (router, jobs, leases, actions, planner) have
    their own lines (:func:`detail_lines`, :func:`planner_line`)."""
    return "  ".join(f"{k}={v}" for k, v in stats.items() if v and not isinstance(v, (dict, list)))


def _pairs(d: dict) -> str:
    """``a=1, b=2`` for a dict; a nested dict in parentheses, a list by its length; floats to 3 digits."""
    def cell(v: Any) -> str:
        if isinstance(v, dict):
            return f"({_pairs(v)})" if v else "-"
        if isinstance(v, list):
            return f"{len(v)} item(s)"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    return ", ".join(f"{k}={cell(v)}" for k, v in d.items())


def detail_lines(stats: dict) -> list[str]:
    """Readable lines for the nested parts of the broker's stats (never a raw Python dict): the rollout
    router, each job, the action scheduler and the direct leases (summed)."""
    out: list[str] = []
    router = stats.get("router")
    if isinstance(router, dict):
        rest = {k: v for k, v in router.items() if k != "router"}
        out.append(f"ROUTER {router.get('router', '?')}: {_pairs(rest) or '-'}")
    for name, job in (stats.get("jobs") or {}).items():
        out.append(f"JOB {name}: {_pairs(job) if isinstance(job, dict) else job}")
    actions = stats.get("actions")
    if isinstance(actions, dict):
        cores = [c for c in (actions.get("cores") or {}).values() if isinstance(c, dict)]
        free, total = sum(int(c.get("free", 0)) for c in cores), sum(int(c.get("cores", 0)) for c in cores)
        policy = actions.get("scheduler") or "first come first served"
        out.append(f"ACTIONS {policy}: running={actions.get('running', 0)}, "
                   f"cores free={free}/{total} on {len(cores)} actor(s), "
                   f"services={_pairs(actions.get('services') or {}) or '-'}")
    audit = stats.get("audit")
    if isinstance(audit, list) and audit:  # an operator's view (libra.broker.access): the newest records
        out.append(f"AUDIT (newest {min(len(audit), AUDIT_SHOWN)} of {len(audit)}; the broker's --audit-log has all):")
        out += [f"  {audit_line(r)}" for r in audit[-AUDIT_SHOWN:] if isinstance(r, dict)]
    lending = stats.get("lending")
    if isinstance(lending, dict):  # lent slots (libra.broker.lending): reclaims, moves, hand-back slack
        rest = {k: v for k, v in lending.items() if k not in ("reclaimed", "handback_slack_s")}
        slack = lending.get("handback_slack_s") or []
        out.append(f"LENDING: {_pairs(rest)}, reclaimed now={len(lending.get('reclaimed') or {})}"
                   + (f", last hand-back {slack[-1]:+.2f}s before its deadline" if slack else ""))
    leases = stats.get("leases")
    if isinstance(leases, list) and leases:
        totals = {k: sum(int(x.get(k) or 0) for x in leases if isinstance(x, dict)) for k in ("done", "failed")}
        out.append(f"DIRECT LEASES {len(leases)}: calls done={totals['done']}, failed={totals['failed']}")
    return [""] + out if out else []


AUDIT_SHOWN = 10  # audit records `libra status` prints (--json has all the broker keeps)


def audit_line(r: dict) -> str:
    """One audit record: how long ago, what, by which key fingerprint and role, and its details."""
    rest = {k: v for k, v in r.items() if k not in ("age_s", "what", "key", "role")}
    return (f"{r.get('age_s', '?')}s ago  {r.get('what', '?')}  by {r.get('key') or '-'} ({r.get('role', '?')})"
            + (f"  {_pairs(rest)}" if rest else ""))


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
    gpu = gpu_lines(actors)
    if gpu:
        parts.append(Text("\n".join(gpu)))
    parts.append(Text(_counters(stats), style="dim"))
    if detail_lines(stats):
        parts.append(Text("\n".join(detail_lines(stats)[1:])))
    if isinstance(stats.get("planner"), dict):
        parts.append(Text(planner_line(stats["planner"])))
    return Group(*parts)
