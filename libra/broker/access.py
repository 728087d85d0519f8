"""Who may do what, in the broker core: the key-role check (:mod:`libra.broker.roles`), job scopes, and the
audit trail. Pure: no I/O.

**Job scopes.** A job-scoped client key (``ALLOW/clients/JOB/``, role ``client:JOB``; see
:mod:`libra.transport.scopes`) acts for its job only:

- a ``JobSubmit`` or ``JobPoll`` (a job's status rows, and its cancel) naming another job is refused with a
  ``forbidden`` Reply, counted in ``job_refused``, logged and audited;
- its client id and its trajectory ids are taken within its job (``JOB/ID``), so its calls, cancels and
  replies never meet another job's client of the same id (a client of job A cannot cancel, or take over the
  replies of, job B's calls), and its calls never run in the sandbox of, or end, another job's trajectory;
- its status view holds the shared cluster and its own job's rows only (:func:`scoped_status`).

Keys not bound to a job (an operator, a client of ``ALLOW/clients/``, a key of the flat layout, and every peer
without CURVE) act for every job, as before.

**The audit trail.** Every directive, plan change, job start, job cancel, refused message and revoked key
comes out as an :class:`~libra.broker.events.Audit` command (the shell appends it to the audit log, a JSON
line each) with the fingerprint and role of the key that caused it (the broker's own planner: ``planner``).
The newest :data:`AUDIT_KEEP` stay in memory, and an operator's ``libra status`` shows them.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

from libra.protocol import messages as m
from libra.protocol.errors import ErrorCode
from libra.transport.scopes import ANY, base_roles, fingerprint, job_scope, may_see_job

from . import roles
from .events import Audit, Command, Log, PeerMessage, Send

__all__ = ["AUDIT_KEEP", "Access", "scoped_status", "sees_audit"]

AUDIT_KEEP = 200  # audit records kept in memory for `libra status`; the audit log keeps them all
REPEAT_S = 1.0  # the same refusal (key, message kind) again within this: counted, not logged or audited again
PLANNER = "planner"  # the role of the broker's own decisions in the trail


def _job_named(msg: object) -> str | None:
    """The job a message acts on by name, or None (``JobSubmit.name``, ``JobPoll.job``)."""
    if isinstance(msg, m.JobSubmit):
        return msg.name
    if isinstance(msg, m.JobPoll):
        return msg.job
    return None


def sees_audit(role: str) -> bool:
    """Whether a key of ``role`` sees the audit trail in its status: an operator's, a key of the flat layout,
    and every peer without CURVE (role "")."""
    return role in ("", ANY) or roles.OPERATOR in base_roles(role)


def scoped_status(reply: m.StatusReply, role: str) -> m.StatusReply:
    """What a key of ``role`` may see of a status snapshot: everything for a key acting for every job; for a
    job-scoped key the shared cluster (the actors, with the tools they offer, and the queue depths: what its job
    runs on, and what a driver checks before it starts) and its own jobs' rows, without other jobs' rows, the
    broker's counters, its router, planner, leases, action placement or audit trail."""
    scope = job_scope(role)
    if scope is None:
        return reply
    jobs = {name: job for name, job in (reply.stats.get("jobs") or {}).items() if name in scope}
    return m.StatusReply(reply.request_id, reply.actors, reply.queues, {"jobs": jobs, "scope": sorted(scope)})


class Access:
    """The role and job-scope checks and the audit trail of one broker core (``stats``: its counters)."""

    def __init__(self, stats: dict[str, int]) -> None:
        self.stats = stats
        self.recent: deque[dict[str, Any]] = deque(maxlen=AUDIT_KEEP)
        self._refused: dict[tuple[str, str, str], tuple[float, int]] = {}  # (key, role, kind) -> (last, repeats)

    def refuse(self, event: PeerMessage, known: bool, now: float) -> list[Command] | None:
        """None when ``event.msg`` may go on; else its typed refusal (counted, logged and audited)."""
        role, msg = event.role, event.msg
        if not role:
            return None
        name = type(msg).__name__
        if not roles.allows(role, type(msg)):  # its key's role may not send it
            self.stats["role_refused"] += 1
            out = roles.refusal(event.peer, msg, role, known)
            return self._noted(out, event, name, now, why="role")
        job = _job_named(msg)
        if job is None or may_see_job(role, job):
            return None
        self.stats["job_refused"] += 1
        why = (f"{name} refused: this connection's key is bound to job(s) {sorted(job_scope(role) or ())} and may "
               f"not act on job {job!r} (its key must be in the allow directory's clients/{job}/)")
        out = [Log("job_refused", {"peer": event.peer.hex(), "role": role, "message": name, "job": job}, "warning"),
               Send(event.peer, m.Reply(getattr(msg, "request_id", ""), False, None, ErrorCode.FORBIDDEN.value, why))]
        return self._noted(out, event, name, now, why="job", job=job)

    def _noted(self, out: list[Command], event: PeerMessage, name: str, now: float, **detail: Any) -> list[Command]:
        """A refusal's commands with its audit record; the same refusal again within :data:`REPEAT_S` only
        answers (a flood of forbidden messages must not flood the log), and the next record counts them."""
        k = (event.key, event.role, name)
        last, repeats = self._refused.get(k, (float("-inf"), 0))
        if now - last < REPEAT_S:
            self._refused[k] = (last, repeats + 1)
            return [c for c in out if not isinstance(c, Log)]
        if len(self._refused) > 10_000:  # bounded: forget them all (a repeat is then audited once more)
            self._refused.clear()
        self._refused[k] = (now, 0)
        out.append(self.audit("refused", event.key, event.role, now, message=name, repeats=repeats, **detail))
        return out

    @staticmethod
    def scoped_trajectory(msg: Any, role: str) -> Any:
        """``msg`` (a ``Submit`` or ``EndTrajectory``) with its trajectory id as the core keeps it for a key of
        ``role`` (:meth:`scoped`); ``msg`` itself when that is its own id (no copy)."""
        traj = Access.scoped(msg.trajectory, role) if msg.trajectory and role else msg.trajectory
        return msg if traj == msg.trajectory else dataclasses.replace(msg, trajectory=traj)

    @staticmethod
    def scoped(name: str, role: str) -> str:
        """A client id or trajectory id as the core keeps it: ``JOB/NAME`` for a job-scoped key (its jobs joined
        with ``+``), ``name`` itself otherwise (job names hold no ``/``: no scoped name can be another job's)."""
        scope = job_scope(role)
        return name if scope is None else f"{'+'.join(sorted(scope))}/{name}"

    def audit(self, what: str, key: str, role: str, now: float, **detail: Any) -> Audit:
        """One audit record (``what``: directive, plan, job_start, job_cancel, refused, key_revoked) by the
        key ``key`` (Z85; "" without CURVE) of ``role``; kept in memory and returned for the audit log."""
        record = {"what": what, "key": fingerprint(key), "role": role or "unchecked", **detail}
        self.recent.append({**record, "at": now})
        return Audit(record)

    def trail(self, now: float) -> list[dict[str, Any]]:
        """The newest audit records, oldest first, each with its age in seconds (for an operator's status)."""
        return [{**{k: v for k, v in r.items() if k != "at"}, "age_s": round(now - r["at"], 1)} for r in self.recent]
