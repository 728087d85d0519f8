"""Pieces shared by the client core and its shells: results, ids, timeouts, the reconnect gate, request checks and
reply mapping. No sockets (those helpers are in ``shell``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from libra.protocol import encode
from libra.protocol import messages as m

from .errors import BadRequest, PayloadTooLarge, error_from_reply

REPLY_MARGIN_S = 0.5  # seconds before the caller's deadline the server times a request out (served_timeout)


def served_timeout(timeout: float) -> float:
    """The timeout a request carries to the broker or a direct actor: the caller's ``timeout`` less a reply
    margin (``REPLY_MARGIN_S``, at most a quarter of it: the broker checks deadlines every tick, up to 0.25 s), so
    that the server's own timeout reply, which says how many attempts were made, arrives before the caller's
    deadline. The client's deadline stays the caller's ``timeout`` exactly: with the broker gone the call fails
    then, not later."""
    return float(timeout) - min(REPLY_MARGIN_S, 0.25 * float(timeout))


BATCH_MAX_BYTES = 1 << 20  # a send batch stops growing at this many bytes (a big request goes alone)
RESEND_BATCH = 256  # unanswered requests resent per frame after a reconnect (paced: one frame at a time)


class ReconnectGate:
    """One reconnect at a time, and each unanswered request resent once per reconnect.

    A broker that restarted answers every frame of an unknown peer (each heartbeat, each request sent before
    the new hello) with ``Disconnect``. Only the first of them starts a reconnect (a new hello); the rest are
    echoes of frames sent before that hello and are ignored, unless no ``Welcome`` came within ``retry_s``
    (the hello itself was lost: say it again). The unanswered requests are resent once, after the ``Welcome``,
    so the broker knows the session before it sees them. Pure: times come in as arguments.
    """

    __slots__ = ("retry_s", "since", "reconnects")

    def __init__(self, retry_s: float) -> None:
        self.retry_s = retry_s
        self.since: float | None = None  # when the reconnect in progress sent its hello
        self.reconnects = 0

    def on_disconnect(self, now: float) -> bool:
        """True: send a hello now. False: a reconnect is already waiting for its welcome."""
        if self.since is not None and now - self.since < self.retry_s:
            return False
        self.since = now
        return True

    def on_welcome(self) -> bool:
        """True: this welcome ends a reconnect, so resend the unanswered requests now (once)."""
        if self.since is None:
            return False
        self.since = None
        self.reconnects += 1
        return True


@dataclass(frozen=True, slots=True)
class ToolResult:
    """A successful call. ``output`` is what the tool returned (``echo``: its args; ``python``:
    ``{"stdout", "stderr", "exit_code", "truncated"}``)."""

    output: Any
    work_id: str
    attempts: int
    actor_id: str
    duration_s: float


class RequestIds:
    """Unique request ids for one client (idempotency keys)."""

    def __init__(self, client_id: str) -> None:
        self._prefix = client_id
        self._n = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}:{next(self._n)}"


def unreachable(url: str, curve: bool, timeout: float | None = None, port_open: bool | None = None) -> str:
    """Why a broker may not answer, in words a user can act on (a CURVE mismatch looks like silence, and so does
    a saturated broker loop). ``port_open``: whether the broker's TCP port accepted a connection (the shells ask
    :func:`libra.client.probe.port_accepts`; ``None``: not checked). When it did, an overloaded broker (or
    another program on that port) is named first, the CURVE keys second."""
    head = f"no answer from the broker at {url}" + (f" within {timeout:g}s" if timeout is not None else "")
    if port_open:
        head += (": its port accepts connections but nothing answered, so the broker may be overloaded (its loop "
                 "saturated: check its CPU and the number of actors and clients) or the program there is not a "
                 "libra broker. A second possibility:")
    elif port_open is None:
        head += ": is it running there, or overloaded (a saturated broker is silent too: check its CPU)?"
    else:
        head += ": is it running there?"
    if curve:
        return (f"{head} This client uses CURVE keys: the broker refuses it when this "
                "client's public key is not in its --curve-allow directory or LIBRA_BROKER_KEY is not the "
                "broker's public key (the broker logs each refused handshake)")
    return (f"{head} If the broker requires CURVE keys (started with --curve-secret), "
            "this client needs them too: set LIBRA_CURVE_SECRET to this client's secret key file and "
            "LIBRA_BROKER_KEY to the broker's public key file, and put this client's public key in the "
            "broker's --curve-allow directory ('libra keys' creates key pairs)")


def result_or_error(reply: m.Reply) -> ToolResult | Exception:
    if reply.ok:
        return ToolResult(reply.output, reply.work_id, reply.attempts, reply.actor_id, reply.duration_s)
    return error_from_reply(reply.error_code, reply.error, work_id=reply.work_id, attempts=reply.attempts,
                            retry_after_s=reply.retry_after_s, tool_code=reply.tool_code)


def _what(msg: Any) -> str:
    return f"{msg.kind} {msg.name!r}" if type(msg) in (m.Submit, m.DirectCall) else type(msg).__name__


def encode_checked(msg: Any, limit: int) -> list[bytes]:
    """The frames of request ``msg``, or a typed error before anything is sent: :class:`BadRequest` for an
    argument msgpack cannot carry, :class:`PayloadTooLarge` for a request over ``limit`` bytes."""
    try:
        frames = encode(msg)
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadRequest(f"{_what(msg)}: the arguments cannot be sent ({exc}); use plain data: "
                         "None, bool, int, float, str, bytes, and lists and dicts of them") from None
    size = sum(map(len, frames))
    if size > limit:
        raise PayloadTooLarge(f"{_what(msg)}: the request is {size:,} bytes, over the frame limit of "
                              f"{limit:,} bytes; send bulk data over the data plane and pass a reference",
                              size=size, limit=limit)
    return frames


def batches(items: list[tuple[Any, int]]) -> Iterator[list[Any]]:
    """``(message, encoded size)`` pairs grouped for ``encode_batch``: at most ``RESEND_BATCH`` messages and
    ``BATCH_MAX_BYTES`` bytes a batch (a bigger message goes alone), in order."""
    batch: list[Any] = []
    total = 0
    for msg, size in items:
        if batch and (len(batch) >= RESEND_BATCH or total + size > BATCH_MAX_BYTES):
            yield batch
            batch, total = [], 0
        batch.append(msg)
        total += size
    if batch:
        yield batch
