"""The data plane's server side: :class:`DataPlaneServer` serves published, immutable objects (header plus
chunks) to any number of concurrent fetchers from one ROUTER socket on a daemon thread.

Protocol and contracts are described in :mod:`libra.dataplane`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

from libra.dataplane.access import RoleGate, job_of_name
from libra.dataplane.errors import InsecureDataPlane
from libra.dataplane.wire import PROTO, DataPlaneKeys, ObjectRef, pack
from libra.logging import get_logger
from libra.transport.security import is_local_endpoint
from libra.transport.zmqio import recv_frames, recv_frames_user

__all__ = ["HOST_ENV", "INSECURE_ENV", "DataPlaneServer"]

HOST_ENV = "LIBRA_DATAPLANE_HOST"
INSECURE_ENV = "LIBRA_DATAPLANE_INSECURE"

log = get_logger("libra.dataplane")


@dataclass(frozen=True, slots=True)
class _Object:
    name: str
    topic: str | None
    version: int | None
    header: bytes
    chunks: tuple[bytes, ...]
    published: float = field(default=0.0)
    job: str | None = None  # the job it belongs to (libra.dataplane.access), None: untagged

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self.chunks)


class DataPlaneServer:
    """Serves published objects to any number of concurrent fetchers from one ROUTER socket.

    ``DataPlaneServer(host="127.0.0.1", keys=None)`` binds ``tcp://host:<ephemeral port>`` and serves
    from a daemon thread until :meth:`close`. ``host`` defaults to ``$LIBRA_DATAPLANE_HOST`` or
    ``127.0.0.1``; ``insecure`` defaults to ``$LIBRA_DATAPLANE_INSECURE == "1"``. Raises
    :class:`InsecureDataPlane` for a non-loopback host without keys (see the module contracts).
    Thread safe: publish/retire from any thread.

    ``provider(name) -> (header, chunks) | None`` makes objects on demand: it is asked on every ``head``
    request (on the server thread) and what it returns is published under ``name`` (topic ``provided``, the
    newest ``PROVIDED_KEEP`` kept: made objects can be large, e.g. a KV cache, and a transfer still running
    when its object is pushed out fails with ``ObjectNotFound``) before the request is served; None leaves the
    request to the published objects. A provider that raises answers ``not_found`` with its message. A rollout
    instance serves trajectory contexts (token ids, KV caches) this way, serialised only when another instance
    asks.

    Roles: with ``keys`` and an ``allow_dir`` (the broker's ``--curve-allow`` layout; an actor passes
    ``$LIBRA_CURVE_ALLOW``) only listed keys connect and each request is checked against its key's role and the
    object's job (:mod:`libra.dataplane.access`); ``refused`` counts the requests refused. ``default_job`` tags
    what is published without a job of its own (a trainer sets it to the job whose weights it publishes).
    Without keys ``allow_dir`` is ignored.
    """

    PROVIDED_KEEP = 8  # objects made by the provider that stay published

    def __init__(self, host: str | None = None, *, keys: DataPlaneKeys | None = None, insecure: bool | None = None,
                 allow_dir: str | os.PathLike[str] | None = None, ctx: zmq.Context | None = None,
                 provider: Callable[[str], tuple[bytes, Sequence[bytes]] | None] | None = None) -> None:
        host = host or os.environ.get(HOST_ENV) or "127.0.0.1"
        insecure = os.environ.get(INSECURE_ENV) == "1" if insecure is None else insecure
        probe = f"tcp://{host}:1"
        if keys is None and not insecure and not is_local_endpoint(probe):
            raise InsecureDataPlane(
                f"refusing to serve the data plane on {host} without encryption: run the cluster with CURVE keys "
                "(LIBRA_CURVE_SECRET, see 'python -m libra keys') or set LIBRA_DATAPLANE_INSECURE=1 to accept "
                "plaintext weights and batches on this network")
        self.keys = keys
        self._provider = provider
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self._gate: RoleGate | None = None
        self.default_job: str | None = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished client raises instead of silently queueing
        self.sock.setsockopt(zmq.SNDHWM, 0)  # flow control is the clients' credit, not the HWM
        if keys is not None:
            self.sock.curve_server = True
            self.sock.curve_publickey = keys.public_key
            self.sock.curve_secretkey = keys.secret_key
            if allow_dir is not None:
                self._gate = RoleGate(self.ctx, self.sock, Path(allow_dir))
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
        log.info("dataplane_serving", endpoint=self.endpoint, curve=keys is not None,
                 roles=str(self._gate.allow_dir) if self._gate is not None else None)

    @property
    def refused(self) -> int:
        """Requests refused for their key's role (0 without role checks)."""
        return self._gate.refused if self._gate is not None else 0

    # ------------------------------------------------------------------ publishing
    def publish(self, name: str, header: bytes, chunks: Sequence[bytes], *, topic: str | None = None,
                version: int | None = None, keep: int = 0, job: str | None = None) -> ObjectRef:
        """Make ``(header, chunks)`` fetchable as ``name`` (replacing an object of that name) and return its
        ref. With ``topic`` and ``keep > 0``, older objects of the topic beyond the newest ``keep`` are
        retired. ``job``: the job it belongs to; None (or "") derives it from a ``traj/JOB/...`` name, else
        takes ``default_job`` (see :mod:`libra.dataplane.access`)."""
        obj = _Object(name, topic, version, bytes(header), tuple(bytes(c) for c in chunks), time.monotonic(),
                      self._job_for(name, job))
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
                           metadata: Mapping[str, Any] | None = None, job: str | None = None) -> ObjectRef:
        """Serialise ``state_dict`` (``libra.weights.format`` format) and :meth:`publish` it."""
        from libra.weights.format import DEFAULT_CHUNK_SIZE, pack_state_dict

        header, chunks = pack_state_dict(state_dict, version=version, chunk_size=chunk_size or DEFAULT_CHUNK_SIZE,
                                         metadata=metadata)
        return self.publish(name, header, chunks, topic=topic, version=version, keep=keep, job=job)

    def _job_for(self, name: str, job: str | None) -> str | None:
        """The job an object published as ``name`` belongs to (see :meth:`publish`)."""
        return job or job_of_name(name) or self.default_job or None

    def job_of(self, name: str) -> str | None:
        """The job object ``name`` is tagged with (None: untagged or not served)."""
        with self._lock:
            obj = self._objects.get(name)
        return obj.job if obj is not None else None

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
        if self._gate is not None:
            self._gate.stop()
        if self._own_ctx:
            self.ctx.term()

    def __enter__(self) -> DataPlaneServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ serving
    def _serve(self) -> None:
        sock, gate = self.sock, self._gate
        try:
            while not self._stop.is_set():
                if gate is not None:
                    gate.maybe_refresh()
                if not sock.poll(100):
                    continue
                for _ in range(256):
                    try:  # with role checks, each request's ZAP user id (its key) comes with it
                        frames, user = recv_frames_user(sock) if gate is not None else (recv_frames(sock), "")
                    except zmq.Again:
                        break
                    self._handle(frames, user)
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
        self._send(ident, [pack({"ok": False, "req": req, "code": code, "message": message})])

    def _refused(self, ident: bytes, req: Any, user: str, op: str, name: str, job: str | None) -> bool:
        """Whether the request's key may not see object ``name`` of ``job``; if so it is answered ``forbidden``
        (and counted and logged, see :class:`RoleGate`)."""
        if self._gate is None:
            return False
        why = self._gate.refusal(user, op, name, job)
        if why is None:
            return False
        self._error(ident, req, "forbidden", why)
        return True

    def _handle(self, frames: list[bytes], user: str = "") -> None:
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
            self._send(ident, [pack({"ok": True, "op": "pong", "req": req})])
        elif op == "latest":
            self._latest(ident, req, msg, user)
        elif op not in ("head", "get"):
            self._error(ident, req, "bad_request", f"unknown op {op!r}")
        elif op != "head" or self._provide(ident, req, msg, user):
            self._serve_object(ident, req, op, msg, user)

    def _latest(self, ident: bytes, req: Any, msg: dict[str, Any], user: str) -> None:
        with self._lock:
            names = self._topics.get(msg.get("topic"), [])
            obj = self._objects.get(names[-1]) if names else None
        if obj is None:
            self._error(ident, req, "not_found", f"nothing published under topic {msg.get('topic')!r}")
        elif not self._refused(ident, req, user, "latest", obj.name, obj.job):
            self._send(ident, [pack({"ok": True, "op": "latest", "req": req, "topic": obj.topic,
                                      "name": obj.name, "version": obj.version})])

    def _provide(self, ident: bytes, req: Any, msg: dict[str, Any], user: str) -> bool:
        """Ask the provider for a ``head`` request's object (see the class docstring); False when the request
        was answered here (refused for the key's role before anything is made, or the provider failed)."""
        name = msg.get("name")
        if self._provider is None or not isinstance(name, str):
            return True
        if self._refused(ident, req, user, "head", name, self._job_for(name, None)):
            return False
        try:
            made = self._provider(name)
        except Exception as exc:  # noqa: BLE001  (the provider could not make it: the fetcher hears why)
            self._error(ident, req, "not_found", f"object {name!r}: {type(exc).__name__}: {exc}")
            return False
        if made is not None:
            self.publish(name, made[0], made[1], topic="provided", keep=self.PROVIDED_KEEP)
        return True

    def _serve_object(self, ident: bytes, req: Any, op: str, msg: dict[str, Any], user: str) -> None:
        with self._lock:
            obj = self._objects.get(msg.get("name"))
        if obj is None:
            self._error(ident, req, "not_found", f"object {msg.get('name')!r} is not (or no longer) served here")
            return
        if self._refused(ident, req, user, op, obj.name, obj.job):
            return
        if op == "head":
            self._send(ident, [pack({"ok": True, "op": "head", "req": req, "name": obj.name, "version": obj.version,
                                      "n_chunks": len(obj.chunks), "total_bytes": obj.nbytes}), obj.header])
            return
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
            if not self._send(ident, [pack({"op": "chunk", "req": req, "name": obj.name, "index": i}), chunk]):
                self.bytes_served -= len(chunk)
                self.chunks_served -= 1
                return
