"""The baseline routers, the router registry and end-to-end routing properties, driven with hand-built
trajectories and cluster snapshots (C-MLFQ's own rules: ``test_routers.py``)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.policies.routing.cmlfq import CMLFQRouter
from libra.policies.routing.baselines import (
    LAMLFQRouter,
    LengthAwareRouter,
    OracleRouter,
    PredictorRouter,
    make_router,
    router_names,
)
from libra.policies.routing.interface import (
    ClusterView,
    ClusterViewError,
    InstanceView,
    RouteDecision,
    Router,
    RoutingError,
    ToolReturn,
    bucket_for,
)
from libra.policies.routing.tool_state import R2E_THRESHOLDS

from router_cases import BUCKETS, LONG_FAIL, SMALL_OK, cluster, info, ret, trained_tree  # tests/unit


# --------------------------------------------------------------------------------------------- baselines


def test_round_robin_cycles_over_ready_instances() -> None:
    r = make_router("round_robin")
    view = ClusterView(BUCKETS, (*cluster().instances[:2], InstanceView("m0", "medium", ready=False),
                                 InstanceView("l0", "long")))
    picks = [r.start(info(f"t{i}"), view).instance_id for i in range(5)]
    assert picks == ["s0", "s1", "l0", "s0", "s1"]
    d = r.on_tool_return("t2", ret(LONG_FAIL, 100), view)
    assert (d.instance_id, d.bucket, d.migrated) == ("l0", "long", False)  # sticky, never migrates


def test_least_loaded_normalises_by_tp() -> None:
    r = make_router("least_loaded", max_queue_length=10)
    d = r.start(info("t1"), cluster(s0=(2, 0), s1=(3, 0), m0=(3, 0), l0=(7, 0)))
    assert d.instance_id == "m0"  # loads per TP: 2, 3, 1.5, 1.75


def test_length_aware_routes_by_input_length() -> None:
    r = LengthAwareRouter()
    assert r.start(info("a", prompt_tokens=3000), cluster()).bucket == "short"  # short -> TP1
    assert r.start(info("b", prompt_tokens=8000), cluster()).bucket == "medium"  # medium -> TP2
    assert r.start(info("c", prompt_tokens=20_000), cluster()).bucket == "long"  # extra_long -> [8, 4]: TP4
    # The context grows to 12K (long: prefers TP4/TP8): leave the TP1 bucket.
    d = r.on_tool_return("a", ret(SMALL_OK, 500, context=12_000), cluster())
    assert (d.bucket, d.reason, d.migrated) == ("long", "input_length", True)
    # medium prefers [2, 4]: a request already on TP4 stays.
    d = r.on_tool_return("c", ret(SMALL_OK, 500, context=7000), cluster())
    assert (d.bucket, d.reason, d.migrated) == ("long", "in_preferred_bucket", False)


def test_la_mlfq_demotes_one_level_per_turn_boundary() -> None:
    r = LAMLFQRouter()
    assert r.start(info("t1"), cluster()).bucket == "short"
    d = r.on_tool_return("t1", ret(SMALL_OK, 3000), cluster())
    assert (d.bucket, d.reason) == ("short", "within_threshold")
    r.on_turn_end("t1", 20_000)  # generated tokens already exceed both the short and medium thresholds
    d = r.on_tool_return("t1", ret(SMALL_OK, 20_000, context=21_000), cluster())
    assert (d.bucket, d.reason, d.migrated, d.migrate_mode) == ("medium", "demote", True, "kv")  # one step
    d = r.on_tool_return("t1", ret(SMALL_OK, 20_100, context=21_100), cluster())
    assert (d.bucket, d.reason, d.migrated) == ("long", "demote", True)  # next boundary: one more
    d = r.on_tool_return("t1", ret(SMALL_OK, 40_000, context=41_000), cluster())
    assert (d.bucket, d.migrated) == ("long", False)  # nowhere further to go


def test_la_mlfq_prompt_history_with_ttl() -> None:
    r = LAMLFQRouter(history_ttl_steps=2)
    r.start(info("t1", "p", step=0), cluster())
    r.on_tool_return("t1", ret(SMALL_OK, 5000), cluster())
    r.finish("t1", 6000)
    assert (r.start(info("t2", "p", step=2), cluster()).bucket, r.bucket_of("t2")) == ("medium", "medium")
    assert r.start(info("t3", "p", step=3), cluster()).bucket == "short"  # entry older than the TTL
    r.on_step(10)
    assert r.start(info("t4", "p", step=2), cluster()).reason == "initial"  # expired entries are dropped


def test_oracle_picks_the_true_bucket() -> None:
    r = OracleRouter(placement="bucket")
    got = [r.start(info(f"t{x}", true_remaining=x), cluster()).bucket for x in (2000, 10_000, 35_000)]
    assert got == ["short", "medium", "long"]
    d = r.on_tool_return("t35000", ToolReturn("bash", 100, true_remaining=100), cluster())
    assert (d.bucket, d.migrated) == ("long", False)  # places once by default
    with pytest.raises(RoutingError, match="true_remaining"):
        r.start(info("x"), cluster())
    follower = OracleRouter(placement="bucket", follow=True)
    follower.start(info("f", true_remaining=20_000), cluster())
    d = follower.on_tool_return("f", ToolReturn("bash", 18_000, context_tokens=19_000, true_remaining=2000), cluster())
    assert (d.bucket, d.migrated) == ("short", True)


def test_predictor_learns_prompt_length_relation() -> None:
    r = PredictorRouter(warmup=8, hash_buckets=8)
    assert r.start(info("cold", "p", prompt_tokens=8000), cluster()).reason == "no_stats"
    rng = random.Random(0)
    for i in range(60):  # output length ~ 3x prompt length
        pt = rng.choice([500, 3000, 8000])
        tid = f"train{i}"
        r.start(info(tid, f"p{i}", prompt_tokens=pt), cluster())
        r.finish(tid, int(3 * pt * rng.uniform(0.9, 1.1)))
    got = {pt: r.start(info(f"q{pt}", f"new{pt}", prompt_tokens=pt), cluster()) for pt in (500, 3000, 8000)}
    assert {pt: d.bucket for pt, d in got.items()} == {500: "short", 3000: "medium", 8000: "long"}
    assert all(d.reason == "predicted" for d in got.values())
    # The prediction is made once: tool returns never move the request.
    d = r.on_tool_return("q500", ret(LONG_FAIL, 5000, context=30_000), cluster())
    assert (d.bucket, d.migrated) == ("short", False)


# --------------------------------------------------------------------------------------------- end to end


def _synthetic(rng: random.Random) -> tuple[list[str], list[int], int]:
    """Two tool calls; the first outcome causes the rest. A large failure is followed by another failure and
    ~20K more tokens (except 10% quick recoveries); a small success by ~1K more tokens."""
    p1 = rng.randint(200, 600)
    if rng.random() < 0.4:
        if rng.random() < 0.9:
            p2 = p1 + rng.randint(9000, 11_000)
            return [LONG_FAIL, LONG_FAIL], [p1, p2], p2 + rng.randint(9000, 11_000)
        return [LONG_FAIL, SMALL_OK], [p1, p1 + 300], p1 + 300 + rng.randint(300, 700)  # quick recovery
    return [SMALL_OK, SMALL_OK], [p1, p1 + 300], p1 + 300 + rng.randint(300, 700)


def test_cmlfq_beats_la_mlfq_on_causal_workload() -> None:
    """After warm-up, C-MLFQ's bucket after each tool return matches the true remaining bucket far more often
    than stepwise LA-MLFQ's (which only reacts once generated tokens pass a threshold)."""
    rng = random.Random(1)
    routers = {"cmlfq": CMLFQRouter(), "la_mlfq": LAMLFQRouter()}
    hits = {name: 0 for name in routers}
    decisions = 0
    for i in range(300):
        states, positions, length = _synthetic(rng)
        decisions += len(states) if i >= 100 else 0
        for name, r in routers.items():
            r.start(info(f"t{i}"), cluster())
            for state, p in zip(states, positions, strict=True):
                d = r.on_tool_return(f"t{i}", ret(state, p), cluster())
                hits[name] += i >= 100 and d.bucket == bucket_for(length - p, BUCKETS).name
            r.finish(f"t{i}", length)
    assert hits["cmlfq"] / decisions > 0.9
    assert hits["cmlfq"] > hits["la_mlfq"]


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["cmlfq", "round_robin", "least_loaded", "length_aware", "la_mlfq", "predictor", "oracle"]),
    seed=st.integers(0, 10_000),
)
def test_decisions_are_consistent_with_the_view(name: str, seed: int) -> None:
    """Random loads, readiness and tool returns: every decision names a ready instance of the view, its
    placed bucket, and a known logical bucket; with ``overflow`` and a ready instance nothing is queued."""
    rng = random.Random(seed)
    r = make_router(name, **({"warmup": 2} if name == "predictor" else {}))
    tree_states = [LONG_FAIL, SMALL_OK, "python:medium:timeout"]

    def view() -> ClusterView:
        insts = [InstanceView(i, b, rng.randint(0, 5), rng.randint(0, 5), ready=rng.random() < 0.8, node=n)
                 for i, b, n in [("s0", "short", "a"), ("s1", "short", "a"), ("m0", "medium", "a"),
                                 ("l0", "long", "b")]]
        return ClusterView(BUCKETS, (*insts, InstanceView("z", "short", ready=True)))

    def check(d: RouteDecision, v: ClusterView) -> None:
        assert v.has_bucket(d.bucket)
        assert d.instance_id is not None  # "overflow" never queues while an instance is ready
        inst = v.instance(d.instance_id)
        assert inst is not None and inst.ready and d.placed_bucket == inst.bucket
        assert d.migrate_mode in (None, "kv", "reprefill")

    for t in range(6):
        length = rng.randint(100, 40_000)
        v = view()
        tid = f"t{t}"
        d = r.start(info(tid, f"p{rng.randint(0, 2)}", prompt_tokens=rng.randint(10, 20_000),
                         true_remaining=length), v)
        check(d, v)
        pos = 0
        for _ in range(rng.randint(0, 4)):
            pos += rng.randint(0, length // 4 + 1)
            v = view()
            before = r.bucket_of(tid)  # type: ignore[attr-defined]
            tool_ret = replace(ret(rng.choice(tree_states), pos, context=pos + 500), true_remaining=max(0, length - pos))
            d = r.on_tool_return(tid, tool_ret, v)
            check(d, v)
            deferred = d.reason == "migrate" and d.bucket == before == d.placed_bucket
            assert d.migrated == (d.bucket != before or deferred)
        r.finish(tid, max(pos, length))


# --------------------------------------------------------------------------------------------- registry


def test_registry_builds_every_router_behind_the_protocol() -> None:
    assert set(router_names()) == {"cmlfq", "round_robin", "least_loaded", "length_aware", "la_mlfq",
                                   "predictor", "oracle", "cmlfq_cost"}
    for name in router_names():
        r = make_router(name, max_queue_length=5)
        assert isinstance(r, Router) and r.name == name and r.max_queue_length == 5  # type: ignore[attr-defined]


def test_registry_errors_and_conveniences(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"unknown router: 'fifo' \(known: cmlfq, round_robin"):
        make_router("fifo")
    with pytest.raises(ValueError, match="router 'oracle': unknown parameter 'ridge'"):
        make_router("oracle", ridge=1.0)
    with pytest.raises(ValueError, match="unknown thresholds: 'tiny'"):
        make_router("cmlfq", thresholds="tiny")
    r = make_router("cmlfq", thresholds="r2e")
    assert r.thresholds == R2E_THRESHOLDS  # type: ignore[attr-defined]
    assert make_router("cmlfq", thresholds={"small": 10, "medium": 20}).thresholds.medium == 20  # type: ignore[attr-defined]
    path = tmp_path / "tree.json"
    trained_tree({(LONG_FAIL,): [20_000] * 3}).save(path)
    loaded = make_router("cmlfq", tree=str(path))
    loaded.start(info("t1"), cluster())
    assert loaded.on_tool_return("t1", ret(LONG_FAIL, 10), cluster()).bucket == "long"
    with pytest.raises(ClusterViewError, match="when_full"):
        make_router("cmlfq", when_full="drop")


def test_positions_are_response_tokens_and_the_tree_learns_remaining_response() -> None:
    """p_i = generated + tool-returned tokens with this return's payload (docs/papers.md §1.4.2), from
    ``response_tokens``, else ``context_tokens - prompt``, else generated + payloads reported so far."""
    r = CMLFQRouter()
    r.start(info("t1", "p1", prompt_tokens=100), cluster())
    r.on_tool_return("t1", ToolReturn("bash", position=300, response_tokens=2300, payload_tokens=2000,
                                      status="success"), cluster())
    r.on_tool_return("t1", ToolReturn("bash", position=500, context_tokens=2700, payload_tokens=100,
                                      status="success"), cluster())
    r.on_tool_return("t1", ToolReturn("bash", position=600, payload_tokens=50, status="success"), cluster())
    r.on_turn_end("t1", 700)
    r.finish("t1", 700)  # a generated-only total is raised to the response tokens seen
    (learned,) = r.tree.history
    assert learned.positions == (2300, 2600, 2750)
    assert learned.total_output_tokens == 2850
    assert learned.remaining() == (550, 250, 100)


def test_response_position_fallbacks() -> None:
    from libra.policies.routing.interface import response_position

    assert response_position(ToolReturn("t", 10, context_tokens=900, response_tokens=700), 100) == 700
    assert response_position(ToolReturn("t", 10, context_tokens=900), 100) == 800
    assert response_position(ToolReturn("t", 10, payload_tokens=40), 100, payload_so_far=5) == 55
    assert response_position(ToolReturn("t", 10, context_tokens=50), 100) == 10  # never below generated


def test_the_migration_mode_rule_comes_from_config() -> None:
    from libra.policies.routing.baselines import make_router, migrate_mode_rule
    from libra.policies.routing.interface import MigrationQuery

    def q(n: int, same: bool = True) -> MigrationQuery:
        return MigrationQuery(n, same, 1, 1)

    assert make_router("la_mlfq", choose_mode="kv").choose_mode(q(1)) == "kv"
    assert make_router("cmlfq", choose_mode="reprefill").choose_mode(q(100_000)) == "reprefill"
    heuristic = migrate_mode_rule("heuristic")
    assert [heuristic(q(4096)), heuristic(q(4097)), heuristic(q(2049, same=False))] == ["reprefill", "kv", "kv"]
    table = migrate_mode_rule({"same_node_max_tokens": 100})
    assert [table(q(100)), table(q(101)), table(q(2048, same=False)), table(q(2049, same=False))] == \
        ["reprefill", "kv", "reprefill", "kv"]
    for bad in ("always", {"same_node_max": 5}, {"cross_node_max_tokens": -1}, 3):
        with pytest.raises(ValueError, match="choose_mode"):
            make_router("la_mlfq", choose_mode=bad)
