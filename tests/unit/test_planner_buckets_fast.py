"""The pruned bucket DP (``BucketTable``) against the dense DP it replaces, kept here as the oracle.

The dense DP below is the straightforward computation the table used before (a ``(budget - w) x (n +
1) x (n + 1)`` candidate array for every TP, instance count ``k`` and state): the fast table must give
the same DP values, the same back-pointers, hence the same buckets for every budget, and the planner
the same plan.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from libra.bench.planner import long_tail_workload
from libra.policies.cost import RolloutCostModel, TrainingCostModel, load_hardware, load_model
from libra.policies.planner.allocators import GlobalResourcePlanner, PlannerConfig, Workload
from libra.policies.planner.buckets import BucketCosts, BucketTable, next_state
from libra.policies.planner.rollout_dp import RolloutSample

from planner_refs import RM, _requests  # reference sums (tests/unit)


def dense_table(costs: BucketCosts, tps: tuple[int, ...], budget: int, het: bool, cap: int | None) -> list:
    """The dense DP: ``[(dp before the TP, ch_k, ch_j, ch_s) per TP] + [final dp]``."""
    n1, G1 = costs.sample.size + 1, budget + 1
    n_c = cap + 1 if cap is not None else 1
    S = (3 if het else 1) * n_c
    dp = np.full((S, G1, n1), np.inf)
    dp[0, :, 0] = 0.0
    out = []
    for tp in sorted(set(tps)):
        new = dp.copy()
        ch = [np.zeros((S, G1, n1), np.int32) for _ in range(3)]
        for k in range(1, budget // tp + 1):
            if cap is not None and k > cap:
                break
            w, c = k * tp, costs.cost(tp, k)
            for s in range(S):
                t = next_state(s, k, n_c, het, cap)
                if t < 0:
                    continue
                cand = np.maximum(dp[s, : G1 - w][:, :, None], c[None, :, :])
                arg = cand.argmin(axis=1)
                val = np.take_along_axis(cand, arg[:, None, :], axis=1)[:, 0, :]
                upd = val < new[t, w:]
                new[t, w:][upd] = val[upd]
                for a, v in zip(ch, (k, arg, s)):
                    a[t, w:][upd] = v[upd] if isinstance(v, np.ndarray) else v
        out.append((dp, *ch))
        dp = new
    return out + [dp]


def _assert_same(table: BucketTable, ref: list) -> None:
    """Every layer but the last equal in full; the last (solved for the whole sample only) at ``i = n``,
    which is all that ``time`` and ``buckets`` read; and both back-track to the same buckets."""
    assert len(table._layers) == len(ref) - 1
    for mine, theirs in zip(table._layers[:-1], ref[:-2]):
        for a, b in zip(mine, theirs):
            np.testing.assert_array_equal(a, b)
    for a, b in zip((*table._layers[-1], table._dp), (*ref[-2], ref[-1])):
        np.testing.assert_array_equal(a[..., -1], b[..., -1])
    dense = copy.copy(table)
    dense._layers, dense._dp = ref[:-1], ref[-1]
    for g in range(table.budget + 1):
        assert table.time(g) == dense.time(g)
        assert table.buckets(g) == dense.buckets(g)


@pytest.mark.parametrize(("gpus", "n", "tps", "seed", "het", "cap", "lag"), [
    (8, 6, (1, 2, 4), 0, False, None, 1),
    (12, 9, (1, 2, 4, 8), 1, True, None, 1),
    (16, 12, (1, 2, 4, 8), 2, False, 5, 2),
    (10, 7, (2, 4), 3, True, 4, 1),
    (24, 20, (1, 2, 4, 8), 4, False, None, 3),
])
def test_small_tables_equal_the_dense_dp(gpus, n, tps, seed, het, cap, lag) -> None:
    costs = BucketCosts(RM, RolloutSample.from_workload(Workload.from_pairs(_requests(n, seed))), lag)
    for c in (costs, costs.shifted(5.0)):
        table = BucketTable(c, tps, gpus, require_heterogeneous=het, max_instances=cap)
        _assert_same(table, dense_table(c, tps, gpus, het, cap))


@pytest.mark.parametrize(("gpus", "het", "cap"), [(64, False, None), (48, True, None), (40, False, 12)])
def test_medium_tables_equal_the_dense_dp(gpus, het, cap) -> None:
    hw, model = load_hardware("a800"), load_model("qwen3-14b")
    sample = RolloutSample.from_workload(long_tail_workload(256, seed=1), 256, 24)
    costs = BucketCosts(RolloutCostModel(hw, model), sample)
    table = BucketTable(costs, (1, 2, 4, 8), gpus, require_heterogeneous=het, max_instances=cap)
    _assert_same(table, dense_table(costs, (1, 2, 4, 8), gpus, het, cap))
    assert any(len(table.buckets(g)) >= 2 for g in range(gpus + 1))  # a case where buckets interact


class _DensePlanner(GlobalResourcePlanner):
    """The planner with the dense oracle's values and choices swapped into its bucket tables."""

    def _tables(self, ctx, budget, costs=None):
        tables = super()._tables(ctx, budget, costs)
        for tb in tables:
            ref = dense_table(tb.costs, tb.tps, tb.budget, tb.het, tb.cap)
            tb._layers, tb._dp = ref[:-1], ref[-1]
        return tables


@pytest.mark.parametrize("gpus", [16, 40])
def test_planner_plan_equals_the_dense_planner(gpus: int) -> None:
    hw, model = load_hardware("a800"), load_model("qwen3-14b")
    wl = long_tail_workload(256, seed=2)
    cfg = PlannerConfig(n_gpus=gpus, global_batch=256, group_size=16)
    args = (RolloutCostModel(hw, model), TrainingCostModel(hw, model), cfg)
    fast, dense = GlobalResourcePlanner(*args).search(wl), _DensePlanner(*args).search(wl)
    assert fast.layout_key() == dense.layout_key()
    assert fast.objective == dense.objective and fast.rollout == dense.rollout


def test_bench_reference_runs_the_dense_table_and_finds_the_same_plan() -> None:
    from libra.bench.planner import DenseBucketTable, build_parser, run

    args = build_parser().parse_args(["--gpus", "16,24", "--requests", "128", "--batch", "128", "--repeat", "1",
                                      "--reference"])
    rows = run(args)["rows"]
    assert [r["gpus"] for r in rows] == [16, 24]
    assert all(r["same_plan_as_dense"] and r["dense_s"] > 0 for r in rows)
    costs = BucketCosts(RM, RolloutSample.from_workload(Workload.from_pairs(_requests(9, 7))))
    fast, dense = BucketTable(costs, (1, 2, 4), 12), DenseBucketTable(costs, (1, 2, 4), 12)
    assert [fast.buckets(g) for g in range(13)] == [dense.buckets(g) for g in range(13)]
