"""The actor data plane: bulk bytes (weights, training shards) peer to peer over ZeroMQ, never via the broker.

Role: a producer (trainer rank 0 for weights, the job driver for training shards) publishes named,
immutable objects on a :class:`DataPlaneServer`; a consumer (a rollout instance, a trainer rank) that
was handed an :class:`ObjectRef` through the broker fetches the bytes straight from the producer with
:func:`fetch`. The broker only ever carries the small ref (``{"endpoint", "name", "version",
"server_key", "bytes"}``).

Objects are ``libra.engines.weights`` streams: a msgpack header (tensor table + one CRC-32 per chunk)
and the chunks. A state dict is published with :meth:`DataPlaneServer.publish_state_dict`; any other
payload is encoded as a dict of tensors first (see ``libra.rl.shards``).

Wire protocol (``LDP1``; DEALER client → ROUTER server, every message ``[b"LDP1", msgpack map, *raw]``):

- ``{"op": "head", "name"}`` → ``{"ok": True, "op": "head", "name", "version", "n_chunks",
  "total_bytes"}`` followed by one raw frame, the object's header.
- ``{"op": "get", "name", "start", "count"}`` → ``count`` messages ``{"op": "chunk", "name", "index"}``
  each followed by one raw frame, the chunk. **Flow control is credit based** (as in the ZeroMQ
  guide's file-transfer model): the client never has more than ``window`` chunks requested and not yet
  received, so neither side buffers more than ``window`` chunks and the server's send queue never
  reaches its high-water mark.
- ``{"op": "latest", "topic"}`` → ``{"ok": True, "op": "latest", "topic", "name", "version"}``: the
  newest object published under ``topic`` (how an idle rollout instance learns of a new version).
- ``{"op": "ping"}`` → ``{"ok": True, "op": "pong"}``.
- Any failure → ``{"ok": False, "code": "not_found" | "bad_request", "message"}``.

Contracts:

- An object is immutable once published; :meth:`DataPlaneServer.retire` removes it (a transfer in
  flight then fails with :class:`ObjectNotFound`). Publishing under a topic with ``keep=k`` retires
  that topic's older objects beyond the newest ``k``.
- :func:`fetch` returns the header and chunks only after every chunk arrived; :func:`fetch_state_dict`
  also checks every chunk's length and CRC-32. Failures are typed: :class:`PeerLost` (no answer for
  ``idle_timeout_s``: the server died or is unreachable, mid-transfer or before), :class:`ObjectNotFound`,
  :class:`TransferCorrupted` (bad CRC, wrong size, malformed header). A failed fetch has no side effect
  on the caller's state: the caller keeps what it had (a rollout keeps its old weights version).
- Security: when keys are given (:class:`DataPlaneKeys`, normally from the ``LIBRA_CURVE_SECRET``
  key file every actor of a CURVE cluster has) the server is a CURVE server and advertises its public
  key in every ref; clients then connect with CURVE (their own key pair, or an ephemeral one) and a
  plaintext peer cannot connect. The server's key travels only inside refs, i.e. over the broker's
  authenticated channel; ``allow_dir`` adds a ZAP allow-list of client public keys. Without keys the
  server binds only to loopback: any other host raises :class:`InsecureDataPlane` unless
  ``insecure=True``.

:class:`WeightPublisher`/:class:`WeightFetcher` are the weights-transport interface
(``publish(version, state_dict) -> ref`` on the trainer, ``fetch(ref) -> (state_dict, version, stats)`` on
the rollout). Two implementations ship: the ZeroMQ data plane here, and ``torch.distributed``
(:mod:`libra.weights_dist`: a gloo or NCCL broadcast from trainer rank 0 per fetch, GPU to GPU under NCCL;
``LIBRA_WEIGHTS_TRANSPORT=torch``).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgpack
import zmq

from libra.logging import get_logger
from libra.security import is_local_endpoint

__all__ = [
    "DataPlaneError",
    "DataPlaneKeys",
    "DataPlaneServer",
    "DataPlaneWeightFetcher",
    "DataPlaneWeightPublisher",
    "FetchStats",
    "InsecureDataPlane",
    "ObjectNotFound",
    "ObjectRef",
    "PeerLost",
    "TransferCorrupted",
    "WeightFetcher",
    "WeightPublisher",
    "fetch",
    "fetch_state_dict",
    "latest",
]

PROTO = b"LDP1"
DEFAULT_WINDOW = 8  # chunks requested and not yet received (the client's credit)
DEFAULT_IDLE_TIMEOUT_S = 10.0
HOST_ENV = "LIBRA_DATAPLANE_HOST"
INSECURE_ENV = "LIBRA_DATAPLANE_INSECURE"

log = get_logger("libra.dataplane")


class DataPlaneError(RuntimeError):
    """A data-plane transfer failed; the message names the peer, the object and what went wrong."""


class PeerLost(DataPlaneError):
    """The serving peer did not answer within the idle timeout (it died, or is unreachable)."""


class ObjectNotFound(DataPlaneError):
    """The server does not hold (or no longer holds) the requested object."""


class TransferCorrupted(DataPlaneError):
    """The bytes arrived but fail the format's checks (CRC-32, sizes, header)."""


class InsecureDataPlane(DataPlaneError, ValueError):
    """A non-loopback bind without CURVE keys and without the explicit insecure opt-in."""


@dataclass(frozen=True, slots=True)
class DataPlaneKeys:
    """A CURVE key pair (Z85 bytes) for a data-plane server or client."""

    public_key: bytes
    secret_key: bytes

    @classmethod
    def from_env(cls) -> DataPlaneKeys | None:
        """This process's key pair from ``LIBRA_CURVE_SECRET`` (the same key file the actor uses for the
        broker), or None when the variable is unset (a plaintext cluster)."""
        path = os.environ.get("LIBRA_CURVE_SECRET")
        if not path:
            return None
        from libra.keys import KeyFileError, load_keypair

        kp = load_keypair(path)
        if kp.secret_key is None:
            raise KeyFileError(f"LIBRA_CURVE_SECRET={path} holds no secret key (pass the NAME.key_secret file)")
        return cls(kp.public_key, kp.secret_key)

    @classmethod
    def ephemeral(cls) -> DataPlaneKeys:
        pub, sec = zmq.curve_keypair()
        return cls(pub, sec)


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """Where to fetch one object: what work messages carry instead of a file path."""

    endpoint: str
    name: str
    version: int | None = None
    server_key: str | None = None  # Z85 public key of a CURVE server; None for plaintext
    nbytes: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "name": self.name, "version": self.version,
                "server_key": self.server_key, "bytes": self.nbytes}

    @classmethod
    def from_wire(cls, d: Any) -> ObjectRef:
        """Validate a ref from a work message; raises ``ValueError`` naming the bad field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a data-plane ref must be a mapping, got {type(d).__name__}")
        ep, name, ver, key = d.get("endpoint"), d.get("name"), d.get("version"), d.get("server_key")
        if not isinstance(ep, str) or not ep.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"data-plane ref has bad endpoint {ep!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"data-plane ref has bad name {name!r}")
        if ver is not None and type(ver) is not int:
            raise ValueError(f"data-plane ref has bad version {ver!r}")
        if key is not None and (not isinstance(key, str) or len(key) != 40):
            raise ValueError("data-plane ref has a malformed server_key (expected 40 Z85 characters)")
        nbytes = d.get("bytes", 0)
        return cls(ep, name, ver, key, int(nbytes) if isinstance(nbytes, int) else 0)


@dataclass(slots=True)
class FetchStats:
    """What one fetch cost: seconds on the wire (head to last chunk), bytes and chunks received."""

    seconds: float = 0.0
    nbytes: int = 0
    chunks: int = 0
    requests: int = 0


@dataclass(frozen=True, slots=True)
class _Object:
    name: str
    topic: str | None
    version: int | None
    header: bytes
    chunks: tuple[bytes, ...]
    published: float = field(default=0.0)

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self.chunks)


def _pack(msg: Mapping[str, Any]) -> bytes:
    return msgpack.packb(dict(msg), use_bin_type=True)


class DataPlaneServer:
    """Serves published objects to any number of concurrent fetchers from one ROUTER socket.

    ``DataPlaneServer(host="127.0.0.1", keys=None)`` binds ``tcp://host:<ephemeral port>`` and serves
    from a daemon thread until :meth:`close`. ``host`` defaults to ``$LIBRA_DATAPLANE_HOST`` or
    ``127.0.0.1``; ``insecure`` defaults to ``$LIBRA_DATAPLANE_INSECURE == "1"``. Raises
    :class:`InsecureDataPlane` for a non-loopback host without keys (see the module contracts).
    Thread safe: publish/retire from any thread.
    """

    def __init__(self, host: str | None = None, *, keys: DataPlaneKeys | None = None, insecure: bool | None = None,
                 allow_dir: str | os.PathLike[str] | None = None, ctx: zmq.Context | None = None) -> None:
        host = host or os.environ.get(HOST_ENV) or "127.0.0.1"
        insecure = os.environ.get(INSECURE_ENV) == "1" if insecure is None else insecure
        probe = f"tcp://{host}:1"
        if keys is None and not insecure and not is_local_endpoint(probe):
            raise InsecureDataPlane(
                f"refusing to serve the data plane on {host} without encryption: run the cluster with CURVE keys "
                "(LIBRA_CURVE_SECRET, see 'python -m libra keys') or set LIBRA_DATAPLANE_INSECURE=1 to accept "
                "plaintext weights and batches on this network")
        self.keys = keys
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self._auth = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished client raises instead of silently queueing
        self.sock.setsockopt(zmq.SNDHWM, 0)  # flow control is the clients' credit, not the HWM
        if keys is not None:
            self.sock.curve_server = True
            self.sock.curve_publickey = keys.public_key
            self.sock.curve_secretkey = keys.secret_key
            if allow_dir is not None:
                from libra.security import ZAP_DOMAIN, Authenticator

                self.sock.zap_domain = ZAP_DOMAIN
                self._auth = Authenticator(self.ctx, Path(allow_dir))
        bind_host = f"[{host}]" if ":" in host else host
        port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
        self.endpoint = f"tcp://{bind_host}:{port}"
        self.server_key = keys.public_key.decode() if keys is not None else None
        self._lock = threading.Lock()
        self._objects: dict[str, _Object] = {}
        self._topics: dict[str, list[str]] = {}
        self.bytes_served = 0
        self.chunks_served = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="libra-dataplane", daemon=True)
        self._thread.start()
        log.info("dataplane_serving", endpoint=self.endpoint, curve=keys is not None)

    # ------------------------------------------------------------------ publishing
    def publish(self, name: str, header: bytes, chunks: Sequence[bytes], *, topic: str | None = None,
                version: int | None = None, keep: int = 0) -> ObjectRef:
        """Make ``(header, chunks)`` fetchable as ``name`` (replacing an object of that name) and return its
        ref. With ``topic`` and ``keep > 0``, older objects of the topic beyond the newest ``keep`` are
        retired."""
        obj = _Object(name, topic, version, bytes(header), tuple(bytes(c) for c in chunks), time.monotonic())
        with self._lock:
            self._objects[name] = obj
            if topic is not None:
                names = [n for n in self._topics.get(topic, []) if n != name] + [name]
                if keep > 0:
                    for old in names[:-keep]:
                        self._objects.pop(old, None)
                    names = names[-keep:]
                self._topics[topic] = names
        return ObjectRef(self.endpoint, name, version, self.server_key, obj.nbytes)

    def publish_state_dict(self, name: str, state_dict: Mapping[str, Any], *, version: int | None = None,
                           topic: str | None = None, keep: int = 0, chunk_size: int | None = None,
                           metadata: Mapping[str, Any] | None = None) -> ObjectRef:
        """Serialise ``state_dict`` (``libra.engines.weights`` format) and :meth:`publish` it."""
        from libra.engines.weights import DEFAULT_CHUNK_SIZE, pack_state_dict

        header, chunks = pack_state_dict(state_dict, version=version, chunk_size=chunk_size or DEFAULT_CHUNK_SIZE,
                                         metadata=metadata)
        return self.publish(name, header, chunks, topic=topic, version=version, keep=keep)

    def retire(self, name: str) -> None:
        """Stop serving ``name`` (no-op if unknown)."""
        with self._lock:
            obj = self._objects.pop(name, None)
            if obj is not None and obj.topic is not None:
                self._topics[obj.topic] = [n for n in self._topics.get(obj.topic, []) if n != name]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._objects)

    def close(self) -> None:
        """Stop serving (fetches in flight fail with :class:`PeerLost`). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5.0)
        if self._auth is not None:
            self._auth.stop()
        if self._own_ctx:
            self.ctx.term()

    def __enter__(self) -> DataPlaneServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ serving
    def _serve(self) -> None:
        sock = self.sock
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                for _ in range(256):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames)
        finally:
            sock.close(0)

    def _send(self, ident: bytes, frames: list[Any]) -> bool:
        """Send one reply; False if the client is gone (its transfer is abandoned)."""
        try:
            self.sock.send_multipart([ident, PROTO, *frames], copy=False)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client is gone; its transfer is abandoned
            log.info("dataplane_peer_gone", error=str(exc))
            return False
        return True

    def _error(self, ident: bytes, req: Any, code: str, message: str) -> None:
        self._send(ident, [_pack({"ok": False, "req": req, "code": code, "message": message})])

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 3 or frames[1] != PROTO:
            return  # not our protocol: drop silently (nothing to reply to sensibly)
        ident = frames[0]
        try:
            msg = msgpack.unpackb(frames[2], raw=False)
            op = msg["op"]
        except Exception:  # noqa: BLE001  (any malformed request gets the same answer)
            self._error(ident, None, "bad_request", "request is not a msgpack map with an 'op'")
            return
        req = msg.get("req")
        if op == "ping":
            self._send(ident, [_pack({"ok": True, "op": "pong", "req": req})])
            return
        if op == "latest":
            with self._lock:
                names = self._topics.get(msg.get("topic"), [])
                obj = self._objects.get(names[-1]) if names else None
            if obj is None:
                self._error(ident, req, "not_found", f"nothing published under topic {msg.get('topic')!r}")
            else:
                self._send(ident, [_pack({"ok": True, "op": "latest", "req": req, "topic": obj.topic,
                                          "name": obj.name, "version": obj.version})])
            return
        if op not in ("head", "get"):
            self._error(ident, req, "bad_request", f"unknown op {op!r}")
            return
        with self._lock:
            obj = self._objects.get(msg.get("name"))
        if obj is None:
            self._error(ident, req, "not_found", f"object {msg.get('name')!r} is not (or no longer) served here")
            return
        if op == "head":
            self._send(ident, [_pack({"ok": True, "op": "head", "req": req, "name": obj.name, "version": obj.version,
                                      "n_chunks": len(obj.chunks), "total_bytes": obj.nbytes}), obj.header])
        elif op == "get":
            start, count = msg.get("start"), msg.get("count")
            if type(start) is not int or type(count) is not int or start < 0 or count < 1 \
                    or start + count > len(obj.chunks):
                self._error(ident, req, "bad_request", f"bad chunk range start={start!r} count={count!r} "
                                                       f"for {len(obj.chunks)} chunks")
                return
            for i in range(start, start + count):
                chunk = obj.chunks[i]
                # counted before the send: a client that has its last chunk sees the final counts
                self.bytes_served += len(chunk)
                self.chunks_served += 1
                if not self._send(ident, [_pack({"op": "chunk", "req": req, "name": obj.name, "index": i}), chunk]):
                    self.bytes_served -= len(chunk)
                    self.chunks_served -= 1
                    return


# ---------------------------------------------------------------------- client side
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
    :class:`ObjectNotFound`, :class:`TransferCorrupted`.
    """
    if window < 1 or batch < 1:
        raise ValueError(f"window and batch must be >= 1, got {window} and {batch}")
    sock = _client_socket(ctx or zmq.Context.instance(), ref.endpoint, ref.server_key, keys)
    stats = FetchStats()
    where = f"data plane {ref.endpoint} object {ref.name!r}"
    req = uuid.uuid4().hex[:12]
    t0 = time.perf_counter()
    try:
        sock.send_multipart([PROTO, _pack({"op": "head", "name": ref.name, "req": req})])
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
                sock.send_multipart([PROTO, _pack({"op": "get", "name": ref.name, "req": req, "start": requested,
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

    ``header`` is a :class:`~libra.engines.weights.WeightsHeader`. A corrupted transfer raises
    :class:`TransferCorrupted` naming the chunk.
    """
    from libra.engines.weights import WeightsFormatError, unpack_state_dict

    header, chunks, stats = fetch(ref, **kw)
    try:
        sd, hdr = unpack_state_dict(header, chunks)
    except WeightsFormatError as exc:
        raise TransferCorrupted(f"data plane {ref.endpoint} object {ref.name!r}: {exc}") from None
    return sd, hdr, stats


def latest(endpoint: str, topic: str, *, server_key: str | None = None, keys: DataPlaneKeys | None = None,
           timeout_s: float = 1.0, ctx: zmq.Context | None = None) -> ObjectRef | None:
    """The newest object published under ``topic`` at ``endpoint`` (None if nothing is); raises
    :class:`PeerLost` when the server does not answer within ``timeout_s``."""
    sock = _client_socket(ctx or zmq.Context.instance(), endpoint, server_key, keys)
    try:
        sock.send_multipart([PROTO, _pack({"op": "latest", "topic": topic})])
        meta, _ = _recv(sock, timeout_s, f"data plane {endpoint}: no answer to 'latest {topic}' within {timeout_s}s")
        if meta.get("ok") is False and meta.get("code") == "not_found":
            return None
        _raise_for(meta, f"data plane {endpoint}")
        ver = meta.get("version")
        return ObjectRef(endpoint, str(meta.get("name")), ver if type(ver) is int else None, server_key)
    finally:
        sock.close(0)


# ---------------------------------------------------------------------- weights transport interface
class WeightPublisher(Protocol):
    """Trainer side of a weights transport: make ``state_dict`` fetchable as ``version``; returns the ref
    (a msgpack-able mapping with at least ``version``) that generate work carries to rollout instances.
    :class:`libra.weights_dist.TorchWeightPublisher` returns ``{"version", "transport": "torch", "backend",
    "endpoint", "name", "bytes"}``."""

    def publish(self, version: int, state_dict: Mapping[str, Any]) -> dict[str, Any]: ...


class WeightFetcher(Protocol):
    """Rollout side: ``fetch(ref) -> (state_dict, version, stats)``; raises :class:`DataPlaneError`
    subclasses and leaves no partial state behind."""

    def fetch(self, ref: Mapping[str, Any]) -> tuple[dict[str, Any], int, FetchStats]: ...


class DataPlaneWeightPublisher:
    """:class:`WeightPublisher` over a :class:`DataPlaneServer`: version ``v`` is object ``weights/v{v}`` in
    topic ``weights``; the newest ``keep`` versions stay fetchable (so a fetch of ``v-1`` that started
    before ``v`` was published completes)."""

    TOPIC = "weights"

    def __init__(self, server: DataPlaneServer, *, keep: int = 2, chunk_size: int | None = None) -> None:
        self.server, self.keep, self.chunk_size = server, keep, chunk_size

    def publish(self, version: int, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        ref = self.server.publish_state_dict(f"{self.TOPIC}/v{version}", state_dict, version=version, topic=self.TOPIC,
                                             keep=self.keep, chunk_size=self.chunk_size)
        return ref.to_wire()


class DataPlaneWeightFetcher:
    """:class:`WeightFetcher` over :func:`fetch_state_dict`; checks that the header's version is the ref's."""

    def __init__(self, *, keys: DataPlaneKeys | None = None, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 window: int = DEFAULT_WINDOW) -> None:
        self.keys, self.idle_timeout_s, self.window = keys, idle_timeout_s, window

    def fetch(self, ref: Mapping[str, Any]) -> tuple[dict[str, Any], int, FetchStats]:
        r = ObjectRef.from_wire(ref)
        sd, hdr, stats = fetch_state_dict(r, keys=self.keys, idle_timeout_s=self.idle_timeout_s, window=self.window)
        if r.version is not None and hdr.version != r.version:
            raise TransferCorrupted(f"data plane {r.endpoint} object {r.name!r}: header says version {hdr.version}, "
                                    f"the ref says {r.version}")
        return sd, int(hdr.version or 0), stats
