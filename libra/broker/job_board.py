"""The job board of the broker core: the RL jobs it hosts (``libra.broker.job_host.JobHost``) by name.

Pure, like the core: :meth:`JobBoard.submit` / :meth:`JobBoard.poll` answer the two client messages,
:meth:`JobBoard.pump` submits what the hosts want (as ordinary work owned by the pseudo-client
``job:NAME``, through the callbacks the core passes) and feeds them the replies :meth:`JobBoard.collect`
gathered. Job work is never journaled (a job does not survive a broker restart: its client sees the job
vanish and fails with a clear error) and never counts against a client's in-flight limit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from libra.config import ConfigError
from libra.protocol import messages as m
from libra.protocol.errors import ErrorCode

from .job_host import JobHost, JobSpec, JobWork

__all__ = ["KEEP_FINISHED", "OWNER_PREFIX", "JobBoard"]

OWNER_PREFIX = "job:"
KEEP_FINISHED = 16  # finished jobs remembered for polling


class JobBoard:
    """Job hosts by name, the replies collected for them, and the newest weights a job published."""

    def __init__(self) -> None:
        self.hosts: dict[str, Any] = {}  # name -> JobHost
        self.dirty = False  # replies to deliver, or a host that may want to submit or cancel work
        self.weights: dict[str, Any] | None = None  # newest weights a job published (generate turns load them)
        self.published = 0  # weights versions published by all jobs (the router's drift clock)
        self.ehp: Any = None  # the Elastic Hybrid Pool (libra.broker.ehp.ElasticPool) under grp_ehp, else None
        self.train_ooms = 0  # train steps of any job that ran out of memory (the core tells its planner)
        self.rollout_instances = 0  # actors accepting generate now (set by the core before each pump)
        self._replies: list[tuple[str, str, m.Reply]] = []

    @staticmethod
    def owner(name: str) -> str:
        """The pseudo-client id that owns the work of job ``name``."""
        return OWNER_PREFIX + name

    @staticmethod
    def owns(client_id: str) -> bool:
        """Whether work of ``client_id`` belongs to a job."""
        return client_id.startswith(OWNER_PREFIX)

    # ------------------------------------------------------------------ client messages
    def submit(self, msg: m.JobSubmit, now: float) -> m.Reply:
        """Start job ``msg.name`` (a resubmission of the same request is answered, not re-run)."""

        def err(text: str) -> m.Reply:
            return m.Reply(msg.request_id, False, None, ErrorCode.BAD_REQUEST.value, text)

        old = self.hosts.get(msg.name)
        if old is not None and old.active:
            if old.submit_request == msg.request_id:  # a resubmission of the same request
                return m.Reply(msg.request_id, True, {"job": msg.name})
            return err(f"job {msg.name!r} is already running (poll it, or cancel it first)")
        if not msg.name or "/" in msg.name:
            return err(f"job name must be non-empty and contain no '/', got {msg.name!r}")
        try:
            host = JobHost(msg.name, JobSpec.from_mapping(msg.spec), list(msg.rows), now)
        except ConfigError as exc:
            return err(str(exc))
        host.submit_request = msg.request_id
        if self.ehp is not None:
            if any(h.active and h.elastic is not None for n, h in self.hosts.items() if n != msg.name):
                return err("the broker's Elastic Hybrid Pool serves one job at a time: another job is running")
            host.elastic = self.ehp
        self.hosts.pop(msg.name, None)
        self.hosts[msg.name] = host
        finished = [n for n, h in self.hosts.items() if not h.active and not h.outstanding()]
        for n in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self.hosts[n]
        self.dirty = True
        return m.Reply(msg.request_id, True, {"job": msg.name})

    def poll(self, msg: m.JobPoll, now: float) -> m.Reply:
        """A job's progress from ``msg.cursor`` on, at most ``msg.limit`` records (``msg.cancel``: cancel it
        first); a limit outside 1..``JOB_POLL_MAX_LIMIT`` is a ``bad_request`` Reply."""
        if isinstance(msg.limit, bool) or not 1 <= msg.limit <= m.JOB_POLL_MAX_LIMIT:
            return m.Reply(msg.request_id, False, None, ErrorCode.BAD_REQUEST.value,
                           f"JobPoll.limit must be an integer from 1 to {m.JOB_POLL_MAX_LIMIT}, got {msg.limit!r}")
        host = self.hosts.get(msg.job)
        if host is None:
            return m.Reply(msg.request_id, False, None, ErrorCode.BAD_REQUEST.value,
                           f"no job {msg.job!r} on this broker (known: {', '.join(self.hosts) or 'none'}); "
                           "a broker restart forgets running jobs")
        if msg.cancel:
            host.cancel("cancelled by the client", now)
            self.dirty = True
        return m.Reply(msg.request_id, True, host.poll(msg.cursor, msg.limit))

    # ------------------------------------------------------------------ the core's side
    def collect(self, client_id: str, tag: str, reply: m.Reply) -> None:
        """The reply of work a job owns (``client_id`` is its owner): kept for :meth:`pump`."""
        self._replies.append((client_id[len(OWNER_PREFIX):], tag, reply))
        self.dirty = True

    def pump(self, now: float, submit: Callable[[str, JobWork, str], None],
             cancel: Callable[[str, str], None]) -> None:
        """Deliver collected replies, submit the hosts' new work, cancel what stopped jobs still have.

        ``submit(owner, work, why)`` admits and places one piece of work for ``owner``; ``cancel(owner,
        why)`` fails everything ``owner`` still has (its replies come back through :meth:`collect`)."""
        while self.dirty:
            self.dirty = False
            replies, self._replies = self._replies, []
            for name, tag, r in replies:
                host = self.hosts.get(name)
                if host is not None:
                    before, ooms = host.weights, host.train_ooms
                    host.rollout_instances = self.rollout_instances
                    host.on_reply(tag, r.ok, r.output, r.error, now, r.attempts, r.tool_code)
                    self.train_ooms += host.train_ooms - ooms
                    if host.weights is not before:  # a step published a version: later turns load it
                        self.weights = host.weights
                        self.published += 1
            for host in list(self.hosts.values()):
                if host.active:
                    host.rollout_instances = self.rollout_instances
                    for jw in host.take_work(now):
                        submit(self.owner(host.name), jw, f"job:{host.name}")
                if not host.active and host.outstanding():
                    cancel(self.owner(host.name), f"job {host.name} {host.phase}")
                    self._forget_replies(now)

    def _forget_replies(self, now: float) -> None:
        """Let the hosts forget the work just cancelled."""
        replies, self._replies = self._replies, []
        for name, tag, r in replies:
            h = self.hosts.get(name)
            if h is not None:
                h.on_reply(tag, r.ok, r.output, r.error, now, r.attempts, r.tool_code)
        self.dirty = False

    def note(self, decisions: list[tuple[str, str, dict[str, Any]]], now: float) -> None:
        """Decisions the broker core made (``(what, text, detail)``: plans, role switches, bucket changes) as
        decision records of every active job (``JobHost.decide``); nothing without one."""
        for host in self.hosts.values():
            if getattr(host, "active", False):
                for what, text, detail in decisions:
                    host.decide(what, text, detail, now)

    def measured_costs(self) -> Any:
        """The measured costs (``MeasuredCosts``) of the newest active job, None without one."""
        active = [h for h in self.hosts.values() if getattr(h, "active", False)]
        return getattr(active[-1], "costs", None) if active else None

    # ------------------------------------------------------------------ views
    def any_active(self) -> bool:
        return any(h.active for h in self.hosts.values())

    def wake_waiting(self) -> bool:
        """True when the jobs need a pump: replies came in, or an active job has nothing outstanding (no
        reply will come to pump it: a batch the Elastic Hybrid Pool was not ready for), which the core then
        pumps on its tick."""
        if any(getattr(h, "active", False) and not h.outstanding() for h in self.hosts.values()):
            self.dirty = True
        return self.dirty

    def last_step_times(self) -> tuple[float | None, float | None]:
        """``(rollout s, training s)`` of the newest RL step recorded by a job (None, None without one)."""
        newest: dict[str, Any] | None = None
        for host in self.hosts.values():  # each job's newest step record (not an eval or decision record)
            last = next((r for r in reversed(getattr(host, "records", None) or []) if "kind" not in r), None)
            if last and (newest is None or last.get("step", 0) >= newest.get("step", 0)):
                newest = last
        if newest is None:
            return None, None
        roll, train = newest.get("rollout_time_s"), newest.get("train_time_s")
        ok = [isinstance(x, (int, float)) and x > 0 for x in (roll, train)]
        return (float(roll) if ok[0] else None), (float(train) if ok[1] else None)

    def summaries(self) -> dict[str, Any]:
        return {name: host.summary() for name, host in self.hosts.items()}
