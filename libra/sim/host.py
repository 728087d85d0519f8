"""The running simulator as its parts see it: :class:`SimHost`, the protocol that
:class:`~libra.sim.engine.Simulator` satisfies and that its GPU fleet (:mod:`libra.sim.gpus`) and
planner-driven allocation (:mod:`libra.sim.planner`) are written against.

It names the simulator state those parts read and change (virtual clock, instances, broker, per-step
timings) and the engine's event hooks they call (push an event, send a peer message, pump the broker,
deliver a broker command, start a training step). Keeping it here, not in the engine, lets the engine
import those parts without the parts importing the engine back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from libra.sim.metrics import RunView

if TYPE_CHECKING:
    from libra.broker.events import Send
    from libra.sim.cluster import InstanceCosts
    from libra.sim.instance import SimInstance

__all__ = ["SimHost"]


class SimHost(RunView, Protocol):
    """A :class:`~libra.sim.metrics.RunView` plus what the GPU fleet and the planner allocation use."""

    instances: dict[bytes, SimInstance]  # the fleet adds and retires instances
    costs: InstanceCosts
    lag: int  # the policy-lag bound in effect
    trained: int  # training steps finished
    training: bool  # a training step is running
    _live: Mapping[str, Any]  # trajectory id -> its running state (``kv_home``: the instance holding its KV)

    def _push(self, t: float, kind: str, payload: Any = None) -> None:
        """Schedule an event at virtual time ``t`` (``kind="call"``: call ``payload()`` then)."""

    def _send(self, peer: bytes, msg: Any) -> None:
        """Queue ``msg`` from ``peer`` for the broker."""

    def _pump(self) -> None:
        """Deliver the queued peer messages to the broker and execute what it sends, until quiet."""

    def _deliver(self, cmd: Send) -> None:
        """Execute one broker command by simulating its receiver."""

    def _maybe_train(self) -> None:
        """Start the next training step if its trajectories are done and a replica is ready."""
