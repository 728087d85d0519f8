"""Read-only views of :class:`~libra.broker.state.BrokerState`: the status snapshot and the invariant check."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from libra.protocol import messages as m

from .work import WorkState

if TYPE_CHECKING:
    from .state import BrokerState


def snapshot(self: BrokerState, request_id: str, now: float) -> m.StatusReply:
    """A status view: one dict per actor, queue depths by ``kind:name``, counters."""
    actors = [
        {
            "id": s.actor_id, "host": s.host, "slot": s.slot, "pid": s.pid,
            "kinds": sorted(s.accepting), "capabilities": {k: sorted(v) for k, v in s.capabilities.items()},
            "state": s.state, "load": len(s.held), "capacity": s.capacity, "completed": s.completed,
            "role": dict(s.directive_config),
            "last_seen_s": round(now - s.last_seen, 3),
        }
        for s in self.actors.values()
    ]
    queues = {f"{k}:{n}": len(q) for (k, n), q in self.queues.items()}
    stats: dict[str, Any] = dict(self.stats)
    stats["inflight"] = len(self.works)
    stats["clients"] = len(self.clients)
    if self.jobs:
        stats["jobs"] = {name: host.summary() for name, host in self.jobs.items()}
    if self.planner is not None:
        stats["planner"] = self.planner.summary()
    return m.StatusReply(request_id, actors, queues, stats)

def validate(self: BrokerState) -> None:
    """Check invariants (tests call this after every scenario). Raises AssertionError."""
    held = set()
    for s in self.actors.values():
        for wid in s.held:
            w = self.works[wid]
            assert w.state is WorkState.LEASED and w.actor == s.peer, (wid, w.state, w.story)
            assert wid not in held, f"{wid} held twice"
            held.add(wid)
    queued = set()
    for key, q in self.queues.items():
        for wid in q:
            w = self.works[wid]
            assert w.state is WorkState.QUEUED and w.key == key, (wid, w.state)
            assert wid not in queued, f"{wid} queued twice"
            queued.add(wid)
    for wid, w in self.works.items():
        assert w.state in (WorkState.QUEUED, WorkState.LEASED), (wid, w.state)
        if w.state is WorkState.QUEUED:
            assert wid in queued, f"{wid} queued but in no queue"
        else:
            assert wid in held, f"{wid} leased but held by no live actor"
