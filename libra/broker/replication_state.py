"""Journal replication's decisions, pure: the primary's book of standbys and the standby's follower state.

No I/O, no clock (``now`` is passed in), no logging; ``libra.broker.replication`` is the shell that moves the
messages (``libra.protocol.messages_replication``).

Primary (:class:`ReplicaSet`): a standby that says hello gets a snapshot as of the current batch sequence
number and is *syncing* until it acks that number; from then on it is *in sync*, and every batch waits for
the ack of every in-sync standby (bounded by the shell's ``replica_ack_timeout_s``). One that misses the
deadline is *lagging*: it gets no more batches (its stream now has a gap, which it sees on the next beat)
until it says hello again and is sent a fresh snapshot.

Standby (:class:`FollowerState`): applies batch ``applied + 1`` and nothing else; a batch or beat that shows a
gap, or a beat from another primary epoch, means "ask for a snapshot". It takes over when the stream has
been silent for ``takeover_after_s`` *and* it holds a snapshot (a standby that never reached its primary has
nothing to serve from and keeps waiting).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["FollowerState", "ReplicaSet", "Standby"]

StandbyMode = Literal["syncing", "in_sync", "lagging"]
BatchAction = Literal["apply", "duplicate", "resync", "ignore"]


@dataclass(slots=True)
class Standby:
    """One standby as the primary sees it (``ident``: its socket identity)."""

    ident: bytes
    standby_id: str
    mode: StandbyMode = "syncing"
    snapshot_seq: int = 0
    acked: int = -1


@dataclass(slots=True)
class ReplicaSet:
    """The primary's standbys and its batch sequence numbers."""

    epoch: str
    seq: int = 0
    standbys: dict[bytes, Standby] = field(default_factory=dict)

    def hello(self, ident: bytes, standby_id: str) -> int:
        """A standby asks for a snapshot: the sequence number the snapshot must carry (the last batch's)."""
        self.standbys[ident] = Standby(ident, standby_id, "syncing", self.seq)
        return self.seq

    def next_batch(self) -> tuple[int, list[bytes]] | None:
        """Number the next batch: ``(seq, identities to send it to)``; None when no standby takes batches (the
        number is then not used, so a later snapshot carries the last one sent)."""
        targets = [s.ident for s in self.standbys.values() if s.mode != "lagging"]
        if not targets:
            return None
        self.seq += 1
        return self.seq, targets

    def ack(self, ident: bytes, epoch: str, seq: int) -> bool:
        """Record an ack; True when it brought a syncing standby in sync."""
        s = self.standbys.get(ident)
        if s is None or epoch != self.epoch or s.mode == "lagging" or seq > self.seq:
            return False
        s.acked = max(s.acked, seq)
        if s.mode == "syncing" and s.acked >= s.snapshot_seq:
            s.mode = "in_sync"
            return True
        return False

    def waiting(self, seq: int) -> list[bytes]:
        """The in-sync standbys whose ack of batch ``seq`` is still missing."""
        return [s.ident for s in self.standbys.values() if s.mode == "in_sync" and s.acked < seq]

    def expire(self, seq: int) -> list[Standby]:
        """The ack deadline of batch ``seq`` passed: the in-sync standbys still missing it become lagging."""
        late = [s for s in self.standbys.values() if s.mode == "in_sync" and s.acked < seq]
        for s in late:
            s.mode = "lagging"
        return late

    def in_sync(self) -> int:
        return sum(1 for s in self.standbys.values() if s.mode == "in_sync")


@dataclass(slots=True)
class FollowerState:
    """What a standby knows of its primary's stream."""

    takeover_after_s: float
    epoch: str = ""
    applied: int = -1
    have_snapshot: bool = False
    awaiting_snapshot: bool = True
    last_heard: float | None = None
    asked_at: float | None = None

    def heard(self, now: float) -> None:
        self.last_heard = now

    def ask(self, now: float) -> None:
        """A hello (snapshot request) was sent."""
        self.awaiting_snapshot = True
        self.asked_at = now

    def ask_again(self, now: float, every_s: float) -> bool:
        """A snapshot is awaited and the last request is ``every_s`` old (lost to a restarting primary)."""
        return self.awaiting_snapshot and (self.asked_at is None or now - self.asked_at >= every_s)

    def on_snapshot(self, epoch: str, seq: int, now: float) -> None:
        self.epoch, self.applied = epoch, seq
        self.have_snapshot, self.awaiting_snapshot = True, False
        self.heard(now)

    def on_batch(self, epoch: str, seq: int, now: float) -> BatchAction:
        """``apply`` batch ``seq`` (then call :meth:`applied_batch`), ack a ``duplicate``, ``resync`` after a gap
        or from another epoch, or ``ignore`` it (a snapshot is on its way and covers it)."""
        self.heard(now)
        if self.awaiting_snapshot:
            return "ignore"
        if epoch != self.epoch or seq > self.applied + 1:
            return "resync"
        return "apply" if seq == self.applied + 1 else "duplicate"

    def applied_batch(self, seq: int) -> None:
        self.applied = seq

    def on_beat(self, epoch: str, seq: int, now: float) -> bool:
        """True when the beat shows this standby missed something (another epoch, or a batch behind it that
        never came: batches and beats travel in order on one connection)."""
        self.heard(now)
        return not self.awaiting_snapshot and (epoch != self.epoch or seq > self.applied)

    def should_take_over(self, now: float) -> bool:
        """The primary has been silent for ``takeover_after_s`` and there is a journal to serve from."""
        return (self.have_snapshot and self.last_heard is not None
                and now - self.last_heard >= self.takeover_after_s)
