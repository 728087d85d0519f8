"""Key roles: which messages a peer may send the broker, by the role of the CURVE key it connected with.

With CURVE on, the broker's allow directory is split by role (``ALLOW/actors/``, ``ALLOW/clients/``,
``ALLOW/operators/``; ``libra keys --allow --role R``). The authenticator (``libra.transport.security``) gives the key that
passed the handshake as the connection's ZAP user id, the shell reads it off each message, looks its role up
and hands it to the core in ``PeerMessage.role``, and the core refuses what the role may not send before any
handler sees it:

- an **actor** key may speak only as an actor (hello, bids, results, hand-backs, lease reports);
- a **client** key only as a client (calls, status, cancels, trajectories, jobs, direct leases);
- an **operator** key as a client, and may also send directives (``DirectRequest``: a slot's role).

A key in the allow directory itself (no role subdirectory: the layout before roles) may send anything, and so
may every peer without CURVE (``role`` ""). A refusal is typed and names the role: a request is answered with
a failed ``Reply`` (``forbidden``, so the client raises ``Forbidden``), a hello with a ``Disconnect``, anything
else with an ``Error``. The core counts refusals (``role_refused``) and logs each one.

Keys change while the broker runs: the shell re-reads the allow directory every heartbeat interval, looks each
message's key up in what it read last (so a key moved to another role has its new role at once, and a removed
key the role ``revoked``, which may send nothing), and hands the core the peers whose keys were removed
(``RevokePeers``): :func:`revoke` ends their sessions and tells each why. Pure: no I/O.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from libra.protocol import messages as m
from libra.protocol.errors import ErrorCode, ProtocolCode
from libra.transport.scopes import ANY, REVOKED, base_roles

from .events import Command, Log, Send

__all__ = ["ANY", "HELLOS", "REVOKED", "allows", "refusal", "revoke"]

ACTOR, CLIENT, OPERATOR = "actor", "client", "operator"  # their keys' directories: libra.transport.security.ROLE_DIRS

HELLOS = (m.ActorHello, m.ClientHello)  # the messages that open a session (the shell notes their key)
_BOTH = (m.Heartbeat, m.Goodbye, m.LeaseEnd)
_ACTOR = frozenset((m.ActorHello, m.Bid, m.WorkResult, m.Handback, m.DirectiveDone, m.LeaseReady, m.LeaseReport,
                    m.OwnerReclaim, *_BOTH))
_CLIENT = frozenset((m.ClientHello, m.Submit, m.StatusRequest, m.CancelRequest, m.EndTrajectory, m.JobSubmit,
                     m.JobPoll, m.LeaseRequest, *_BOTH))
ALLOWED: dict[str, frozenset[type]] = {ACTOR: _ACTOR, CLIENT: _CLIENT, OPERATOR: _CLIENT | {m.DirectRequest}}


@functools.lru_cache(maxsize=4096)  # few roles and kinds; the check runs on every message under CURVE
def allows(role: str, kind: type) -> bool:
    """Whether a key of ``role`` may send a message of class ``kind`` ("" or ``any``: every kind; a key in
    several role directories has their roles comma separated, and any of them may allow it; a job-scoped
    client key, ``client:JOB``, sends what a client may)."""
    if not role or role == ANY:
        return True
    return any(kind in ALLOWED.get(r, ()) for r in base_roles(role))


def refusal(peer: bytes, msg: object, role: str, known: bool) -> list[Command]:
    """The typed answer to ``msg`` from ``peer``, whose key's ``role`` may not send it (``known``: the peer has
    a session)."""
    name = type(msg).__name__
    why = (f"{name} refused: this connection's key has the role {role!r}, which may not send it "
           f"(see libra keys --allow --role; actors, clients and operators each need their own key)")
    log = Log("role_refused", {"peer": peer.hex(), "role": role, "message": name}, "warning")
    request_id = getattr(msg, "request_id", None)
    if isinstance(request_id, str):
        return [log, Send(peer, m.Reply(request_id, False, None, ErrorCode.FORBIDDEN.value, why))]
    if isinstance(msg, HELLOS) or not known:
        return [log, Send(peer, m.Disconnect(f"{ProtocolCode.FORBIDDEN.value}: {why}"))]
    return [log, Send(peer, m.Error(ProtocolCode.FORBIDDEN.value, why))]


def revoke(peers: tuple[bytes, ...], why: str, now: float, known: Callable[[bytes], bool],
           drop_actor: Callable[..., None], close_client: Callable[[bytes], object]) -> tuple[list[Command], int]:
    """End the sessions of ``peers`` (their keys were removed; those without a session now are passed over): an
    actor's as if it were lost (its work re-queued, the loss counted in ``attempts``), a client's at once; each
    gets a ``Disconnect`` saying why. Returns the commands and how many sessions ended."""
    out: list[Command] = []
    peers = tuple(p for p in peers if known(p))
    for peer in peers:
        drop_actor(peer, now, out, why, lost=True)
        close_client(peer)
        out.append(Send(peer, m.Disconnect(f"{ProtocolCode.FORBIDDEN.value}: {why}")))
    if peers:
        out.append(Log("keys_revoked", {"peers": [p.hex() for p in peers], "why": why}, "warning"))
    return out, len(peers)
