"""The broker replication stream's messages: a primary broker ships its journal to a standby broker.

No I/O. These travel on the primary's separate replication endpoint (``--replicate-bind``), never on the
broker's serving socket, so they are their own family with their own header (:data:`REPL_VERSION`) and
codec: one frame, ``REPL_VERSION + msgpack`` of a tagged array (``msgspec``, ``array_like``). Decoding *is*
validation: a frame that is not one of these messages, or a field of the wrong type, raises
:class:`~libra.protocol.errors.ProtocolError` naming the message and field.

Directions: ``S→P`` standby to primary, ``P→S`` primary to standby.

- :class:`ReplHello` S→P: "send me a snapshot" (on connect, after a sequence gap, or on a new primary epoch).
- :class:`ReplSnapshot` P→S: the whole journal database (``sqlite3.Connection.serialize()``) as of ``seq``.
- :class:`ReplBatch` P→S: the journal records one broker loop pass committed (the same ``JournalWrite``
  records the primary wrote, as ``[op, client_id, request_id, data]``; ``op`` ``prune`` carries no ids), ``seq``
  one more than the batch before it.
- :class:`ReplAck` S→P: "everything up to ``seq`` is committed in my journal".
- :class:`ReplBeat` P→S: the primary is alive; ``seq`` is the last batch it sent (a standby behind it without a
  batch on the way has missed one: it asks for a snapshot).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from .errors import ProtocolCode, ProtocolError

__all__ = ["REPL_VERSION", "ReplAck", "ReplBatch", "ReplBeat", "ReplHello", "ReplSnapshot", "decode_repl",
           "encode_repl"]

REPL_VERSION = b"LIBRAR1"
"""The replication stream's frame header (the serving socket's is ``LIBRA1``: neither decodes the other)."""


class _Repl(msgspec.Struct, frozen=True, array_like=True, tag=True, forbid_unknown_fields=True):
    epoch: str
    """The primary's run: a fresh random token each time a primary starts (a standby that sees another
    epoch than its snapshot's resyncs)."""


class ReplHello(_Repl, frozen=True, array_like=True, tag="hello", forbid_unknown_fields=True):
    """S→P: ask for a snapshot. ``epoch`` is the epoch of the standby's last snapshot ("" for none)."""

    standby_id: str
    applied_seq: int


class ReplSnapshot(_Repl, frozen=True, array_like=True, tag="snapshot", forbid_unknown_fields=True):
    """P→S: the journal database as of batch ``seq``."""

    seq: int
    db: bytes


class ReplBatch(_Repl, frozen=True, array_like=True, tag="batch", forbid_unknown_fields=True):
    """P→S: one committed loop pass's journal records."""

    seq: int
    records: list[tuple[str, str, str, dict[str, Any]]]


class ReplAck(_Repl, frozen=True, array_like=True, tag="ack", forbid_unknown_fields=True):
    """S→P: batches up to ``seq`` are committed on the standby (``epoch``: the primary epoch they came from)."""

    standby_id: str
    seq: int


class ReplBeat(_Repl, frozen=True, array_like=True, tag="beat", forbid_unknown_fields=True):
    """P→S: heartbeat; ``seq`` is the last batch sent."""

    seq: int


ReplMessage = Union[ReplHello, ReplSnapshot, ReplBatch, ReplAck, ReplBeat]
_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(ReplMessage)  # type: ignore[arg-type]


def encode_repl(msg: ReplMessage) -> bytes:
    """The one frame of a replication message."""
    return REPL_VERSION + _ENC.encode(msg)


def decode_repl(frame: bytes) -> ReplMessage:
    """The message in ``frame``; :class:`ProtocolError` for anything else (wrong header, kind or field)."""
    head = bytes(frame[:len(REPL_VERSION)])
    if head != REPL_VERSION:
        raise ProtocolError(ProtocolCode.BAD_VERSION,
                            f"replication header {head!r} is not {REPL_VERSION!r} (wrong peer or version)")
    try:
        return _DEC.decode(memoryview(frame)[len(REPL_VERSION):])
    except msgspec.ValidationError as exc:
        raise ProtocolError(ProtocolCode.BAD_TYPE, f"bad replication message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(ProtocolCode.BAD_PAYLOAD, f"replication payload is not valid msgpack: {exc}") from None
