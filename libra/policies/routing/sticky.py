"""Shared machinery of the rollout routers: per-trajectory tracks, stickiness, placement and migration.

:class:`StickyRouter` implements the :class:`libra.policies.routing.interface.Router` call sequence once; C-MLFQ
(:mod:`libra.policies.routing.cmlfq`) and the baselines (:mod:`libra.policies.routing.baselines`) subclass it and only decide
*which bucket* a trajectory belongs in (at ``start`` and after each tool return) and what to learn at ``finish``.
Placement, the queue cap and fallbacks come from :func:`libra.policies.routing.interface.place`; how a context moves
(KV transfer or re-prefill) from the ``choose_mode`` callable. Pure: no I/O, clocks or threads; the only
state is the per-trajectory :class:`Track` table, mutated by the Router methods.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from libra.policies.routing.interface import (
    _CAP_METRICS,
    _WHEN_FULL,
    BucketSpec,
    CapMetric,
    ClusterView,
    ClusterViewError,
    InstanceView,
    MigrateMode,
    MigrationQuery,
    RouteDecision,
    RoutingError,
    ToolReturn,
    TrajectoryInfo,
    WhenFull,
    bucket_for,
    check_int,
    has_room,
    heuristic_migrate_mode,
    least_loaded,
    place,
    response_position,
)

__all__ = ["StickyRouter", "Track"]


@dataclass(slots=True)
class Track:
    """Per-trajectory router state.

    ``bucket``/``bucket_max``: logical bucket and its threshold (to re-map it when a re-plan removes the
    bucket); ``instance``: the instance holding (or about to hold) its context, ``None`` before its first
    placement; ``queued``: its last decision was "queue"; ``states``/``positions``: tool-return keys and
    response positions ``p_i`` (generated + tool-returned tokens, see
    :func:`libra.policies.routing.interface.response_position`) seen so far; ``generated``: cumulative generated tokens
    reported so far; ``payload``: tool-returned tokens so far; ``context``: the latest known context size (what
    a move has to transfer or recompute); ``pending_move``: the logical bucket changed but that bucket had no
    room, so the context still waits on its old instance; ``tool_position``: generated tokens at the latest
    tool return (positions may not go backwards).
    """

    info: TrajectoryInfo
    bucket: str
    bucket_max: int
    instance: str | None = None
    queued: bool = False
    generated: int = 0
    payload: int = 0
    context: int = 0
    states: list[str] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    pending_move: bool = False
    tool_position: int = 0

    @property
    def response(self) -> int:
        """Response tokens so far (generated + tool-returned): the unit of bucket thresholds."""
        return self.generated + self.payload

    def set_bucket(self, spec: BucketSpec) -> None:
        self.bucket, self.bucket_max = spec.name, spec.max_tokens


class StickyRouter:
    """Shared machinery of all routers: per-trajectory tracks, stickiness, placement and migration.

    Subclasses implement :meth:`_initial_bucket` (logical bucket and reason at ``start``) and may override
    :meth:`_decide` (target bucket and reason after a tool return; default: stay), :meth:`_learn` and
    :meth:`on_step`. A migration goes only into the target bucket itself: when that bucket has no room the
    request stays where its cache is (reason ``target_bucket_full``); a subclass with :attr:`commit_when_full`
    (C-MLFQ) still takes the target as its logical bucket (``RouteDecision.bucket``, what routing accuracy
    scores) and retries the move at the next tool return, the others keep their bucket and decide again then. Raises :class:`ClusterViewError` for bad parameters and :class:`RoutingError` for unknown or
    duplicate trajectory ids and backwards tool positions.
    """

    name = "sticky"
    #: Whether a decision whose target bucket is full still changes the logical bucket (and retries the move).
    commit_when_full = False

    def __init__(
        self,
        *,
        max_queue_length: int = 3,
        cap_metric: CapMetric = "queued",
        when_full: WhenFull = "overflow",
        choose_mode: Callable[[MigrationQuery], MigrateMode] = heuristic_migrate_mode,
    ) -> None:
        check_int("max_queue_length", max_queue_length, 1)
        if when_full not in _WHEN_FULL:
            raise ClusterViewError(f"when_full must be one of {', '.join(_WHEN_FULL)}, got {when_full!r}")
        if cap_metric not in _CAP_METRICS:
            raise ClusterViewError(f"cap_metric must be one of {', '.join(_CAP_METRICS)}, got {cap_metric!r}")
        self.max_queue_length = max_queue_length
        self.cap_metric: CapMetric = cap_metric
        self.when_full: WhenFull = when_full
        self.choose_mode = choose_mode
        self._tracks: dict[str, Track] = {}

    # -- subclass hooks ---------------------------------------------------------------------------

    def _initial_bucket(self, traj: TrajectoryInfo, view: ClusterView) -> tuple[int, str]:
        """Bucket index and reason for a new trajectory; the default is the smallest bucket."""
        return 0, "initial"

    def _decide(self, track: Track, ret: ToolReturn, view: ClusterView) -> tuple[int, str]:
        """Target bucket index and reason after a tool return; the default keeps the current bucket."""
        return view.bucket_index(track.bucket), "stay"

    def _learn(self, track: Track, total_output_tokens: int) -> None:
        """Called by :meth:`finish` with the finished trajectory's track."""
        return None

    # -- Router API ---------------------------------------------------------------------------------

    @property
    def active_trajectories(self) -> int:
        return len(self._tracks)

    def bucket_of(self, traj_id: str) -> str:
        """Logical bucket of a live trajectory; raises :class:`RoutingError` if unknown."""
        return self._track(traj_id).bucket

    def start(self, traj: TrajectoryInfo, view: ClusterView) -> RouteDecision:
        """Place a new trajectory's first turn. Raises :class:`RoutingError` if ``traj_id`` is already live."""
        if traj.traj_id in self._tracks:
            raise RoutingError(f"trajectory {traj.traj_id!r} already started")
        idx, reason = self._initial_bucket(traj, view)
        track = Track(traj, view.buckets[idx].name, view.buckets[idx].max_tokens, context=traj.prompt_tokens)
        decision = self._assign(track, self._place(view, idx), reason, track.context, view)
        self._tracks[traj.traj_id] = track
        return decision

    def on_tool_return(self, traj_id: str, ret: ToolReturn, view: ClusterView) -> RouteDecision:
        """Record the tool return (the track's position, generated, payload and context are updated before
        :meth:`_decide` sees it), decide the target bucket, and place the next turn."""
        track = self._track(traj_id)
        if ret.position < track.tool_position:
            raise RoutingError(
                f"trajectory {traj_id!r}: tool return position {ret.position} < previous {track.tool_position}"
            )
        track.tool_position = ret.position
        generated = max(track.generated, ret.position)
        resp = max(response_position(ret, track.info.prompt_tokens, track.payload), generated + track.payload)
        self._sync_bucket(track, view)
        track.positions.append(resp)
        track.generated = generated
        track.payload = resp - generated
        track.context = max(ret.context_tokens, track.info.prompt_tokens + track.response)
        target, reason = self._decide(track, ret, view)
        return self._move_or_stay(track, target, reason, track.context, view)

    def on_turn_end(self, traj_id: str, generated_tokens: int) -> None:
        """Note the trajectory's cumulative generated tokens after a turn."""
        track = self._track(traj_id)
        check_int(f"trajectory {traj_id!r}: generated_tokens", generated_tokens, 0, RoutingError)
        track.generated = max(track.generated, generated_tokens)
        track.context = max(track.context, track.info.prompt_tokens + track.response)

    def finish(self, traj_id: str, total_output_tokens: int) -> None:
        """Forget a finished trajectory after letting the router learn from it.

        ``total_output_tokens`` is its response length (generated + tool-returned tokens); :meth:`_learn`
        gets it raised to at least the response tokens this router saw, so it is never below a position.
        """
        track = self._tracks.pop(traj_id, None)
        if track is None:
            raise RoutingError(f"unknown trajectory {traj_id!r} (not started, or already finished)")
        total = total_output_tokens
        if not isinstance(total, bool) and isinstance(total, int) and total >= 0:
            total = max(total, track.response, track.positions[-1] if track.positions else 0)
        self._learn(track, total)

    def discard(self, traj_id: str) -> None:
        """Forget a trajectory without learning from it; unknown ids are ignored."""
        self._tracks.pop(traj_id, None)

    def reroute(self, traj_id: str, view: ClusterView) -> RouteDecision:
        """Place again a queued trajectory, or one whose instance is gone; otherwise it stays where it is."""
        track = self._track(traj_id)
        return self._move_or_stay(track, self._sync_bucket(track, view), "reroute", track.context, view)

    def on_step(self, step: int) -> None:
        return None

    # -- internals ----------------------------------------------------------------------------------

    def _track(self, traj_id: str) -> Track:
        track = self._tracks.get(traj_id)
        if track is None:
            raise RoutingError(f"unknown trajectory {traj_id!r} (not started, or already finished)")
        return track

    def _sync_bucket(self, track: Track, view: ClusterView) -> int:
        """Index of the track's bucket; a bucket missing from the view (re-planned away) is re-mapped to the
        bucket its old threshold falls in."""
        if not view.has_bucket(track.bucket):
            track.set_bucket(bucket_for(track.bucket_max, view.buckets))
        return view.bucket_index(track.bucket)

    def _place(self, view: ClusterView, target: int, fallback: bool = True) -> InstanceView | None:
        return place(view, target, max_queue_length=self.max_queue_length, cap_metric=self.cap_metric,
                     when_full=self.when_full, fallback=fallback)

    def _room_in(self, view: ClusterView, target: int) -> InstanceView | None:
        name = view.buckets[target].name
        cands = [i for i in view.instances
                 if i.ready and i.bucket == name and has_room(i, self.max_queue_length, self.cap_metric)]
        return least_loaded(cands, view)

    def _assign(self, track: Track, dst: InstanceView | None, reason: str, seq_len: int, view: ClusterView,
                migrated: bool = False) -> RouteDecision:
        """Point ``track`` at ``dst`` (``None``: queue) and build the decision, choosing how the context moves."""
        if dst is None:
            track.queued = True
            return RouteDecision(None, track.bucket, reason, migrated=migrated)
        mode: MigrateMode | None = None
        if track.instance is not None and dst.id != track.instance:
            home = view.instance(track.instance)
            if home is None or not home.ready:
                mode = "reprefill"  # the KV cache is unreachable (instance gone or not ready)
            else:
                same_node = home.node is not None and home.node == dst.node
                mode = self.choose_mode(MigrationQuery(seq_len, same_node,
                                                       view.buckets[view.bucket_index(home.bucket)].tp,
                                                       view.buckets[view.bucket_index(dst.bucket)].tp))
        track.instance, track.queued = dst.id, False
        return RouteDecision(dst.id, track.bucket, reason, migrated=migrated, migrate_mode=mode,
                             placed_bucket=dst.bucket)

    def _move_or_stay(self, track: Track, target: int, reason: str, seq_len: int, view: ClusterView) -> RouteDecision:
        """Apply a bucket decision; the context moves only into the target bucket itself.

        When the target bucket has no room the context stays on its home instance (reason
        ``target_bucket_full``). With :attr:`commit_when_full` the logical bucket still becomes the target and
        the move is retried at the next tool return (``pending_move``); without it the logical bucket stays and
        the router decides afresh at the next tool return.
        """
        home = view.instance(track.instance) if track.instance is not None else None
        home_usable = home is not None and home.ready
        changed = target != view.bucket_index(track.bucket)
        if not home_usable:
            if changed:
                track.set_bucket(view.buckets[target])
            track.pending_move = False
            return self._assign(track, self._place(view, target), reason, seq_len, view, migrated=changed)
        assert home is not None
        if not changed and (home.bucket == track.bucket or not track.pending_move):
            track.pending_move = False
            return self._assign(track, home, reason, seq_len, view)
        dst = self._room_in(view, target)
        if dst is None:
            if changed and self.commit_when_full:
                track.set_bucket(view.buckets[target])
                track.pending_move = True
            return self._assign(track, home, "target_bucket_full", seq_len, view,
                                migrated=changed and self.commit_when_full)
        deferred = track.pending_move and not changed
        track.set_bucket(view.buckets[target])
        track.pending_move = False
        return self._assign(track, dst, "migrate" if deferred else reason, seq_len, view, migrated=True)
