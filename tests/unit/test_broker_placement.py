"""The broker's action placement over every action actor: core pools per host with NUMA nodes, best fit,
elastic shrinking, a trajectory's home actor; driven through BrokerState: exact core ids in the route, cores
shared by actors of one host never granted twice."""

from __future__ import annotations

from libra.broker.core_pools import CorePools
from libra.broker.events import PeerMessage
from libra.broker.sessions import ActorSession
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m

C = b"client"


def actor(name: str, labels: dict, host: str = "h") -> ActorSession:
    return ActorSession(name.encode(), name, host, "cpu0", 1, {"action": frozenset({"python"})},
                        frozenset({"action"}), 8, labels, 0.0, 0.0, 0.0, cores=labels.get("cores", 8))


def test_best_fit_goes_to_the_actor_left_with_the_fewest_free_cores() -> None:
    pools = CorePools()
    a, b = actor("a", {"cores": 4}), actor("b", {"cores": 8})
    s, ids = pools.best_fit([b, a], 3)
    assert s is a and len(ids) == 3  # a keeps 1 free, b would keep 5: a is the best fit
    pools.take("w1", s, ids)
    s, ids = pools.best_fit([a, b], 2)
    assert s is b
    pools.take("w2", s, ids)
    assert pools.best_fit([a, b], 1)[0] is a  # exactly fills a
    assert pools.total_free([a, b]) == 1 + 6
    assert pools.give_back("w1") == 3 and pools.total_free([a, b]) == 4 + 6


def test_numa_best_fit_inside_an_actor_and_spanning_only_when_nothing_fits() -> None:
    pools = CorePools()
    a = actor("a", {"cores": 8, "cpus": list(range(8)), "numa": [0, 0, 0, 0, 1, 1, 1, 1]})
    pools.take("busy", a, [0, 1, 2])  # node 0 keeps core 3; node 1 keeps 4-7
    assert pools.best_fit([a], 1) == (a, (3,))  # the node with the fewest free cores that fits
    assert pools.best_fit([a], 3) == (a, (4, 5, 6))
    pools.take("busy2", a, [4, 5])  # node 0: {3}, node 1: {6, 7}
    assert pools.best_fit([a], 3) == (a, (3, 6, 7))  # no node fits 3: most-free node first, then the rest
    pools.take("busy3", a, [6])  # a: {3} on node 0, {7} on node 1
    b = actor("b", {"cores": 4, "cpus": [0, 1, 2, 3], "numa": [0, 0, 1, 1]}, host="other")
    # a would be the tighter fit (0 left vs 2) but splits the grant over two nodes; b holds it in one
    assert pools.best_fit([a, b], 2) == (b, (0, 1))


def test_actors_of_one_host_share_their_cores() -> None:
    pools = CorePools()
    a, b = (actor(n, {"cores": 4, "cpus": [0, 1, 2, 3]}) for n in ("a", "b"))
    assert pools.total_free([a, b]) == 4
    pools.take("w1", a, [0, 1, 2])
    assert pools.free_ids(b) == [3] and not pools.take("w2", b, [2, 3])  # core 2 is taken through a
    assert pools.best_fit([b], 2, least=1) == (b, (3,))  # shrinks to what is free (elastic DoP)
    assert pools.best_fit([b], 2, least=2) is None


def test_a_trajectorys_home_actor_comes_first_when_it_fits() -> None:
    pools = CorePools()
    a, b = actor("a", {"cores": 2}), actor("b", {"cores": 8})
    assert pools.best_fit([a, b], 1, home="b")[0] is b
    assert pools.best_fit([a, b], 4, home="a")[0] is b  # home does not fit: best fit elsewhere


def cluster(actors: int = 2, cpus: tuple[int, ...] = (0, 1, 2, 3)) -> BrokerState:
    tools = {"python": {"cpu": 1, "max_cpu": 4, "parallel_fraction": 0.95, "duration_s": 4.0}}
    s = BrokerState(BrokerConfig(action_scheduler="tangram", tools=tools))
    s.handle(PeerMessage(C, m.ClientHello("c", 1)), 0)
    for i in range(actors):  # two slots on one host: they list the same CPUs
        peer = f"a{i}".encode()
        s.handle(PeerMessage(peer, m.ActorHello(f"a{i}", "h", f"cpu{i}", 1, {"action": ["python"]}, ["action"], 8,
                                                {"cores": len(cpus), "cpus": list(cpus), "numa": [0] * len(cpus)})), 0)
        s.handle(PeerMessage(peer, m.Bid(["action"], 8)), 0)
    return s


def assigns(out: list) -> list[m.Assign]:
    return [c.msg for c in out if isinstance(getattr(c, "msg", None), m.Assign)]


def test_a_lone_action_gets_several_cores_named_in_the_route() -> None:
    s = cluster()
    (a,) = assigns(s.handle(PeerMessage(C, m.Submit("r1", "action", "python", {"code": "1"}, "t1")), 1.0))
    assert a.route["cores"] > 1 and len(a.route["core_ids"]) == a.route["cores"]
    assert set(a.route["core_ids"]) <= {0, 1, 2, 3}


def test_a_burst_on_one_hosts_shared_cores_never_grants_a_core_twice() -> None:
    s = cluster()
    running: dict[str, m.Assign] = {}
    for i in range(10):
        for a in assigns(s.handle(PeerMessage(C, m.Submit(f"r{i}", "action", "python", {"code": "1"}, f"t{i}")), 1.0)):
            running[a.work_id] = a
        s.validate()
        ids = [c for a in running.values() for c in a.route["core_ids"]]
        assert len(ids) == len(set(ids)) and set(ids) <= {0, 1, 2, 3}
    done = 0
    while running:
        wid, a = next(iter(running.items()))
        del running[wid]
        out = s.handle(PeerMessage(s.works[wid].actor, m.WorkResult(wid, a.lease, True, {})), 2.0 + done)
        done += 1
        for b in assigns(out):
            running[b.work_id] = b
        ids = [c for x in running.values() for c in x.route["core_ids"]]
        assert len(ids) == len(set(ids))
    assert done == 10 and all(x.cores_used == 0 for x in s.actors.values())


def test_a_trajectorys_next_action_returns_to_the_actor_holding_its_sandbox() -> None:
    s = BrokerState(BrokerConfig(action_scheduler="tangram"))  # undeclared tool: one core, not elastic
    s.handle(PeerMessage(C, m.ClientHello("c", 1)), 0)
    for name, n in (("big", 8), ("small", 2)):
        s.handle(PeerMessage(name.encode(), m.ActorHello(name, name, "cpu0", 1, {"action": ["python"]}, ["action"],
                                                         8, {"cores": n, "cpus": list(range(n))})), 0)
        s.handle(PeerMessage(name.encode(), m.Bid(["action"], 8)), 0)

    def run(rid: str, traj: str, now: float) -> m.Assign:
        (a,) = assigns(s.handle(PeerMessage(C, m.Submit(rid, "action", "python", {"code": "1"}, traj)), now))
        return a

    y1, y2 = run("y1", "y1", 1.0), run("y2", "y2", 1.0)  # best fit: both on the small actor, now full
    assert {s.works[y1.work_id].actor, s.works[y2.work_id].actor} == {b"small"}
    x1 = run("x1", "x", 1.0)
    assert s.works[x1.work_id].actor == b"big"
    for a in (y1, y2, x1):
        s.handle(PeerMessage(s.works[a.work_id].actor, m.WorkResult(a.work_id, a.lease, True, {})), 2.0)
    x2 = run("x2", "x", 3.0)  # best fit alone would pick the small actor; x's workspace is on the big one
    assert s.works[x2.work_id].actor == b"big"
    s.handle(PeerMessage(s.works[x2.work_id].actor, m.WorkResult(x2.work_id, x2.lease, True, {})), 4.0)
    s.handle(PeerMessage(C, m.EndTrajectory("x")), 5.0)  # x ended: no home any more, best fit again
    x3 = run("x3", "x", 6.0)
    assert s.works[x3.work_id].actor == b"small"


def test_an_actor_whose_labels_do_not_parse_runs_on_its_own_cores_and_the_broker_says_so() -> None:
    from libra.broker.events import Log

    tools = {"python": {"cpu": 1, "max_cpu": 4, "parallel_fraction": 0.95, "duration_s": 4.0}}
    s = BrokerState(BrokerConfig(action_scheduler="tangram", tools=tools))
    s.handle(PeerMessage(C, m.ClientHello("c", 1)), 0)
    s.handle(PeerMessage(b"a0", m.ActorHello("a0", "h", "cpu0", 1, {"action": ["python"]}, ["action"], 8,
                                             {"cores": 2, "cpus": [3, 3], "numa": [0, 0]})), 0)  # repeated id
    s.handle(PeerMessage(b"a0", m.Bid(["action"], 8)), 0)
    out = s.handle(PeerMessage(C, m.Submit("r1", "action", "python", {"code": "1"}, "t1")), 1.0)
    (a,) = assigns(out)
    assert a.route["cores"] == 2 and a.route.get("core_ids") is None  # the fallback: 2 anonymous cores
    (log,) = [c for c in out if isinstance(c, Log) and c.event == "actor_labels_unparsed"]
    assert log.level == "warning" and log.fields["actor"] == "a0" and "cpus" in log.fields["error"]
    assert s.stats["actor_labels_unparsed"] == 1
    out = s.handle(PeerMessage(C, m.Submit("r2", "action", "python", {"code": "1"}, "t2")), 1.5)
    assert not [c for c in out if isinstance(c, Log) and c.event == "actor_labels_unparsed"]  # said once
