"""Action work scheduled by the Tangram policy inside BrokerState: cores granted per action."""

from __future__ import annotations

from libra.broker.events import PeerMessage
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m

C = b"client"
TOOLS = {"pytest": {"cpu": 1, "max_cpu": 8, "parallel_fraction": 0.9, "duration_s": 4.0}}


def setup(scheduler: str = "tangram", actors: int = 1, cores: int = 8) -> BrokerState:
    s = BrokerState(BrokerConfig(action_scheduler=scheduler, tools=TOOLS))
    s.handle(PeerMessage(C, m.ClientHello("c", 1)), 0)
    for i in range(actors):
        peer = f"a{i}".encode()
        s.handle(PeerMessage(peer, m.ActorHello(f"a{i}", "h", f"cpu{i}", 1, {"action": ["pytest", "echo"]},
                                                ["action"], 16, {"cores": cores})), 0)
        s.handle(PeerMessage(peer, m.Bid(["action"], 16)), 0)
    return s


def submit(s: BrokerState, rid: str, tool: str = "pytest", now: float = 1.0) -> list[m.Assign]:
    out = s.handle(PeerMessage(C, m.Submit(rid, "action", tool, {}, f"traj-{rid}")), now)
    s.validate()
    return [c.msg for c in out if isinstance(getattr(c, "msg", None), m.Assign)]


def cores_ok(s: BrokerState) -> None:
    for a in s.actors.values():
        assert 0 <= a.cores_used <= a.cores, (a.actor_id, a.cores_used)


def test_lone_elastic_action_gets_many_cores_and_they_come_back() -> None:
    s = setup()
    (a,) = submit(s, "r1")
    assert a.route["cores"] > 1  # idle cluster: more cores, shorter action
    assert s.actors[b"a0"].cores_used == a.route["cores"]
    s.handle(PeerMessage(b"a0", m.WorkResult(a.work_id, a.lease, True, {})), 2.0)
    assert s.actors[b"a0"].cores_used == 0 and not s.actions.granted and not s.actions.remembers(a.work_id)


def test_under_load_cores_are_shared_and_never_oversubscribed() -> None:
    s = setup(actors=2, cores=4)
    assigned = []
    for i in range(12):
        assigned += submit(s, f"r{i}")
        cores_ok(s)
    assert sum(a.route["cores"] for a in assigned) <= 8
    assert s.snapshot("x", 1.0).queues.get("action:pytest", 0) == 12 - len(assigned)
    # finishing work lets queued actions start, still within the cores
    for a in list(assigned):
        peer = s.works[a.work_id].actor
        out = s.handle(PeerMessage(peer, m.WorkResult(a.work_id, a.lease, True, {})), 3.0)
        cores_ok(s)
        s.validate()
        assert all(x.msg.route["cores"] >= 1 for x in out if isinstance(getattr(x, "msg", None), m.Assign))


def test_lost_actor_releases_cores_and_requeues_through_the_scheduler() -> None:
    s = setup(actors=2, cores=4)
    (a,) = submit(s, "r1")
    holder = s.works[a.work_id].actor
    other = b"a1" if holder == b"a0" else b"a0"
    from libra.broker.events import Tick
    s.handle(PeerMessage(other, m.Heartbeat()), 3.0)
    out = s.handle(Tick(), 3.5)
    (again,) = [c.msg for c in out if isinstance(getattr(c, "msg", None), m.Assign)]
    assert again.work_id == a.work_id and s.works[a.work_id].actor == other
    cores_ok(s)


def test_fixed_dop_baseline_is_selectable() -> None:
    s = setup(scheduler="fixed_dop", cores=8)
    (a,) = submit(s, "r1")
    assert a.route["cores"] == 4  # fixed DoP 4 by default
