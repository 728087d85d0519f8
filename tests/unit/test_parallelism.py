"""EARL parallelism selector: context-growth runs, range switching, OOM guard, the Fig. 3 table."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from libra.policies.cost import RolloutCostModel, load_hardware, load_model
from libra.policies.parallelism.selector import (
    ParallelismError,
    ParallelismSelector,
    ProfileRow,
    ProfileTable,
    batch_tgs,
    build_profile_table,
    earl_fig3_table,
    make_selector,
)

CM = RolloutCostModel(load_hardware("h200"), load_model("qwen3-14b"))
N_GPUS = 16
TPS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def table() -> ProfileTable:
    return build_profile_table(CM, N_GPUS, configs=TPS, loads=(32, 128))


@pytest.mark.parametrize("load", [32, 128])
def test_context_growth_run_beats_every_fixed_tp_and_never_ooms(table: ProfileTable, load: int) -> None:
    def oom(tp: int, ctx: float, n: int) -> bool:
        return batch_tgs(CM, tp, ctx, n, N_GPUS)[1]

    selector = ParallelismSelector(table, oom_check=oom)
    contexts = np.geomspace(1024, 32768, 40)  # average context grows 1K -> 32K over 40 steps
    chosen, totals = [], {tp: 0.0 for tp in TPS}
    best_tps: set[int] = set()  # the best fixed TP at each context (physics decides whether it changes)
    selected_total = 0.0
    for ctx in contexts:
        sel = selector.select(float(ctx), load)
        tgs, is_oom = batch_tgs(CM, sel.tp, float(ctx), load, N_GPUS)
        assert not is_oom and not sel.oom
        fixed = {tp: batch_tgs(CM, tp, float(ctx), load, N_GPUS) for tp in TPS}
        best_fixed = max(v for v, o in fixed.values() if not o)
        assert tgs >= best_fixed * (1 - 1e-9), (ctx, sel.tp, fixed)
        for tp, (v, o) in fixed.items():
            totals[tp] += 0.0 if o else v
        selected_total += tgs
        chosen.append(sel.tp)
    assert selected_total >= max(totals.values())
    assert chosen == sorted(chosen)  # switches only toward larger TP
    assert len(set(chosen)) >= min(2, len(best_tps))  # and does switch when the best fixed TP changes
    assert chosen[-1] == 8


def test_fixed_small_tp_would_oom_where_the_selector_does_not(table: ProfileTable) -> None:
    # Qwen3-14B keeps ~160 KB of KV per token; an H200 at 0.88 utilisation holds ~600K tokens beside its
    # weights, so 1,024 responses dealt over 16 TP-1 instances (64 each) run out of KV well before 32K context.
    ooms = [ctx for ctx in np.geomspace(1024, 32768, 40) if batch_tgs(CM, 1, float(ctx), 1024, N_GPUS)[1]]
    assert ooms, "expected TP1 to run out of KV memory at 1,024 responses and long context"
    assert not batch_tgs(CM, 8, float(ooms[0]), 1024, N_GPUS)[1]  # where TP-8 (8x the KV room each) does not


def test_ranges_tile_the_context_axis(table: ProfileTable) -> None:
    for rows in table.rows.values():
        assert rows[0].lo == 0.0 and rows[-1].hi == math.inf
        assert all(a.hi == b.lo for a, b in itertools.pairwise(rows))
        assert all(a.best != b.best for a, b in itertools.pairwise(rows))
    assert (table.load_key(20), table.load_key(32), table.load_key(33), table.load_key(500)) == (32, 32, 128, 128)


def test_selector_switches_only_when_entering_a_new_range() -> None:
    rows = (
        ProfileRow(0.0, 4096.0, 2048.0, {4: 1.0, 8: 0.8}, frozenset(), 4),
        ProfileRow(4096.0, math.inf, 8192.0, {4: 1.0, 8: 1.1}, frozenset(), 8),
    )
    sel = ParallelismSelector(ProfileTable((4, 8), {32: rows}), initial_tp=8)
    first = sel.select(1000, 32)
    assert (first.tp, first.switched, first.reason) == (4, True, "range_changed")
    again = sel.select(3000, 32)
    assert (again.tp, again.switched, again.reason) == (4, False, "same_range")
    up = sel.select(5000, 32)
    assert (up.tp, up.switched) == (8, True) and (up.range_lo, up.range_hi) == (4096.0, math.inf)


def test_oom_guard_goes_to_the_next_larger_tp() -> None:
    rows = (ProfileRow(0.0, math.inf, 1000.0, {1: 3.0, 2: 2.0, 4: 1.5, 8: 1.0}, frozenset(), 1),)
    table = ProfileTable((1, 2, 4, 8), {16: rows})

    def oom(tp: int, ctx: float, load: int) -> bool:
        return tp < 4 and ctx > 5000  # small TPs run out of memory past 5K

    sel = ParallelismSelector(table, oom_check=oom)
    assert sel.select(1000, 16).tp == 1
    guarded = sel.select(6000, 16)
    assert (guarded.tp, guarded.reason, guarded.oom) == (4, "oom_guard", False)
    everything = ParallelismSelector(table, oom_check=lambda tp, c, n: True).select(1000, 16)
    assert everything.oom and everything.reason == "all_configs_oom" and everything.tp == 8


def test_earl_fig3_table_reproduces_the_paper_choices() -> None:
    sel32 = make_selector(source="earl_fig3")
    picks32 = {ctx: sel32.select(ctx, 32).tp for ctx in (1024, 2048, 4096, 8192, 16384, 32768)}
    assert picks32 == {1024: 4, 2048: 4, 4096: 4, 8192: 4, 16384: 8, 32768: 8}
    table = earl_fig3_table()
    assert table.tgs(4, 1024, 32) / table.tgs(8, 1024, 32) == pytest.approx(1 / 0.693)  # TP4 ~31% better early
    assert table.tgs(8, 32768, 32) == pytest.approx(1.05)  # TP8 ~5% better late
    sel128 = make_selector(source="earl_fig3")
    for ctx in (1024, 2048, 4096, 8192, 16384, 32768):
        pick = sel128.select(ctx, 128)
        assert not pick.oom
    assert pick.tp == 8 and 4 in table.row(32768, 128)[2].oom  # TP4 OOMs at 32K x 128


def test_make_selector_from_cost_model_and_errors() -> None:
    sel = make_selector(CM, N_GPUS, loads=(32,))
    assert sel.select(30000, 32).tp == 8
    with pytest.raises(ValueError, match=r"unknown parallelism table source: 'fig9' \(known: cost_model, earl_fig3\)"):
        make_selector(CM, source="fig9")
    with pytest.raises(ParallelismError, match="needs a RolloutCostModel"):
        make_selector(None)
    with pytest.raises(ParallelismError, match="context must be > 0"):
        sel.select(0, 32)
    with pytest.raises(ParallelismError, match="load must be > 0"):
        sel.select(100, 0)
    with pytest.raises(ParallelismError, match="initial_tp=3"):
        ParallelismSelector(earl_fig3_table(), initial_tp=3)
    with pytest.raises(ParallelismError, match="no config"):
        build_profile_table(CM, 1, configs=(2, 4))


def test_tiny_cpu_profile_builds_a_table() -> None:
    cm = RolloutCostModel(load_hardware("cpu"), load_model("tiny"))
    table = build_profile_table(cm, 2, configs=(1, 2), loads=(4,), min_context=64, max_context=2048)
    sel = ParallelismSelector(table)
    assert sel.select(128, 4).tp in (1, 2)
