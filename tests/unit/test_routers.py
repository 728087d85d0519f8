"""C-MLFQ and the baseline routers, driven with hand-built trajectories and cluster snapshots."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.policies.routing.cmlfq import CMLFQRouter, tool_state_key
from libra.policies.routing.prefix_tree import CausalPrefixTree, FinishedTrajectory
from libra.policies.routing.baselines import (
    LAMLFQRouter,
    LengthAwareRouter,
    OracleRouter,
    PredictorRouter,
    make_router,
    router_names,
)
from libra.policies.routing.interface import (
    BucketSpec,
    ClusterView,
    ClusterViewError,
    InstanceView,
    MigrationQuery,
    NoInstanceAvailable,
    RouteDecision,
    Router,
    RoutingError,
    ToolReturn,
    TrajectoryInfo,
    bucket_for,
    heuristic_migrate_mode,
    mode_by_cost,
)
from libra.policies.routing.tool_state import R2E_THRESHOLDS

# The 48-GPU R2E bucket configuration: short TP1 <= 4000, medium TP2 <= 12000, long TP4 <= 30000.
BUCKETS = (BucketSpec("short", 1, 4000), BucketSpec("medium", 2, 12000), BucketSpec("long", 4, 30000))
LONG_FAIL = "bash:large:failure"
SMALL_OK = "bash:small:success"


def cluster(**loads: tuple[int, int]) -> ClusterView:
    """s0, s1 (short, node a), m0 (medium, node a), l0 (long, node b); ``loads`` maps id -> (active, queued)."""
    spec = [("s0", "short", "a"), ("s1", "short", "a"), ("m0", "medium", "a"), ("l0", "long", "b")]
    return ClusterView(BUCKETS, tuple(InstanceView(i, b, *loads.get(i, (0, 0)), node=n) for i, b, n in spec))


def ret(state: str, position: int, context: int = 1000) -> ToolReturn:
    tool, size, status = state.split(":")
    return ToolReturn(tool, position=position, context_tokens=context,
                      payload_tokens={"small": 100, "medium": 2000, "large": 9000}[size], status=status)


def info(tid: str, prompt: str | None = None, **kw: int) -> TrajectoryInfo:
    return TrajectoryInfo(tid, prompt_id=prompt, **kw)


def trained_tree(samples: dict[tuple[str, ...], list[int]]) -> CausalPrefixTree:
    """A global tree trained on one trajectory per sample: ``states`` at positions 10, 20, ... and then
    ``remaining`` more tokens. (Prefixes of ``states`` see these trajectories too.)"""
    tree = CausalPrefixTree()
    for states, remainings in samples.items():
        for r in remainings:
            positions = tuple(10 * (i + 1) for i in range(len(states)))
            tree.record(FinishedTrajectory(None, states, positions, r + positions[-1] if positions else r))
    return tree


# --------------------------------------------------------------------------------------------- helpers


def test_bucket_for_boundaries() -> None:
    assert [bucket_for(x, BUCKETS).name for x in (0, 4000, 4001, 12000, 12001, 30000, 99999)] == [
        "short", "short", "medium", "medium", "long", "long", "long"]


def test_cluster_view_validation() -> None:
    with pytest.raises(ClusterViewError, match="ascending max_tokens"):
        ClusterView((BucketSpec("a", 1, 5000), BucketSpec("b", 2, 4000)))
    with pytest.raises(ClusterViewError, match="unknown bucket 'x'"):
        ClusterView(BUCKETS, (InstanceView("i", "x"),))
    with pytest.raises(ClusterViewError, match="duplicate instance id"):
        ClusterView(BUCKETS, (InstanceView("i", "short"), InstanceView("i", "long")))
    with pytest.raises(ClusterViewError, match="active"):
        InstanceView("i", "short", active=-1)


def test_heuristic_migrate_mode_thresholds() -> None:
    def mode(n: int, same: bool) -> str:
        return heuristic_migrate_mode(MigrationQuery(n, same, 1, 4))

    assert [mode(4096, True), mode(4097, True), mode(2048, False), mode(2049, False)] == [
        "reprefill", "kv", "reprefill", "kv"]
    cheap_kv = mode_by_cost(lambda q: 0.1, lambda q: q.seq_len * 1e-4)
    assert cheap_kv(MigrationQuery(500, True, 1, 2)) == "reprefill"  # 0.05 s re-prefill < 0.1 s KV
    assert cheap_kv(MigrationQuery(5000, True, 1, 2)) == "kv"


# --------------------------------------------------------------------------------------------- C-MLFQ


def test_cmlfq_starts_in_smallest_bucket_on_least_loaded_instance() -> None:
    r = CMLFQRouter()
    d = r.start(info("t1"), cluster(s0=(5, 0), s1=(2, 0)))
    assert (d.instance_id, d.bucket, d.reason, d.migrated) == ("s1", "short", "initial", False)


def test_unseen_node_stays() -> None:
    r = CMLFQRouter()
    r.start(info("t1"), cluster())
    d = r.on_tool_return("t1", ret(LONG_FAIL, 300), cluster(s0=(9, 2)))
    assert (d.instance_id, d.bucket, d.reason, d.migrated, d.migrate_mode) == ("s0", "short", "no_stats", False, None)


def test_agreement_migrates_up_then_down() -> None:
    # After a large failure ~20K tokens remain; after a following small success only ~500.
    tree = CausalPrefixTree.from_trajectories(
        FinishedTrajectory(None, (LONG_FAIL, SMALL_OK), (300, 300 + r - 500), 300 + r) for r in (19_000, 20_000, 21_000)
    )
    r = CMLFQRouter(tree=tree)
    r.start(info("t1"), cluster())
    up = r.on_tool_return("t1", ret(LONG_FAIL, 300, context=9000), cluster())
    assert (up.instance_id, up.bucket, up.reason, up.migrated) == ("l0", "long", "migrate", True)
    assert up.migrate_mode == "kv"  # 9000 tokens across nodes a -> b: cheaper to move the KV cache
    assert r.last_estimate is not None and r.last_estimate.depth == 1
    down = r.on_tool_return("t1", ret(SMALL_OK, 800, context=9600), cluster())
    assert (down.instance_id, down.bucket, down.reason, down.migrated) == ("s0", "short", "migrate", True)
    assert down.migrate_mode == "kv"  # the context only grows: 9600 tokens back across nodes


def test_mean_p90_disagreement_stays() -> None:
    # 80% short tails and 20% very long ones: mean ~7.4K (medium) but P90 ~25K (long).
    tree = trained_tree({(LONG_FAIL,): [3000] * 8 + [25_000] * 2})
    r = CMLFQRouter(tree=tree)
    r.start(info("t1"), cluster())
    d = r.on_tool_return("t1", ret(LONG_FAIL, 100), cluster())
    assert (d.instance_id, d.bucket, d.reason, d.migrated) == ("s0", "short", "mean_p90_disagree", False)


def test_already_in_target_bucket_stays_on_its_instance() -> None:
    tree = trained_tree({(SMALL_OK,): [900, 1000, 1100]})
    r = CMLFQRouter(tree=tree)
    first = r.start(info("t1"), cluster())
    # Even though s0 is now much busier than s1, the trajectory sticks to it (prefix cache).
    d = r.on_tool_return("t1", ret(SMALL_OK, 100), cluster(s0=(8, 2)))
    assert d.instance_id == first.instance_id == "s0" and d.reason == "already_in_target_bucket"


def test_deepest_prefix_fallback_drives_the_decision() -> None:
    tree = trained_tree({(LONG_FAIL,): [20_000] * 3})
    r = CMLFQRouter(tree=tree)
    r.start(info("t1"), cluster())
    r.on_tool_return("t1", ret(SMALL_OK, 100), cluster())  # unseen first state: root stats (20K) -> long
    assert r.bucket_of("t1") == "long"
    d = r.on_tool_return("t1", ret(LONG_FAIL, 200), cluster())  # [SMALL_OK, LONG_FAIL] unseen: parent again
    assert d.reason == "already_in_target_bucket" and r.last_estimate is not None
    assert r.last_estimate.depth == 0


def test_cmlfq_learns_from_its_own_finished_trajectories() -> None:
    r = CMLFQRouter()
    for i in range(3):  # three trajectories: after a large failure they run 20K more tokens
        tid = f"warm{i}"
        r.start(info(tid, "p"), cluster())
        r.on_tool_return(tid, ret(LONG_FAIL, 500), cluster())
        r.on_turn_end(tid, 20_500)
        r.finish(tid, 20_500)
    assert r.active_trajectories == 0
    r.start(info("new", "p"), cluster())
    d = r.on_tool_return("new", ret(LONG_FAIL, 400), cluster())
    assert (d.bucket, d.reason) == ("long", "migrate")
    est = r.tree.lookup("p", [LONG_FAIL])
    assert est is not None and est.source == "prompt" and est.mean == 20_000


def test_cmlfq_rebuilds_on_step() -> None:
    r = CMLFQRouter(rebuild_interval=2, history_size=2)
    for i, total in enumerate((30_000, 100, 200)):
        r.start(info(f"t{i}"), cluster())
        r.finish(f"t{i}", total)
    r.on_step(1)
    assert r.tree.global_tree.root.stats.count == 3
    r.on_step(2)
    assert r.tree.rebuilds == 1 and r.tree.global_tree.root.stats.count == 2


def test_discard_forgets_without_learning() -> None:
    r = CMLFQRouter()
    r.start(info("t1"), cluster())
    r.discard("t1")
    assert r.tree.lookup(None, []) is None and r.active_trajectories == 0
    with pytest.raises(RoutingError, match="unknown trajectory 't1'"):
        r.finish("t1", 10)


def test_tool_state_uses_configured_thresholds() -> None:
    rt = ToolReturn("bash", position=0, payload_chars=3000, output="fine")
    assert tool_state_key(rt) == "bash:medium:success"
    assert tool_state_key(rt, R2E_THRESHOLDS) == "bash:medium:success"
    assert tool_state_key(ToolReturn("bash", 0, payload_chars=900), R2E_THRESHOLDS) == "bash:small:success"


# --------------------------------------------------------------------------------------------- placement


def test_queue_cap_falls_back_to_nearest_bucket_then_globally_least_loaded() -> None:
    r = CMLFQRouter(max_queue_length=3)
    d = r.start(info("t1"), cluster(s0=(4, 3), s1=(2, 3)))  # both short instances at the cap
    assert (d.instance_id, d.bucket, d.placed_bucket) == ("m0", "short", "medium")
    # Everything full: overflow to the least load per TP degree (l0: 9/4 < s1: 5/1 < m0: 8/2).
    d = r.start(info("t2"), cluster(s0=(4, 3), s1=(2, 3), m0=(5, 3), l0=(6, 3)))
    assert d.instance_id == "l0"


def test_when_full_queue_then_reroute() -> None:
    full = cluster(s0=(1, 3), s1=(1, 3), m0=(1, 3), l0=(1, 3))
    r = CMLFQRouter(when_full="queue")
    d = r.start(info("t1"), full)
    assert d.queued and d.instance_id is None and d.bucket == "short"
    d = r.reroute("t1", cluster(s0=(1, 3), s1=(1, 1), m0=(1, 3), l0=(1, 3)))
    assert (d.instance_id, d.migrate_mode) == ("s1", None)  # first placement: nothing to move


def test_when_full_raise_and_no_ready_instance() -> None:
    full = cluster(s0=(1, 3), s1=(1, 3), m0=(1, 3), l0=(1, 3))
    with pytest.raises(NoInstanceAvailable, match="no ready instance with room"):
        CMLFQRouter(when_full="raise").start(info("t1"), full)
    down = ClusterView(BUCKETS, (InstanceView("s0", "short", ready=False),))
    with pytest.raises(NoInstanceAvailable):
        CMLFQRouter().start(info("t1"), down)
    assert CMLFQRouter(when_full="queue").start(info("t1"), down).queued


def test_cap_metric_load_counts_running_requests() -> None:
    r = CMLFQRouter(max_queue_length=3, cap_metric="load")
    d = r.start(info("t1"), cluster(s0=(3, 0), s1=(2, 1)))
    assert d.instance_id == "m0"


def test_full_target_bucket_keeps_request_in_place_until_room() -> None:
    tree = trained_tree({(LONG_FAIL,): [20_000] * 3, (LONG_FAIL, LONG_FAIL): [20_000] * 3})
    r = CMLFQRouter(tree=tree)
    r.start(info("t1"), cluster())
    d = r.on_tool_return("t1", ret(LONG_FAIL, 100), cluster(l0=(5, 3)))
    # C-MLFQ commits to the target bucket (the decision routing accuracy scores); the context waits on s0.
    assert (d.instance_id, d.bucket, d.reason, d.migrated) == ("s0", "long", "target_bucket_full", True)
    d = r.on_tool_return("t1", ret(LONG_FAIL, 200), cluster(l0=(5, 3)))
    assert (d.instance_id, d.bucket, d.reason) == ("s0", "long", "target_bucket_full")
    d = r.on_tool_return("t1", ret(LONG_FAIL, 300), cluster())
    assert (d.instance_id, d.bucket, d.reason, d.migrated) == ("l0", "long", "migrate", True)
    d = r.on_tool_return("t1", ret(LONG_FAIL, 400), cluster())  # the deferred move is done: sticky again
    assert (d.instance_id, d.bucket, d.reason, d.migrated) == ("l0", "long", "already_in_target_bucket", False)


def test_full_target_bucket_keeps_a_baseline_in_its_bucket() -> None:
    r = LAMLFQRouter()
    r.start(info("t1"), cluster())
    d = r.on_tool_return("t1", ret(SMALL_OK, 5_000, context=5_100), cluster(m0=(5, 3)))
    assert (d.instance_id, d.bucket, d.reason, d.migrated) == ("s0", "short", "target_bucket_full", False)
    d = r.on_tool_return("t1", ret(SMALL_OK, 5_100, context=5_300), cluster())
    assert (d.instance_id, d.bucket, d.reason, d.migrated) == ("m0", "medium", "demote", True)


def test_lost_instance_is_replaced_in_bucket_with_reprefill() -> None:
    r = CMLFQRouter()
    r.start(info("t1"), cluster())  # on s0
    without_s0 = ClusterView(BUCKETS, tuple(i for i in cluster().instances if i.id != "s0"))
    d = r.on_tool_return("t1", ret(SMALL_OK, 100), without_s0)
    assert (d.instance_id, d.migrated, d.migrate_mode, d.reason) == ("s1", False, "reprefill", "no_stats")


def test_replanned_away_bucket_is_remapped_by_threshold() -> None:
    r = OracleRouter()
    r.start(info("t1", true_remaining=8000), cluster())  # medium (<= 12000), on m0
    replanned = ClusterView((BucketSpec("short", 1, 4000), BucketSpec("long", 8, 40_000)),
                            (InstanceView("s0", "short"), InstanceView("x0", "long")))
    d = r.on_tool_return("t1", ToolReturn("bash", 100), replanned)
    assert (d.instance_id, d.bucket, d.migrate_mode) == ("x0", "long", "reprefill")


def test_with_instance_updates_one_snapshot_for_batched_decisions() -> None:
    r = CMLFQRouter()
    view = cluster()
    picks = []
    for i in range(4):
        d = r.start(info(f"t{i}"), view)
        assert d.instance_id is not None
        picks.append(d.instance_id)
        inst = view.instance(d.instance_id)
        assert inst is not None
        view = view.with_instance(d.instance_id, active=inst.active + 1)
    assert picks == ["s0", "s1", "s0", "s1"]


def test_routing_errors() -> None:
    r = CMLFQRouter()
    r.start(info("t1"), cluster())
    with pytest.raises(RoutingError, match="already started"):
        r.start(info("t1"), cluster())
    with pytest.raises(RoutingError, match="unknown trajectory 'nope'"):
        r.on_tool_return("nope", ret(SMALL_OK, 1), cluster())
    r.on_tool_return("t1", ret(SMALL_OK, 500), cluster())
    with pytest.raises(RoutingError, match="position 100 < previous 500"):
        r.on_tool_return("t1", ret(SMALL_OK, 100), cluster())


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
    r = OracleRouter()
    got = [r.start(info(f"t{x}", true_remaining=x), cluster()).bucket for x in (2000, 10_000, 35_000)]
    assert got == ["short", "medium", "long"]
    d = r.on_tool_return("t35000", ToolReturn("bash", 100, true_remaining=100), cluster())
    assert (d.bucket, d.migrated) == ("long", False)  # places once by default
    with pytest.raises(RoutingError, match="true_remaining"):
        r.start(info("x"), cluster())
    follower = OracleRouter(follow=True)
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
            d = r.on_tool_return(tid, ret(rng.choice(tree_states), pos, context=pos + 500), v)
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
