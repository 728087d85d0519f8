"""The dashboard's memory: the latest status snapshot, a short history of series derived from the polls, the
timeline (:mod:`.timeline`) and the jobs' step curves. Pure: every time is an argument (the poller's wall clock,
seconds since the epoch); nothing here does I/O. :meth:`History.view` is what ``/api/status`` answers and each
``/api/events`` event carries.

Series, one point per poll (the newest ``keep``): the depth of every queue (``kind:name``; a generate queue per
C-MLFQ bucket), the broker's completed and submitted work per second (from its counters), the router's
migrations (per second, and its running total), the action scheduler's free and total cores and running
grants, and how many actors accept each kind of work (role switches show as steps in it).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .timeline import Timeline

__all__ = ["History", "actor_role", "bucket_occupancy", "step_point"]

KEEP_POINTS = 600  # series points kept: 10 minutes at one poll a second
KEEP_STEPS = 5000  # step points kept per job
ROLE_KINDS = ("generate", "train", "action", "episode")
STEP_FIELDS = ("reward_mean", "reward_std", "accuracy", "tokens_per_s", "window_tokens_per_s", "step_time_s",
               "policy_lag_mean", "tool_calls_per_episode", "loss")


def actor_role(actor: dict[str, Any]) -> str:
    """What an actor does now: its directive's role (``rollout``, ``train``) when it has one and still accepts
    that work, else the kinds it accepts (``generate`` is shown as ``rollout``)."""
    kinds = list(actor.get("kinds") or [])
    names = ["rollout" if k == "generate" else k for k in kinds]
    role = (actor.get("role") or {}).get("role")
    if role and (role == "rollout") == ("generate" in kinds) and role in names:
        return str(role)
    return ",".join(names) or "idle"


def bucket_occupancy(actors: list[dict[str, Any]], queues: dict[str, int]) -> list[dict[str, Any]]:
    """Per C-MLFQ bucket (its ``generate:NAME`` queue): turns queued, and the rollout actors serving it (their
    directive's ``bucket``; an actor without one serves ``default``) with their load and capacity."""
    out: dict[str, dict[str, Any]] = {}
    for key, depth in queues.items():
        kind, _, name = key.partition(":")
        if kind == "generate":
            out[name] = {"bucket": name, "queued": int(depth), "actors": [], "load": 0, "capacity": 0}
    for a in actors:
        if "generate" not in (a.get("kinds") or []):
            continue
        name = str((a.get("role") or {}).get("bucket") or "default")
        b = out.setdefault(name, {"bucket": name, "queued": 0, "actors": [], "load": 0, "capacity": 0})
        b["actors"].append(a.get("id"))
        b["load"] += int(a.get("load") or 0)
        b["capacity"] += int(a.get("capacity") or 0)
    return sorted(out.values(), key=lambda b: b["bucket"])


def step_point(r: dict[str, Any]) -> dict[str, Any]:
    """The fields of a step record the curves need (a record also holds samples, texts and per-rank lists)."""
    return {"step": r.get("step"), **{k: r.get(k) for k in STEP_FIELDS}}


def _cores(actions: dict[str, Any] | None) -> tuple[float | None, float | None, float | None]:
    if not isinstance(actions, dict):
        return None, None, None
    cores = [c for c in (actions.get("cores") or {}).values() if isinstance(c, dict)]
    return (float(sum(int(c.get("free", 0)) for c in cores)), float(sum(int(c.get("cores", 0)) for c in cores)),
            float(actions.get("running", 0)))


class History:
    """What the dashboard keeps between polls (see the module docstring). ``interval_s``: the poll period."""

    def __init__(self, broker: str, interval_s: float = 1.0, keep: int = KEEP_POINTS) -> None:
        self.broker, self.interval_s, self.keep = broker, interval_s, keep
        self.timeline = Timeline(slack_s=interval_s + 2.0)
        self.t: deque[float] = deque(maxlen=keep)
        self.series: dict[str, deque[float | None]] = {}
        self.queues: dict[str, deque[float | None]] = {}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.snapshot: dict[str, Any] = {"actors": [], "queues": {}, "stats": {}}
        self.poll_t: float | None = None
        self.polls = 0
        self.error: str | None = None
        self._prev: tuple[float, dict[str, Any]] | None = None

    def _push(self, table: dict[str, deque[float | None]], name: str, value: float | None) -> None:
        d = table.get(name)
        if d is None:  # a new series: no value at the points before it existed
            d = table[name] = deque([None] * (len(self.t) - 1), maxlen=self.keep)
        d.append(value)

    def add(self, poll_t: float, actors: list[dict[str, Any]], queues: dict[str, int], stats: dict[str, Any]) -> None:
        """One status reply, received at ``poll_t``."""
        self.snapshot = {"actors": actors, "queues": queues, "stats": stats}
        self.poll_t, self.error = poll_t, None
        self.polls += 1
        self.t.append(poll_t)
        for name in set(self.queues) | set(queues):
            self._push(self.queues, name, float(queues.get(name, 0)))
        rates: dict[str, float | None] = {"completed_per_s": None, "submitted_per_s": None, "migrations_per_s": None}
        router = stats.get("router") if isinstance(stats.get("router"), dict) else {}
        if self._prev is not None and poll_t > self._prev[0]:
            dt, before = poll_t - self._prev[0], self._prev[1]
            for k in ("completed", "submitted"):
                if isinstance(stats.get(k), int) and isinstance(before.get(k), int):
                    rates[f"{k}_per_s"] = max(0.0, (stats[k] - before[k]) / dt)
            if "migrations" in router and "migrations" in before:
                rates["migrations_per_s"] = max(0.0, (router["migrations"] - before["migrations"]) / dt)
        self._prev = (poll_t, {"completed": stats.get("completed"), "submitted": stats.get("submitted"),
                               **({"migrations": router["migrations"]} if "migrations" in router else {})})
        free, total, running = _cores(stats.get("actions"))
        values = {**rates, "migrations": router.get("migrations"), "cores_free": free, "cores_total": total,
                  "actions_running": running}
        for k in ROLE_KINDS:
            values[f"actors_{k}"] = float(sum(1 for a in actors if k in (a.get("kinds") or [])))
        for name, value in values.items():
            self._push(self.series, name, value)
        audit = stats.get("audit")
        if isinstance(audit, list):
            self.timeline.add_audit(poll_t, audit)
        planner = stats.get("planner")
        if isinstance(planner, dict):
            self.timeline.add_decisions(poll_t, list(planner.get("decisions") or []))

    def failed(self, poll_t: float, error: str) -> None:
        """A poll that got no answer (the broker is down or unreachable): shown, the last snapshot kept."""
        self.poll_t, self.error = poll_t, error

    def add_job(self, name: str, poll_t: float, reply: dict[str, Any]) -> None:
        """A ``JobPoll`` reply of job ``name`` (its records from the cursor :meth:`job_cursor` gave)."""
        job = self.jobs.setdefault(name, {"cursor": 0, "steps": deque(maxlen=KEEP_STEPS), "evals": []})
        records = list(reply.get("records") or [])
        for r in records:
            kind = r.get("kind", "step")
            if kind == "step":
                job["steps"].append(step_point(r))
            elif kind == "eval":
                job["evals"].append({k: v for k, v in r.items() if isinstance(v, (int, float, str, type(None)))})
        self.timeline.add_job_records(name, poll_t, records)
        job["cursor"] = int(reply.get("next_cursor", job["cursor"] + len(records)))
        job["state"] = {k: reply.get(k) for k in ("state", "error", "steps", "steps_done", "version",
                                                  "episodes_running", "episodes_failed", "dropped_groups")}

    def job_cursor(self, name: str) -> int:
        return int(self.jobs.get(name, {}).get("cursor", 0))

    def view(self) -> dict[str, Any]:
        """The JSON the page reads: the latest snapshot, the series, bucket occupancy, timeline and jobs."""
        snap = self.snapshot
        jobs = {}
        for name, j in self.jobs.items():
            steps = list(j["steps"])
            jobs[name] = {"state": j.get("state", {}), "step": [p["step"] for p in steps],
                          **{k: [p.get(k) for p in steps] for k in STEP_FIELDS}, "evals": j["evals"][-50:]}
        return {
            "broker": self.broker, "interval_s": self.interval_s, "poll_t": self.poll_t, "polls": self.polls,
            "error": self.error, "snapshot": snap,
            "series": {"t": list(self.t), **{k: list(v) for k, v in self.series.items()}},
            "queues": {k: list(v) for k, v in sorted(self.queues.items())},
            "buckets": bucket_occupancy(snap["actors"], snap["queues"]),
            "roles": {a.get("id"): actor_role(a) for a in snap["actors"]},
            "timeline": self.timeline.view(), "audit_visible": self.timeline.audit_seen, "jobs": jobs,
        }
