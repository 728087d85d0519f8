"""The oracle router (issue #17): ``cmlfq_cost``'s placement rule given the true remaining length, on the real
A800 / Qwen3-14B cost model; the length-bucket placement it replaced stays available as ``placement="bucket"``."""

from __future__ import annotations

import pytest

from libra.policies.routing.baselines import make_router
from libra.policies.routing.interface import ClusterViewError, RoutingError, ToolReturn
from libra.policies.routing.oracle import OracleRouter

from router_cases import cluster, info  # tests/unit


def _argmin(costs: dict[str, float]) -> str:
    return min(costs, key=costs.__getitem__)


def test_start_goes_where_the_true_length_finishes_soonest_at_the_current_load() -> None:
    r = OracleRouter(cap_metric="load", max_queue_length=3)
    d = r.start(info("long", prompt_tokens=500, true_remaining=28_000), cluster())
    assert d.reason == "oracle_cost" and set(r.last_costs) == {"s0", "m0", "l0"}  # one candidate per bucket
    assert d.instance_id == _argmin(r.last_costs) == "l0"  # idle TP-4 decodes fastest
    # The same trajectory when the TP-4 instance has two running sequences, the TP-2 one none: the load moves it.
    r2 = OracleRouter(cap_metric="load", max_queue_length=3)
    busy = cluster(l0=(2, 0))
    d2 = r2.start(info("long", prompt_tokens=500, true_remaining=28_000), busy)
    assert d2.instance_id == _argmin(r2.last_costs)
    assert r2.last_costs["l0"] > r.last_costs["l0"]  # the load is priced in


def test_nothing_with_room_overflows_by_cost_or_queues() -> None:
    full = cluster(s0=(3, 0), s1=(3, 0), m0=(4, 0), l0=(9, 0))  # active + queued >= 3 everywhere
    r = OracleRouter(cap_metric="load", max_queue_length=3)
    d = r.start(info("t", prompt_tokens=100, true_remaining=20_000), full)
    assert d.reason == "oracle_overflow" and set(r.last_costs) == {"s0", "s1", "m0", "l0"}  # every ready instance
    assert d.instance_id == _argmin(r.last_costs)
    # the other routers overflow to the least load per TP (m0: 2.0), whatever the length
    assert make_router("least_loaded", cap_metric="load").start(info("x"), full).instance_id == "m0"
    q = OracleRouter(cap_metric="load", max_queue_length=3, when_full="queue")
    d = q.start(info("t", true_remaining=20_000), full)
    assert d.queued and (d.reason, d.bucket) == ("oracle_no_room", "long")


def test_tool_return_moves_only_when_cheaper_and_into_room() -> None:
    r = OracleRouter(cap_metric="load", max_queue_length=3)
    d = r.start(info("t", prompt_tokens=200, true_remaining=500), cluster(l0=(3, 0), m0=(3, 0)))  # room: TP-1 only
    home = d.instance_id
    assert home == "s0" and set(r.last_costs) == {"s0"}
    full = cluster(s1=(3, 0), l0=(3, 0), m0=(3, 0))
    d = r.on_tool_return("t", ToolReturn("bash", 300, context_tokens=600, true_remaining=29_000), full)
    assert (d.instance_id, d.reason, d.migrated) == (home, "stay_cheaper", False)  # no room elsewhere: stays
    assert set(r.last_costs) == {home}
    d = r.on_tool_return("t", ToolReturn("bash", 400, context_tokens=800, true_remaining=29_000), cluster())
    assert d.reason == "oracle_cost" and d.migrated and d.instance_id == _argmin(r.last_costs) != home
    assert d.migrate_mode in ("kv", "reprefill")
    with pytest.raises(RoutingError, match="true_remaining"):
        r.on_tool_return("t", ToolReturn("bash", 500, context_tokens=900), cluster())
    with pytest.raises(RoutingError, match="true_remaining"):
        r.start(info("u"), cluster())


def test_learns_the_turn_shape_without_a_prefix_tree() -> None:
    r = OracleRouter(learn_after=1)
    r.start(info("t", "p", prompt_tokens=100, true_remaining=3000), cluster())
    r.on_tool_return("t", ToolReturn("bash", 1000, context_tokens=1600, true_remaining=2000), cluster())
    r.on_turn_end("t", 3000)
    r.finish("t", 3500)
    assert r.shape() == (1500.0, 250.0, pytest.approx(3000 / 3500))  # 2 turns, 3000 generated, 500 returned
    assert r.tree.num_prompts == 0 and r.describe()["placement"] == "cost"


def test_bucket_placement_and_parameter_errors() -> None:
    b = make_router("oracle", placement="bucket")
    assert [b.start(info(f"t{x}", true_remaining=x), cluster()).bucket for x in (2000, 10_000, 29_000)] == \
        ["short", "medium", "long"]
    d = b.on_tool_return("t29000", ToolReturn("bash", 100), cluster())  # sticky: needs no true_remaining
    assert (d.bucket, d.migrated) == ("long", False)
    with pytest.raises(ClusterViewError, match="placement"):
        OracleRouter(placement="nearest")  # type: ignore[arg-type]
    with pytest.raises(ClusterViewError, match="follow"):
        OracleRouter(follow=True)
    with pytest.raises(ValueError, match="unknown parameter 'tree'"):
        make_router("oracle", tree=None)
