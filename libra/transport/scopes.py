"""Key roles and job scopes as text: what a CURVE key's place in the allow directory says it may do. Pure: no
ZeroMQ, no files (``libra.transport.security`` reads the directory; the broker core and the data plane read
the role strings it makes).

The allow directory (the broker's ``--curve-allow``; ``libra keys --allow --role R [--job J]``)::

    ALLOW/*.key                  role "any": may do anything (the layout before roles)
    ALLOW/actors/*.key           role "actor": serves work
    ALLOW/clients/*.key          role "client": calls tools, runs and polls jobs, any job
    ALLOW/clients/JOB/*.key      role "client:JOB": a job-scoped client, only job JOB's work, rows and data
    ALLOW/operators/*.key        role "operator": a client that may also direct slots, and sees everything

A key in several places has each role, comma separated and sorted (``"actor,client:a"``); a key removed while
connected has the role ``revoked``; a peer without CURVE has the role "" (unchecked).
"""

from __future__ import annotations

import functools
import hashlib

__all__ = ["ANY", "REVOKED", "ROLE_DIRS", "base_roles", "fingerprint", "job_dir_ok", "job_scope", "may_see_job",
           "role_text"]

ROLE_DIRS = {"actor": "actors", "client": "clients", "operator": "operators"}  # under the allow directory
ANY = "any"  # a key listed in the allow directory itself: every message, as before roles
REVOKED = "revoked"  # a key removed from the allow directory while connected: nothing


def job_dir_ok(name: str) -> bool:
    """Whether ``name`` can be a job-scoped key directory (a job name: non-empty, no '/', not hidden)."""
    return bool(name) and "/" not in name and not name.startswith(".") and ":" not in name and "," not in name


def role_text(roles: set[str]) -> str:
    """The role string of a key found in ``roles`` places (``any`` wins: that key was unrestricted)."""
    return ANY if ANY in roles else ",".join(sorted(roles))


def base_roles(role: str) -> tuple[str, ...]:
    """The roles of a role string without their job scopes: ``"actor,client:a"`` → ``("actor", "client")``."""
    return tuple(r.split(":", 1)[0] for r in role.split(",")) if role else ()


@functools.lru_cache(maxsize=4096)  # few role strings; asked per Submit and per data-plane request under CURVE
def job_scope(role: str) -> frozenset[str] | None:
    """The jobs a key of ``role`` may act for: None for every job (no CURVE, ``any``, an operator, an actor or
    a client key not bound to a job); else the jobs of its job-scoped client entries (empty for ``revoked``)."""
    if not role or role == ANY:
        return None
    jobs: set[str] = set()
    for r in role.split(","):
        base, _, job = r.partition(":")
        if base == REVOKED:
            continue
        if not job:
            return None  # one unscoped place is enough
        jobs.add(job)
    return frozenset(jobs)


def may_see_job(role: str, job: str | None) -> bool:
    """Whether a key of ``role`` may see or act on job ``job`` (None: something no job owns, which a
    job-scoped key may not see)."""
    scope = job_scope(role)
    return scope is None or (job is not None and job in scope)


def fingerprint(key: str | bytes) -> str:
    """A short, stable name for a CURVE public key (its Z85 text): the first 16 hex digits of its SHA-256 (""
    for none). The broker's audit trail names keys this way, and ``libra keys`` prints it for a new key."""
    if not key:
        return ""
    return hashlib.sha256(key if isinstance(key, bytes) else key.encode("ascii", "replace")).hexdigest()[:16]
