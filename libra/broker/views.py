"""Read-only views of the broker core's components: the status snapshot and the invariant check."""

from __future__ import annotations

from typing import Any

from libra.protocol import messages as m

from .job_board import JobBoard
from .plan_decider import PlannerLoop
from .sessions import SessionRegistry
from .work import WorkState
from .work_table import WorkTable

__all__ = ["snapshot", "validate"]


def snapshot(request_id: str, now: float, sessions: SessionRegistry, table: WorkTable, stats: dict[str, int],
             jobs: JobBoard, planner: PlannerLoop | None, router: dict[str, Any] | None = None,
             actions: dict[str, Any] | None = None, leases: list[dict[str, Any]] | None = None,
             lending: dict[str, Any] | None = None) -> m.StatusReply:
    """A status view: one dict per actor, queue depths by ``kind:name``, counters."""
    actors = [
        {
            "id": s.actor_id, "host": s.host, "slot": s.slot, "pid": s.pid,
            "kinds": sorted(s.accepting), "capabilities": {k: sorted(v) for k, v in s.capabilities.items()},
            "state": s.state, "load": len(s.held), "capacity": s.capacity, "completed": s.completed,
            "leased": s.leased,
            "role": dict(s.directive_config),
            "gpu": dict(s.gpu),
            "last_seen_s": round(now - s.last_seen, 3),
            **({"lent": {"owner": s.lent_owner, "reclaimed_in_s": round(max(0.0, s.reclaimed_until - now), 3)
                         if s.reclaimed_until else None}} if s.lent_owner else {}),
        }
        for s in sessions.actors.values()
    ]
    queues = {f"{k}:{n}": len(q) for (k, n), q in table.queues.items()}
    st: dict[str, Any] = dict(stats)
    st["inflight"] = len(table.works)
    st["parked"] = len(table.parked)  # restored work waiting for its actor to come back (adoption.py)
    st["clients"] = len(sessions.clients)
    if jobs.hosts:
        st["jobs"] = jobs.summaries()
    if planner is not None:
        st["planner"] = planner.summary()
    if router is not None:
        st["router"] = router
    if leases:  # direct leases (direct_leases.py): calls that go from a client straight to an actor
        st["leases"] = leases
    if lending and (lending["reclaims"] or any(s.lent_owner for s in sessions.actors.values())):
        st["lending"] = lending  # lent slots (lending.py): reclaims, how their trajectories moved
    if actions is not None:  # action placement (tangram and friends): cores per actor, resident services
        st["actions"] = actions
    return m.StatusReply(request_id, actors, queues, st)


def validate(sessions: SessionRegistry, table: WorkTable) -> None:
    """Check the invariants between the sessions and the work table. Raises AssertionError."""
    works = table.works
    held = set()
    for s in sessions.actors.values():
        for wid in s.held:
            w = works[wid]
            assert w.state is WorkState.LEASED and w.actor == s.peer, (wid, w.state, w.story)
            assert wid not in held, f"{wid} held twice"
            held.add(wid)
    queued = set()
    for key, q in table.queues.items():
        for wid in q:
            w = works[wid]
            assert w.state is WorkState.QUEUED and w.key == key, (wid, w.state)
            assert wid not in queued, f"{wid} queued twice"
            queued.add(wid)
    for wid, w in works.items():
        assert w.state in (WorkState.QUEUED, WorkState.LEASED), (wid, w.state)
        if w.state is WorkState.QUEUED:
            assert (wid in queued) != (wid in table.parked), f"{wid} queued but in no queue (or also parked)"
        else:
            assert wid in held, f"{wid} leased but held by no live actor"
