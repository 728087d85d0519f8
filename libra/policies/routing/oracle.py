"""``oracle``: the placement upper-bound baseline (simulator only): it knows each trajectory's true remaining
response length, and sees the same cluster view (per-instance load, room) as every other router.

Two placements (``placement``):

- ``"cost"`` (the default): the decision rule of ``cmlfq_cost``
  (:class:`~libra.policies.routing.cmlfq_cost.CostCMLFQRouter`) with the prefix tree's distribution of remaining
  lengths replaced by the truth, a point mass at ``true_remaining``. At ``start`` the candidates are the
  least-loaded instance with room of every bucket, each charged the prompt's prefill there; after each tool
  return the home instance (no movement) and the least-loaded instance with room of every other bucket,
  each charged the move (KV transfer or re-prefill, by ``choose_mode``). It picks the one with the least
  expected seconds to decode the true remaining tokens at that instance's load (the cost arithmetic, the
  learned per-turn shape and ``min_gain_s`` are ``cmlfq_cost``'s). With no candidate (nothing has room)
  it asks for the bucket of the true length, which the base class places with its usual fallbacks. So it
  differs from ``cmlfq_cost`` only in knowing the length: a length-oracle of the same placement rule.
- ``"bucket"``: the bucket of the true remaining length at ``start``, then stays (sticky, no load
  information beyond the base class's least-loaded instance inside that bucket and its fallbacks when the
  bucket is full); with ``follow=True`` it also moves to the bucket of ``ToolReturn.true_remaining`` after
  each tool return. This was the ``oracle`` until issue #17: placing by the length's bucket alone is no
  upper bound when that bucket's instances are saturated (measured in ``libra.bench.calibration``'s oracle
  check), and without ``follow`` it decides on the *total* length while routing accuracy scores the bucket
  of the length still to come after the first tool return. The simulation's ``noisy_predictor`` is this
  placement given a noisy total at T=0.

Raises :class:`~libra.policies.routing.interface.RoutingError` when a trajectory or tool return lacks
``true_remaining`` where the placement needs it. Pure: no I/O, clocks or threads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from libra.policies.routing.cmlfq_cost import CostCMLFQRouter, RouterCosts
from libra.policies.routing.interface import (
    CapMetric,
    ClusterView,
    ClusterViewError,
    InstanceView,
    MigrateMode,
    MigrationQuery,
    RoutingError,
    ToolReturn,
    TrajectoryInfo,
    WhenFull,
    bucket_index_for,
    heuristic_migrate_mode,
)
from libra.policies.routing.sticky import Track

__all__ = ["OracleRouter", "Placement"]

Placement = Literal["cost", "bucket"]


class OracleRouter(CostCMLFQRouter):
    """Knows the true remaining length (simulator only); see the module docstring.

    Parameters: ``placement`` (``"cost"`` or ``"bucket"``), ``follow`` (``"bucket"`` only: move to the bucket
    of the true remaining length after each tool return), and ``cmlfq_cost``'s cost parameters (``costs``,
    ``hardware``/``model``, ``min_gain_s``, the per-turn shape priors and ``learn_after``). Raises
    :class:`ClusterViewError` for bad values.
    """

    name = "oracle"
    commit_when_full = False  # the logical bucket moves with the context (as cmlfq_cost)

    def __init__(self, *, placement: Placement = "cost", follow: bool = False, costs: RouterCosts | None = None,
                 hardware: str = "a800", model: str = "qwen3-14b", min_gain_s: float = 0.0,
                 gen_per_turn: float = 512.0, payload_per_turn: float = 1000.0, gen_share: float = 0.5,
                 learn_after: int = 16, max_queue_length: int = 3, cap_metric: CapMetric = "queued",
                 when_full: WhenFull = "overflow",
                 choose_mode: Callable[[MigrationQuery], MigrateMode] = heuristic_migrate_mode) -> None:
        if placement not in ("cost", "bucket"):
            raise ClusterViewError(f"oracle placement must be 'cost' or 'bucket', got {placement!r}")
        if follow and placement != "bucket":
            raise ClusterViewError("oracle follow=True applies to placement='bucket' only "
                                   "(placement='cost' decides again at every tool return)")
        super().__init__(costs=costs, hardware=hardware, model=model, initial="cost", min_gain_s=min_gain_s,
                         gen_per_turn=gen_per_turn, payload_per_turn=payload_per_turn, gen_share=gen_share,
                         learn_after=learn_after, max_queue_length=max_queue_length, cap_metric=cap_metric,
                         when_full=when_full, choose_mode=choose_mode)
        self.placement: Placement = placement
        self.follow = bool(follow)
        self._overflow_to: InstanceView | None = None  # the instance an ``oracle_overflow`` start goes to

    def _learn(self, track: Track, total_output_tokens: int) -> None:
        # Only the per-turn shape the cost rule uses; the oracle has no use for the prefix tree.
        s = self._sums
        s[0] += 1
        s[1] += len(track.positions) + 1
        s[2] += track.generated
        s[3] += track.payload
        s[4] += max(total_output_tokens, track.generated)

    def on_step(self, step: int) -> None:
        return None  # no tree to rebuild

    def describe(self) -> dict[str, Any]:
        return {"router": self.name, "placement": self.placement, "follow": self.follow,
                "active_trajectories": self.active_trajectories}

    def _initial_bucket(self, traj: TrajectoryInfo, view: ClusterView) -> tuple[int, str]:
        if traj.true_remaining is None:
            raise RoutingError(f"oracle router needs TrajectoryInfo.true_remaining (trajectory {traj.traj_id!r})")
        truth = bucket_index_for(traj.true_remaining, view.buckets)
        if self.placement == "bucket":
            return truth, "oracle"
        cands = [i for i in (self._room_in(view, b) for b in range(len(view.buckets))) if i is not None]
        reason = "oracle_cost"
        if not cands:
            if self.when_full != "overflow":
                return truth, "oracle_no_room"
            # Nothing has room and overflow is allowed (every router then takes the globally least-loaded
            # instance): the oracle overflows to the ready instance where the true length finishes soonest.
            cands, reason = [i for i in view.instances if i.ready], "oracle_overflow"
            if not cands:
                return truth, "oracle_no_room"
        track = Track(traj, view.buckets[0].name, view.buckets[0].max_tokens, context=traj.prompt_tokens)
        best = self._choose(track, [(1.0, float(traj.true_remaining))], None, cands, view,
                            lambda i: self.costs.prefill(self._tp(i, view), traj.prompt_tokens))
        self._overflow_to = best if reason == "oracle_overflow" else None
        return view.bucket_index(best.bucket), reason

    def _place(self, view: ClusterView, target: int, fallback: bool = True) -> InstanceView | None:
        pick, self._overflow_to = self._overflow_to, None
        return pick if pick is not None else super()._place(view, target, fallback)

    def _decide(self, track: Track, ret: ToolReturn, view: ClusterView) -> tuple[int, str]:
        current = view.bucket_index(track.bucket)
        if self.placement == "bucket" and not self.follow:
            return current, "oracle"
        if ret.true_remaining is None:
            raise RoutingError(f"oracle router needs ToolReturn.true_remaining at each tool return with "
                               f"placement={self.placement!r}, follow={self.follow} "
                               f"(trajectory {track.info.traj_id!r})")
        truth = bucket_index_for(ret.true_remaining, view.buckets)
        if self.placement == "bucket":
            return truth, "oracle"
        home, usable, cands = self._candidates(track, view, current)
        if not cands:
            return truth, "oracle_no_room"
        best = self._choose(track, [(1.0, float(ret.true_remaining))], usable, cands, view,
                            lambda i: self.movement_seconds(track.context, home, i, view))
        if usable is not None and best.id == usable.id:
            return current, "stay_cheaper"
        return view.bucket_index(best.bucket), "oracle_cost"
