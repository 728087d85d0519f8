"""What travels between data-plane peers and through the broker: the ``LDP1`` protocol tag and message
packing, the client's flow-control defaults, the :class:`ObjectRef` work messages carry, a fetch's
:class:`FetchStats`, and the CURVE key pair (:class:`DataPlaneKeys`) a server or client uses.

The wire protocol itself is described in :mod:`libra.dataplane`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

__all__ = ["DEFAULT_IDLE_TIMEOUT_S", "DEFAULT_WINDOW", "PROTO", "DataPlaneKeys", "FetchStats", "ObjectRef", "pack"]

PROTO = b"LDP1"
DEFAULT_WINDOW = 8  # chunks requested and not yet received (the client's credit)
DEFAULT_IDLE_TIMEOUT_S = 10.0


def pack(msg: Mapping[str, Any]) -> bytes:
    """One protocol message as msgpack bytes."""
    return msgpack.packb(dict(msg), use_bin_type=True)


@dataclass(frozen=True, slots=True)
class DataPlaneKeys:
    """A CURVE key pair (Z85 bytes) for a data-plane server or client."""

    public_key: bytes
    secret_key: bytes

    @classmethod
    def from_env(cls) -> DataPlaneKeys | None:
        """This process's key pair from ``LIBRA_CURVE_SECRET`` (the same key file the actor uses for the
        broker), or None when the variable is unset (a plaintext cluster). Its sibling ``LIBRA_CURVE_ALLOW``
        (:func:`libra.dataplane.access.allow_dir_from_env`) names the allow directory an actor's servers check
        the fetchers' key roles against (the broker's ``--curve-allow`` layout); unset, any CURVE client may
        fetch."""
        path = os.environ.get("LIBRA_CURVE_SECRET")
        if not path:
            return None
        from libra.transport.keys import KeyFileError, load_keypair

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
