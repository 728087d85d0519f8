"""Every message that crosses a Libra socket, as a typed dataclass. Nothing else goes here.

Messages are values: nothing changes one after it is built. They are not ``frozen`` because a frozen
dataclass's generated ``__init__`` sets each field through ``object.__setattr__``: 4.3 µs for an 11-field
``Reply`` against 0.7 µs, and one tool call builds eight messages on its way (Submit, Assign, WorkResult,
Reply, each encoded once and decoded once).

Each class has a one-byte ``KIND``. On the wire a message is one frame ``b"LIBRA1" + KIND byte + msgpack
payload`` followed by its raw buffers (three frames, ``[b"LIBRA1", KIND byte, payload, *buffers]``, when the
payload is over 64 KiB; both decode), ROUTER identity frames in front, where the
payload is a msgpack **array** of the fields in declaration order. Fields are therefore append-only:
a new field goes last and must have a default so older peers' frames still decode.

Directions: ``A→B`` actor to broker, ``C→B`` client to broker, ``B→A``/``B→C`` broker to peer, ``*``
either way. Work kinds are strings (``action``, ``generate``, ``train``, ``episode``, ``sync``); for
``action`` work the ``name`` is the tool, for ``generate`` the bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

WORK_KINDS = ("action", "generate", "train", "episode", "sync")


@dataclass(slots=True)
class ActorHello:
    """A→B: first frame of an actor session. ``capabilities`` maps work kind → names it can serve
    (tool names for ``action``; ``"*"`` = any name). ``kinds`` are the kinds it accepts right now.
    ``held``: work the actor still holds from an earlier session (running, or finished with its result
    not yet delivered), as ``[work_id, lease, attempt]`` entries: the broker adopts each one it can (its
    result is then accepted) and answers ``Revoke`` for the rest, so a broker restart or a lost session
    never runs a piece of work twice."""

    KIND: ClassVar[int] = 0x01
    actor_id: str
    host: str
    slot: str
    pid: int
    capabilities: dict[str, list[str]]
    kinds: list[str]
    capacity: int
    labels: dict[str, Any] = field(default_factory=dict)
    held: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class ClientHello:
    """C→B: first frame of a client session."""

    KIND: ClassVar[int] = 0x02
    client_id: str
    pid: int


@dataclass(slots=True)
class Heartbeat:
    """*: liveness. Any frame counts as a heartbeat; this one is sent when nothing else was. An actor on a GPU
    slot also sends one with each NVML sample of its GPU in ``gpu`` (``index``, ``memory_used_bytes``,
    ``memory_total_bytes``, ``utilization_pct``; see ``libra.actors.gpu_stats``); empty otherwise."""

    KIND: ClassVar[int] = 0x03
    gpu: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class Bid:
    """A→B: "I accept these kinds, with this many slots in total". The broker subtracts the work it
    has assigned and not yet seen finish, so a bid never races with assignments in flight; results
    return credit implicitly. A bid also ends a directive's drain."""

    KIND: ClassVar[int] = 0x04
    kinds: list[str]
    capacity: int
    rebid: bool = False
    """A capacity update while ready (the KV credit moved): never ends a directive's drain."""


@dataclass(slots=True)
class Submit:
    """C→B: ask for one piece of work. ``request_id`` is the client's idempotency key: a resubmission
    with the same id never runs twice (the broker answers from its record)."""

    KIND: ClassVar[int] = 0x05
    request_id: str
    kind: str
    name: str
    args: Any
    trajectory: str | None = None
    timeout_s: float = 60.0
    prior_attempts: int = 0
    """Runs this request already had elsewhere: a direct call (``DirectCall``) whose actor was lost comes
    back through the broker with 1, so its ``attempts`` and retry budget count that run."""


@dataclass(slots=True)
class WorkResult:
    """A→B: the outcome of an assignment. Dropped by the broker unless ``lease`` is current."""

    KIND: ClassVar[int] = 0x06
    work_id: str
    lease: int
    ok: bool
    output: Any = None
    error_code: str = ""
    error: str = ""
    duration_s: float = 0.0


@dataclass(slots=True)
class Handback:
    """A→B: return an assignment unstarted (drain for a directive, shutting down)."""

    KIND: ClassVar[int] = 0x07
    work_id: str
    lease: int
    reason: str = ""


@dataclass(slots=True)
class DirectiveDone:
    """A→B: the actor has drained and reconfigured for directive ``directive_id``."""

    KIND: ClassVar[int] = 0x08
    directive_id: int
    kinds: list[str]


@dataclass(slots=True)
class StatusRequest:
    """C→B: ask for a cluster snapshot."""

    KIND: ClassVar[int] = 0x09
    request_id: str


@dataclass(slots=True)
class CancelRequest:
    """C→B: the client no longer wants ``request_id``; it is failed with ``cancelled`` if unfinished."""

    KIND: ClassVar[int] = 0x0A
    request_id: str


@dataclass(slots=True)
class Goodbye:
    """A→B / C→B: the peer is leaving on purpose; its leased work is re-queued at once."""

    KIND: ClassVar[int] = 0x0B
    reason: str = ""


@dataclass(slots=True)
class DirectRequest:
    """C→B (operator): send ``actor_id`` a Directive to accept ``kinds`` from now on. Answered with a
    Reply whose output is the directive id (or an error if the actor is unknown)."""

    KIND: ClassVar[int] = 0x0C
    request_id: str
    actor_id: str
    kinds: list[str]
    mode: str = "finish"
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class EndTrajectory:
    """C→B: trajectory ``trajectory`` is finished (``ok``) or abandoned; the rollout router learns from
    its ``total_output_tokens``. No reply."""

    KIND: ClassVar[int] = 0x0D
    trajectory: str
    total_output_tokens: int = 0
    ok: bool = True


@dataclass(slots=True)
class JobSubmit:
    """C→B: run an RL job inside the broker (``libra.broker.job_host``). ``spec`` is the job's validated
    settings (see :class:`libra.broker.job_host.JobSpec`), ``rows`` its dataset rows (one mapping per prompt;
    opaque to the broker, handed to episode runners). Answered at once with a Reply (``output``:
    ``{"job": name}``) or an error (bad spec, name already running). Resubmitting a running job's name
    with the same ``request_id`` is answered from the record."""

    KIND: ClassVar[int] = 0x0E
    request_id: str
    name: str
    spec: dict[str, Any]
    rows: list[Any]


JOB_POLL_LIMIT = 500  # JobPoll.limit's default: records in one reply
JOB_POLL_MAX_LIMIT = 5000  # the most a JobPoll may ask for; above it (or below 1) the broker answers bad_request


@dataclass(slots=True)
class JobPoll:
    """C→B: progress of job ``job``: a Reply whose output is ``{"state", "error", "steps_done",
    "version", "records": [at most ``limit`` records with index >= cursor], "next_cursor", "more", "summary"}``
    (``more``: records after ``next_cursor`` are waiting; a client pages on from ``next_cursor`` at once).
    ``limit`` must be 1..``JOB_POLL_MAX_LIMIT`` (a bad one is a ``bad_request`` Reply).
    ``cancel=True`` stops the job first (its queued work is cancelled, running work finishes unused)."""

    KIND: ClassVar[int] = 0x0F
    request_id: str
    job: str
    cursor: int = 0
    cancel: bool = False
    limit: int = JOB_POLL_LIMIT


@dataclass(slots=True)
class LeaseRequest:
    """C→B: ask for a direct lease on ``kind``/``name``: the broker picks an actor that runs it inline
    (constant-time, on its socket thread) and answers with a Reply whose output is ``{"lease",
    "actor_id", "host", "endpoint", "ipc"}``, or ``no_lease``. The client then sends ``DirectCall`` messages to that
    actor's endpoint, with no broker hop (see ``libra.client.direct``)."""

    KIND: ClassVar[int] = 0x10
    request_id: str
    kind: str
    name: str


@dataclass(slots=True)
class LeaseReady:
    """A→B: the actor holds lease ``lease_id`` (``ok``) or cannot serve it (``error`` says why)."""

    KIND: ClassVar[int] = 0x11
    lease_id: str
    ok: bool = True
    error: str = ""


@dataclass(slots=True)
class LeaseReport:
    """A→B: direct calls the actor answered on ``lease_id`` since its last report (for the broker's counters)."""

    KIND: ClassVar[int] = 0x12
    lease_id: str
    done: int = 0
    failed: int = 0


@dataclass(slots=True)
class DirectCall:
    """C→A, on the actor's direct socket: run ``name`` under lease ``lease_id``. Answered with a ``Reply``
    (``attempts`` 1); an actor that does not hold the lease (it ended) answers ``lease_ended`` without
    running anything, and the client sends the call through the broker instead."""

    KIND: ClassVar[int] = 0x13
    request_id: str
    lease_id: str
    kind: str
    name: str
    args: Any
    timeout_s: float = 60.0


@dataclass(slots=True)
class LeaseEnd:
    """*: lease ``lease_id`` is over. C→B: the client returns it (idle, closing). B→A: accept no more calls on
    it. B→C: use it no more; ``lost``: its actor is gone, so unanswered calls on it are sent again through the
    broker (with ``prior_attempts`` 1)."""

    KIND: ClassVar[int] = 0x14
    lease_id: str
    reason: str = ""
    lost: bool = False


@dataclass(slots=True)
class LeaseGrant:
    """B→A: hold lease ``lease_id`` for client ``client_id``'s direct calls of ``kind``/``name`` (answer
    ``LeaseReady``) until the broker sends ``LeaseEnd``."""

    KIND: ClassVar[int] = 0x28
    lease_id: str
    client_id: str
    kind: str
    name: str


@dataclass(slots=True)
class Welcome:
    """B→*: the hello was accepted. Carries the liveness contract both sides use: a peer beats every
    ``heartbeat_s`` and is dead after ``liveness`` silent intervals. The broker beats an actor that holds
    none of its work only every ``idle_heartbeat_s`` (0: every ``heartbeat_s``), so such an actor calls the
    broker silent after ``liveness`` of those."""

    KIND: ClassVar[int] = 0x20
    session: str
    broker_id: str
    heartbeat_s: float
    liveness: int
    max_frame_bytes: int
    idle_heartbeat_s: float = 0.0


@dataclass(slots=True)
class Assign:
    """B→A: run this. ``lease`` fences the result; ``attempt`` counts assignments of this work;
    ``budget_s`` is the time left before the request's deadline."""

    KIND: ClassVar[int] = 0x21
    work_id: str
    lease: int
    attempt: int
    kind: str
    name: str
    args: Any
    trajectory: str | None = None
    budget_s: float = 60.0
    route: dict[str, Any] = field(default_factory=dict)  # generate: bucket, reason, migrated, mode


@dataclass(slots=True)
class Reply:
    """B→C: the single answer to ``request_id`` (exactly once per accepted request)."""

    KIND: ClassVar[int] = 0x22
    request_id: str
    ok: bool
    output: Any = None
    error_code: str = ""
    error: str = ""
    work_id: str = ""
    attempts: int = 0
    actor_id: str = ""
    duration_s: float = 0.0
    retry_after_s: float = 0.0
    tool_code: str = ""  # with error_code "tool_failed": the tool's own code (timeout, memory, ...)


@dataclass(slots=True)
class Error:
    """B→*: a frame from this peer was rejected (``code`` is a ProtocolCode or ErrorCode value)."""

    KIND: ClassVar[int] = 0x23
    code: str
    message: str
    request_id: str = ""


@dataclass(slots=True)
class Directive:
    """B→A: from now on accept ``kinds`` (replacing the current set). ``mode`` is ``finish`` (run what
    you hold to the end) or ``handback`` (return unstarted work). ``config`` carries role details for
    the engine (bucket, TP group, ...). The actor answers with DirectiveDone then a Bid."""

    KIND: ClassVar[int] = 0x24
    directive_id: int
    kinds: list[str]
    mode: str = "finish"
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Revoke:
    """B→A: stop working on this assignment; its result will be dropped anyway."""

    KIND: ClassVar[int] = 0x25
    work_id: str
    lease: int
    reason: str = ""


@dataclass(slots=True)
class StatusReply:
    """B→C: cluster snapshot: one dict per actor, queue depths by ``kind:name``, counters."""

    KIND: ClassVar[int] = 0x26
    request_id: str
    actors: list[dict[str, Any]]
    queues: dict[str, int]
    stats: dict[str, Any]


@dataclass(slots=True)
class Disconnect:
    """B→*: the broker dropped this session (expired, protocol violation). The peer must open a new
    socket and say hello again (7/MDP). ``code``: ``""``, or ``"actor_id_in_use"`` when the broker refused an
    actor's hello because a live session of another actor (another supervisor run) holds that id: the
    actor backs off before it says hello again."""

    KIND: ClassVar[int] = 0x27
    reason: str = ""
    code: str = ""


@dataclass(slots=True)
class OwnerReclaim:
    """A→B: the owner of this lent slot's GPU (``labels["lend"]`` in its hello) wants it back within
    ``deadline_s`` seconds. The broker gives the slot no more work, moves the trajectories pinned to it
    (their KV when moving it fits the deadline, else a re-prefill), takes back what it hands back, and
    re-plans without it. ``reason`` is a static word from the owner's rule (``slo_headroom_low``,
    ``spot_notice``, ...). The slot bids again (an ordinary ``Bid``) when its owner lends it again."""

    KIND: ClassVar[int] = 0x15
    owner: str
    deadline_s: float
    reason: str = ""


@dataclass(slots=True)
class ContextsMoved:
    """B→A: after an ``OwnerReclaim``, every trajectory that was pinned to this slot has run its next turn
    elsewhere or ended, so nothing needs the contexts it holds: it may free its engine before the deadline."""

    KIND: ClassVar[int] = 0x29
    owner: str = ""


@dataclass(slots=True)
class Batch:
    """*: several messages to the same peer in one frame set, in order. ``messages`` holds
    ``[kind, [fields...]]`` pairs, each validated exactly like a standalone message; a batch never
    nests and carries no raw buffers. Senders coalesce what one loop pass produced for a peer
    (as Dask's BatchedSend does), so a busy path pays the socket cost once per batch."""

    KIND: ClassVar[int] = 0x30
    messages: list[Any]


MESSAGE_TYPES: tuple[type, ...] = (
    ActorHello, ClientHello, Heartbeat, Bid, Submit, WorkResult, Handback, DirectiveDone,
    StatusRequest, CancelRequest, Goodbye, DirectRequest, EndTrajectory, JobSubmit, JobPoll,
    LeaseRequest, LeaseReady, LeaseReport, DirectCall, LeaseEnd,
    Welcome, Assign, Reply, Error, Directive, Revoke, StatusReply, Disconnect, LeaseGrant, OwnerReclaim,
    ContextsMoved,
)

Message = Any  # any instance of MESSAGE_TYPES (kept loose so dataclasses need no common base)
