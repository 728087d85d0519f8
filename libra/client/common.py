"""Pieces shared by the sync and asyncio clients: results, ids, socket setup, reply mapping."""

from __future__ import annotations

import itertools
import os
import uuid
from dataclasses import dataclass
from typing import Any

import zmq

from libra.protocol import messages as m
from libra.security import CurveClient, apply_client

from .errors import error_from_reply

REPLY_GRACE_S = 2.0  # how long past its timeout a client waits for the broker's own timeout reply


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


def new_client_id() -> str:
    return f"c-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def configure_socket(sock: zmq.Socket, max_frame_bytes: int, curve: CurveClient | None = None) -> None:
    """Socket options every client uses; CURVE keys when ``curve`` (or the LIBRA_CURVE_* env) is set."""
    curve = curve or CurveClient.from_env()
    if curve is not None:
        apply_client(sock, curve)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"c-" + uuid.uuid4().bytes)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.SNDHWM, 1_000_000)
    sock.setsockopt(zmq.RCVHWM, 1_000_000)


def result_or_error(reply: m.Reply) -> ToolResult | Exception:
    if reply.ok:
        return ToolResult(reply.output, reply.work_id, reply.attempts, reply.actor_id, reply.duration_s)
    return error_from_reply(reply.error_code, reply.error, work_id=reply.work_id, attempts=reply.attempts,
                            retry_after_s=reply.retry_after_s, tool_code=reply.tool_code)
