"""Multi-Level Cell GPU allocator vs first fit, and the evict-on-execution service placement policy."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest

from libra.policies.actions.gpu_cells import (
    FirstFitAllocator,
    GpuCellError,
    MultiLevelCellAllocator,
    level_free_masks,
    node_value,
)
from libra.policies.actions.gpu_services import ServicePlacement, ServiceSpec

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


# ---------------------------------------------------------------------- GPU memory model (co-residency)

TEACHERS = [ServiceSpec(f"s{i}", 4, 40.0) for i in range(4)]  # 10 GB per GPU each


def shared(nodes: list[int], gpu_mem_gb: float, services: list[ServiceSpec] = TEACHERS, **kw) -> ServicePlacement:
    return ServicePlacement(MultiLevelCellAllocator(nodes), services, h2d_gbps=25.0, gpu_mem_gb=gpu_mem_gb, **kw)


def test_replicas_of_different_services_share_a_cell_while_memory_fits() -> None:
    sp = shared([4], 30.0)  # one TP-4 cell, room for three 10 GB shards per GPU
    for t, name in enumerate(("s0", "s1", "s2")):
        p = sp.acquire(name, float(t))
        assert p is not None and p.restore_s == pytest.approx(0.4) and p.evicted == ()
        sp.release(p.instance, t + 0.5)
    assert sp.resident() == {"s0": 1, "s1": 1, "s2": 1}
    assert sp.memory_used()[0][:4] == (30.0, 30.0, 30.0, 30.0)
    hit = sp.acquire("s0", 5.0)
    assert hit is not None and hit.restore_s == 0.0 and hit.evicted == ()
    assert (sp.stats.hits, sp.stats.restores, sp.stats.evictions) == (1, 3, 0)
    assert sp.stats.restore_s == pytest.approx(1.2)


def test_eviction_only_when_memory_is_short_and_only_the_lru_idle_replica() -> None:
    sp = shared([4], 30.0)
    for t, name in enumerate(("s0", "s1", "s2")):
        p = sp.acquire(name, float(t))
        assert p is not None
        sp.release(p.instance, float(t))
    again = sp.acquire("s0", 10.0)  # s0 becomes the most recently used; s1 is now the LRU
    assert again is not None and again.restore_s == 0.0
    sp.release(again.instance, 11.0)
    p = sp.acquire("s3", 12.0)
    assert p is not None and p.evicted == ("s1",)  # one victim is enough: s2 and s0 stay
    assert sp.resident() == {"s0": 1, "s2": 1, "s3": 1}
    assert (sp.stats.restores, sp.stats.evictions) == (4, 1)


def test_victims_are_only_replicas_on_gpus_short_of_memory() -> None:
    services = [ServiceSpec("small", 1, 4.0), ServiceSpec("large", 1, 10.0), ServiceSpec("big", 4, 40.0, reserve_gb=5.0)]
    sp = shared([4], 20.0, services)
    a = sp.acquire("small", 0.0)
    assert a is not None and a.alloc.gpus == (0,)
    sp.release(a.instance, 1.0)
    b = sp.acquire("large", 2.0)
    assert b is not None and b.alloc.gpus == (1,)  # the cell left with the most free memory
    sp.release(b.instance, 3.0)
    c = sp.acquire("big", 4.0)  # 15 GB per GPU: GPU 0 fits next to small (19 GB), GPU 1 does not
    assert c is not None and c.evicted == ("large",)  # the LRU replica (small) frees nothing needed
    assert sp.memory_used()[0][:4] == (19.0, 15.0, 15.0, 15.0)


def test_nothing_is_placed_on_an_executing_cell() -> None:
    sp = shared([8], 30.0)  # two TP-4 cells
    p0 = sp.acquire("s0", 0.0)
    p1 = sp.acquire("s1", 0.0)  # memory is free next to s0, but that cell executes
    assert p0 is not None and p1 is not None and not set(p0.alloc.gpus) & set(p1.alloc.gpus)
    assert sp.acquire("s2", 0.0) is None  # both cells execute: wait
    assert sp.busy_gpus == 8 and sp.schedulable_gpus() == 0
    assert sp.allocator.occupancy == (0xFF,)  # the allocator holds exactly the executing cells
    sp.release(p0.instance, 1.0)
    assert sp.allocator.occupancy == (p1.alloc.mask,) and sp.busy_gpus == 4
    p2 = sp.acquire("s2", 2.0)
    assert p2 is not None and p2.alloc == p0.alloc and p2.evicted == ()  # co-resident with idle s0


def test_a_busy_replicas_cell_is_never_booked_twice() -> None:
    sp = shared([4], 30.0)
    p = sp.acquire("s0", 0.0)
    assert p is not None
    assert sp.acquire("s0", 0.1) is None  # its only replica is busy and there is no other cell
    assert sp.acquire("s1", 0.1) is None  # memory is free, compute is not
    sp.release(p.instance, 1.0)
    q = sp.acquire("s0", 2.0)
    assert q is not None and q.instance == p.instance and q.restore_s == 0.0
    with pytest.raises(GpuCellError, match="not executing"):
        sp.release(p.instance + 1, 3.0)


def test_a_replica_idle_behind_another_services_call_restores_a_copy_elsewhere() -> None:
    sp = shared([8], 30.0)
    x = sp.acquire("s2", 0.0)  # cell A
    y = sp.acquire("s0", 0.0)  # cell B (A executes)
    assert x is not None and y is not None
    sp.release(y.instance, 1.0)
    sp.release(x.instance, 1.0)
    z = sp.acquire("s1", 2.0)  # both cells equally free: A, next to s2
    assert z is not None and z.alloc == x.alloc
    sp.release(z.instance, 3.0)
    busy = sp.acquire("s2", 4.0)  # a hit: A executes s2
    assert busy is not None and busy.restore_s == 0.0
    copy = sp.acquire("s1", 4.0)  # s1 is idle on A but A executes: a second replica on B, no eviction
    assert copy is not None and copy.alloc == y.alloc and copy.restore_s > 0 and copy.evicted == ()
    assert sp.resident() == {"s0": 1, "s1": 2, "s2": 1}
    assert sp.acquire("s0", 4.0) is None  # s0's cell B executes s1's copy; A executes s2


def test_memory_model_invariants_on_a_random_trace() -> None:
    rng = random.Random(7)
    sizes = [rng.choice((1, 2, 4, 8)) for _ in range(8)]
    services = [ServiceSpec(f"t{i}", g, g * rng.uniform(4, 20), rng.choice((0.0, 2.0))) for i, g in enumerate(sizes)]
    sp = shared([8, 8, 4], 48.0, services, workspace_gb=6.0)
    busy: list[int] = []
    acquired = 0
    for step in range(600):
        if busy and rng.random() < 0.45:
            sp.release(busy.pop(rng.randrange(len(busy))), float(step))
        else:
            p = sp.acquire(rng.choice(services).name, float(step))
            if p is not None:
                acquired += 1
                busy.append(p.instance)
        reps = sp.replicas()
        assert all(gb <= 42.0 + 1e-9 for row in sp.memory_used() for gb in row)
        held = [0, 0, 0]
        for _rid, (_svc, alloc, is_busy) in reps.items():
            if is_busy:
                assert not held[alloc.node] & alloc.mask  # one executing replica per GPU
                held[alloc.node] |= alloc.mask
        assert tuple(h | a for h, a in zip(held, sp.allocator.absent_masks)) == sp.allocator.occupancy
        assert sp.busy_gpus == sum(bin(h).count("1") for h in held)
        assert sp.stats.hits + sp.stats.restores == acquired
        assert sp.stats.restores - sp.stats.evictions == len(reps)
        per_cell = {}
        for _rid, (svc, alloc, _b) in reps.items():
            assert (svc, alloc.node, alloc.mask) not in per_cell  # one replica of a service per cell
            per_cell[(svc, alloc.node, alloc.mask)] = True
    assert sp.stats.evictions > 0 and sp.stats.hits > 0


def test_exclusive_cells_stay_the_default_and_ignore_reserves() -> None:
    def trace(services: list[ServiceSpec], **kw) -> list[object]:
        sp = ServicePlacement(MultiLevelCellAllocator([8, 4]), services, h2d_gbps=25.0, **kw)
        rng = random.Random(3)
        out: list[object] = []
        busy: list[int] = []
        for step in range(300):
            if busy and rng.random() < 0.5:
                sp.release(busy.pop(rng.randrange(len(busy))), float(step))
            else:
                p = sp.acquire(rng.choice(services).name, float(step))
                out.append(p)
                if p is not None:
                    busy.append(p.instance)
        out.append(sp.stats)
        return out

    plain = [ServiceSpec(f"s{i}", 4, 40.0) for i in range(4)]
    reserved = [ServiceSpec(f"s{i}", 4, 40.0, reserve_gb=30.0) for i in range(4)]
    assert trace(plain) == trace(reserved) == trace(plain, gpu_mem_gb=None)
    sp = placement(pool=4)  # one cell, no memory model: a second service must evict the first
    a = sp.acquire("s0", 0.0)
    assert a is not None and sp.gpu_mem_gb is None and not sp.shared
    sp.release(a.instance, 1.0)
    b = sp.acquire("s1", 2.0)
    assert b is not None and b.evicted == ("s0",) and sp.allocator.occupancy == (0xFF,)  # 4 GPUs held + 4 absent


def test_memory_model_validation() -> None:
    with pytest.raises(GpuCellError, match="needs 25 GB per GPU"):
        shared([4], 24.0, [ServiceSpec("s", 4, 80.0, reserve_gb=5.0)])
    with pytest.raises(GpuCellError, match="workspace 8 GB"):
        shared([4], 30.0, [ServiceSpec("s", 4, 92.0)], workspace_gb=8.0)
    with pytest.raises(GpuCellError, match="gpu_mem_gb"):
        shared([4], 0.0)
    with pytest.raises(GpuCellError, match="workspace_gb"):
        shared([4], 30.0, workspace_gb=30.0)
    with pytest.raises(GpuCellError, match="reserve_gb"):
        ServiceSpec("s", 4, 40.0, reserve_gb=-1.0)
    sp = shared([4], 80.0, workspace_gb=8.0)
    assert sp.replica_capacity_gb == 72.0 and sp.shared


# ---------------------------------------------------------------------- wait for a resident replica or restore


@pytest.mark.parametrize("memory_model", [False, True])
def test_a_call_waits_for_a_busy_replica_that_frees_sooner_than_a_restore(memory_model: bool) -> None:
    kw = {"wait_for_resident": True}
    services = [ServiceSpec(f"s{i}", 4, 40.0) for i in range(3)]
    cells = MultiLevelCellAllocator([8, 4])  # three TP-4 cells
    sp = ServicePlacement(cells, services, h2d_gbps=25.0, gpu_mem_gb=80.0 if memory_model else None, **kw)
    assert sp.restore_cost("s0") == pytest.approx(0.4)
    first = sp.acquire("s0", 0.0)
    assert first is not None and first.restore_s == pytest.approx(0.4)
    second = sp.acquire("s0", 0.0)  # no estimate yet (nothing completed): restores a copy as before
    assert second is not None and second.restore_s == pytest.approx(0.4) and sp.stats.waits == 0
    sp.release(first.instance, 1.0)  # s0's actions take 1.0 - 0.4 = 0.6 s
    sp.release(second.instance, 1.0)
    assert sp.mean_action_s("s0") == pytest.approx(0.6)
    sp.evict_idle("s0")
    a = sp.acquire("s0", 2.0)  # restore, busy until 2.0 + 0.4 + 0.6 = 3.0
    assert a is not None and a.restore_s > 0
    assert sp.acquire("s0", 2.5) is not None  # frees in 0.5 s > 0.4 s restore: restore a second copy
    assert sp.acquire("s0", 2.9) is None  # the first copy frees at 3.0, within the 0.4 s restore: wait
    assert sp.stats.waits == 1
    third = sp.acquire("s0", 2.9)  # the next caller at this instant counts the first: 3.5 - 2.9 > 0.4
    assert third is not None and third.restore_s > 0 and sp.stats.waits == 1
    assert sp.acquire("s0", 3.3) is None  # later: copies free at 3.0 (overdue, skipped) and 3.5: wait
    assert sp.stats.waits == 2


def test_an_overdue_action_is_not_waited_for_and_waiting_is_off_by_default() -> None:
    sp = placement(pool=8, wait_for_resident=True)
    p = sp.acquire("s0", 0.0)
    assert p is not None
    sp.release(p.instance, 1.4)  # 1.0 s of work after the restore
    q = sp.acquire("s0", 2.0)
    assert q is not None and q.restore_s == 0.0  # a hit, busy until ~3.0
    assert sp.acquire("s0", 2.8) is None  # 0.2 s left: wait
    assert sp.acquire("s0", 3.5) is not None  # past its estimate: no estimate left, restore a copy
    off = placement(pool=8)
    assert off.wait_for_resident is False
    x = off.acquire("s0", 0.0)
    assert x is not None
    off.release(x.instance, 1.0)
    assert off.acquire("s0", 2.0) is not None
    assert off.acquire("s0", 2.1) is not None and off.stats.waits == 0  # restores at once, as before
