"""Glue between :class:`~libra.broker.state.BrokerState` and its job hosts (``libra.broker.job``).

Pure, like the core: ``on_job_submit`` / ``on_job_poll`` answer the two client messages, ``pump`` submits
what the hosts want (as ordinary work owned by the pseudo-client ``job:NAME``) and feeds them the replies
the core collected. Job work is never journaled (a job does not survive a broker restart: its client sees
the job vanish and fails with a clear error) and never counts against a client's in-flight limit.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from libra.config import ConfigError
from libra.protocol import messages as m
from libra.protocol.errors import ErrorCode, ProtocolCode

from .events import Send
from .job import JobHost, JobSpec, JobWork
from .work import WorkState

if TYPE_CHECKING:
    from .events import Command
    from .state import BrokerState

OWNER_PREFIX = "job:"
KEEP_FINISHED = 16  # finished jobs remembered for polling


def owner(name: str) -> str:
    return OWNER_PREFIX + name


def on_job_submit(b: BrokerState, peer: bytes, msg: m.JobSubmit, now: float, out: list[Command]) -> None:
    if peer not in b.clients:
        out.extend(b._reject(peer, ProtocolCode.UNEXPECTED, "say ClientHello before JobSubmit"))
        return

    def err(text: str) -> None:
        out.append(Send(peer, m.Reply(msg.request_id, False, None, ErrorCode.BAD_REQUEST.value, text)))

    old = b.jobs.get(msg.name)
    if old is not None and old.active:
        if old.submit_request == msg.request_id:  # a resubmission of the same request
            out.append(Send(peer, m.Reply(msg.request_id, True, {"job": msg.name})))
        else:
            err(f"job {msg.name!r} is already running (poll it, or cancel it first)")
        return
    if not msg.name or "/" in msg.name:
        err(f"job name must be non-empty and contain no '/', got {msg.name!r}")
        return
    try:
        host = JobHost(msg.name, JobSpec.from_mapping(msg.spec), list(msg.rows), now)
    except ConfigError as exc:
        err(str(exc))
        return
    host.submit_request = msg.request_id
    b.jobs.pop(msg.name, None)
    b.jobs[msg.name] = host
    finished = [n for n, h in b.jobs.items() if not h.active and not h.outstanding()]
    for n in finished[: max(0, len(finished) - KEEP_FINISHED)]:
        del b.jobs[n]
    b.jobs_dirty = True
    out.append(Send(peer, m.Reply(msg.request_id, True, {"job": msg.name})))


def on_job_poll(b: BrokerState, peer: bytes, msg: m.JobPoll, now: float, out: list[Command]) -> None:
    if peer not in b.clients:
        out.extend(b._reject(peer, ProtocolCode.UNEXPECTED, "say ClientHello before JobPoll"))
        return
    host = b.jobs.get(msg.job)
    if host is None:
        out.append(Send(peer, m.Reply(msg.request_id, False, None, ErrorCode.BAD_REQUEST.value,
                                      f"no job {msg.job!r} on this broker (known: {', '.join(b.jobs) or 'none'}); "
                                      "a broker restart forgets running jobs")))
        return
    if msg.cancel:
        host.cancel("cancelled by the client", now)
        b.jobs_dirty = True
    out.append(Send(peer, m.Reply(msg.request_id, True, host.poll(msg.cursor))))


def collect(b: BrokerState, w: Any, reply: m.Reply) -> None:
    """Called by the core's ``_finish`` for work a job owns: keep the reply for :func:`pump`."""
    b.job_replies.append((w.client_id[len(OWNER_PREFIX):], w.request_id, reply))
    b.jobs_dirty = True


def pump(b: BrokerState, now: float, out: list[Command]) -> None:
    """Deliver collected replies, submit the hosts' new work, cancel what stopped jobs still have."""
    while b.jobs_dirty:
        b.jobs_dirty = False
        replies, b.job_replies = b.job_replies, []
        for name, tag, r in replies:
            host = b.jobs.get(name)
            if host is not None:
                before = host.weights
                host.on_reply(tag, r.ok, r.output, r.error, now)
                if host.weights is not before:  # a step published a version: later turns load it
                    b.job_weights = host.weights
        for host in list(b.jobs.values()):
            if host.active:
                for jw in host.take_work(now):
                    _submit(b, host, jw, now, out)
            if not host.active and host.outstanding():
                _cancel_outstanding(b, host, now, out)


def _submit(b: BrokerState, host: JobHost, jw: JobWork, now: float, out: list[Command]) -> None:
    w = b._admit(owner(host.name), jw.tag, b"", jw.kind, jw.name, jw.args, jw.trajectory, jw.timeout_s, now,
                 f"job:{host.name}")
    b.stats["submitted"] += 1
    key = w.key
    sess = b._best_actor(key)
    if sess is not None:
        b._assign(w, sess, now, out)
    else:
        b.queues.setdefault(key, deque()).append(w.work_id)


def _cancel_outstanding(b: BrokerState, host: JobHost, now: float, out: list[Command]) -> None:
    mine = owner(host.name)
    for w in [w for w in b.works.values() if w.client_id == mine and w.state in (WorkState.QUEUED, WorkState.LEASED)]:
        b._fail(w, now, out, ErrorCode.CANCELLED, f"job {host.name} {host.phase}")
    replies, b.job_replies = b.job_replies, []
    for name, tag, r in replies:  # let the host forget them
        h = b.jobs.get(name)
        if h is not None:
            h.on_reply(tag, r.ok, r.output, r.error, now)
    b.jobs_dirty = False
