"""Journal replication, the I/O: a primary broker ships its journal to a standby, which takes over when the
primary falls silent (design and limits: docs/failover.md).

Synchronous log shipping over the broker's own ZeroMQ transport (CURVE when the broker has keys). The
primary binds a ROUTER at ``--replicate-bind``; a standby (``--standby-of``) connects a DEALER, says hello and
gets a snapshot of the whole journal (``sqlite3`` ``serialize()``), then every batch of journal records the
primary commits, numbered. :meth:`ReplicationPrimary.ship` runs in the server's ``_flush`` after the local
commit and *before* the pass's replies go out, and waits (at most ``replica_ack_timeout_s``) for every in-sync
standby's ack: a client never sees an answer its standby does not have. A standby that misses the deadline
is marked lagging (logged, counted) and the primary carries on alone until it resyncs. Beats every
``replica_beat_s`` tell the standby the primary lives; :class:`ReplicationStandby` takes over after
``takeover_after_s`` of silence. The decisions are in ``replication_state`` (pure).
"""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path

import zmq

from libra.logging import get_logger
from libra.protocol import ProtocolError
from libra.protocol.messages_replication import (ReplAck, ReplBatch, ReplBeat, ReplHello, ReplSnapshot, decode_repl,
                                                  encode_repl)
from libra.transport.security import CurveClient, CurveServer, apply_client, apply_server

from .config import BrokerConfig
from .journal_store import BrokerJournal
from .replication_state import FollowerState, ReplicaSet

__all__ = ["ReplicationPrimary", "ReplicationStandby"]

log = get_logger("libra.broker.replication")


class ReplicationPrimary:
    """The primary's side: a ROUTER at ``bind`` serving snapshots and batches of ``journal`` to standbys."""

    def __init__(self, ctx: zmq.Context, bind: str, journal: BrokerJournal, config: BrokerConfig,
                 curve: CurveServer | None = None) -> None:
        self.journal = journal
        journal.shipping = True
        self.ack_timeout_s = config.replica_ack_timeout_s
        self.beat_s = config.replica_beat_s
        self.max_bytes = 2 * config.max_frame_bytes
        self.book = ReplicaSet(secrets.token_hex(8))
        self.sock = ctx.socket(zmq.ROUTER)
        if curve is not None:
            apply_server(self.sock, curve)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.bind(bind)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._next_beat = 0.0
        self.lagging_events = 0
        self.batches = 0
        self.ack_wait_s = 0.0
        log.info("replication_serving", endpoint=self.endpoint, epoch=self.book.epoch)

    def ship(self) -> None:
        """Send the records the journal just committed to the standbys and wait for the in-sync ones' acks
        (at most ``ack_timeout_s``; the late ones become lagging). Call after ``journal.commit()``."""
        records = self.journal.take_shipped()
        if not records:
            return
        numbered = self.book.next_batch()
        if numbered is None:
            return
        seq, targets = numbered
        frame = encode_repl(ReplBatch(self.book.epoch, seq, records))
        for ident in targets:
            self._send(ident, frame)
        self.batches += 1
        t0 = time.monotonic()
        deadline = t0 + self.ack_timeout_s
        while self.book.waiting(seq):
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                if time.monotonic() >= deadline:
                    break
                continue
            self._drain()
        self.ack_wait_s += time.monotonic() - t0
        for s in self.book.expire(seq):
            self.lagging_events += 1
            log.warning("replica_lagging", standby=s.standby_id, seq=seq, acked=s.acked,
                        ack_timeout_s=self.ack_timeout_s, in_sync_left=self.book.in_sync())

    def pump(self, now: float) -> None:
        """Between loop passes: answer hellos and acks that arrived, and beat when due."""
        self._drain()
        if now >= self._next_beat:
            frame = encode_repl(ReplBeat(self.book.epoch, self.book.seq))
            for ident in list(self.book.standbys):
                self._send(ident, frame)
            self._next_beat = now + self.beat_s

    def _drain(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) != 2 or len(frames[1]) > self.max_bytes:
                continue
            try:
                msg = decode_repl(frames[1])
            except ProtocolError as err:
                log.warning("replication_bad_frame", error=str(err))
                continue
            if type(msg) is ReplAck:
                if self.book.ack(frames[0], msg.epoch, msg.seq):
                    log.info("replica_in_sync", standby=msg.standby_id, seq=msg.seq)
            elif type(msg) is ReplHello:
                seq = self.book.hello(frames[0], msg.standby_id)
                image = self.journal.snapshot()
                self._send(frames[0], encode_repl(ReplSnapshot(self.book.epoch, seq, image)))
                log.info("replica_snapshot_sent", standby=msg.standby_id, seq=seq, bytes=len(image),
                         had_epoch=msg.epoch, had_seq=msg.applied_seq)

    def _send(self, ident: bytes, frame: bytes) -> None:
        try:
            self.sock.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a full pipe: the standby is not reading; its ack will not come in time
            log.warning("replication_send_failed", error=str(exc))

    def close(self) -> None:
        self.journal.shipping = False
        self.sock.close(0)


class ReplicationStandby:
    """The standby's side: follows a primary's replication endpoint into ``journal_path`` until the primary
    has been silent for ``takeover_after_s`` (then :meth:`follow` returns True and the caller starts the broker
    on the journal) or :meth:`stop` is called (False)."""

    def __init__(self, primary: str, journal_path: str | Path, config: BrokerConfig,
                 ctx: zmq.Context | None = None, curve: CurveClient | None = None,
                 standby_id: str | None = None) -> None:
        self.primary = primary
        self.journal = BrokerJournal(journal_path, config.reply_cache)
        self.state = FollowerState(config.takeover_after_s)
        self.standby_id = standby_id or f"standby-{secrets.token_hex(4)}"
        self._ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self.sock = self._ctx.socket(zmq.DEALER)
        if curve is not None:
            apply_client(self.sock, curve)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, self.standby_id.encode())
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * config.max_frame_bytes)
        self.sock.connect(primary)
        self._stop = threading.Event()
        self.batches = 0
        self.snapshots = 0

    def stop(self) -> None:
        self._stop.set()

    def follow(self, poll_s: float = 0.1) -> bool:
        """Follow until takeover (True) or :meth:`stop` (False). Closes the socket and the journal either way,
        so the broker can open the journal afresh."""
        st = self.state
        log.info("standby_following", primary=self.primary, standby=self.standby_id,
                 takeover_after_s=st.takeover_after_s)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if st.ask_again(now, max(1.0, st.takeover_after_s)):
                    self._hello(now)
                if self.sock.poll(int(poll_s * 1000)):
                    self._drain()
                now = time.monotonic()
                if st.should_take_over(now):
                    log.warning("standby_takeover", primary=self.primary, last_applied_seq=st.applied,
                                epoch=st.epoch, silent_s=round(now - (st.last_heard or now), 3),
                                in_sync=not st.awaiting_snapshot, batches=self.batches, snapshots=self.snapshots)
                    return True
            return False
        finally:
            self.sock.close(0)
            self.journal.close()
            if self._own_ctx:
                self._ctx.term()

    def _hello(self, now: float) -> None:
        self.state.ask(now)
        self.sock.send(encode_repl(ReplHello(self.state.epoch, self.standby_id, self.state.applied)))

    def _ack(self, seq: int) -> None:
        self.sock.send(encode_repl(ReplAck(self.state.epoch, self.standby_id, seq)))

    def _drain(self) -> None:
        st = self.state
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            now = time.monotonic()
            try:
                msg = decode_repl(frame)
            except ProtocolError as err:
                log.warning("replication_bad_frame", error=str(err))
                continue
            t = type(msg)
            if t is ReplBatch:
                action = st.on_batch(msg.epoch, msg.seq, now)
                if action == "apply":
                    self.journal.apply(msg.records)
                    st.applied_batch(msg.seq)
                    self.batches += 1
                    self._ack(msg.seq)
                elif action == "duplicate":
                    self._ack(msg.seq)
                elif action == "resync":
                    log.warning("standby_resync", reason="gap or new primary", seq=msg.seq, applied=st.applied)
                    self._hello(now)
            elif t is ReplBeat:
                if st.on_beat(msg.epoch, msg.seq, now):
                    log.warning("standby_resync", reason="missed batches" if msg.epoch == st.epoch else "new primary",
                                seq=msg.seq, applied=st.applied)
                    self._hello(now)
            elif t is ReplSnapshot and st.awaiting_snapshot:
                self.journal.replace(msg.db)
                st.on_snapshot(msg.epoch, msg.seq, now)
                self.snapshots += 1
                self._ack(msg.seq)
                log.info("standby_snapshot_applied", seq=msg.seq, bytes=len(msg.db), epoch=msg.epoch)
