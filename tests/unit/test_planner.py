"""GRP search: rollout DP and training tree against brute force, memoisation, plans, allocators."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest

from libra.policies.cost import RolloutCostModel, TrainConfig, TrainingCostModel, load_hardware, load_model
from libra.policies.planner.allocators import (
    ALLOCATORS,
    GlobalResourcePlanner,
    Plan,
    PlannerConfig,
    PlannerError,
    Workload,
    make_allocator,
)
from libra.policies.planner.rollout_dp import RolloutSample, RolloutTable, cost_matrices, evaluate_layout
from libra.policies.planner.training import TrainingSearch

A800 = load_hardware("a800")
Q14 = load_model("qwen3-14b")
RM = RolloutCostModel(A800, Q14)


def _requests(n: int, seed: int, lo: float = 300.0, hi: float = 40000.0) -> list[tuple[float, float]]:
    rng = np.random.default_rng(seed)
    total = np.exp(rng.uniform(np.log(lo), np.log(hi), n)).round()
    prompt = np.minimum(rng.uniform(100, 2048, n), total / 2).round()
    return list(zip(prompt.tolist(), (total - prompt).tolist()))


# -- rollout DP vs exhaustive enumeration ----------------------------------------------------------
def _brute_rollout(
    cm: RolloutCostModel,
    reqs: list[tuple[float, float]],
    gpus: int,
    tps: tuple[int, ...],
    *,
    het: bool = False,
    cap: int | None = None,
) -> float:
    """Every ordered sequence of instance TPs using <= ``gpus`` GPUs x every contiguous split of the
    length-sorted requests into non-empty runs, one per instance (direct sums, no prefix sums)."""
    reqs = sorted(reqs, key=lambda r: r[0] + r[1])
    n = len(reqs)

    def cost(tp: int, j: int, i: int) -> float:
        part = reqs[j:i]
        return float(
            cm.segment_cost(
                tp, sum(p for p, _ in part), sum(g for _, g in part), len(part), max(p + g for p, g in part),
                gen_prompt_sum=sum(g * p for p, g in part), gen_sq_sum=sum(g * g for _, g in part),
            )
        )

    table = {(tp, j, i): cost(tp, j, i) for tp in tps for j in range(n) for i in range(j + 1, n + 1)}
    best = math.inf
    for k in range(1, min(n, gpus) + 1):
        if cap is not None and k > cap:
            break
        for seq in itertools.product(tps, repeat=k):
            if sum(seq) > gpus or (het and len(set(seq)) < 2):
                continue
            for cuts in itertools.combinations(range(1, n), k - 1):
                bounds = (0, *cuts, n)
                best = min(best, max(table[(seq[a], bounds[a], bounds[a + 1])] for a in range(k)))
    return best


CASES = [
    # (gpus, n_requests, tps, seed)
    (8, 10, (1, 2, 4, 8), 0),
    (8, 9, (1, 2, 4, 8), 1),
    (7, 8, (2, 4), 2),
    (6, 10, (1, 2, 4), 3),
    (5, 6, (1, 4), 4),
    (4, 10, (1, 2, 4), 5),
]


@pytest.mark.parametrize(("gpus", "n", "tps", "seed"), CASES)
@pytest.mark.parametrize(("het", "cap"), [(False, None), (True, None), (False, 2), (True, 3)])
def test_rollout_dp_equals_exhaustive_enumeration(
    gpus: int, n: int, tps: tuple[int, ...], seed: int, het: bool, cap: int | None
) -> None:
    reqs = _requests(n, seed)
    sample = RolloutSample.from_workload(Workload.from_pairs(reqs), max_requests=64)
    assert np.all(sample.weight == 1.0)
    costs = cost_matrices(RM, sample, tps)
    table = RolloutTable(costs, gpus, require_heterogeneous=het, max_instances=cap)
    for g in range(gpus + 1):
        expected = _brute_rollout(RM, reqs, g, tps, het=het, cap=cap)
        got = table.time(g)
        if math.isinf(expected):
            assert math.isinf(got)
            assert table.instances(g) == []
            continue
        assert got == pytest.approx(expected, rel=1e-12)
        segs = table.instances(g)
        # the back-tracked layout is valid and achieves the DP value
        assert sum(tp for tp, _, _ in segs) <= g
        assert [j for _, j, _ in segs] == [0] + [i for _, _, i in segs[:-1]] and segs[-1][2] == n
        assert max(costs[tp][j, i] for tp, j, i in segs) == pytest.approx(got, rel=1e-12)
        if het:
            assert len({tp for tp, _, _ in segs}) >= 2
        if cap is not None:
            assert len(segs) <= cap


def test_rollout_table_is_monotone_and_matches_per_budget_solves() -> None:
    reqs = _requests(200, 7)
    sample = RolloutSample.from_workload(Workload.from_pairs(reqs), batch=256, max_requests=48)
    costs = cost_matrices(RM, sample, (1, 2, 4, 8))
    big = RolloutTable(costs, 40)
    times = [big.time(g) for g in range(41)]
    assert all(b <= a for a, b in itertools.pairwise(times))
    for g in (1, 9, 17, 40):
        small = RolloutTable(costs, g)
        assert small.time(g) == big.time(g) and small.instances(g) == big.instances(g)


def test_evaluate_layout_matches_dp_and_permutation_brute_force() -> None:
    reqs = _requests(9, 11)
    sample = RolloutSample.from_workload(Workload.from_pairs(reqs))
    costs = cost_matrices(RM, sample, (1, 2, 4, 8))
    table = RolloutTable(costs, 16)
    chosen = tuple(tp for tp, _, _ in table.instances(16))
    assert evaluate_layout(costs, chosen)[0] == pytest.approx(table.time(16))
    n = sample.size
    for layout in [(1, 1, 2, 4), (2, 8), (4, 4, 1)]:
        best = math.inf
        for order in set(itertools.permutations(layout)):
            for cuts in itertools.combinations_with_replacement(range(n + 1), len(order) - 1):
                bounds = (0, *cuts, n)
                parts = [
                    costs[order[a]][bounds[a], bounds[a + 1]] if bounds[a] < bounds[a + 1] else 0.0
                    for a in range(len(order))
                ]
                best = min(best, max(parts))
        value, segs = evaluate_layout(costs, layout)
        assert value == pytest.approx(best, rel=1e-12)
        used = [tp for tp, _, _ in segs]
        assert all(used.count(t) <= layout.count(t) for t in used)  # a sub-multiset of the layout
        assert max(costs[tp][j, i] for tp, j, i in segs) == pytest.approx(value, rel=1e-12)
    with pytest.raises(PlannerError, match="no rollout cost matrix for TP"):
        evaluate_layout({1: costs[1]}, (1, 16))


def test_sample_is_quantile_downsampled_with_weights() -> None:
    reqs = _requests(1000, 3)
    wl = Workload.from_pairs(reqs)
    sample = RolloutSample.from_workload(wl, batch=512, max_requests=64)
    assert sample.size <= 64 and np.all(np.diff(sample.lengths) >= 0)
    assert sample.lengths[0] == wl.totals.min() and sample.lengths[-1] == wl.totals.max()
    assert sample.weight.sum() == pytest.approx(512)


# -- training tree vs brute force ----------------------------------------------------------------
def _brute_train(tm: TrainingCostModel, cfg: PlannerConfig, lengths: np.ndarray, n: int) -> float:
    """All (tp, ep, pp, dp, micro) with the feasibility rules re-stated here, scored directly."""
    m, hw = tm.model, tm.hardware
    batch = lengths.size
    mean = float(lengths.mean())
    best = math.inf
    eps = range(1, (m.n_experts if m.is_moe else 1) + 1)
    for tp, ep, pp, micro in itertools.product(range(1, n + 1), eps, range(1, n + 1), range(1, batch + 1)):
        if tp not in cfg.train_tps or tp > hw.gpus_per_node or n % (tp * pp):
            continue
        dp = n // (tp * pp)
        if m.is_moe and (m.n_experts % ep or tp * ep > hw.gpus_per_node or dp % ep):
            continue
        if tm.comm_ratio(TrainConfig(tp, 1, 1, 1, ep=ep), mean) > cfg.max_comm_ratio:
            continue
        if m.n_layers % pp or batch % dp or (batch // dp) % cfg.group_size:
            continue
        if (batch // dp) % micro or micro > cfg.max_micro_batch:
            continue
        n_micro = batch // dp // micro
        if (pp - 1) / (pp + n_micro - 1) > cfg.max_bubble:
            continue
        best = min(best, tm.evaluate(TrainConfig(tp, pp, dp, micro, ep=ep), lengths).time)
    return best


@pytest.mark.parametrize(
    ("hw_name", "model_name", "batch", "group", "ns", "max_comm"),
    [
        ("a800", "qwen3-4b", 32, 4, range(1, 9), 0.5),
        ("cpu", "tiny", 16, 2, range(1, 7), 0.5),
        ("h200", "qwen3-30b-a3b", 16, 2, (1, 2, 4, 8), 0.5),
        ("a800", "qwen3-14b", 48, 8, (4, 6, 8), 0.5),
        ("a800", "qwen3-14b", 48, 8, (4, 8), 0.02),  # the comm-ratio rule prunes TP 4 and 8
    ],
)
def test_training_tree_equals_brute_force(
    hw_name: str, model_name: str, batch: int, group: int, ns: range, max_comm: float
) -> None:
    hw, model = load_hardware(hw_name), load_model(model_name)
    tm = TrainingCostModel(hw, model)
    cfg = PlannerConfig(n_gpus=16, global_batch=batch, group_size=group, max_micro_batch=8, max_comm_ratio=max_comm)
    lengths = np.sort(np.exp(np.random.default_rng(batch).uniform(np.log(200), np.log(12000), batch)).round())
    search = TrainingSearch(tm, cfg, lengths)
    seen_feasible = seen_infeasible = False
    for n in ns:
        expected = _brute_train(tm, cfg, lengths, n)
        choice = search.best(n)
        if math.isinf(expected):
            assert choice is None
            seen_infeasible = True
            continue
        seen_feasible = True
        assert choice is not None and choice.time == expected
        assert choice.config.n_gpus == n and choice.config in search.configs(n)
        assert tm.comm_ratio(replace(choice.config, pp=1, dp=1, micro_batch=1), float(lengths.mean())) <= max_comm
        assert (choice.config.pp - 1) / (choice.config.pp + choice.estimate.n_micro - 1) <= cfg.max_bubble
    assert seen_feasible
    if model_name in ("qwen3-4b", "qwen3-30b-a3b"):
        assert seen_infeasible  # small n runs out of memory: the OOM rule is exercised


def test_training_bound_prunes_without_changing_the_winner() -> None:
    tm = TrainingCostModel(A800, load_model("qwen3-4b"))
    cfg = PlannerConfig(n_gpus=16, global_batch=32, group_size=4)
    lengths = np.linspace(500, 9000, 32)
    full = TrainingSearch(tm, cfg, lengths)
    best = full.best(8)
    assert best is not None
    bounded = TrainingSearch(tm, cfg, lengths)
    assert bounded.best(8, bound=best.time * 1.0001).config == best.config
    assert bounded.leaves_evaluated <= full.leaves_evaluated
    assert TrainingSearch(tm, cfg, lengths).best(8, bound=best.time * 0.5) is None
    assert full.lower_bound(8) <= best.time


# -- the whole search ------------------------------------------------------------------------------
def _small_planner(n_gpus: int, **kw: object) -> tuple[GlobalResourcePlanner, RolloutCostModel, TrainingCostModel]:
    hw, model = A800, load_model("qwen3-4b")
    rm, tm = RolloutCostModel(hw, model), TrainingCostModel(hw, model)
    kw.setdefault("pooled_buckets", False)  # the instance-level DP is what the brute force enumerates
    kw.setdefault("objective", "pipeline")  # the brute force's instance cost includes the chain (pipeline objective)
    cfg = PlannerConfig(n_gpus=n_gpus, global_batch=8, group_size=2, max_micro_batch=4, **kw)  # type: ignore[arg-type]
    return GlobalResourcePlanner(rm, tm, cfg), rm, tm


@pytest.mark.parametrize(("n_gpus", "seed", "het"), [(6, 0, False), (8, 1, False), (8, 2, True), (7, 3, False)])
def test_grp_search_equals_brute_force_over_everything(n_gpus: int, seed: int, het: bool) -> None:
    planner, rm, tm = _small_planner(n_gpus, require_heterogeneous=het)
    reqs = _requests(8, seed, hi=30000)
    plan = planner.search(reqs)
    lengths = Workload.from_pairs(reqs).training_lengths(8)
    expected = math.inf
    for n_train in range(1, n_gpus):
        t_train = _brute_train(tm, planner.config, lengths, n_train)
        t_roll = _brute_rollout(rm, reqs, n_gpus - n_train, (1, 2, 4, 8), het=het)
        expected = min(expected, max(t_train, t_roll))
    assert plan.objective == pytest.approx(expected, rel=1e-12)
    assert plan.n_train + plan.n_rollout <= n_gpus and plan.train is not None
    assert plan.train.n_gpus == plan.n_train
    if het:
        assert len(set(plan.rollout_tps)) >= 2


@pytest.mark.parametrize("kw", [{}, {"require_heterogeneous": True}, {"granularity": 4, "min_train_gpus": 4}])
def test_memoised_and_unmemoised_searches_return_the_same_plan(kw: dict) -> None:
    tm = TrainingCostModel(A800, Q14)
    cfg = PlannerConfig(n_gpus=40, global_batch=128, group_size=16, **kw)
    reqs = _requests(300, 5)
    memo = GlobalResourcePlanner(RM, tm, cfg, memoize=True).search_detailed(reqs)
    base = GlobalResourcePlanner(RM, tm, cfg, memoize=False).search_detailed(reqs)
    assert memo.plan == base.plan
    assert memo.stats.rollout_dp_solves == 1 and base.stats.rollout_dp_solves == memo.stats.candidates


def test_plan_evaluation_reproduces_search_times_and_buckets() -> None:
    tm = TrainingCostModel(A800, Q14)
    planner = GlobalResourcePlanner(RM, tm, PlannerConfig(n_gpus=48, global_batch=256, group_size=16,
                                                          pooled_buckets=False))
    reqs = _requests(400, 9)
    plan = planner.search(reqs)
    again = planner.evaluate(plan, reqs)
    assert again.layout_key() == plan.layout_key()
    assert again.t_train == pytest.approx(plan.t_train) and again.t_rollout == pytest.approx(plan.t_rollout)
    buckets = plan.buckets()
    assert [b.tp for b in buckets] == sorted({i.tp for i in plan.rollout})
    thresholds = [b.max_tokens for b in buckets]
    assert thresholds[-1] == math.inf and all(b >= a for a, b in itertools.pairwise(thresholds))
    assert sum(b.n_instances for b in buckets) == len(plan.rollout)
    # instances tile the sorted sample in order
    assert all(a.max_tokens <= b.min_tokens for a, b in zip(plan.rollout, plan.rollout[1:]))


def test_min_gpus_and_granularity_are_respected() -> None:
    tm = TrainingCostModel(A800, Q14)
    cfg = PlannerConfig(
        n_gpus=48, global_batch=256, group_size=16, granularity=8, min_train_gpus=16, min_rollout_gpus=8
    )
    plan = GlobalResourcePlanner(RM, tm, cfg).search(_requests(300, 1))
    assert plan.n_train % 8 == 0 and 16 <= plan.n_train <= 40


def test_infeasible_inputs_raise_clear_errors() -> None:
    tm = TrainingCostModel(A800, Q14)
    with pytest.raises(PlannerError, match="no feasible plan"):
        cfg = PlannerConfig(n_gpus=16, global_batch=16, group_size=16, rollout_tps=(1,))
        GlobalResourcePlanner(RM, tm, cfg).search([(1000, 200000)])  # longer than TP1's KV capacity
    with pytest.raises(PlannerError, match="not a multiple of group_size"):
        PlannerConfig(n_gpus=8, global_batch=10, group_size=4)
    with pytest.raises(PlannerError, match="exceeds n_gpus"):
        PlannerConfig(n_gpus=8, global_batch=8, group_size=8, min_train_gpus=6, min_rollout_gpus=6)
    with pytest.raises(PlannerError, match="workload is empty"):
        Workload.from_pairs([])
    with pytest.raises(PlannerError, match=r"workload\[1\] has invalid lengths"):
        Workload.from_pairs([(1, 2), (-1, 5)])
    with pytest.raises(PlannerError, match="contradicts"):
        GlobalResourcePlanner(
            RM, tm, PlannerConfig(n_gpus=8, global_batch=16, require_heterogeneous=True), homogeneous_rollout=True
        )


# -- allocators ------------------------------------------------------------------------------------
def _alloc(name: str, **kw: object):
    return make_allocator(name, hardware="a800", model="qwen3-14b", n_gpus=48, global_batch=256, group_size=16, **kw)


def test_registry_names_and_errors() -> None:
    assert set(ALLOCATORS) == {"grp", "grp_homogeneous", "static_uniform", "static_best", "greedy", "colocated"}
    with pytest.raises(ValueError, match=r"unknown allocator: 'verl' \(known: colocated, greedy, grp, "):
        make_allocator("verl", hardware="a800", model="qwen3-14b", n_gpus=8, global_batch=16)
    with pytest.raises(ValueError, match="unknown parameter"):
        _alloc("grp", increment=3)
    with pytest.raises(PlannerError, match="needs rollout_model"):
        make_allocator("grp", n_gpus=8, global_batch=16)


def test_grp_is_never_worse_than_the_baselines() -> None:
    reqs = _requests(400, 21)
    plans = {name: _alloc(name).propose(Workload.from_pairs(reqs)) for name in ALLOCATORS if name != "colocated"}
    for name, plan in plans.items():
        assert isinstance(plan, Plan) and plan.allocator == name
        assert plan.n_train + plan.n_rollout <= 48
        assert plans["grp"].objective <= plan.objective + 1e-9, name
    assert len(set(plans["grp_homogeneous"].rollout_tps)) == 1
    assert set(plans["static_uniform"].rollout_tps) == {2} and plans["static_uniform"].n_train <= 24


def test_colocated_time_shares_every_gpu() -> None:
    wl = Workload.from_pairs(_requests(300, 5))
    alloc = _alloc("colocated")
    plan = alloc.propose(wl)
    assert plan.colocated and plan.allocator == "colocated" and plan.n_idle == 0
    assert plan.n_rollout == 48 and set(plan.rollout_tps) == {2} and 0 < plan.n_train <= 48
    assert plan.objective == pytest.approx(plan.t_train + plan.t_rollout)
    again = alloc.evaluate(plan, wl)
    assert again.same_layout(plan) and again.objective == pytest.approx(plan.objective)
    assert not plan.same_layout(_alloc("grp").propose(wl))


def test_static_best_freezes_and_greedy_moves_toward_the_slower_stage() -> None:
    short, long = Workload.from_pairs(_requests(300, 1, hi=4000)), Workload.from_pairs(_requests(300, 2, lo=8000))
    sb = _alloc("static_best")
    first = sb.propose(short)
    later = sb.propose(long)
    assert later.layout_key() == first.layout_key() and later.objective > first.objective
    greedy = _alloc("greedy", increment=4)
    start = greedy.propose(long)
    moved = greedy.propose(long, start)
    if start.t_rollout > start.t_train * 1.1:
        assert moved.n_train < start.n_train
    elif start.t_train > start.t_rollout * 1.1:
        assert moved.n_train > start.n_train
    else:
        assert moved.n_train == start.n_train


def test_allocators_accept_explicit_models_and_config() -> None:
    tm = TrainingCostModel(A800, Q14)
    cfg = PlannerConfig(n_gpus=16, global_batch=64, group_size=16)
    alloc = make_allocator("grp", rollout_model=RM, train_model=tm, config=cfg, memoize=False)
    plan = alloc.propose(_requests(100, 4))
    assert plan.n_gpus == 16 and alloc.evaluate(plan, _requests(100, 4)).layout_key() == plan.layout_key()
    wider = make_allocator("grp", rollout_model=RM, train_model=tm, config=cfg, n_gpus=24)
    assert wider.propose(_requests(100, 4)).n_gpus == 24
    assert replace(plan, allocator="x").same_layout(plan)
