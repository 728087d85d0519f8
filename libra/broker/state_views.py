"""``BrokerViews``: the read-only views of the broker core (:class:`~libra.broker.state.BrokerState` derives from
it): its sessions, work, jobs and planner as attributes, the status snapshot and the invariant check. Nothing
here changes state (change it through ``BrokerState.handle``)."""

from __future__ import annotations

from typing import Any

from libra.protocol import messages as m

from . import views
from .access import Access, scoped_status, sees_audit
from .actions import ActionPlacement
from .adoption import Adoption
from .direct_leases import DirectLeases
from .dispatch import Dispatcher
from .job_board import JobBoard
from .lending import Lending
from .plan_applier import GpuSlot, PlanApplier
from .plan_decider import PlannerLoop
from .plan_rounds import Planning
from .rollout import RolloutRouting
from .sessions import ActorSession, ClientSession, SessionRegistry
from .work import Work
from .work_table import WorkTable

__all__ = ["BrokerViews"]


class BrokerViews:
    """The components a broker core holds (built by ``BrokerState.__init__``) and the views over them."""

    stats: dict[str, int]
    rollout: RolloutRouting
    actions: ActionPlacement | None
    _sessions: SessionRegistry
    _table: WorkTable
    _jobs: JobBoard
    _dispatch: Dispatcher
    _planning: Planning
    _adoption: Adoption
    _leases: DirectLeases
    _lending: Lending
    _access: Access

    # ------------------------------------------------------------------ read-only views
    @property
    def actors(self) -> dict[bytes, ActorSession]:
        """Connected actors by socket identity (read-only: change them through ``handle``)."""
        return self._sessions.actors

    @property
    def clients(self) -> dict[bytes, ClientSession]:
        """Connected clients by socket identity (read-only)."""
        return self._sessions.clients

    @property
    def works(self) -> dict[str, Work]:
        """Live (queued or leased) work by id (read-only)."""
        return self._table.works

    @property
    def queues(self) -> dict[tuple[str, str], Any]:
        """Queued work ids per ``(kind, name)``, oldest first (read-only)."""
        return self._table.queues

    @property
    def jobs(self) -> dict[str, Any]:
        """The RL jobs this broker hosts (``job_host.JobHost``) by name."""
        return self._jobs.hosts

    @property
    def planner(self) -> PlannerLoop | None:
        """The broker's periodic planner (``[broker.planner]``), or None."""
        return self._planning.loop

    @property
    def plan_applier(self) -> PlanApplier | None:
        """The plan being applied (or the last one applied), or None."""
        return self._planning.applier

    @property
    def adopt_grace_s(self) -> float:
        """How long restored work waits for the actors that still run it (``adoption.Adoption``)."""
        return self._adoption.grace_s

    @property
    def journaling(self) -> bool:
        return self._dispatch.journaling

    @property
    def planner_offload(self) -> bool:
        return self._planning.offload

    def gpu_slots(self) -> list[GpuSlot]:
        """The connected GPU actors as plan slots (labels ``slot_kind == "gpu"``, slot ``gpuN``)."""
        return self._planning.gpu_slots()

    def lent_slots(self) -> list[str]:
        """The connected lent GPU slots not reclaimed, in the order they connected (``Planning.lent_slots``: the
        borrowed capacity a planner round counts)."""
        return self._planning.lent_slots()

    def snapshot(self, request_id: str, now: float) -> m.StatusReply:
        """A status view: one dict per actor, queue depths by ``kind:name``, counters."""
        return views.snapshot(request_id, now, self._sessions, self._table, self.stats, self._jobs,
                              self._planning.loop, router=self.rollout.summary(),
                              actions=self.actions.summary() if self.actions is not None else None,
                              leases=self._leases.summary(), lending=self._lending.summary())

    def validate(self) -> None:
        """Check invariants (tests call this after every scenario). Raises AssertionError."""
        views.validate(self._sessions, self._table)

    def status(self, request_id: str, now: float, role: str = "") -> m.StatusReply:
        """The status a key of ``role`` sees: the :meth:`snapshot`, with the audit trail for an operator (and
        for every peer without CURVE); a job-scoped key sees its jobs' rows only (``access.scoped_status``)."""
        reply = self.snapshot(request_id, now)
        if sees_audit(role):
            reply.stats["audit"] = self._access.trail(now)
        return scoped_status(reply, role)
