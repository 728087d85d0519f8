"""The data plane's client side: :func:`fetch` an object's header and chunks with credit-based flow
control, :func:`fetch_state_dict` to also decode and verify them, and :func:`latest` to learn the newest
object of a topic.

Protocol and contracts are described in :mod:`libra.dataplane`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from libra.dataplane.errors import (
    DataPlaneError,
    Forbidden,
    ObjectNotFound,
    PeerLost,
    TransferCorrupted,
)
from libra.dataplane.wire import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_WINDOW,
    PROTO,
    DataPlaneKeys,
    FetchStats,
    ObjectRef,
    pack,
)

__all__ = ["fetch", "fetch_state_dict", "latest"]


def _client_socket(ctx: zmq.Context, endpoint: str, server_key: str | None, keys: DataPlaneKeys | None) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    if server_key is not None:
        own = keys or DataPlaneKeys.ephemeral()
        s.curve_publickey = own.public_key
        s.curve_secretkey = own.secret_key
        s.curve_serverkey = server_key.encode()
    s.connect(endpoint)
    return s


def _recv(sock: zmq.Socket, timeout_s: float, what: str) -> tuple[dict[str, Any], list[memoryview]]:
    if not sock.poll(max(1, int(timeout_s * 1000))):
        raise PeerLost(what)
    frames = sock.recv_multipart(copy=False)  # zero-copy: chunks stay in ZeroMQ's buffers until unpacked
    if len(frames) < 2 or frames[0].bytes != PROTO:
        raise TransferCorrupted(f"{what}: the peer does not speak the data-plane protocol")
    try:
        meta = msgpack.unpackb(frames[1].bytes, raw=False)
    except Exception as exc:  # noqa: BLE001
        raise TransferCorrupted(f"{what}: undecodable reply ({exc})") from None
    if not isinstance(meta, dict):
        raise TransferCorrupted(f"{what}: reply is not a map")
    return meta, [f.buffer for f in frames[2:]]


def _raise_for(meta: dict[str, Any], where: str) -> None:
    if meta.get("ok") is False:
        code, message = meta.get("code"), meta.get("message", "")
        if code == "not_found":
            raise ObjectNotFound(f"{where}: {message}")
        if code == "forbidden":
            raise Forbidden(f"{where}: refused: {message}")
        raise DataPlaneError(f"{where}: server says {code}: {message}")


def fetch(ref: ObjectRef, *, keys: DataPlaneKeys | None = None, window: int = DEFAULT_WINDOW, batch: int = 2,
          idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S, ctx: zmq.Context | None = None,
          on_chunk: Callable[[int, int], None] | None = None) -> tuple[bytes, list[memoryview], FetchStats]:
    """Fetch ``ref``'s header and chunks with credit-based flow control; returns ``(header, chunks, stats)``.

    At most ``window`` chunks are requested and unreceived at any time, asked for ``batch`` at a time.
    ``idle_timeout_s`` bounds the wait for *any* progress (not the whole transfer). ``on_chunk(received,
    total)`` is called after each chunk (progress reporting; tests use it to kill a server mid-way).
    The chunks are read-only memoryviews of the received frames (no copy) and are not CRC-checked here
    (see :func:`fetch_state_dict`). Raises :class:`PeerLost`,
    :class:`ObjectNotFound`, :class:`Forbidden` (the key's role may not see it), :class:`TransferCorrupted`.
    """
    if window < 1 or batch < 1:
        raise ValueError(f"window and batch must be >= 1, got {window} and {batch}")
    sock = _client_socket(ctx or zmq.Context.instance(), ref.endpoint, ref.server_key, keys)
    stats = FetchStats()
    where = f"data plane {ref.endpoint} object {ref.name!r}"
    req = uuid.uuid4().hex[:12]
    t0 = time.perf_counter()
    try:
        sock.send_multipart([PROTO, pack({"op": "head", "name": ref.name, "req": req})])
        stats.requests += 1
        meta, raw = _recv(sock, idle_timeout_s, f"{where}: no answer to the header request within {idle_timeout_s}s "
                                                f"(the server is down or unreachable)")
        _raise_for(meta, where)
        n, total = meta.get("n_chunks"), meta.get("total_bytes")
        if meta.get("op") != "head" or type(n) is not int or n < 0 or len(raw) != 1:
            raise TransferCorrupted(f"{where}: malformed header reply")
        header = bytes(raw[0])
        chunks: list[memoryview | None] = [None] * n
        received = requested = outstanding = 0
        while received < n:
            while requested < n and outstanding < window:
                count = min(batch, n - requested, window - outstanding)
                sock.send_multipart([PROTO, pack({"op": "get", "name": ref.name, "req": req, "start": requested,
                                                   "count": count})])
                stats.requests += 1
                requested += count
                outstanding += count
            meta, raw = _recv(sock, idle_timeout_s,
                              f"{where}: the server stopped answering after {received}/{n} chunks "
                              f"(no data for {idle_timeout_s}s; it died or the network dropped)")
            if meta.get("req") != req:
                continue  # defensive: not a reply to this transfer
            _raise_for(meta, where)
            idx = meta.get("index")
            if meta.get("op") != "chunk" or type(idx) is not int or not 0 <= idx < requested or len(raw) != 1:
                raise TransferCorrupted(f"{where}: malformed chunk reply")
            if chunks[idx] is not None:
                raise TransferCorrupted(f"{where}: chunk {idx} arrived twice")
            chunks[idx] = raw[0]
            received += 1
            outstanding -= 1
            stats.nbytes += len(raw[0])
            if on_chunk is not None:
                on_chunk(received, n)
        if total is not None and stats.nbytes != total:
            raise TransferCorrupted(f"{where}: received {stats.nbytes} bytes, the server announced {total}")
        stats.chunks = n
        stats.seconds = time.perf_counter() - t0
        return header, [c for c in chunks if c is not None], stats
    finally:
        sock.close(0)


def fetch_state_dict(ref: ObjectRef, **kw: Any) -> tuple[dict[str, Any], Any, FetchStats]:
    """:func:`fetch` then decode and verify (every chunk's size and CRC-32): ``(state_dict, header, stats)``.

    ``header`` is a :class:`~libra.weights.format.WeightsHeader`. A corrupted transfer raises
    :class:`TransferCorrupted` naming the chunk.
    """
    from libra.weights.format import WeightsFormatError, unpack_state_dict

    header, chunks, stats = fetch(ref, **kw)
    try:
        sd, hdr = unpack_state_dict(header, chunks)
    except WeightsFormatError as exc:
        raise TransferCorrupted(f"data plane {ref.endpoint} object {ref.name!r}: {exc}") from None
    return sd, hdr, stats


def latest(endpoint: str, topic: str, *, server_key: str | None = None, keys: DataPlaneKeys | None = None,
           timeout_s: float = 1.0, ctx: zmq.Context | None = None) -> ObjectRef | None:
    """The newest object published under ``topic`` at ``endpoint`` (None if nothing is); raises
    :class:`PeerLost` when the server does not answer within ``timeout_s``, :class:`Forbidden` when the newest
    one belongs to a job the key may not see."""
    sock = _client_socket(ctx or zmq.Context.instance(), endpoint, server_key, keys)
    try:
        sock.send_multipart([PROTO, pack({"op": "latest", "topic": topic})])
        meta, _ = _recv(sock, timeout_s, f"data plane {endpoint}: no answer to 'latest {topic}' within {timeout_s}s")
        if meta.get("ok") is False and meta.get("code") == "not_found":
            return None
        _raise_for(meta, f"data plane {endpoint}")
        ver = meta.get("version")
        return ObjectRef(endpoint, str(meta.get("name")), ver if type(ver) is int else None, server_key)
    finally:
        sock.close(0)
