"""Durability, the core's side: the journal records the core emits and rebuilding state from them.

The core emits a :class:`~libra.broker.events.JournalWrite` ``accept`` record for every client request it
accepts (with its work id), a ``start`` record each time it is given to an actor (its lease and attempt
count) and a ``done`` record for its one reply (work a job owns is never journaled); the shell stores them
(``journal_store.BrokerJournal``, SQLite) and, after a restart, hands what it loaded back as a ``Restore``
event, which :func:`restore` applies: each unanswered request comes back under its work id, lease and
attempt count, parked, so that an actor which still runs it can adopt it (``adoption.Adoption``) instead
of it running a second time. No I/O here.
"""

from __future__ import annotations

from typing import Any

from libra.protocol import messages as m

from .events import JournalWrite
from .rollout import RolloutRouting
from .work import Work
from .work_table import WorkTable

__all__ = ["accept_record", "restore", "start_record"]


def accept_record(client_id: str, msg: m.Submit, work_id: str) -> JournalWrite:
    """The ``accept`` record of an accepted Submit: what is needed to queue it again after a restart."""
    record = {"kind": msg.kind, "name": msg.name, "args": msg.args, "trajectory": msg.trajectory,
              "timeout_s": msg.timeout_s, "work_id": work_id}
    if msg.prior_attempts:  # a lost direct call's earlier run (libra.client.direct)
        record["prior_attempts"] = msg.prior_attempts
    return JournalWrite("accept", client_id, msg.request_id, record)


def start_record(w: Work) -> JournalWrite:
    """The ``start`` record of journaled work ``w`` given to (or adopted from) an actor."""
    return JournalWrite("start", w.client_id, w.request_id, {"work_id": w.work_id, "lease": w.lease,
                                                             "attempt": w.attempt, "actor_id": w.holder})


def restore(table: WorkTable, rollout: RolloutRouting, accepted: list[tuple[str, str, dict[str, Any]]],
            done: list[tuple[str, str, dict[str, Any]]], keep_replies: int, now: float) -> int:
    """Rebuild after a restart from a journal: the newest ``keep_replies`` ``done`` replies answer
    resubmissions of their request ids; ``accepted`` requests without a reply come back with their full
    timeout (their clients re-attach by resubmitting the same request id), under their work id, last lease
    and attempt count, parked until the caller's grace period ends. Returns how many came back."""
    for client_id, rid, reply in done[-keep_replies:]:
        table.restore_reply(client_id, rid, m.Reply(rid, **reply))
    n = 0
    for client_id, rid, d in accepted:
        if table.known_request(client_id, rid):
            continue
        name = rollout.bucket_named(d["name"]) if d["kind"] == "generate" and not d["trajectory"] else d["name"]
        wid, prior = d.get("work_id"), d.get("prior_attempts")
        w = table.admit(client_id, rid, b"", d["kind"], name, d["args"], d["trajectory"], d["timeout_s"], now,
                        "restored", wid if type(wid) is str else None,
                        prior_attempts=prior if type(prior) is int else 0)  # a lost direct call's earlier run
        lease, attempt, holder = d.get("lease"), d.get("attempt"), d.get("actor_id")
        if type(lease) is int and type(attempt) is int and type(holder) is str:
            w.lease, w.attempt, w.holder = lease, attempt, holder
            table.note_lease(lease)
        table.park(w)
        n += 1
    return n
