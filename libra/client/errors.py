"""Typed errors raised by ``libra.client``. Every failure is a subclass of :class:`LibraError`."""

from __future__ import annotations

from libra.protocol.errors import ErrorCode


class LibraError(Exception):
    """Base of every client-side failure. ``code`` is the wire error code; ``work_id`` when known."""

    code = "error"

    def __init__(self, message: str, *, work_id: str = "", attempts: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.work_id = work_id
        self.attempts = attempts


class UnknownTool(LibraError):
    """No actor offers the requested tool (or work kind)."""

    code = ErrorCode.UNKNOWN_TOOL.value


class ToolTimeout(LibraError):
    """The request did not finish before its timeout."""

    code = ErrorCode.TIMEOUT.value


class ToolFailed(LibraError):
    """The tool ran and failed (raised, crashed, hit a sandbox limit). ``tool_code`` says how."""

    code = ErrorCode.TOOL_FAILED.value

    def __init__(self, message: str, *, tool_code: str = "tool_failed", work_id: str = "", attempts: int = 0) -> None:
        super().__init__(message, work_id=work_id, attempts=attempts)
        self.tool_code = tool_code


class WorkLost(LibraError):
    """Actors holding the work died or lost its lease too many times."""

    code = ErrorCode.RETRIES_EXHAUSTED.value


class Busy(LibraError):
    """The broker is at its queue bound; retry after ``retry_after_s``."""

    code = ErrorCode.BUSY.value

    def __init__(self, message: str, *, retry_after_s: float = 1.0, **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.retry_after_s = retry_after_s


class Cancelled(LibraError):
    code = ErrorCode.CANCELLED.value


class BadRequest(LibraError):
    """The request is malformed: e.g. an argument msgpack cannot carry (a ``set``, an arbitrary object).
    Raised by the client before anything is sent, or answered by the broker or the tool."""

    code = ErrorCode.BAD_REQUEST.value


class PayloadTooLarge(BadRequest):
    """The encoded request is larger than the frame limit (the broker's, from its welcome, or the client's
    own ``max_frame_bytes``). Raised before anything is sent; ``size`` and ``limit`` are in bytes."""

    code = ErrorCode.PAYLOAD_TOO_LARGE.value

    def __init__(self, message: str, *, size: int = 0, limit: int = 0, **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.size = size
        self.limit = limit


class BrokerUnreachable(LibraError):
    """The broker did not answer the hello (wrong address, not running, network cut)."""

    code = "unreachable"


class BadAddress(LibraError, ValueError):
    """An address no Libra socket can use (no ``tcp://``, a wrong scheme, no port), raised before any socket is
    made. The message names the address, what is accepted and the likely fix (``libra.transport.endpoints``);
    ``address`` is the address as given."""

    code = "bad_address"

    def __init__(self, message: str, *, address: str = "", **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.address = address


class ProtocolRejected(LibraError):
    """The broker rejected a frame of ours (a client/broker version mismatch or a bug)."""

    code = ErrorCode.PROTOCOL.value


class Forbidden(LibraError):
    """The broker refused the request for this client's key role (e.g. a client key asking for a directive,
    which only an operator key may send): the message names the role."""

    code = ErrorCode.FORBIDDEN.value


_BY_CODE: dict[str, type[LibraError]] = {
    c.code: c for c in (UnknownTool, ToolTimeout, WorkLost, Busy, Cancelled, BadRequest, PayloadTooLarge,
                         ProtocolRejected, Forbidden)
}


def error_from_reply(code: str, message: str, *, work_id: str = "", attempts: int = 0,
                     retry_after_s: float = 0.0, tool_code: str = "") -> LibraError:
    """Map a failed Reply to its typed exception. Tool failures carry the tool's own code."""
    if code == ErrorCode.TOOL_FAILED.value:
        return ToolFailed(message, tool_code=tool_code or code, work_id=work_id, attempts=attempts)
    cls = _BY_CODE.get(code)
    if cls is Busy:
        return Busy(message, retry_after_s=retry_after_s or 1.0, work_id=work_id, attempts=attempts)
    if cls is not None:
        return cls(message, work_id=work_id, attempts=attempts)
    return ToolFailed(message, tool_code=code or "tool_failed", work_id=work_id, attempts=attempts)
