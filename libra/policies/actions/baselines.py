"""Baseline action schedulers behind the same API as ``tangram`` (docs/papers.md §2.4 ablation, §4 item 15).

- ``fixed_dop`` (:class:`FixedDoPScheduler`): FCFS over the queue; every elastic action asks for exactly
  ``dop`` units of its key resource (clamped to its own range and allowed sizes) and waits until they are
  free. With ``backfill=True`` (default, like tangram's window) later actions that fit may start while an
  earlier one waits; with ``backfill=False`` the head of the queue blocks everyone (strict FIFO).
- ``per_trajectory`` (:class:`PerTrajectoryScheduler`): a Kubernetes-style dedicated sandbox per live
  trajectory. On a trajectory's first action a sandbox of ``sandbox[kind]`` units is reserved for every
  resource kind named in ``sandbox`` (e.g. ``{"cpu": 4}``) and held until :meth:`trajectory_finished`,
  idle or not. Its actions run inside it (granted the whole sandbox) and never queue behind other
  trajectories; a trajectory whose first action finds no room waits for a whole sandbox to be freed. If the
  demanded place (``cpu@n03``) is full, the sandbox goes to the place of the same kind with most free units
  (a pod is scheduled wherever it fits). Resource kinds not in ``sandbox`` (quotas, services, GPUs) are taken
  per action, FCFS.

State: ``fixed_dop`` holds only parameters. ``per_trajectory`` holds its reservations; mutation rule: a
sandbox is created only inside :meth:`PerTrajectoryScheduler.schedule` (when it grants a trajectory's first
action) and removed only by :meth:`PerTrajectoryScheduler.trajectory_finished`. No I/O, clocks or threads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from libra.policies.actions.model import ActionSpec, Grant, resource_kind
from libra.policies.actions.views import RunningSet, RunningView, held_units, scan_order

__all__ = ["FixedDoPScheduler", "PerTrajectoryScheduler"]


def _fixed_units(spec: ActionSpec, dop: int) -> int:
    """``dop`` clamped into the action's range, rounded down to an allowed size."""
    m = min(max(dop, spec.min_units), spec.max_units)
    while m > spec.min_units and math.isinf(spec.durations[m]):
        m -= 1
    return m


class FixedDoPScheduler:
    """``fixed_dop``: FCFS with a fixed DoP per elastic action (``dop`` 4 or 16 in the paper's ablation).

    ``window`` bounds the grants per decision and ``max_scan`` the queue entries read (default ``4·window``).
    Raises ``ValueError`` for a bad parameter.
    """

    name = "fixed_dop"

    def __init__(self, *, dop: int = 4, window: int = 64, max_scan: int | None = None, backfill: bool = True) -> None:
        for pname, val in (("dop", dop), ("window", window)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"fixed_dop: {pname} must be an integer >= 1, got {val!r}")
        max_scan = 4 * window if max_scan is None else max_scan
        if isinstance(max_scan, bool) or not isinstance(max_scan, int) or max_scan < 1:
            raise ValueError(f"fixed_dop: max_scan must be an integer >= 1, got {max_scan!r}")
        self.dop = dop
        self.window = window
        self.max_scan = max_scan
        self.backfill = bool(backfill)

    def trajectory_finished(self, trajectory: str, now: float) -> None:
        """No per-trajectory state."""

    def schedule(
        self,
        queue: Sequence[ActionSpec],
        free: Mapping[str, int],
        running: Sequence[RunningView],
        now: float,
    ) -> list[Grant]:
        """Grant queued actions in FCFS order at the fixed DoP while they fit (see the module docstring)."""
        avail = dict(free)
        grants: list[Grant] = []
        dop, limit, window = self.dop, self.max_scan, self.window
        pos = 0
        for spec in scan_order(queue, free) if self.backfill else queue:
            if pos >= limit or len(grants) >= window:
                break
            pos += 1
            key = spec.key
            if key is not None and spec.max_units > spec.min_units:
                units = dict(spec.demand)
                units[key] = _fixed_units(spec, dop)
                items = units.items()
            else:
                units = spec.demand  # type: ignore[assignment]
                items = spec.items  # type: ignore[assignment]
            for r, u in items:
                if avail.get(r, 0) < u:
                    break
            else:
                for r, u in items:
                    avail[r] -= u
                grants.append(Grant(spec.id, units))
                continue
            if not self.backfill:
                break
        return grants


class PerTrajectoryScheduler:
    """``per_trajectory``: one dedicated sandbox per live trajectory, reserved from its first action to its end.

    ``sandbox`` maps resource kinds to sandbox size (default ``{"cpu": 4}``). ``max_scan`` bounds queue
    entries read per decision. Raises ``ValueError`` for a bad parameter.
    """

    name = "per_trajectory"

    def __init__(self, *, sandbox: Mapping[str, int] | None = None, max_scan: int = 4096) -> None:
        sb = dict(sandbox) if sandbox is not None else {"cpu": 4}
        for kind, units in sb.items():
            if not isinstance(kind, str) or not kind or "@" in kind:
                raise ValueError(f"per_trajectory: sandbox keys are resource kinds like 'cpu', got {kind!r}")
            if isinstance(units, bool) or not isinstance(units, int) or units < 1:
                raise ValueError(f"per_trajectory: sandbox[{kind!r}] must be an integer >= 1, got {units!r}")
        if isinstance(max_scan, bool) or not isinstance(max_scan, int) or max_scan < 1:
            raise ValueError(f"per_trajectory: max_scan must be an integer >= 1, got {max_scan!r}")
        self.sandbox = sb
        self.max_scan = max_scan
        self._pods: dict[str, dict[str, int]] = {}
        self._reserved: dict[str, int] = {}

    @property
    def reservations(self) -> Mapping[str, Mapping[str, int]]:
        """Live sandboxes: trajectory → reserved units per resource (read-only view)."""
        return self._pods

    def reserved_units(self) -> dict[str, int]:
        """Total units reserved by sandboxes, per resource (maintained incrementally; a copy)."""
        return {r: u for r, u in self._reserved.items() if u}

    def trajectory_finished(self, trajectory: str, now: float) -> None:
        """Release the trajectory's sandbox (no-op if it never got one)."""
        pod = self._pods.pop(trajectory, None)
        if pod:
            for r, u in pod.items():
                self._reserved[r] -= u

    def _pod_for(
        self, spec: ActionSpec, pod: Mapping[str, int], spare: Mapping[str, int]
    ) -> tuple[dict[str, int], dict[str, int]] | None:
        """The sandbox ``spec`` needs, starting from ``pod`` (empty for a new trajectory), and the extra units
        to take from ``spare``; ``None`` if it does not fit anywhere.

        A kind already in the sandbox grows in place when the action needs more than it holds; a new kind is
        placed on the demanded place, else on the place of that kind with most spare units.
        """
        out = dict(pod)
        delta: dict[str, int] = {}
        for r, u in spec.items:
            kind = resource_kind(r)
            size = self.sandbox.get(kind)
            if size is None:
                continue
            have = next((r2 for r2 in out if resource_kind(r2) == kind), None)
            if have is not None:
                if out[have] < u:
                    grow = u - out[have]
                    if spare.get(have, 0) - delta.get(have, 0) < grow:
                        return None
                    delta[have] = delta.get(have, 0) + grow
                    out[have] = u
                continue
            size = max(size, u)
            place = r if spare.get(r, 0) - delta.get(r, 0) >= size else None
            if place is None:
                best_free = -1
                for r2, free2 in spare.items():
                    free2 -= delta.get(r2, 0)
                    if free2 >= size and free2 > best_free and resource_kind(r2) == kind:
                        place, best_free = r2, free2
            if place is None:
                return None
            out[place] = size
            delta[place] = delta.get(place, 0) + size
        return out, delta

    def schedule(
        self,
        queue: Sequence[ActionSpec],
        free: Mapping[str, int],
        running: Sequence[RunningView],
        now: float,
    ) -> list[Grant]:
        """Run actions of trajectories with a sandbox inside it; create sandboxes FCFS while they fit.

        ``free`` is what no running action holds; idle sandboxes are subtracted here (they stay reserved).
        """
        pods = self._pods
        spare = dict(free)
        # Idle sandboxes are reserved, not free. Every running action holding a sandbox kind runs in its
        # sandbox and holds all of it, so spare = free + held - reserved for those resources.
        for r, u in self._reserved.items():
            spare[r] = spare.get(r, 0) + held_units(running, r) - u
        if isinstance(running, RunningSet):
            is_busy = running.has_trajectory
        else:
            busy_set = {v.trajectory for v in running}
            is_busy = busy_set.__contains__
        grants: list[Grant] = []
        started: set[str] = set()
        waiting_pod = False
        sandbox = self.sandbox
        # Sandboxed kinds are never skipped: an action may run in its idle sandbox whatever is free.
        for pos, spec in enumerate(scan_order(queue, spare, tuple(sandbox))):
            if pos >= self.max_scan:
                break
            traj = spec.trajectory
            if traj in started:
                continue  # one action at a time per sandbox
            pod = pods.get(traj)
            if pod is None and waiting_pod:
                continue  # sandboxes are handed out FCFS: an earlier trajectory is still waiting for one
            # Per-action resources (kinds without a sandbox) must fit first: cheap, and most queued actions
            # in a congested queue fail here.
            units: dict[str, int] = {}
            boxed = False
            fits = True
            for r, u in spec.items:
                if resource_kind(r) in sandbox:
                    boxed = True
                elif spare.get(r, 0) < u:
                    fits = False
                    break
                else:
                    units[r] = u
            if not fits:
                continue
            delta: dict[str, int] = {}
            if boxed or pod is not None:
                if pod is not None and is_busy(traj):
                    continue  # one action at a time per sandbox
                fit = self._pod_for(spec, pod or {}, spare)
                if fit is None:
                    if pod is None:
                        waiting_pod = True
                    continue
                pod, delta = fit
                pods[traj] = pod
                for r, u in delta.items():
                    spare[r] -= u  # an idle sandbox's units are already out of spare; only growth is new
                    self._reserved[r] = self._reserved.get(r, 0) + u
                units.update(pod)
            for r, u in units.items():
                if r not in delta and (pod is None or r not in pod):
                    spare[r] -= u
            grants.append(Grant(spec.id, units))
            started.add(traj)
        return grants
