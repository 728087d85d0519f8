"""Durability, the core's side: the journal records the core emits and rebuilding state from them.

The core emits a :class:`~libra.broker.events.JournalWrite` ``accept`` record for every client request it
accepts and a ``done`` record for its one reply (work a job owns is never journaled); the shell stores them
(``journal_store.BrokerJournal``, SQLite) and, after a restart, hands what it loaded back as a ``Restore``
event, which :func:`restore` applies. No I/O here.
"""

from __future__ import annotations

from typing import Any

from libra.protocol import messages as m

from .events import JournalWrite
from .rollout import RolloutRouting
from .work_table import WorkTable

__all__ = ["accept_record", "restore"]


def accept_record(client_id: str, msg: m.Submit) -> JournalWrite:
    """The ``accept`` record of an accepted Submit: what is needed to queue it again after a restart."""
    return JournalWrite("accept", client_id, msg.request_id, {
        "kind": msg.kind, "name": msg.name, "args": msg.args, "trajectory": msg.trajectory,
        "timeout_s": msg.timeout_s})


def restore(table: WorkTable, rollout: RolloutRouting, accepted: list[tuple[str, str, dict[str, Any]]],
            done: list[tuple[str, str, dict[str, Any]]], keep_replies: int, now: float) -> int:
    """Rebuild after a restart from a journal: the newest ``keep_replies`` ``done`` replies answer
    resubmissions of their request ids; ``accepted`` requests without a reply are queued again with their
    full timeout (their clients re-attach by resubmitting the same request id). Returns how many were
    queued again."""
    for client_id, rid, reply in done[-keep_replies:]:
        table.restore_reply(client_id, rid, m.Reply(rid, **reply))
    n = 0
    for client_id, rid, d in accepted:
        if table.known_request(client_id, rid):
            continue
        name = rollout.bucket_named(d["name"]) if d["kind"] == "generate" and not d["trajectory"] else d["name"]
        w = table.admit(client_id, rid, b"", d["kind"], name, d["args"], d["trajectory"], d["timeout_s"], now,
                        "restored")
        table.push(w)
        n += 1
    return n
