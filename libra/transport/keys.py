"""CurveZMQ key pairs for brokers, actors and clients (``python -m libra keys``).

Files are ZeroMQ certificates as ``zmq.auth`` reads them (``zmq.auth.load_certificate``):
``NAME.key`` holds the public key (mode 0644, safe to copy to the broker's allow-list directory) and
``NAME.key_secret`` holds both keys (mode 0600, never leaves the host that owns it).

Contract: :func:`create_keypair` never overwrites an existing file unless ``overwrite=True`` and never
leaves a secret readable by others, even for an instant: the pair is written inside a fresh 0700
directory, chmod-ed, then linked into place. Errors are :class:`KeyFileError` with a message
that says what to do. Sockets use the keys through ``libra.transport.security``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


class KeyFileError(Exception):
    """A key pair could not be created or read; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class KeyPair:
    """Paths of a key pair and its Z85-encoded keys (``secret_key`` is None for a public-only file)."""

    public_file: Path
    secret_file: Path | None
    public_key: bytes
    secret_key: bytes | None


def _check_name(name: str) -> None:
    if not name or name.startswith(".") or any(c in name for c in "/\\\0") or name != name.strip():
        raise KeyFileError(f"bad key name {name!r}: use a plain file name such as 'broker' or 'actor-gpu0'")


def create_keypair(out_dir: str | os.PathLike[str], name: str, *, overwrite: bool = False) -> KeyPair:
    """Create ``out_dir/NAME.key`` and ``out_dir/NAME.key_secret``; return the pair.

    Raises :class:`KeyFileError` if CURVE is unavailable, the name is bad, or a file exists
    (pass ``overwrite=True`` to replace it).
    """
    _check_name(name)
    if not zmq.has("curve"):
        raise KeyFileError("this libzmq was built without CURVE support; install pyzmq's bundled libzmq")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pub, sec = out / f"{name}{PUBLIC_SUFFIX}", out / f"{name}{SECRET_SUFFIX}"
    if not overwrite:
        for p in (pub, sec):
            if p.exists():
                raise KeyFileError(f"{p} already exists; pick another --name or pass --force to replace it")
    tmp = Path(tempfile.mkdtemp(prefix=".libra-keys-", dir=out))  # 0700: nobody else can open files in it
    try:
        tpub, tsec = zmq.auth.create_certificates(tmp, name)
        os.chmod(tsec, 0o600)
        os.chmod(tpub, 0o644)
        for src, dst in ((tpub, pub), (tsec, sec)):
            if overwrite:
                os.replace(src, dst)
            else:
                try:
                    os.link(src, dst)  # atomic and refuses to clobber a file created meanwhile
                except FileExistsError:
                    raise KeyFileError(f"{dst} appeared while writing; nothing was replaced") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_keypair(sec)


def load_keypair(path: str | os.PathLike[str]) -> KeyPair:
    """Read a certificate file (public or secret). Raises :class:`KeyFileError` on a bad file."""
    p = Path(path)
    try:
        public, secret = zmq.auth.load_certificate(p)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot read a ZeroMQ certificate from {p}: {exc}") from None
    if secret is not None:
        mode = p.stat().st_mode & 0o777
        if mode & 0o077:
            raise KeyFileError(f"{p} is readable by others (mode {mode:o}); run: chmod 600 {p}")
        pub_file = p.with_name(p.name[: -len(SECRET_SUFFIX)] + PUBLIC_SUFFIX) if p.name.endswith(SECRET_SUFFIX) else p
        return KeyPair(pub_file, p, public, secret)
    return KeyPair(p, None, public, None)
