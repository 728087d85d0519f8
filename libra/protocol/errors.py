"""Protocol-level errors and the stable error codes that travel in ``Error``/``Reply`` messages.

Nothing here does I/O. ``ProtocolError`` is raised by the codec for any frame it cannot accept; its
``code`` is one of :class:`ProtocolCode` and its message says what was wrong in words a user can act on.
``ErrorCode`` values are the machine-readable reasons a piece of work failed; the client maps each to a
typed exception (``libra.client.errors``).
"""

from __future__ import annotations

from enum import Enum


class ProtocolCode(str, Enum):
    """Why a frame was rejected by the codec."""

    TOO_FEW_FRAMES = "too_few_frames"
    BAD_VERSION = "bad_version"
    UNKNOWN_KIND = "unknown_kind"
    BAD_PAYLOAD = "bad_payload"  # not msgpack, or not an array
    MISSING_FIELD = "missing_field"
    EXTRA_FIELD = "extra_field"
    BAD_TYPE = "bad_type"
    OVERSIZE = "oversize"
    UNEXPECTED = "unexpected"  # well-formed but not allowed in this state (e.g. no hello yet)
    FORBIDDEN = "forbidden"  # the sender's key role may not send this (libra.broker.roles)


class ErrorCode(str, Enum):
    """Why a request failed; stable strings on the wire."""

    UNKNOWN_TOOL = "unknown_tool"  # no actor offers this tool / kind
    TIMEOUT = "timeout"  # the request's deadline passed
    TOOL_FAILED = "tool_failed"  # the tool ran and raised
    RETRIES_EXHAUSTED = "retries_exhausted"  # actors holding it died or lost the lease too often
    BUSY = "busy"  # queue bound reached; retry later
    CANCELLED = "cancelled"
    BAD_REQUEST = "bad_request"  # malformed or invalid arguments
    PAYLOAD_TOO_LARGE = "payload_too_large"  # the encoded request exceeds the frame limit
    PROTOCOL = "protocol"  # the peer sent a frame the broker could not decode
    INTERNAL = "internal"
    NO_LEASE = "no_lease"  # no actor runs this inline: no direct lease (the client uses the broker)
    FORBIDDEN = "forbidden"  # the caller's key role may not ask this (an actor key submitting work, ...)
    LEASE_ENDED = "lease_ended"  # a direct call on a lease its actor no longer holds: it did not run


class ProtocolError(Exception):
    """A frame that cannot be decoded or is not allowed. ``code`` is a :class:`ProtocolCode`."""

    def __init__(self, code: ProtocolCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
