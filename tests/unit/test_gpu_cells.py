"""Multi-Level Cell GPU allocator vs first fit, and the evict-on-execution service placement policy."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest

from libra.policies.gpu_cells import (
    FirstFitAllocator,
    GpuCellError,
    MultiLevelCellAllocator,
    ServicePlacement,
    ServiceSpec,
    level_free_masks,
    node_value,
)

MIX = (1, 1, 1, 2, 2, 4, 4, 8)


def test_level_masks_follow_the_buddy_structure() -> None:
    assert level_free_masks(0) == (0xFF, 0xF, 0x3, 0x1)
    # GPU 5 busy: cells 2 (size 2) and 1 (size 4) and the node cell are no longer free.
    f0, f1, f2, f3 = level_free_masks(1 << 5)
    assert f0 == 0xFF & ~(1 << 5) and f1 == 0b1011 and f2 == 0b01 and f3 == 0
    assert node_value(0) > node_value(1) > node_value(0b11)


def test_best_fit_keeps_large_cells_whole() -> None:
    a = MultiLevelCellAllocator(2)
    x = a.allocate(1)
    y = a.allocate(1)
    # The second single GPU goes next to the first (same 2-cell), leaving node 1 and a 4-cell whole.
    assert (x.node, y.node) == (0, 0) and {x.gpus[0] // 2, y.gpus[0] // 2} == {x.gpus[0] // 2}
    assert a.placeable(8) == 1 and a.placeable(4) == 3
    ff = FirstFitAllocator(2)
    ff.allocate(2)
    ff.allocate(1)
    assert ff.placeable(4) == 3


def simulate(make, seed: int, n: int = 1500, mean_hold: float = 12.0) -> tuple[float, float, list]:
    """Poisson arrivals of MIX requests with exponential holding; returns (GPU acceptance, mean 4-GPU
    fragmentation, allocations made)."""
    rng = random.Random(seed)
    alloc = make()
    live: list = []
    t = 0.0
    got = req = 0
    frag = 0.0
    made = []
    for i in range(n):
        t += rng.expovariate(1.0)
        while live and live[0][0] <= t:
            alloc.free(heapq.heappop(live)[2])
        size = rng.choice(MIX)
        hold = rng.expovariate(1.0 / mean_hold)
        req += size
        a = alloc.allocate(size)
        if a is not None:
            got += size
            made.append(a)
            heapq.heappush(live, (t + hold, i, a))
        frag += alloc.fragmentation(4)
    return got / req, frag / n, made


def test_mlc_is_no_worse_than_first_fit_on_random_mixes() -> None:
    mlc = [simulate(lambda: MultiLevelCellAllocator(5), s) for s in range(8)]
    ff = [simulate(lambda: FirstFitAllocator(5), s) for s in range(8)]
    acc_mlc = sum(x[0] for x in mlc) / len(mlc)
    acc_ff = sum(x[0] for x in ff) / len(ff)
    frag_mlc = sum(x[1] for x in mlc) / len(mlc)
    frag_ff = sum(x[1] for x in ff) / len(ff)
    assert acc_mlc >= acc_ff
    assert frag_mlc < frag_ff


def test_every_cell_is_aligned_and_a_four_gpu_service_is_never_split() -> None:
    _acc, _frag, made = simulate(lambda: MultiLevelCellAllocator([8, 8, 8, 4]), 11)
    assert made
    for a in made:
        assert a.aligned, a
        if len(a.gpus) == 4:
            assert a.gpus in ((0, 1, 2, 3), (4, 5, 6, 7))
    # The non-aligned first-fit baseline does split (that is what the cells prevent).
    _a, _f, naive = simulate(lambda: FirstFitAllocator(5, aligned=False), 11)
    assert any(not a.aligned for a in naive)


def test_partial_nodes_and_bad_requests() -> None:
    a = MultiLevelCellAllocator([8, 2])
    assert a.total_gpus == 10
    assert a.allocate(8) is not None
    assert a.allocate(4) is None
    two = a.allocate(2)
    assert two is not None and two.node == 1 and two.gpus == (0, 1)
    assert a.allocate(1) is None
    with pytest.raises(GpuCellError, match="1, 2, 4 or 8"):
        a.allocate(3)
    a.free(two)
    with pytest.raises(GpuCellError, match="not allocated"):
        a.free(two)
    with pytest.raises(GpuCellError, match="per-node GPU counts"):
        MultiLevelCellAllocator([9])


def brute_best_value(occ: tuple[int, ...], sizes: list[int]) -> int | None:
    """Max total node value over every aligned placement of ``sizes`` (exhaustive)."""
    cells = []
    for s in sizes:
        cells.append([(n, j, ((1 << s) - 1) << (j * s)) for n in range(len(occ)) for j in range(8 // s)])
    best = None
    for combo in itertools.product(*cells):
        state = list(occ)
        ok = True
        for n, _j, m in combo:
            if state[n] & m:
                ok = False
                break
            state[n] |= m
        if ok:
            v = sum(node_value(b) for b in state)
            best = v if best is None else max(best, v)
    return best


@pytest.mark.parametrize("seed", range(10))
def test_allocate_many_is_all_or_nothing_and_optimal(seed: int) -> None:
    rng = random.Random(seed)
    a = MultiLevelCellAllocator(2)
    for _ in range(rng.randint(0, 5)):
        a.allocate(rng.choice((1, 1, 2)))
    before = a.occupancy
    sizes = [rng.choice((1, 2, 4)) for _ in range(rng.randint(1, 3))]
    best = brute_best_value(before, sizes)
    got = a.allocate_many(sizes)
    if best is None:
        assert got is None and a.occupancy == before
    else:
        assert got is not None and [len(x.gpus) for x in got] == sizes
        assert all(x.aligned for x in got)
        assert sum(node_value(b) for b in a.occupancy) == best


def placement(pool: int = 8, **kw) -> ServicePlacement:
    services = [ServiceSpec(f"s{i}", 4, 40.0) for i in range(3)]
    return ServicePlacement(MultiLevelCellAllocator([8] * (pool // 8) or [pool]), services, h2d_gbps=25.0, **kw)


def test_restore_cost_and_resident_hits() -> None:
    sp = placement()
    assert sp.restore_cost("s0") == pytest.approx(40.0 / (4 * 25.0))
    p = sp.acquire("s0", 0.0)
    assert p is not None and p.restore_s == pytest.approx(0.4) and p.alloc.aligned
    sp.release(p.instance, 1.0)
    again = sp.acquire("s0", 2.0)
    assert again is not None and again.restore_s == 0.0 and again.instance == p.instance
    assert sp.stats.hits == 1 and sp.stats.restores == 1


def test_lru_eviction_and_busy_replicas_are_never_evicted() -> None:
    sp = placement()
    a = sp.acquire("s0", 0.0)
    b = sp.acquire("s1", 0.0)
    assert a and b and sp.schedulable_gpus() == 0
    assert sp.acquire("s2", 0.5) is None  # both replicas busy: nothing to evict
    sp.release(a.instance, 1.0)
    sp.release(b.instance, 2.0)
    c = sp.acquire("s2", 3.0)
    assert c is not None and c.evicted == ("s0",)  # s0 is the least recently used
    assert sp.resident() == {"s1": 1, "s2": 1}
    with pytest.raises(GpuCellError, match="unknown GPU service"):
        sp.acquire("nope", 4.0)
    with pytest.raises(GpuCellError, match="not executing"):
        sp.release(b.instance, 4.0)


def test_replicas_scale_out_into_free_cells_up_to_the_cap() -> None:
    sp = placement(pool=16, max_replicas=2)
    p1 = sp.acquire("s0", 0.0)
    p2 = sp.acquire("s0", 0.0)
    assert p1 and p2 and p1.instance != p2.instance
    assert sp.acquire("s0", 0.0) is None  # capped at 2 resident replicas, both busy
    assert sp.busy_gpus == 8
