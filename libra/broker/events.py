"""Inputs to and outputs of the broker's pure core (``BrokerState.handle``).

Events are what the shell observed (a decoded frame from a peer, a frame that failed to decode, a
timer tick, a planner search it ran off the loop) and what an operator, the simulator or a restart asks of
the core (a directive, a plan, a journal to restore). Commands are everything the core wants done outside
itself: send a message to a peer, append a record to the journal, run a planner search off the loop, write
a log line. The core has no other way out: no sockets, no files, no threads, no logger. All are plain
frozen dataclasses so tests can build and compare them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from libra.protocol.errors import ProtocolError

# ---------------------------------------------------------------------------------------------- events


@dataclass(slots=True)  # not frozen: built per message on the hot path (see protocol.messages)
class PeerMessage:
    """A decoded message from the peer with routing identity ``peer``. ``role``: the role of the CURVE key its
    connection passed the handshake with (``libra.broker.roles``; "" without CURVE: anything goes)."""

    peer: bytes
    msg: Any
    buffers: tuple[bytes, ...] = ()
    role: str = ""
    key: str = ""
    """The Z85 public key of that connection ("" without CURVE): the audit trail names it by fingerprint."""


@dataclass(frozen=True, slots=True)
class BadFrame:
    """A frame list from ``peer`` that the codec rejected."""

    peer: bytes
    error: ProtocolError


@dataclass(frozen=True, slots=True)
class Tick:
    """Periodic timer: liveness, leases, deadlines, heartbeats, the planner's rounds. ``behind``: the shell
    stopped reading at its per-pass limit with frames still waiting, which may hold the heartbeats of actors
    that look silent, so this tick declares no actor dead (an overloaded broker must not expire live actors,
    which then say hello again and load it more)."""

    behind: bool = False


@dataclass(frozen=True, slots=True)
class PlannerDone:
    """The search of a broker planning round finished (``job``: the ``plan_decider.PlanJob`` of a
    :class:`StartPlannerSearch` command, which the shell ran off the event loop)."""

    job: Any


@dataclass(frozen=True, slots=True)
class Direct:
    """Tell actor ``actor_id`` to accept ``kinds`` from now on (``mode``: ``finish`` or ``handback``;
    ``config``: its role details). The core raises ``KeyError`` (no such live actor) or ``ValueError``
    (bad mode or kind): this is an operator's or the planner's call, not peer input."""

    actor_id: str
    kinds: tuple[str, ...] | list[str]
    mode: str = "finish"
    config: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ApplyPlan:
    """Move the GPU actors to the roles of ``plan`` (a planner ``Plan``); raises ``plan_applier.PlanError`` when it
    does not fit the actors connected now. ``placement``: the lent slots' bucket policy (``place_borrowed``;
    None: the broker planner's ``borrowed_placement``, ``proportional`` without one)."""

    plan: Any
    placement: str | None = None


@dataclass(frozen=True, slots=True)
class PlaceLent:
    """Direct the connected, not-reclaimed lent slots to their TP-1 rollout instances under ``plan`` (the deployed
    plan), without re-laying the owned GPUs: what a planner round that deploys nothing does
    (``Planning.place_lent``), for a shell that runs the planner's rounds itself, as the simulator does.
    ``placement``: as :class:`ApplyPlan`'s."""

    plan: Any
    placement: str | None = None


@dataclass(frozen=True, slots=True)
class Restore:
    """Rebuild after a restart from a journal (before serving): ``accepted`` requests without a reply and
    the ``done`` replies, each ``(client_id, request_id, fields)``, oldest first."""

    accepted: list[tuple[str, str, dict[str, Any]]]
    done: list[tuple[str, str, dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Rehome:
    """Move rollout instances and queued generate turns of buckets a re-plan removed onto current buckets
    (``buckets``: old bucket name -> current bucket name). The simulator uses it; the live broker's
    instances get new roles by directive instead."""

    buckets: dict[str, str]


@dataclass(frozen=True, slots=True)
class RevokePeers:
    """The keys these peers connected with were removed from the allow directory while they were connected
    (the shell re-reads it: ``libra.broker.roles``). Their sessions end as if lost (an actor's work is
    re-queued with its loss counted) and each is told why. ``keys``: the removed key (Z85) they connected with, for
    the audit (the shell sends one event per removed key, so the sessions ended are that key's)."""

    peers: tuple[bytes, ...]
    why: str
    keys: tuple[str, ...] = ()


Event = (PeerMessage | BadFrame | Tick | PlannerDone | Direct | ApplyPlan | PlaceLent | Restore | Rehome
         | RevokePeers)

# -------------------------------------------------------------------------------------------- commands


@dataclass(slots=True)  # not frozen: built per message on the hot path (see protocol.messages)
class Send:
    """Send ``msg`` (plus raw ``buffers``) to ``peer``."""

    peer: bytes
    msg: Any
    buffers: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class JournalWrite:
    """Record for durability: ``op`` is ``accept`` (a request was accepted: ``data`` has its fields and work
    id), ``start`` (it was given to an actor, or adopted: ``data`` has its work id, lease and attempt count)
    or ``done`` (its one reply was produced: ``data`` is the Reply's fields). Only a core built with
    ``journaling=True`` emits them; the shell appends them to its journal and commits before it sends the
    replies of the same pass."""

    op: str
    client_id: str
    request_id: str
    data: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StartPlannerSearch:
    """Run ``job.run()`` (a ``plan_decider.PlanJob``: a planning round's search, seconds at 512 GPUs) off the
    event loop and hand the job back as a :class:`PlannerDone` event. Only a core built with
    ``planner_offload=True`` emits it; otherwise the search runs inline."""

    job: Any


@dataclass(frozen=True, slots=True)
class Log:
    """Write one log line: ``event`` (a static snake_case name, or a short sentence) with ``fields``, at
    ``level`` (``debug`` | ``info`` | ``warning`` | ``error``), as ``component``."""

    event: str
    fields: dict[str, Any] = field(default_factory=dict)
    level: str = "info"
    component: str = "libra.broker"


@dataclass(frozen=True, slots=True)
class Audit:
    """Append ``record`` to the audit log (``libra.broker.access``: what was done or refused, by which key
    fingerprint and role). The shell adds the wall-clock time; it never changes or removes a record."""

    record: dict[str, Any]


Command = Send | JournalWrite | StartPlannerSearch | Log | Audit
