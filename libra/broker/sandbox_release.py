"""Which action actors hold a sandbox of which trajectory, and what each must release. Pure; ``actions.py`` asks it.

An action actor keeps a trajectory's sandbox (its workspace, a warm zygote) between that trajectory's tool calls
(:class:`~libra.engines.sandbox.pool.SandboxPool`), and only the broker learns when the trajectory ends (the
client's ``EndTrajectory``). The broker remembers the actors a trajectory's sandbox tool calls ran on
(:meth:`SandboxReleases.ran`); when it ends (:meth:`finished`) its id is queued for each of them, and the next
sandbox tool call placed on that actor carries the queue in its route (:meth:`take`,
``ActionRoute.release``): the actor's pool retires those sandboxes in the background before they would have
to be evicted under pressure. No message of its own: an actor that gets no further sandbox call keeps the
sandboxes until its pool's idle TTL, as before. Everything here is bounded (the oldest entries are dropped).
"""

from __future__ import annotations

from collections import OrderedDict, deque

__all__ = ["SANDBOX_TOOLS", "SandboxReleases"]

#: The built-in tools that run in a trajectory's sandbox (a user tool declared ``sandboxed`` does too).
SANDBOX_TOOLS = frozenset({"python", "bash", "pytest"})


class SandboxReleases:
    """Trajectory -> actors holding its sandbox, and per actor the finished trajectories to release."""

    def __init__(self, trajectories: int = 100_000, per_actor: int = 4096, per_route: int = 256) -> None:
        if min(trajectories, per_actor, per_route) < 1:
            raise ValueError("SandboxReleases bounds must be >= 1")
        self._held: OrderedDict[str, set[str]] = OrderedDict()  # trajectory -> actor ids that ran its calls
        self._pending: dict[str, deque[str]] = {}  # actor id -> finished trajectories it still holds
        self._limit, self._per_actor, self._per_route = trajectories, per_actor, per_route

    def ran(self, trajectory: str, actor_id: str) -> None:
        """A sandbox tool call of ``trajectory`` was placed on ``actor_id`` (its sandbox is there now)."""
        actors = self._held.get(trajectory)
        if actors is None:
            actors = self._held[trajectory] = set()
            if len(self._held) > self._limit:
                self._held.popitem(last=False)
        actors.add(actor_id)

    def finished(self, trajectory: str) -> list[str]:
        """``trajectory`` ended: queue its release on every actor that holds its sandbox; returns those actors."""
        actors = sorted(self._held.pop(trajectory, ()))
        for aid in actors:
            self._pending.setdefault(aid, deque(maxlen=self._per_actor)).append(trajectory)
        return actors

    def take(self, actor_id: str) -> list[str] | None:
        """The finished trajectories ``actor_id`` should release now (at most ``per_route``; None when none)."""
        q = self._pending.get(actor_id)
        if not q:
            return None
        out = [q.popleft() for _ in range(min(len(q), self._per_route))]
        if not q:
            del self._pending[actor_id]
        return out

    def pending(self, actor_id: str) -> int:
        """How many releases wait for ``actor_id``'s next sandbox call."""
        return len(self._pending.get(actor_id, ()))
