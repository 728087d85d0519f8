"""C-MLFQ and the baseline routers, driven with hand-built trajectories and cluster snapshots."""

from __future__ import annotations


import pytest

from libra.policies.routing.cmlfq import CMLFQRouter, tool_state_key
from libra.policies.routing.prefix_tree import CausalPrefixTree, FinishedTrajectory
from libra.policies.routing.baselines import (
    LAMLFQRouter,
    OracleRouter,
)
from libra.policies.routing.interface import (
    BucketSpec,
    ClusterView,
    ClusterViewError,
    InstanceView,
    MigrationQuery,
    NoInstanceAvailable,
    RoutingError,
    ToolReturn,
    bucket_for,
    heuristic_migrate_mode,
    mode_by_cost,
)
from libra.policies.routing.tool_state import R2E_THRESHOLDS

from router_cases import BUCKETS, LONG_FAIL, SMALL_OK, cluster, info, ret, trained_tree  # tests/unit


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


def test_mode_rule_goes_to_the_modal_bucket_where_mean_and_p90_disagree() -> None:
    # agree: 6 of 10 samples long, mean 16.2K and P90 25K both long -> both rules move up.
    windows = {"agree": [3000] * 4 + [25_000] * 6, "bimodal": [3000] * 3 + [6000] * 5 + [25_000] * 2}
    got = {}
    for name, window in windows.items():
        for rule in ("mean_p90", "mode"):
            r = CMLFQRouter(tree=trained_tree({(LONG_FAIL,): window}), rule=rule)
            r.start(info("t1"), cluster())
            d = r.on_tool_return("t1", ret(LONG_FAIL, 100), cluster())
            got[name, rule] = (d.bucket, d.reason)
    assert got["agree", "mean_p90"] == got["agree", "mode"] == ("long", "migrate")
    # bimodal: mean 8.9K (medium), P90 25K (long) disagree; 5 of 10 samples are medium, 3 short, 2 long.
    assert got["bimodal", "mean_p90"] == ("short", "mean_p90_disagree")
    assert got["bimodal", "mode"] == ("medium", "migrate")


def test_mode_rule_keeps_the_current_bucket_on_a_tie_and_rejects_unknown_rules() -> None:
    r = CMLFQRouter(tree=trained_tree({(LONG_FAIL,): [3000] * 5 + [25_000] * 5}), rule="mode")
    r.start(info("t1"), cluster())
    assert r.on_tool_return("t1", ret(LONG_FAIL, 100), cluster()).reason == "already_in_target_bucket"
    with pytest.raises(ClusterViewError):
        CMLFQRouter(rule="median")  # type: ignore[arg-type]


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
    r = OracleRouter(placement="bucket")
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
