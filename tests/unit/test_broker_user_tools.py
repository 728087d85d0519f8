"""The broker places a user tool by the resources its action actors declare in their hello labels
(``labels["tool_decls"]``, ``libra.actors.tools``): the declared cores are granted and held, never
oversubscribed; a tool declaring a GPU service is routed as a call of that service; the broker's own tool
table wins over an actor's declaration; a declaration that does not parse is reported and ignored."""

from __future__ import annotations

from typing import Any

from libra.broker.events import Log, PeerMessage
from libra.broker.state import BrokerConfig, BrokerState
from libra.protocol import messages as m
from libra.protocol.payloads_actions import ActionRoute

C = b"client"


def cluster(decls: Any, cores: int = 4, tools: dict[str, Any] | None = None,
            gpu: bool = False) -> tuple[BrokerState, list[Any]]:
    s = BrokerState(BrokerConfig(action_scheduler="tangram", tools=tools or {}))
    s.handle(PeerMessage(C, m.ClientHello("c", 1)), 0)
    labels: dict[str, Any] = {"cpus": list(range(cores)), "numa": [0] * cores, "tool_decls": decls}
    if gpu:
        labels["gpus"] = 1
    names = sorted(decls) if isinstance(decls, dict) else ["search"]
    s.handle(PeerMessage(b"a0", m.ActorHello("a0", "h", "gpu0" if gpu else "cpu0", 1,
                                             {"action": [*names, "echo"]}, ["action"], 16, labels)), 0)
    out = s.handle(PeerMessage(b"a0", m.Bid(["action"], 16)), 0)
    return s, out


def submit(s: BrokerState, rid: str, tool: str, args: Any = None, now: float = 1.0) -> tuple[list[m.Assign], list]:
    out = s.handle(PeerMessage(C, m.Submit(rid, "action", tool, args or {}, f"traj-{rid}")), now)
    s.validate()
    return [c.msg for c in out if isinstance(getattr(c, "msg", None), m.Assign)], out


def test_a_user_tool_is_granted_the_cores_it_declares() -> None:
    s, _ = cluster({"search": {"cores": 2}, "peek": {"cores": 1}})
    (a,), _ = submit(s, "r1", "search")
    route = ActionRoute.from_wire(a.route)
    assert route.cores == 2 and route.core_ids is not None and len(route.core_ids) == 2
    assert s.actors[b"a0"].cores_used == 2
    (b,), _ = submit(s, "r2", "search")  # 2 of 4 cores left: the second call gets the other two
    assert set(ActionRoute.from_wire(b.route).core_ids or []) == {0, 1, 2, 3} - set(route.core_ids)
    waiting, _ = submit(s, "r3", "search")  # no cores left: it waits, the cores are never oversubscribed
    assert waiting == [] and s.actors[b"a0"].cores_used == 4
    out = s.handle(PeerMessage(b"a0", m.WorkResult(a.work_id, a.lease, True, {"hits": []})), 2.0)
    (c,) = [x.msg for x in out if isinstance(getattr(x, "msg", None), m.Assign)]
    assert ActionRoute.from_wire(c.route).cores == 2 and s.actors[b"a0"].cores_used == 4
    echo, _ = submit(s, "r4", "echo", now=3.0)  # an undeclared tool takes one core: none is free yet
    assert echo == []


def test_an_undeclared_tool_takes_one_core_and_the_brokers_table_wins() -> None:
    s, _ = cluster({"search": {"cores": 3}}, tools={"search": {"cpu": 1}})
    (a,), _ = submit(s, "r1", "search")
    assert ActionRoute.from_wire(a.route).cores == 1  # BrokerConfig.tools names it: the operator's table
    (e,), _ = submit(s, "r2", "echo")
    assert ActionRoute.from_wire(e.route).cores == 1


def test_a_tool_declaring_a_gpu_service_is_routed_as_a_call_of_that_service() -> None:
    s, _ = cluster({"embed": {"gpu_service": "emb"}}, gpu=True)
    (a,), _ = submit(s, "r1", "embed", {"text": "no service named in the args"})
    route = ActionRoute.from_wire(a.route)
    assert route.service is not None and route.service.service == "emb" and route.service.restore is True
    assert s.actors[b"a0"].cores_used == 0  # a service call holds a replica, not cores


def test_a_declaration_that_does_not_parse_is_reported_and_the_tool_runs_undeclared() -> None:
    s, out = cluster({"search": {"cores": "many"}})
    (a,), more = submit(s, "r1", "search")
    assert ActionRoute.from_wire(a.route).cores == 1
    logs = [c for c in out + more if isinstance(c, Log) and c.event == "actor_labels_unparsed"]
    assert logs and "tool declaration of 'search'" in logs[0].fields["error"]
