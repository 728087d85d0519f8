"""The dashboard's timeline of role switches and re-plans, built from what each status poll says. Pure: every
time is an argument (the poller's wall clock, seconds since the epoch); nothing here does I/O.

**Sources.** The broker's audit trail (``stats.audit``, newest :data:`libra.broker.access.AUDIT_KEEP` records,
oldest first; an operator's key, a key of the flat layout and every peer without CURVE see it) gives the
directives (an operator's, the Elastic Hybrid Pool's, the broker process's own), the planner's plans, role
switches and bucket changes, and job starts and cancels. Each record carries its age (``age_s``, to 0.1 s), so
its wall time is the poll's time minus its age, and the same record seen again by the next poll is recognised by
its content and a time that agrees within :data:`AUDIT_MATCH_S`: polls never add it twice. The planner's own
decisions (``stats.planner.decisions``, the newest 16) add what the audit trail does not say: each re-plan's
predicted step times before and after (``current_s``, ``candidate_s``), hence its **predicted gain**, and the
re-plans it rejected. An applied decision is folded into the audit trail's ``plan`` record of the same moment.
Without the audit trail (a client key under CURVE) the jobs' decision records (``JobPoll``) stand in for it.

**Clocks.** A planner decision's ``t`` and a job record's ``t`` are on the broker's clocks, not the dashboard's:
:class:`ClockAnchor` places them at the earliest wall time consistent with every poll that saw them (a decision
first seen at poll *k* happened before poll *k*), so a new one is at most one poll interval late, and those found
at the dashboard's start are placed relative to the newest of them.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AUDIT_MATCH_S", "ClockAnchor", "Event", "Timeline", "TIMELINE_WHATS"]

TIMELINE_WHATS = ("directive", "plan", "role_switch", "buckets", "job_start", "job_cancel")
AUDIT_MATCH_S = 1.0  # an audit record seen again: poll time - age_s agrees with the first sighting within this
KEEP_EVENTS = 500  # timeline entries kept (oldest dropped first)
NOTABLE = ("plan_abandoned", "planner_error", "planner_config_error", "apply_failed", "profiled_plan")
JOB_DECISIONS = ("plan", "role_switch", "buckets", "ehp_join", "ehp_leave", "oom_replan")


@dataclass
class Event:
    """One timeline entry. ``what``: the audit record's kind (or ``decision``, or a job decision's kind);
    ``switch``: it moved a slot between roles; ``gain_s``/``gain_ratio``: the planner's predicted step-time
    saving (seconds per step; its share of the current step time) where it said one."""

    t: float
    what: str
    text: str
    by: str = ""
    source: str = "audit"
    actor: str = ""
    switch: bool = False
    gain_s: float | None = None
    gain_ratio: float | None = None
    reason: str = ""
    key: str = field(default="", repr=False)

    def view(self) -> dict[str, Any]:
        return {"t": round(self.t, 3), "what": self.what, "text": self.text, "by": self.by, "source": self.source,
                "actor": self.actor, "switch": self.switch, "gain_s": self.gain_s, "gain_ratio": self.gain_ratio,
                "reason": self.reason}


class ClockAnchor:
    """Wall time of a broker-clock time ``t``: ``t + offset``, where ``offset`` is the least ``poll_t - t`` over
    every ``t`` a poll at ``poll_t`` has seen (each happened before the poll that saw it)."""

    def __init__(self) -> None:
        self.offset: float | None = None

    def see(self, poll_t: float, t: float) -> None:
        d = poll_t - t
        self.offset = d if self.offset is None else min(self.offset, d)

    def wall(self, t: float) -> float:
        return t + (self.offset or 0.0)


def _gain(current: Any, candidate: Any) -> tuple[float | None, float | None]:
    if not isinstance(current, (int, float)) or not isinstance(candidate, (int, float)):
        return None, None
    gain = float(current) - float(candidate)
    return round(gain, 4), (round(gain / float(current), 4) if current > 0 else None)


def audit_text(r: dict[str, Any]) -> str:
    """One line for an audit record of :data:`TIMELINE_WHATS`."""
    what = r.get("what")
    if what == "directive":
        kinds = ",".join(r.get("kinds") or []) or "nothing"
        text = f"{r.get('actor', '?')} -> {kinds}"
        return text + (f" (refused: {r['error']})" if r.get("error") else "")
    if what in ("job_start", "job_cancel"):
        verb = "started" if what == "job_start" else "cancelled"
        return f"job {r.get('job', '?')} {verb}" + (f" ({r['rows']} rows)" if "rows" in r else "")
    return str(r.get("text") or what)


class Timeline:
    """The de-duplicated timeline (see the module docstring). ``slack_s``: how late after its ``plan`` audit
    record a planner decision may be placed and still be folded into it (one poll interval and a margin)."""

    def __init__(self, slack_s: float = 3.0, keep: int = KEEP_EVENTS) -> None:
        self.slack_s = slack_s
        self.events: deque[Event] = deque(maxlen=keep)
        self._by_key: dict[str, list[Event]] = {}
        self.anchor = ClockAnchor()
        self._decisions: dict[tuple[Any, Any], Event] = {}
        self._job_anchor: dict[str, ClockAnchor] = {}
        self.audit_seen = False

    def _keep(self, e: Event) -> None:
        if len(self.events) == self.events.maxlen:
            old = self.events[0]
            bucket = self._by_key.get(old.key, [])
            if old in bucket:
                bucket.remove(old)
            if not bucket:
                self._by_key.pop(old.key, None)
        self.events.append(e)
        self._by_key.setdefault(e.key, []).append(e)

    def add_audit(self, poll_t: float, records: list[dict[str, Any]]) -> int:
        """Take one poll's audit records; returns how many were new."""
        self.audit_seen = True
        claimed: set[int] = set()
        new = 0
        for r in records:
            if not isinstance(r, dict) or r.get("what") not in TIMELINE_WHATS:
                continue
            key = json.dumps({k: v for k, v in r.items() if k != "age_s"}, sort_keys=True, default=str)
            t = poll_t - float(r.get("age_s") or 0.0)
            seen = next((e for e in self._by_key.get(key, ()) if id(e) not in claimed
                         and abs(e.t - t) <= AUDIT_MATCH_S), None)
            if seen is not None:
                claimed.add(id(seen))
                continue
            what = str(r["what"])
            e = Event(t, what, audit_text(r), by=str(r.get("role", "")), actor=str(r.get("actor", "")),
                      switch=what in ("directive", "role_switch") and not r.get("error"), key=key)
            if what == "role_switch" and not e.actor:
                e.actor = e.text.split(" -> ", 1)[0]
            self._keep(e)
            claimed.add(id(e))
            new += 1
        return new

    def add_decisions(self, poll_t: float, decisions: list[dict[str, Any]]) -> int:
        """Take the planner summary's decisions; returns how many were new (those worth a line: a candidate
        was weighed, a plan deployed, or something went wrong). A decision seen again is updated in place (the
        broker marks a plan it could not lay out ``apply_failed`` afterwards)."""
        new = 0
        for d in decisions:
            if not isinstance(d, dict) or not isinstance(d.get("t"), (int, float)):
                continue
            self.anchor.see(poll_t, float(d["t"]))
            k = (d.get("round"), d["t"])
            reason = str(d.get("reason", "?"))
            if k in self._decisions:
                self._decisions[k].reason = reason
                continue
            if d.get("candidate_s") is None and not d.get("plan") and reason not in NOTABLE:
                continue
            gain_s, ratio = _gain(d.get("current_s"), d.get("candidate_s"))
            trigger = f", trigger {d['trigger']}" if d.get("trigger") else ""
            text = f"re-plan round {d.get('round')}: {reason}{trigger}"
            e = Event(float(d["t"]), "decision", text, by="planner", source="planner", gain_s=gain_s,
                      gain_ratio=ratio, reason=reason, key=f"decision:{k}")
            self._decisions[k] = e
            new += 1
        return new

    def add_job_records(self, job: str, poll_t: float, records: list[dict[str, Any]]) -> int:
        """A job's decision records (``JobPoll``): the timeline's source when the audit trail is not visible (with
        it, they are left out: the trail says the same)."""
        if self.audit_seen:
            return 0
        anchor = self._job_anchor.setdefault(job, ClockAnchor())
        new = 0
        for r in records:
            if r.get("kind") != "decision" or r.get("what") not in JOB_DECISIONS:
                continue
            anchor.see(poll_t, float(r.get("t", 0.0)))
            detail = r.get("detail") or {}
            what = str(r["what"])
            e = Event(float(r.get("t", 0.0)), what, f"step {r.get('step')}: {r.get('text', '')}",
                      by=str(detail.get("by", "")), source=f"job:{job}", actor=str(detail.get("actor", "")),
                      switch=what == "role_switch", key=f"job:{job}")
            self._keep(e)
            new += 1
        return new

    def _wall(self, e: Event) -> float:
        if e.source == "planner":
            return self.anchor.wall(e.t)
        if e.source.startswith("job:"):
            return self._job_anchor[e.source[4:]].wall(e.t)
        return e.t

    def view(self) -> list[dict[str, Any]]:
        """Every entry, oldest first, at wall times; applied planner decisions folded into the ``plan``
        audit record they caused (which then shows the predicted gain)."""
        shown = [e for e in self.events if not (self.audit_seen and e.source.startswith("job:"))]
        rows = [(self._wall(e), e) for e in shown]
        plans = [(t, e) for t, e in rows if e.what == "plan" and e.by == "planner"]
        used: set[int] = set()
        for dec in self._decisions.values():
            td = self.anchor.wall(dec.t)
            match = None
            if dec.gain_s is not None and dec.reason not in NOTABLE:
                match = next((e for t, e in plans if id(e) not in used and -AUDIT_MATCH_S <= td - t <= self.slack_s),
                             None)
            if match is not None and dec.reason != "apply_failed":
                used.add(id(match))
                match.gain_s, match.gain_ratio, match.reason = dec.gain_s, dec.gain_ratio, dec.reason
            else:
                rows.append((td, dec))
        rows.sort(key=lambda x: x[0])
        return [{**e.view(), "t": round(t, 3)} for t, e in rows]
