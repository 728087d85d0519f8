"""The simulator's GRPO batch former: which groups start rolling out, and which complete groups each
training step consumes (:class:`BatchFormer`, driven by :class:`~libra.sim.engine.Simulator`).

Two execution models (``SimConfig.batching``):

- ``"streaming"`` (default; Libra's, docs/papers.md §1.7): the rule of :mod:`libra.policies.batching`,
  the same functions the runtime's :class:`~libra.broker.job_groups.JobState` uses. A group starts while
  ``admitted < (eta + version + 1) * B`` and fewer than ``max_concurrent`` groups are running
  (``version`` = training steps finished, ``B`` = groups per batch, ``eta`` = ``SimConfig.eta``,
  ``max_concurrent`` = ``SimConfig.max_concurrent`` or ``2 * B``); training step ``k`` takes the first
  ``B_k`` complete groups by creation order (``B_k`` = the groups of the trace's step ``k``), whichever
  trace step they were generated for: the long tail lands in a later batch instead of holding back its own.
- ``"barrier"`` (the earlier model, kept for comparison; always used by the synchronous ``colocated``
  layout): the groups of trace step ``k`` start together once ``k < version + lag`` and training step ``k``
  takes exactly them, when all are complete.

Groups are keyed by ``TrajectorySpec.group``, in trace order (step, then first appearance). A group starts
all its samples at once; its version is the training version when it started (the oldest turn of each of its
trajectories). :attr:`BatchFormer.staleness` keeps, per training step, the staleness of every trajectory
consumed (version at consumption minus the group's version).

Pure bookkeeping: no clock, no events.
"""

from __future__ import annotations

from collections.abc import Sequence

from libra.policies.batching import admission_room, first_complete
from libra.traces import TrajectorySpec

__all__ = ["BATCHING_MODES", "BatchFormer"]

BATCHING_MODES = ("streaming", "barrier")


class BatchFormer:
    """See the module docstring. ``by_step``: the trace's trajectories grouped by step, in step order."""

    def __init__(self, by_step: Sequence[Sequence[TrajectorySpec]], mode: str = "streaming", eta: int = 2,
                 max_concurrent: int | None = None, lag: int = 1) -> None:
        if mode not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {BATCHING_MODES}, got {mode!r}")
        self.mode = mode
        self.eta = eta
        self.lag = lag
        self.groups: list[list[TrajectorySpec]] = []
        self.step_of: list[int] = []  # trace step index of each group
        self.sizes: list[int] = []  # groups per trace step = groups per training batch
        for k, specs in enumerate(by_step):
            keyed: dict[str, list[TrajectorySpec]] = {}
            for t in specs:
                keyed.setdefault(t.group, []).append(t)
            self.groups.extend(keyed.values())
            self.step_of.extend([k] * len(keyed))
            self.sizes.append(len(keyed))
        n = len(self.groups)
        self.batch = max(1, round(n / max(1, len(self.sizes))))
        self.max_concurrent = max_concurrent if max_concurrent is not None else 2 * self.batch
        self.gid_of = {t.id: g for g, grp in enumerate(self.groups) for t in grp}
        self.admitted = 0  # groups started (creation order = id order)
        self.running = 0  # started, not complete
        self.left = [len(g) for g in self.groups]  # samples still rolling out
        self.version_of: list[int] = [-1] * n  # training version when each group started
        self.complete: list[int] = []  # complete groups not yet consumed
        self.batches: list[list[int]] = []  # groups consumed by each training step
        self.staleness: list[list[int]] = []  # per training step: staleness of every trajectory consumed

    # ------------------------------------------------------------------ admission
    def admit(self, version: int) -> list[int]:
        """Start every group the rule allows at training ``version``; returns their ids (in order)."""
        n = len(self.groups)
        if self.mode == "barrier":
            stop = self.admitted
            while stop < n and self.step_of[stop] < version + self.lag:
                stop += 1
            room = stop - self.admitted
        else:
            room = min(n - self.admitted, admission_room(version, self.eta, self.batch, self.admitted,
                                                         self.running, self.max_concurrent))
        out = list(range(self.admitted, self.admitted + room))
        for g in out:
            self.version_of[g] = version
        self.admitted += room
        self.running += room
        return out

    # ------------------------------------------------------------------ results
    def done(self, traj_id: str) -> bool:
        """One trajectory finished; True when its group became complete."""
        g = self.gid_of[traj_id]
        self.left[g] -= 1
        if self.left[g] == 0:
            self.running -= 1
            self.complete.append(g)
            return True
        return False

    def cut(self, version: int) -> list[TrajectorySpec] | None:
        """The batch of training step ``version`` (its trajectories), or None while it is not ready. Records
        the batch and its staleness; call only when the step will start now."""
        k = version
        if k >= len(self.sizes):
            return None
        if self.mode == "barrier":
            mine = [g for g in self.complete if self.step_of[g] == k]
            picked = sorted(mine) if len(mine) == self.sizes[k] else None
        else:
            picked = first_complete(self.complete, self.sizes[k])
        if picked is None:
            return None
        chosen = set(picked)
        self.complete = [g for g in self.complete if g not in chosen]
        self.batches.append(picked)
        self.staleness.append([version - self.version_of[g] for g in picked for _ in self.groups[g]])
        return [t for g in picked for t in self.groups[g]]

    def batch_specs(self, k: int) -> list[TrajectorySpec]:
        """The trajectories training step ``k`` consumed."""
        return [t for g in self.batches[k] for t in self.groups[g]]

    def step_staleness(self) -> list[dict[str, float]]:
        """Per training step: mean and max staleness of the trajectories it consumed."""
        return [{"mean": sum(s) / len(s) if s else 0.0, "max": float(max(s, default=0))} for s in self.staleness]
