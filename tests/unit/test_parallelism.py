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


class LinesCost:
    """A cost model whose answers are worked out by hand (the selector's table is built from it, its choices
    are checked against the hand-worked ones, not against the same model).

    An instance of TP ``tp`` serving ``per`` responses of ``ctx`` tokens takes
    ``per * ctx * (U[tp] + V[tp] * ctx) / tp`` seconds, so with ``load`` responses dealt evenly to
    ``n / tp`` instances (``per = load * tp / n``) the tokens per GPU per second are
    ``1 / (U[tp] + V[tp] * ctx)``: the best TP has the lowest line ``U + V * ctx``. KV: an instance holds
    ``tp * M - W`` tokens (weights sharded over its GPUs), and needs ``per * ctx``.

    Hand-worked at ``load = 32`` on 16 GPUs (``per = 2 tp``): lines cross at 1|2: 0.2 / 0.5e-4 = 4,000,
    2|4: 0.4 / 0.3e-4 = 13,333.3, 4|8: 0.4 / 0.15e-4 = 26,666.7 (the 1|4, 1|8 and 2|8 crossings lie above
    the envelope); TP1 runs out of KV where 2 ctx > M - W = 6,000, i.e. past 3,000 tokens, TP2 past 32,000,
    TP4 past 46,500, TP8 past 53,750. So the best TP that fits is 1 below 3,000, 2 up to 13,333, 4 up to
    26,667 and 8 beyond.
    """

    U = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.0}
    V = {1: 1.0e-4, 2: 0.5e-4, 4: 0.2e-4, 8: 0.05e-4}
    M, W = 122_000, 116_000

    def fits_load(self, tp: int, context: float, per: int) -> bool:
        return per * context <= tp * self.M - self.W

    def segment_cost(self, tp: int, prompt: float, gen: float, per: int, context: float) -> float:
        return per * context * (self.U[tp] + self.V[tp] * context) / tp


def _hand_worked_best(ctx: float) -> int:
    return 1 if ctx <= 3000 else 2 if ctx < 40000 / 3 else 4 if ctx < 80000 / 3 else 8


def _brute_force_best(ctx: float, load: int, n_gpus: int) -> int:
    """Every TP tried with the closed forms of :class:`LinesCost` (not through the selector's code)."""
    c = LinesCost()
    fits = [tp for tp in TPS if load * tp / n_gpus * ctx <= tp * c.M - c.W]
    return min(fits, key=lambda tp: c.U[tp] + c.V[tp] * ctx)


def test_context_growth_run_switches_where_the_hand_worked_best_tp_changes() -> None:
    cost = LinesCost()
    table = build_profile_table(cost, N_GPUS, configs=TPS, loads=(32,), min_context=256, max_context=40000)
    selector = ParallelismSelector(table, oom_check=lambda tp, ctx, n: batch_tgs(cost, tp, ctx, n, N_GPUS)[1])
    contexts = np.geomspace(1024, 32768, 40)  # average context grows 1K -> 32K over 40 steps
    chosen, best_tps = [], []
    for ctx in contexts:
        want = _brute_force_best(float(ctx), 32, N_GPUS)
        assert want == _hand_worked_best(float(ctx)), ctx
        sel = selector.select(float(ctx), 32)
        assert not sel.oom and sel.tp == want, (ctx, sel, want)
        chosen.append(sel.tp)
        best_tps.append(want)
    assert chosen == best_tps and sorted(set(best_tps)) == [1, 2, 4, 8]  # four switches, each where it pays
    # The table's range ends are the hand-worked crossings (found by bisection over the cost).
    ends = [r.hi for r in table.rows[32][:-1]]
    assert ends == pytest.approx([3000.0, 40000 / 3, 80000 / 3], rel=1e-6)
    assert [r.best for r in table.rows[32]] == [1, 2, 4, 8]


def test_context_falling_back_keeps_the_tp_until_a_new_range_then_takes_its_best() -> None:
    cost = LinesCost()
    table = build_profile_table(cost, N_GPUS, configs=TPS, loads=(32,), min_context=256, max_context=40000)
    sel = ParallelismSelector(table, oom_check=lambda tp, ctx, n: batch_tgs(cost, tp, ctx, n, N_GPUS)[1])
    picks = [sel.select(c, 32).tp for c in (30000.0, 28000.0, 20000.0, 15000.0, 5000.0, 2000.0)]
    assert picks == [8, 8, 4, 4, 2, 1]


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
