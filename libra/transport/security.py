"""CurveZMQ on Libra's sockets: encryption plus a ZAP allow-list of client and actor public keys.

- The broker is a CURVE server (``apply_server``) with a ``zmq.auth`` authenticator whose allow-list is
  a directory of public key files (``NAME.key``, from ``python -m libra keys``); a peer whose key is not
  listed, or a plaintext peer, fails the handshake and never reaches ``BrokerState``.
- Actors and clients are CURVE clients (``apply_client``) with their own key pair and the broker's
  public key (``CurveClient.from_files`` or the ``LIBRA_CURVE_SECRET``/``LIBRA_BROKER_KEY`` variables).
- Plaintext is allowed only on loopback (or ipc/inproc); ``require_curve_or_loopback`` refuses a public
  bind without CURVE unless the operator explicitly passes ``--insecure``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from libra.transport.keys import KeyFileError, load_keypair
from libra.transport.scopes import ANY, ROLE_DIRS, job_dir_ok, role_text

ZAP_DOMAIN = b"libra"


class InsecureBind(ValueError):
    """A non-loopback endpoint without CURVE and without the explicit insecure flag."""


def is_local_endpoint(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp on a loopback address."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def require_curve_or_loopback(endpoint: str, curve: bool, insecure: bool) -> None:
    if not curve and not insecure and not is_local_endpoint(endpoint):
        raise InsecureBind(
            f"refusing to serve {endpoint} without encryption: create keys with 'python -m libra keys' and pass "
            "--curve-secret/--curve-allow, or pass --insecure to accept plaintext on this network")


@dataclass(frozen=True, slots=True)
class CurveServer:
    """The broker's key pair and the directory of public keys allowed to connect."""

    public_key: bytes
    secret_key: bytes
    allow_dir: Path

    @classmethod
    def from_files(cls, secret_file: str | os.PathLike[str], allow_dir: str | os.PathLike[str]) -> "CurveServer":
        kp = load_keypair(secret_file)
        if kp.secret_key is None:
            raise KeyFileError(f"{secret_file} holds no secret key (pass the NAME.key_secret file)")
        d = Path(allow_dir)
        if not d.is_dir():
            raise KeyFileError(f"allow-list {d} is not a directory of public key files")
        return cls(kp.public_key, kp.secret_key, d)


@dataclass(frozen=True, slots=True)
class CurveClient:
    """A peer's key pair and the broker's public key."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes

    @classmethod
    def from_files(cls, secret_file: str | os.PathLike[str], broker_key_file: str | os.PathLike[str]) -> "CurveClient":
        kp = load_keypair(secret_file)
        if kp.secret_key is None:
            raise KeyFileError(f"{secret_file} holds no secret key (pass the NAME.key_secret file)")
        return cls(kp.public_key, kp.secret_key, load_keypair(broker_key_file).public_key)

    @classmethod
    def from_env(cls, *, as_client: bool = False) -> "CurveClient | None":
        """From ``LIBRA_CURVE_SECRET`` and ``LIBRA_BROKER_KEY`` when both are set, else None. ``as_client``: the
        key an actor host's slots call tools with (an episode runner is a client of the broker too), from
        ``LIBRA_CLIENT_CURVE_SECRET`` when set: with key roles an actor key may not submit work, so such a host
        is given a client key as well (``libra keys --allow --role client``)."""
        sec, srv = os.environ.get("LIBRA_CURVE_SECRET"), os.environ.get("LIBRA_BROKER_KEY")
        if as_client and os.environ.get("LIBRA_CLIENT_CURVE_SECRET"):
            sec = os.environ["LIBRA_CLIENT_CURVE_SECRET"]
        return cls.from_files(sec, srv) if sec and srv else None


def apply_server(sock: zmq.Socket, curve: CurveServer) -> None:
    sock.curve_server = True
    sock.curve_publickey = curve.public_key
    sock.curve_secretkey = curve.secret_key
    sock.zap_domain = ZAP_DOMAIN


def apply_client(sock: zmq.Socket, curve: CurveClient) -> None:
    sock.curve_publickey = curve.public_key
    sock.curve_secretkey = curve.secret_key
    sock.curve_serverkey = curve.server_key


def key_places(allow_dir: Path) -> list[tuple[Path, str]]:
    """The directories of the allow directory that hold keys, each with the role its keys get (see
    :mod:`libra.transport.scopes`): itself (``any``), ``actors/``, ``clients/``, ``operators/`` and each
    job-scoped ``clients/JOB/`` (``client:JOB``)."""
    allow_dir = Path(allow_dir)
    places = [(allow_dir, ANY)] + [(allow_dir / d, r) for r, d in ROLE_DIRS.items()]
    clients = allow_dir / ROLE_DIRS["client"]
    if clients.is_dir():
        places += [(d, f"client:{d.name}") for d in sorted(clients.iterdir()) if d.is_dir() and job_dir_ok(d.name)]
    return places


def key_roles(allow_dir: Path) -> dict[bytes, str]:
    """Z85 public key → its role string from the allow directory (:func:`key_places`; a key in several places
    has each role, comma separated and sorted)."""
    found: dict[bytes, set[str]] = {}
    for where, role in key_places(allow_dir):
        if where.is_dir():
            for key in zmq.auth.load_certificates(str(where)):
                found.setdefault(key, set()).add(role)
    return {k: role_text(r) for k, r in found.items()}


class _ReportingAuthenticator(ThreadAuthenticator):
    """``ThreadAuthenticator`` that reports every refused handshake (peer address, mechanism, client key) to
    ``on_refused``: a peer refused by ZAP otherwise sees only silence, and so does the operator. A key that
    passes has its Z85 text as the connection's user id (the broker looks its role up per message)."""

    def __init__(self, ctx: zmq.Context, on_refused: Callable[[dict[str, str]], None] | None) -> None:
        super().__init__(ctx)
        self._on_refused = on_refused
        self._request: dict[str, str] = {}

    def curve_user_id(self, client_public_key: bytes) -> str:
        return zmq.utils.z85.encode(client_public_key).decode("ascii")

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # One request at a time on the authenticator's thread: remember who asked until the reply.
        self._request = {"peer": msg[3].decode("utf-8", "replace") if len(msg) > 3 else "",
                         "mechanism": msg[5].decode("ascii", "replace") if len(msg) > 5 else ""}
        if len(msg) > 6 and self._request["mechanism"] == "CURVE":
            self._request["client_key"] = zmq.utils.z85.encode(msg[6]).decode("ascii") if len(msg[6]) == 32 else "?"
        await super().handle_zap_message(msg)

    def _send_zap_reply(self, request_id: bytes, status_code: bytes, status_text: bytes,
                        user_id: str = "anonymous") -> None:
        if status_code != b"200" and self._on_refused is not None:
            try:
                self._on_refused({**self._request, "reason": status_text.decode("utf-8", "replace")})
            except Exception:  # a reporting failure must never break authentication
                pass
        super()._send_zap_reply(request_id, status_code, status_text, user_id)


class Authenticator:
    """ZAP handler thread for one context: only keys in ``allow_dir`` pass. ``reload()`` re-reads it.
    ``on_refused(info)`` is called (on the authenticator's thread) for every refused handshake with the
    peer's ``peer`` address, ``mechanism``, ``client_key`` (Z85) and ``reason``.

    Roles: a key in ``allow_dir/actors/``, ``clients/`` or ``operators/`` passes with that role, one in
    ``clients/JOB/`` with ``client:JOB`` (a key in several, with each); a key in ``allow_dir`` itself with the
    role ``any`` (the layout before roles). See :mod:`libra.transport.scopes`.
    ``roles`` maps each allowed key (Z85 text, the connection's ZAP user id) to its roles; the broker looks a
    message's key up there (``libra.broker.roles``). :meth:`refresh` re-reads the directory when it changed
    and returns the keys removed, so a running broker takes keys in and out without a restart."""

    def __init__(self, ctx: zmq.Context, allow_dir: Path,
                 on_refused: Callable[[dict[str, str]], None] | None = None) -> None:
        self._auth = _ReportingAuthenticator(ctx, on_refused)
        self._allow_dir = allow_dir
        self._lock = threading.Lock()
        self.roles: dict[str, str] = {}
        self._seen: tuple = ()
        self._auth.start()
        self.reload()

    def reload(self, signature: tuple | None = None) -> set[str]:
        """Read the allow directory (``signature``: its :meth:`_signature`, when the caller just took it); the
        keys that were allowed before and are not now."""
        with self._lock:
            self._seen = self._signature() if signature is None else signature
            roles = {k.decode("ascii"): r for k, r in key_roles(self._allow_dir).items()}
            self._auth.allow_any = False  # what configure_curve sets, without reading the directory a second time
            self._auth.certs[ZAP_DOMAIN.decode()] = {k.encode("ascii"): True for k in roles}
            removed = set(self.roles) - set(roles)
            self.roles = roles
            return removed

    def refresh(self) -> set[str]:
        """:meth:`reload` if a key file was added, removed or changed since the last read; else nothing."""
        signature = self._signature()
        return self.reload(signature) if signature != self._seen else set()

    def _signature(self) -> tuple:
        out = []
        for where, _ in key_places(self._allow_dir):
            for f in sorted(where.glob("*.key")) if where.is_dir() else ():
                with contextlib.suppress(OSError):
                    st = f.stat()
                    out.append((str(f), st.st_mtime_ns, st.st_size))
        return tuple(out)

    def stop(self) -> None:
        self._auth.stop()
