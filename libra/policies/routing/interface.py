"""The rollout-router interface: Protocol, snapshot and decision types, bucket mapping and placement.

Every rollout router (C-MLFQ in :mod:`libra.policies.routing.cmlfq`, the baselines in :mod:`libra.policies.routing.baselines`)
implements :class:`Router`. The broker (over ZeroMQ) and the discrete-event simulator both drive it:

1. ``start(traj, view)`` before a trajectory's first generation turn;
2. ``on_tool_return(traj_id, ret, view)`` after each tool call, before the next turn;
3. ``on_turn_end(traj_id, generated_tokens)`` after each turn (cumulative generated tokens so far);
4. ``finish(traj_id, total_output_tokens)`` once the trajectory is done (the learning hook; the total is
   the *response* length, generated plus tool-returned tokens), or
   ``discard(traj_id)`` to forget it without learning (failed, aborted);
5. ``reroute(traj_id, view)`` to place again a trajectory whose last decision was "queue" or whose
   instance left the view;
6. ``on_step(step)`` when the RL step (policy version) advances.

Contracts:

- Routers are pure: no sockets, threads, clocks or globals. Load comes only from the :class:`ClusterView`
  passed in, so the caller must pass a view that reflects its earlier assignments (``ClusterView.with_instance``
  helps when deciding a batch against one snapshot).
- Shared router machinery (stickiness, migration, tracks) is :class:`libra.policies.routing.sticky.StickyRouter`.
- A trajectory sticks to its instance (its prefix/KV cache lives there) until the router *migrates* it to
  another bucket. If its instance is gone or not ready, it is placed again inside its bucket and the decision
  says ``migrate_mode="reprefill"`` with ``migrated=False``. A migration goes only into the target bucket
  itself; when that bucket has no room the request stays put (reason ``target_bucket_full``). C-MLFQ
  (``commit_when_full``) then already takes the target as its logical bucket (docs/papers.md §1.4.3: the next
  call is routed to the target bucket, with fallbacks) and retries the move at the next tool return; the
  baselines keep their bucket and decide again at the next tool return.
- Buckets are ordered by ascending ``max_tokens``; ``bucket_for(x)`` is the first bucket with ``x <= max_tokens``,
  else the last.
- Lengths are *response* tokens: generated plus tool-returned (everything after the prompt), the unit in which
  bucket thresholds, the 40,960-token model cap and R2E's 30K new-token budget are stated (docs/papers.md
  §1.4.1, §1.5). A tool return's position ``p_i`` (:func:`response_position`) includes its own payload, so
  ``total - p_i`` is what is still to come once the trajectory is routed again.
- Placement inside a bucket is least-loaded (``active + queued``; across TP degrees normalised by ``tp``) among
  ready instances with room (``queued < max_queue_length``, or ``active + queued`` with ``cap_metric="load"``),
  then the other buckets nearest first, then, when everything is full, by ``when_full``: ``"overflow"``
  (globally least-loaded ready instance), ``"queue"`` (a decision with ``instance_id=None``) or ``"raise"``
  (:class:`NoInstanceAvailable`). With no ready instance at all, ``"queue"`` queues and the others raise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal, Protocol, runtime_checkable

__all__ = [
    "BucketSpec",
    "ClusterView",
    "ClusterViewError",
    "InstanceView",
    "MigrateMode",
    "MigrationQuery",
    "NoInstanceAvailable",
    "RouteDecision",
    "Router",
    "RoutingError",
    "ToolReturn",
    "TrajectoryInfo",
    "bucket_for",
    "bucket_index_for",
    "fallback_order",
    "has_room",
    "heuristic_migrate_mode",
    "migrate_mode_by_limits",
    "least_loaded",
    "mode_by_cost",
    "place",
    "response_position",
]

MigrateMode = Literal["kv", "reprefill"]
WhenFull = Literal["overflow", "queue", "raise"]
CapMetric = Literal["queued", "load"]
_WHEN_FULL: Final = ("overflow", "queue", "raise")
_CAP_METRICS: Final = ("queued", "load")


class RoutingError(RuntimeError):
    """A routing call that cannot be honoured (unknown or duplicate trajectory, inconsistent input)."""


class NoInstanceAvailable(RoutingError):
    """No ready instance can take the request and the router was told not to queue it."""


class ClusterViewError(ValueError):
    """An inconsistent cluster snapshot or router parameter (names the field and value)."""


def check_int(what: str, value: Any, minimum: int = 0, error: type[Exception] = ClusterViewError) -> None:
    """Raise ``error`` naming ``what`` unless ``value`` is an integer (not a bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise error(f"{what} must be an integer >= {minimum}, got {value!r}")


# ------------------------------------------------------------------------------------------------ snapshots


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """A rollout bucket: instances of one TP degree serving remaining lengths up to ``max_tokens``."""

    name: str
    tp: int
    max_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ClusterViewError(f"bucket name must be a non-empty string, got {self.name!r}")
        check_int(f"bucket {self.name!r}: tp", self.tp, 1)
        check_int(f"bucket {self.name!r}: max_tokens", self.max_tokens, 1)


@dataclass(frozen=True, slots=True)
class InstanceView:
    """A rollout instance as the router sees it.

    ``active``: requests running on it; ``queued``: requests assigned to it but waiting; ``ready``: accepting
    work; ``node``: host name (same-node migrations are cheaper), ``None`` if unknown (treated as remote).
    """

    id: str
    bucket: str
    active: int = 0
    queued: int = 0
    ready: bool = True
    node: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ClusterViewError(f"instance id must be a non-empty string, got {self.id!r}")
        check_int(f"instance {self.id!r}: active", self.active)
        check_int(f"instance {self.id!r}: queued", self.queued)

    @property
    def load(self) -> int:
        return self.active + self.queued


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Read-only snapshot of buckets (ascending ``max_tokens``) and instances.

    Raises :class:`ClusterViewError` for no buckets, duplicate names or ids, unordered thresholds, or an
    instance in an unknown bucket.
    """

    buckets: tuple[BucketSpec, ...]
    instances: tuple[InstanceView, ...] = ()
    _index: dict[str, int] = field(init=False, repr=False, compare=False)
    _by_id: dict[str, InstanceView] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "buckets", tuple(self.buckets))
        object.__setattr__(self, "instances", tuple(self.instances))
        if not self.buckets:
            raise ClusterViewError("cluster view needs at least one bucket")
        index: dict[str, int] = {}
        for i, b in enumerate(self.buckets):
            if b.name in index:
                raise ClusterViewError(f"duplicate bucket name {b.name!r}")
            if i and b.max_tokens <= self.buckets[i - 1].max_tokens:
                raise ClusterViewError(
                    f"buckets must have ascending max_tokens: {b.name!r} ({b.max_tokens}) follows "
                    f"{self.buckets[i - 1].name!r} ({self.buckets[i - 1].max_tokens})"
                )
            index[b.name] = i
        by_id: dict[str, InstanceView] = {}
        for inst in self.instances:
            if inst.bucket not in index:
                raise ClusterViewError(f"instance {inst.id!r} is in unknown bucket {inst.bucket!r}")
            if inst.id in by_id:
                raise ClusterViewError(f"duplicate instance id {inst.id!r}")
            by_id[inst.id] = inst
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_by_id", by_id)

    def has_bucket(self, name: str) -> bool:
        return name in self._index

    def bucket_index(self, name: str) -> int:
        """Position of bucket ``name``; raises :class:`ClusterViewError` if unknown."""
        try:
            return self._index[name]
        except KeyError:
            raise ClusterViewError(f"unknown bucket {name!r} (known: {', '.join(self._index)})") from None

    def instance(self, instance_id: str) -> InstanceView | None:
        return self._by_id.get(instance_id)

    def with_instance(self, instance_id: str, **changes: Any) -> ClusterView:
        """A copy with one instance's fields replaced (e.g. ``queued=inst.queued + 1`` after assigning)."""
        inst = self._by_id.get(instance_id)
        if inst is None:
            raise ClusterViewError(f"unknown instance {instance_id!r}")
        new = replace(inst, **changes)
        return ClusterView(self.buckets, tuple(new if i.id == instance_id else i for i in self.instances))


@dataclass(frozen=True, slots=True)
class TrajectoryInfo:
    """A new trajectory. ``true_remaining`` (its total output tokens) is for the oracle router only."""

    traj_id: str
    prompt_id: str | None = None
    prompt_tokens: int = 0
    step: int = 0
    true_remaining: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.traj_id, str) or not self.traj_id:
            raise RoutingError(f"traj_id must be a non-empty string, got {self.traj_id!r}")
        for name in ("prompt_tokens", "step", "true_remaining"):
            if name != "true_remaining" or self.true_remaining is not None:
                check_int(f"trajectory {self.traj_id!r}: {name}", getattr(self, name), 0, RoutingError)


@dataclass(frozen=True, slots=True)
class ToolReturn:
    """One tool return, reported before the trajectory's next turn.

    ``position``: tokens the trajectory had generated when it called the tool;
    ``context_tokens``: total context now (prompt + generated + payloads), the size a migration moves (when
    left 0, routers use prompt tokens + ``position``);
    ``response_tokens``: the *response position* ``p_i`` -- response tokens so far, generated plus
    tool-returned with this return's payload included -- in the unit of the buckets' ``max_tokens`` (see
    :func:`response_position` for the fallback when it is ``None``);
    ``output``/``status``/``payload_tokens``/``payload_chars``: what the tool-state extractor reads;
    ``true_remaining``: remaining response tokens from here (oracle and simulator only).
    """

    tool: str | None
    position: int
    context_tokens: int = 0
    output: Any = None
    status: str | None = None
    payload_tokens: int | None = None
    payload_chars: int | None = None
    true_remaining: int | None = None
    response_tokens: int | None = None

    def __post_init__(self) -> None:
        check_int("tool return: position", self.position, 0, RoutingError)
        check_int("tool return: context_tokens", self.context_tokens, 0, RoutingError)
        if self.response_tokens is not None:
            check_int("tool return: response_tokens", self.response_tokens, 0, RoutingError)


def response_position(ret: ToolReturn, prompt_tokens: int, payload_so_far: int = 0) -> int:
    """Response tokens (generated + tool-returned, this return included) once ``ret`` is in the context.

    ``ret.response_tokens`` when given; else ``ret.context_tokens - prompt_tokens`` when the context is
    known; else ``ret.position + payload_so_far + ret.payload_tokens`` (``payload_so_far``: tool-returned
    tokens of the earlier returns). Never below ``ret.position``.
    """
    if ret.response_tokens is not None:
        resp = ret.response_tokens
    elif ret.context_tokens > 0:
        resp = ret.context_tokens - prompt_tokens
    else:
        resp = ret.position + payload_so_far + (ret.payload_tokens or 0)
    return max(resp, ret.position)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where the next turn runs.

    ``instance_id`` is ``None`` when the request must wait (``queued``). ``bucket`` is the trajectory's
    logical bucket after this decision; ``placed_bucket`` the bucket of the chosen instance (differs after a
    fallback). ``migrated`` is true when the decision moved it to another logical bucket (even if
    the context waits on its old instance, ``target_bucket_full``) or carries out such a deferred move; ``migrate_mode`` says how the
    context moves whenever it changes instance (``"kv"`` or ``"reprefill"``), else ``None``. ``reason`` is a
    static snake_case word (``initial``, ``migrate``, ``mean_p90_disagree``, ...).
    """

    instance_id: str | None
    bucket: str
    reason: str
    migrated: bool = False
    migrate_mode: MigrateMode | None = None
    placed_bucket: str | None = None

    @property
    def queued(self) -> bool:
        return self.instance_id is None


@runtime_checkable
class Router(Protocol):
    """What the broker and the simulator call. See the module docstring for the call order and contracts."""

    name: str

    def start(self, traj: TrajectoryInfo, view: ClusterView) -> RouteDecision: ...

    def on_tool_return(self, traj_id: str, ret: ToolReturn, view: ClusterView) -> RouteDecision: ...

    def on_turn_end(self, traj_id: str, generated_tokens: int) -> None: ...

    def finish(self, traj_id: str, total_output_tokens: int) -> None: ...

    def discard(self, traj_id: str) -> None: ...

    def reroute(self, traj_id: str, view: ClusterView) -> RouteDecision: ...

    def on_step(self, step: int) -> None: ...


# ------------------------------------------------------------------------------------------------ helpers


def bucket_index_for(remaining_tokens: float, buckets: Sequence[BucketSpec]) -> int:
    """Index of the first bucket with ``remaining_tokens <= max_tokens``, else of the last bucket."""
    if not buckets:
        raise ClusterViewError("bucket_for needs at least one bucket")
    for i, b in enumerate(buckets):
        if remaining_tokens <= b.max_tokens:
            return i
    return len(buckets) - 1


def bucket_for(remaining_tokens: float, buckets: Sequence[BucketSpec]) -> BucketSpec:
    """The bucket a request with ``remaining_tokens`` left belongs to (see :func:`bucket_index_for`)."""
    return buckets[bucket_index_for(remaining_tokens, buckets)]


@dataclass(frozen=True, slots=True)
class MigrationQuery:
    """Input of a migrate-vs-re-prefill choice: context size and where it moves."""

    seq_len: int
    same_node: bool
    src_tp: int
    dst_tp: int


HEURISTIC_SAME_NODE_MAX_TOKENS: Final = 4096
HEURISTIC_CROSS_NODE_MAX_TOKENS: Final = 2048


def migrate_mode_by_limits(q: MigrationQuery, same_node_max_tokens: int, cross_node_max_tokens: int) -> MigrateMode:
    """Re-prefill a context up to the limit for where it moves (same node or across nodes), else KV."""
    limit = same_node_max_tokens if q.same_node else cross_node_max_tokens
    return "reprefill" if q.seq_len <= limit else "kv"


def heuristic_migrate_mode(q: MigrationQuery) -> MigrateMode:
    """Libra's profile-free rule: re-prefill up to 4096 tokens on the same node (2048 across nodes), else KV."""
    return migrate_mode_by_limits(q, HEURISTIC_SAME_NODE_MAX_TOKENS, HEURISTIC_CROSS_NODE_MAX_TOKENS)


def mode_by_cost(
    kv_seconds: Callable[[MigrationQuery], float], reprefill_seconds: Callable[[MigrationQuery], float]
) -> Callable[[MigrationQuery], MigrateMode]:
    """A chooser that picks the cheaper mode by the two cost functions (ties re-prefill)."""

    def choose(q: MigrationQuery) -> MigrateMode:
        return "kv" if kv_seconds(q) < reprefill_seconds(q) else "reprefill"

    return choose


def has_room(inst: InstanceView, max_queue_length: int, cap_metric: CapMetric = "queued") -> bool:
    """Whether ``inst`` is under the queue cap (``queued`` or ``active + queued`` below ``max_queue_length``)."""
    used = inst.queued if cap_metric == "queued" else inst.load
    return used < max_queue_length


def least_loaded(cands: Sequence[InstanceView], view: ClusterView) -> InstanceView | None:
    """The candidate with the least ``load / tp`` (``None`` if there are none)."""
    # min() keeps the first of equals, so ties go to the instance listed first in the view.
    return min(cands, key=lambda i: i.load / view.buckets[view.bucket_index(i.bucket)].tp, default=None)


def fallback_order(target: int, n: int) -> list[int]:
    """Bucket indices other than ``target``, nearest first; at equal distance the larger bucket first."""
    order = []
    for d in range(1, n):
        for idx in (target + d, target - d):
            if 0 <= idx < n:
                order.append(idx)
    return order


def place(
    view: ClusterView,
    target: int,
    *,
    max_queue_length: int = 3,
    cap_metric: CapMetric = "queued",
    when_full: WhenFull = "overflow",
    fallback: bool = True,
) -> InstanceView | None:
    """Choose an instance for a request whose logical bucket is ``view.buckets[target]``.

    Returns the instance, or ``None`` for "queue" (see the module docstring for the order). With
    ``fallback=False`` only the target bucket is tried before ``when_full`` applies.
    Raises :class:`NoInstanceAvailable` as described there.
    """
    ready = [i for i in view.instances if i.ready]
    order = [target, *(fallback_order(target, len(view.buckets)) if fallback else [])]
    for idx in order:
        name = view.buckets[idx].name
        pick = least_loaded([i for i in ready if i.bucket == name and has_room(i, max_queue_length, cap_metric)], view)
        if pick is not None:
            return pick
    if when_full == "queue":
        return None
    if when_full == "overflow" and ready:
        return least_loaded(ready, view)
    raise NoInstanceAvailable(
        f"no ready instance with room for bucket {view.buckets[target].name!r} "
        f"({len(ready)} ready of {len(view.instances)}; max_queue_length={max_queue_length})"
    )
