"""Who may fetch what from a data-plane server: the job an object belongs to, and the role of the key asking.

- **Job tags.** Every published object may carry a job (:meth:`DataPlaneServer.publish`'s ``job``): given
  explicitly, else derived from a trajectory's name (``traj/JOB/gG/I/WORK`` → ``JOB``, see
  :func:`job_of_name`), else the server's ``default_job`` (a trainer sets it from ``TrainArgs.job`` before
  it publishes a step's weights), else none (untagged).
- **Roles.** A CURVE server given an allow directory (``allow_dir``, an actor's ``$LIBRA_CURVE_ALLOW``) reads
  it with :class:`libra.transport.security.Authenticator`, the same layout and roles as the broker's
  ``--curve-allow`` (:mod:`libra.transport.scopes`). Each request's ZAP user id is the sender's key; its role
  decides what ``head``, ``get`` and ``latest`` may return (:meth:`RoleGate.refusal`): ``actor``,
  ``operator``, ``any`` (a key directly in the directory) and unscoped ``client`` keys see every object; a
  ``client:JOB`` key sees only objects of job JOB (an untagged object is refused); a key no longer in the
  directory (``revoked``) sees nothing. A refusal is answered ``forbidden`` (the client raises
  :class:`~libra.dataplane.errors.Forbidden`), logged (``dataplane_refused``) and counted
  (:attr:`RoleGate.refused`).
- **Key changes apply without a restart.** :meth:`RoleGate.maybe_refresh`, called from the serve loop,
  re-reads the directory at most once a second (only when a key file changed): a new key can connect, a
  removed key's open connections are refused from then on and its new connections fail the handshake.
- Without keys, or without an allow directory, nothing is checked (any CURVE client may fetch anything).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import zmq

from libra.logging import get_logger
from libra.transport.keys import KeyFileError
from libra.transport.scopes import REVOKED, may_see_job
from libra.transport.security import ZAP_DOMAIN, Authenticator

__all__ = ["ALLOW_ENV", "REFRESH_S", "RoleGate", "allow_dir_from_env", "job_of_name"]

ALLOW_ENV = "LIBRA_CURVE_ALLOW"
REFRESH_S = 1.0  # the allow directory is re-read at most this often

log = get_logger("libra.dataplane")


def job_of_name(name: str) -> str | None:
    """The job a trajectory's object name says it belongs to (``traj/JOB/...`` → ``JOB``); None otherwise."""
    if not name.startswith("traj/"):
        return None
    job = name.split("/", 2)[1]
    return job or None


def allow_dir_from_env() -> Path | None:
    """The allow directory an actor's data-plane servers check roles against, from ``$LIBRA_CURVE_ALLOW``
    (the broker's ``--curve-allow`` directory, or a copy of it); None when unset. Raises
    :class:`~libra.transport.keys.KeyFileError` when it is set to something that is not a directory."""
    path = os.environ.get(ALLOW_ENV)
    if not path:
        return None
    d = Path(path)
    if not d.is_dir():
        raise KeyFileError(f"{ALLOW_ENV}={path} is not a directory of public key files (the allow directory "
                           "of 'libra keys --allow')")
    return d


class RoleGate:
    """The role check of one CURVE data-plane server (see the module contracts): owns the ZAP authenticator of
    the server's context; ``refused`` counts the requests it refused."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, allow_dir: str | os.PathLike[str]) -> None:
        sock.zap_domain = ZAP_DOMAIN
        self.allow_dir = Path(allow_dir)
        self.auth = Authenticator(ctx, self.allow_dir)
        self.refused = 0
        self._read_at = time.monotonic()

    def role(self, user: str) -> str:
        """The role of the key whose Z85 text is ``user`` (the request's ZAP user id), ``revoked`` when the
        directory no longer lists it."""
        return self.auth.roles.get(user, REVOKED)

    def refusal(self, user: str, op: str, name: str, job: str | None) -> str | None:
        """None when the key ``user`` may see object ``name`` of job ``job``; else the refusal's message (the
        refusal is then counted and logged)."""
        role = self.role(user)
        if may_see_job(role, job):
            return None
        self.refused += 1
        owner = f"job {job!r}" if job is not None else "no job"
        log.warning("dataplane_refused", op=op, name=name, job=job, role=role, key=user)
        return f"a key of role {role!r} may not see {name!r}, an object of {owner}"

    def maybe_refresh(self) -> None:
        """Re-read the allow directory if a second has passed since the last read and a key file changed. An
        unreadable directory keeps the roles last read (logged), never stops the server."""
        now = time.monotonic()
        if now - self._read_at < REFRESH_S:
            return
        self._read_at = now
        try:
            removed = self.auth.refresh()
        except Exception as exc:  # noqa: BLE001  (a bad key file must not kill the serve loop)
            log.warning("dataplane_allow_unreadable", allow_dir=str(self.allow_dir), error=repr(exc))
            return
        if removed:
            log.info("dataplane_keys_removed", allow_dir=str(self.allow_dir), keys=sorted(removed))

    def stop(self) -> None:
        self.auth.stop()
