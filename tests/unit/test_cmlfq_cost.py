"""The distribution- and cost-based C-MLFQ router (``cmlfq_cost``) on hand-built trajectories and snapshots."""

from __future__ import annotations

import pytest

from libra.policies.routing.cmlfq_cost import CostCMLFQRouter, ModelRouterCosts, histogram
from libra.policies.cost import RolloutCostModel, load_hardware, load_model
from libra.policies.routing.prefix_tree import CausalPrefixTree, FinishedTrajectory
from libra.policies.routing.baselines import make_router, router_names
from libra.policies.routing.interface import (
    BucketSpec,
    ClusterView,
    ClusterViewError,
    InstanceView,
    MigrationQuery,
    Router,
    ToolReturn,
    TrajectoryInfo,
)

BUCKETS = (BucketSpec("short", 1, 4000), BucketSpec("medium", 2, 12000), BucketSpec("long", 4, 30000))
STATE = "bash:small:success"


class FakeCosts:
    """Round numbers: a decode step of ``0.01 + 0.02 * seqs / tp`` s, no per-turn stall, unbounded KV,
    prefill ``1e-4 * tokens / tp`` s, KV transfer ``0.05 + 1e-4 * tokens`` s."""

    request_overhead_s = 0.0

    def decode_step(self, tp: int, seqs: int, tokens: float) -> float:
        return 0.01 + 0.02 * seqs / tp

    def prefill(self, tp: int, tokens: float) -> float:
        return 1e-4 * tokens / tp

    def token_capacity(self, tp: int) -> float:
        return 1e12

    def kv_seconds(self, q: MigrationQuery) -> float:
        return 0.05 + 1e-4 * q.seq_len

    def reprefill_seconds(self, q: MigrationQuery) -> float:
        return self.prefill(q.dst_tp, q.seq_len)


def cluster(buckets: tuple[BucketSpec, ...] = BUCKETS, **loads: tuple[int, int]) -> ClusterView:
    """s0 (short, node a), m0 (medium, node a), l0 (long, node b); ``loads``: id -> (active, queued)."""
    spec = [("s0", buckets[0].name, "a"), ("m0", buckets[1].name, "a"), ("l0", buckets[-1].name, "b")]
    return ClusterView(buckets, tuple(InstanceView(i, b, *loads.get(i, (0, 0)), node=n) for i, b, n in spec))


def tree_with(remaining: list[int], root_total: int | None = None) -> CausalPrefixTree:
    """A tree whose node after one ``STATE`` return (at response position 100) holds ``remaining``."""
    tree = CausalPrefixTree()
    for r in remaining:
        tree.record(FinishedTrajectory(None, (STATE,), (100,), 100 + r))
    if root_total is not None:
        for _ in range(len(remaining)):
            tree.record(FinishedTrajectory(None, (), (), root_total))
    return tree


def router(tree: CausalPrefixTree, **kw: object) -> CostCMLFQRouter:
    params: dict[str, object] = {"costs": FakeCosts(), "payload_per_turn": 0.0, "gen_share": 0.5}
    params.update(kw)
    return CostCMLFQRouter(tree=tree, **params)  # type: ignore[arg-type]


def tool_return(context: int) -> ToolReturn:
    return ToolReturn("bash", position=50, context_tokens=context, payload_tokens=50, status="success")


def test_registered_and_builds_by_name() -> None:
    assert "cmlfq_cost" in router_names()
    r = make_router("cmlfq_cost", costs=FakeCosts(), min_visits=2, rebuild_interval=5, thresholds="r2e",
                    cap_metric="load")
    assert isinstance(r, Router) and isinstance(r, CostCMLFQRouter) and r.min_visits == 2
    with pytest.raises(ValueError, match="unknown parameter"):
        make_router("cmlfq_cost", costs=FakeCosts(), bogus=1)
    with pytest.raises(ClusterViewError):
        CostCMLFQRouter(costs=FakeCosts(), initial="largest")  # type: ignore[arg-type]


def test_histogram_bins_follow_bucket_thresholds() -> None:
    h = histogram([100, 3000, 5000, 40000], BUCKETS)
    assert h == [(0.5, 1550.0), (0.25, 5000.0), (0.25, 40000.0)]
    assert histogram([], BUCKETS) == []


def test_moves_up_when_the_histogram_says_long() -> None:
    r = router(tree_with([20000] * 8 + [500] * 2), initial="smallest")
    assert r.start(TrajectoryInfo("t", prompt_tokens=200), cluster()).instance_id == "s0"
    d = r.on_tool_return("t", tool_return(400), cluster())
    assert d.reason == "migrate" and d.migrated and d.instance_id == "l0" and d.bucket == "long"
    assert r.last_costs["l0"] < r.last_costs["m0"] < r.last_costs["s0"]


def test_stays_when_moving_does_not_pay() -> None:
    r = router(tree_with([20] * 10), initial="smallest")
    r.start(TrajectoryInfo("t", prompt_tokens=200), cluster())
    # 10 generated tokens left: TP-4 saves 10 * (0.03 - 0.015) s, far less than moving 20K tokens
    d = r.on_tool_return("t", tool_return(20000), cluster())
    assert d.reason == "stay_cheaper" and not d.migrated and d.instance_id == "s0" and d.bucket == "short"
    assert d.migrate_mode is None


def _on_loaded_long_instance(remaining: list[int]) -> tuple[CostCMLFQRouter, ClusterView]:
    r = router(tree_with(remaining, root_total=25000))  # initial="cost": the root says long -> TP-4
    assert r.start(TrajectoryInfo("t", prompt_tokens=200), cluster()).instance_id == "l0"
    return r, cluster(l0=(40, 0))  # TP-4 home now crowded: 0.215 s per token against 0.03 on an idle TP-1


def test_does_not_move_down_near_the_end_when_the_move_costs_more_than_it_saves() -> None:
    r, view = _on_loaded_long_instance([20] * 10)
    d = r.on_tool_return("t", tool_return(30000), view)
    assert d.reason == "stay_cheaper" and d.instance_id == "l0" and d.bucket == "long" and not d.migrated


def test_moves_down_when_the_saving_exceeds_the_move() -> None:
    r, view = _on_loaded_long_instance([5000] * 10)
    d = r.on_tool_return("t", tool_return(30000), view)
    assert d.reason == "migrate" and d.migrated and d.instance_id == "m0" and d.migrate_mode == "kv"


def test_ties_and_small_gains_stay() -> None:
    flat = (BucketSpec("a", 2, 4000), BucketSpec("b", 2, 30000))
    r = router(tree_with([20000] * 10), initial="smallest")
    r.start(TrajectoryInfo("t", prompt_tokens=0), cluster(flat))
    d = r.on_tool_return("t", ToolReturn("bash", position=0, context_tokens=0, payload_tokens=0), cluster(flat))
    assert d.reason == "stay_cheaper" and d.instance_id == "s0"  # same TP, same load: equal cost, stay
    r = router(tree_with([20000] * 10), initial="smallest", min_gain_s=1e6)
    r.start(TrajectoryInfo("t", prompt_tokens=200), cluster())
    assert r.on_tool_return("t", tool_return(400), cluster()).reason == "stay_cheaper"


def test_fallbacks_like_cmlfq() -> None:
    r = router(CausalPrefixTree(), initial="smallest")
    r.start(TrajectoryInfo("t", prompt_tokens=200), cluster())
    assert r.on_tool_return("t", tool_return(400), cluster()).reason == "no_stats"
    # home gone and no room anywhere: the bucket of the mean, placed with the usual overflow fallback
    r = router(tree_with([20000] * 10), initial="smallest")
    r.start(TrajectoryInfo("t", prompt_tokens=200), cluster())
    full = ClusterView(BUCKETS, (InstanceView("m0", "medium", 5, 3, node="a"), InstanceView("l0", "long", 9, 3, node="b")))
    d = r.on_tool_return("t", tool_return(400), full)
    assert d.reason == "no_room" and d.bucket == "long" and d.instance_id in ("m0", "l0")
    # initial "cost" without statistics: C-MLFQ's smallest bucket
    r = router(CausalPrefixTree())
    assert r.start(TrajectoryInfo("u", prompt_tokens=200), cluster()).reason == "initial"


def test_learns_the_turn_shape_from_finished_trajectories() -> None:
    r = router(tree_with([20] * 10), initial="smallest", learn_after=1, gen_per_turn=999.0)
    r.start(TrajectoryInfo("t", prompt_tokens=200), cluster())
    r.on_tool_return("t", ToolReturn("bash", position=300, context_tokens=600, payload_tokens=100), cluster())
    r.on_turn_end("t", 700)
    r.finish("t", 800)
    gen_turn, payload_turn, share = r.shape()
    assert gen_turn == pytest.approx(350.0) and payload_turn == pytest.approx(50.0)
    assert share == pytest.approx(700 / 800)


def test_model_costs_match_the_cost_model() -> None:
    cm = RolloutCostModel(load_hardware("a800"), load_model("qwen3-14b"))
    c = ModelRouterCosts(cm)
    assert c.decode_step(4, 8, 1e5) == pytest.approx(float(cm.decode_step(4, 8, 1e5)))
    assert c.prefill(2, 0) == 0.0 and c.prefill(2, 4096) == pytest.approx(float(cm.prefill_time(2, 4096)))
    q = MigrationQuery(40000, True, 1, 4)
    assert c.kv_seconds(q) < 0.33 < c.reprefill_seconds(q)  # docs/papers.md §1.4.3: < 330 ms at 40K same node


def test_per_instance_load_is_kept_incrementally_and_matches_a_full_scan() -> None:
    """Over random starts, tool returns, turn ends, reroutes, finishes and discards, the incremental
    per-instance aggregate equals a scan of every live track."""
    import random

    rng = random.Random(7)
    r = router(tree_with([500, 3000, 9000, 30000] * 5))
    view = cluster(s0=(1, 0))
    live: list[str] = []
    pos: dict[str, int] = {}
    for step in range(400):
        op = rng.random()
        if op < 0.3 or not live:
            tid = f"t{step}"
            r.start(TrajectoryInfo(tid, f"p{step % 3}", rng.randint(50, 900)), view)
            live.append(tid)
            pos[tid] = 0
        elif op < 0.6:
            tid = rng.choice(live)
            pos[tid] += rng.randint(1, 400)
            ret = ToolReturn("bash", position=pos[tid], context_tokens=pos[tid] + 2000, payload_tokens=50,
                             status="success")
            r.on_tool_return(tid, ret, view)
        elif op < 0.7:
            tid = rng.choice(live)
            r.on_turn_end(tid, pos[tid] + rng.randint(0, 50))
        elif op < 0.8:
            r.reroute(rng.choice(live), view)
        else:
            tid = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.5:
                r.finish(tid, pos[tid] + 100)
            else:
                r.discard(tid)
        scan: dict[str, tuple[int, int]] = {}
        for t in r._tracks.values():
            if t.instance is not None:
                n, c = scan.get(t.instance, (0, 0))
                scan[t.instance] = (n + 1, c + t.context)
        assert r._homed == scan, step
