"""Pure RL job state: admission under the policy-lag bound, GRPO groups, batch cutting, versions.

Hosted by the broker's job host (:mod:`libra.broker.job_host`).

No I/O, no clocks, no asyncio: the job host feeds it events and does what it says. Tested on its own.

Contracts:

- Group ``g`` (0-based, in admission order) is *nominally* trained in step ``g // prompts_per_step``.
  :meth:`JobState.admit` hands out a new group only while ``g // prompts_per_step <= version +
  max_policy_lag``, where ``version`` is the published policy version (``0`` before the first step,
  ``k`` after ``k`` steps). Rollout therefore runs ahead of training by at most ``max_policy_lag``
  steps and never waits otherwise (``max_policy_lag = 0`` is synchronous, on-policy GRPO).
- A trajectory's version is the *oldest* weights version of any of its turns. A group's version is the
  oldest of its trajectories. The policy lag of a group trained at version ``v`` is ``v - group
  version``.
- :meth:`cut_batch` returns the oldest (by creation) ``prompts_per_step`` complete groups whose lag would
  be within the bound, or ``None``; complete groups already beyond the bound are dropped (counted in
  ``dropped_groups``) and their slots re-admitted, so every trained turn's lag is <= the bound.
- One batch is in training at a time; :meth:`step_done` publishes the next version.
- Zero-variance filter (``filter_zero_variance``; DAPO's dynamic sampling): a group that completes with
  every reward equal carries no advantage; it is dropped (``filtered_groups``, not ``dropped_groups``) and
  its slot re-admitted with the next prompt, at most ``max_extra_groups`` times per step (the window
  between two published versions). Past that bound such groups are batched as they are, so a step never
  waits for signal that may not come; the job host reports when a step has none. With or without the
  filter, ``window`` counts the groups completed and those with zero variance since the last step.
- Admission and batch selection are the shared rule of :mod:`libra.policies.batching` (the simulator's
  batch former uses the same functions); the drop of over-stale groups is this runtime's own filter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from libra.policies.batching import admission_room, first_complete

__all__ = ["Group", "JobState", "Trajectory", "zero_variance"]


@dataclass(slots=True)
class Trajectory:
    """One finished episode as the job state sees it: the tensors stay with the episode runner that made
    them; ``ref`` is the data-plane ref a trainer rank fetches them from (``None`` in pure tests)."""

    group: int
    index: int
    tokens: int  # sequence length (prompt + generated + tool tokens): what dispatch balances
    gen_tokens: int
    reward: float
    versions: list[int]  # weights version of every generated turn
    ref: dict[str, Any] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    admitted_at: float = 0.0  # broker clock: when its episode work was created ...
    done_at: float = 0.0  # ... and when its result came back

    @property
    def min_version(self) -> int:
        return min(self.versions) if self.versions else 0


@dataclass(slots=True)
class Group:
    gid: int
    prompt: Any
    size: int
    trajs: list[Trajectory] = field(default_factory=list)
    failed: int = 0

    @property
    def complete(self) -> bool:
        return len(self.trajs) + self.failed >= self.size

    @property
    def min_version(self) -> int:
        return min((t.min_version for t in self.trajs), default=0)


def zero_variance(g: Group) -> bool:
    """Whether ``g`` has at least two trajectories and all their rewards are equal (no GRPO signal)."""
    return len(g.trajs) >= 2 and len({t.reward for t in g.trajs}) == 1


class JobState:
    """See the module contracts. ``steps`` optimisation steps of ``prompts_per_step`` groups each."""

    def __init__(self, steps: int, prompts_per_step: int, group_size: int, max_policy_lag: int, *,
                 filter_zero_variance: bool = False, max_extra_groups: int = 8) -> None:
        if steps < 1 or prompts_per_step < 1 or group_size < 1 or max_policy_lag < 0:
            raise ValueError("steps, prompts_per_step, group_size must be >= 1 and max_policy_lag >= 0")
        self.steps = steps
        self.per_step = prompts_per_step
        self.group_size = group_size
        self.max_lag = max_policy_lag
        self.version = 0
        self.steps_done = 0
        self.training = False
        self.admitted = 0  # groups handed out (including dropped ones)
        self.dropped_groups = 0
        self.filter_zero_variance = filter_zero_variance
        self.max_extra_groups = max_extra_groups
        self.filtered_groups = 0  # zero-variance groups dropped by the filter (their slots re-admitted)
        self.window = {"completed": 0, "zero_variance": 0, "filtered": 0}  # since the last published version
        self.groups: dict[int, Group] = {}
        self._complete: list[int] = []

    # ------------------------------------------------------------------ admission
    def can_admit(self) -> bool:
        live = self.admitted - self.dropped_groups - self.filtered_groups
        if live >= self.steps * self.per_step:
            return False
        return admission_room(self.version, self.max_lag, self.per_step, live) > 0

    def admit(self, prompt: Any) -> Group:
        """Start a new group for ``prompt``; raises RuntimeError when the lag bound says wait."""
        if not self.can_admit():
            raise RuntimeError("admission refused: the policy-lag bound or the step count says wait")
        g = Group(self.admitted, prompt, self.group_size)
        self.groups[g.gid] = g
        self.admitted += 1
        return g

    # ------------------------------------------------------------------ results
    def add(self, traj: Trajectory) -> bool:
        """Record a finished trajectory; True when its group became complete."""
        g = self.groups[traj.group]
        g.trajs.append(traj)
        return self._maybe_complete(g)

    def fail(self, gid: int) -> bool:
        """An episode of group ``gid`` failed (engine or tool error); the group goes on smaller."""
        g = self.groups[gid]
        g.failed += 1
        return self._maybe_complete(g)

    def _maybe_complete(self, g: Group) -> bool:
        if not g.complete:
            return False
        flat = zero_variance(g)
        self.window["completed"] += 1
        self.window["zero_variance"] += flat
        if flat and self.filter_zero_variance and self.window["filtered"] < self.max_extra_groups:
            self.window["filtered"] += 1
            self.filtered_groups += 1
            del self.groups[g.gid]
            return False
        self._complete.append(g.gid)
        return True

    def lag_of(self, g: Group) -> int:
        return self.version - g.min_version

    def cut_batch(self) -> list[Group] | None:
        """The next batch of groups to train on at ``version`` (see contracts), or None."""
        if self.training or self.steps_done >= self.steps:
            return None
        keep: list[int] = []
        for gid in self._complete:
            g = self.groups[gid]
            if len(g.trajs) < 2 or self.lag_of(g) > self.max_lag:
                self.dropped_groups += 1  # too stale, or nothing to compare within the group
                del self.groups[gid]
            else:
                keep.append(gid)
        self._complete = keep
        picked = first_complete(keep, self.per_step)
        if picked is None:
            return None
        batch = [self.groups.pop(gid) for gid in picked]
        chosen = set(picked)
        self._complete = [gid for gid in keep if gid not in chosen]
        self.training = True
        return batch

    def step_done(self, new_version: int) -> None:
        """The batch in training produced ``new_version`` (must be the next version)."""
        if not self.training:
            raise RuntimeError("step_done without a batch in training")
        if new_version != self.version + 1:
            raise RuntimeError(f"trainer published version {new_version}, expected {self.version + 1}")
        self.training = False
        self.version = new_version
        self.steps_done += 1
        self.window = {"completed": 0, "zero_variance": 0, "filtered": 0}

    def step_failed(self) -> None:
        """The batch in training was lost; its groups are counted as dropped and re-admitted."""
        if not self.training:
            raise RuntimeError("step_failed without a batch in training")
        self.training = False
        self.dropped_groups += self.per_step

    @property
    def finished(self) -> bool:
        return self.steps_done >= self.steps
