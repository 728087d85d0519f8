"""Durability, the shell's side: the broker's journal of accepted requests and delivered replies, in SQLite (WAL).

The pure core emits :class:`~libra.broker.events.JournalWrite` commands; the server shell appends them here
and commits once per loop pass (WAL with ``synchronous=NORMAL`` survives a killed process; a power loss
may lose the last commit). ``load()`` returns what the core's ``Restore`` event needs after a restart:
accepted requests that have no reply yet, and the most recent replies (so a client retrying a request id
gets the original answer instead of a second execution); an accepted request comes back with its work
id and, when it was given to an actor, its last lease and attempt count (``start`` records). Payloads are
msgpack, never pickle.

Replication (``libra.broker.replication``): with ``shipping`` on, every record written is also kept, as
``(op, client_id, request_id, data)``, until :meth:`take_shipped` hands the committed pass's records to the
primary's replicator; a standby applies the same records with :meth:`apply` and starts from a primary's
:meth:`snapshot` (``sqlite3`` ``serialize()``) with :meth:`replace`.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import msgpack

from .events import JournalWrite

SCHEMA = """
CREATE TABLE IF NOT EXISTS accepted (client_id TEXT, request_id TEXT, body BLOB, PRIMARY KEY (client_id, request_id));
CREATE TABLE IF NOT EXISTS done (seq INTEGER PRIMARY KEY AUTOINCREMENT, client_id TEXT, request_id TEXT, reply BLOB,
                                 UNIQUE (client_id, request_id));
CREATE TABLE IF NOT EXISTS started (client_id TEXT, request_id TEXT, lease INTEGER, attempt INTEGER,
                                    actor_id TEXT, PRIMARY KEY (client_id, request_id));
"""


class BrokerJournal:
    def __init__(self, path: str | Path, keep_replies: int = 20_000) -> None:
        self.path = Path(path)
        self.keep = keep_replies
        self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self._pending = 0
        self.shipping = False
        self._shipped: list[tuple[str, str, str, dict[str, Any]]] = []
        self.db.execute("BEGIN")

    def accept(self, client_id: str, request_id: str, data: dict[str, Any]) -> None:
        self.db.execute("INSERT OR IGNORE INTO accepted VALUES (?, ?, ?)",
                        (client_id, request_id, msgpack.packb(data, use_bin_type=True)))
        self._pending += 1

    def start(self, client_id: str, request_id: str, data: dict[str, Any]) -> None:
        self.db.execute("INSERT OR REPLACE INTO started VALUES (?, ?, ?, ?, ?)",
                        (client_id, request_id, int(data["lease"]), int(data["attempt"]), str(data["actor_id"])))
        self._pending += 1

    def done(self, client_id: str, request_id: str, reply: dict[str, Any]) -> None:
        self.db.execute("DELETE FROM accepted WHERE client_id = ? AND request_id = ?", (client_id, request_id))
        self.db.execute("DELETE FROM started WHERE client_id = ? AND request_id = ?", (client_id, request_id))
        self.db.execute("INSERT OR REPLACE INTO done (client_id, request_id, reply) VALUES (?, ?, ?)",
                        (client_id, request_id, msgpack.packb(reply, use_bin_type=True)))
        self._pending += 1

    def write(self, rec: JournalWrite) -> None:
        """Append one record the core emitted (committed by the next :meth:`commit`)."""
        op = self.accept if rec.op == "accept" else self.start if rec.op == "start" else self.done
        op(rec.client_id, rec.request_id, rec.data)
        if self.shipping:
            self._shipped.append((rec.op, rec.client_id, rec.request_id, rec.data))

    def commit(self) -> None:
        if self._pending:
            self.db.execute("COMMIT")
            self._pending = 0
            self.db.execute("BEGIN")

    def prune(self, keep: int | None = None) -> None:
        """Keep only the newest ``keep`` (default ``keep_replies``) replies (bounded disk use)."""
        keep = self.keep if keep is None else keep
        self.db.execute("DELETE FROM done WHERE seq <= (SELECT MAX(seq) FROM done) - ?", (keep,))
        self._pending += 1
        if self.shipping:
            self._shipped.append(("prune", "", "", {"keep": keep}))

    def take_shipped(self) -> list[tuple[str, str, str, dict[str, Any]]]:
        """The records written since the last call (call it right after :meth:`commit`)."""
        out, self._shipped = self._shipped, []
        return out

    def apply(self, records: list[tuple[str, str, str, dict[str, Any]]]) -> None:
        """A standby: write a primary's batch of records and commit them."""
        for op, client_id, request_id, data in records:
            if op == "prune":
                self.prune(int(data["keep"]))
            elif op in ("accept", "start", "done"):
                self.write(JournalWrite(op, client_id, request_id, data))  # type: ignore[arg-type]
            else:
                raise ValueError(f"journal record with unknown op {op!r}")
        self.commit()

    def snapshot(self) -> bytes:
        """The whole committed journal database as bytes (``sqlite3`` ``serialize()``)."""
        self.commit()
        return self.db.serialize()

    def replace(self, image: bytes) -> None:
        """A standby: make this journal a copy of a primary's :meth:`snapshot`."""
        raw = bytearray(image)
        if len(raw) >= 20:
            raw[18] = raw[19] = 1  # a WAL database's header says "WAL"; an in-memory copy must read it as rollback
        mem = sqlite3.connect(":memory:")
        try:
            mem.deserialize(bytes(raw))
            if self.db.in_transaction:
                self.db.execute("COMMIT")
            mem.backup(self.db)
        finally:
            mem.close()
            if not self.db.in_transaction:
                self.db.execute("BEGIN")
        self._pending = 0

    def load(self) -> tuple[list[tuple[str, str, dict[str, Any]]], list[tuple[str, str, dict[str, Any]]]]:
        unpack = lambda b: msgpack.unpackb(b, raw=False)  # noqa: E731
        accepted = []
        for c, r, b, lease, attempt, actor_id in self.db.execute(
                "SELECT a.client_id, a.request_id, a.body, s.lease, s.attempt, s.actor_id FROM accepted a "
                "LEFT JOIN started s ON a.client_id = s.client_id AND a.request_id = s.request_id ORDER BY a.rowid"):
            d = unpack(b)
            if lease is not None:
                d["lease"], d["attempt"], d["actor_id"] = lease, attempt, actor_id
            accepted.append((c, r, d))
        done = [(c, r, unpack(b)) for c, r, b in
                self.db.execute("SELECT client_id, request_id, reply FROM done ORDER BY seq")]
        return accepted, done

    def close(self) -> None:
        self.commit()
        self.db.execute("COMMIT")
        self.db.close()
