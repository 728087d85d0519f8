"""Streaming GRPO batch formation (docs/papers.md §1.7): the shared rule (libra.policies.batching), the
simulator's batch former (libra.sim.batching) and the engine running it; the runtime's JobState uses
the same rule."""

from __future__ import annotations

import pytest

from libra.broker.job_groups import JobState, Trajectory
from libra.policies.batching import admission_room, first_complete
from libra.sim.engine import SimConfig, Simulator
from libra.sim.batching import BatchFormer
from libra.sim.cluster import SimConfigError
from libra.traces import TrajectorySpec, Turn


def _spec(tid: str, step: int, group: str, gen: int = 100) -> TrajectorySpec:
    return TrajectorySpec(tid, f"p-{group}", step, group, 100, (Turn(gen),))


def _trace(steps: int, groups: int, size: int = 2) -> list[list[TrajectorySpec]]:
    return [[_spec(f"t{k}-{g}-{i}", k, f"g{k}-{g}") for g in range(groups) for i in range(size)]
            for k in range(steps)]


def test_admission_room_is_the_staleness_budget_capped_by_concurrency() -> None:
    # (eta + version + 1) * B - admitted
    assert admission_room(0, 2, 4, 0) == 12
    assert admission_room(0, 2, 4, 10) == 2
    assert admission_room(3, 2, 4, 20) == 4
    assert admission_room(0, 0, 4, 4) == 0  # eta = 0: one batch ahead at most (synchronous)
    # min(max_concurrent - running, ...)
    assert admission_room(0, 2, 4, 6, running=6, max_concurrent=8) == 2
    assert admission_room(5, 2, 4, 6, running=9, max_concurrent=8) == 0
    with pytest.raises(ValueError):
        admission_room(0, 2, 0, 0)


def test_first_complete_takes_the_oldest_created_groups() -> None:
    assert first_complete([7, 3, 5, 1], 2) == [1, 3]
    assert first_complete([7, 3], 3) is None
    assert first_complete([], 1) is None


def test_streaming_former_throttles_by_staleness_and_concurrency() -> None:
    f = BatchFormer(_trace(6, 2), "streaming", eta=1, max_concurrent=10)
    assert f.batch == 2
    assert f.admit(0) == [0, 1, 2, 3]  # (eta + 0 + 1) * B = 4 groups
    assert f.admit(0) == []
    for tid in ("t0-0-0", "t0-0-1", "t0-1-0", "t0-1-1"):
        f.done(tid)
    assert f.admit(0) == []  # completion alone frees no staleness budget ...
    assert f.cut(0) is not None
    assert f.admit(1) == [4, 5]  # ... the published version does
    capped = BatchFormer(_trace(6, 2), "streaming", eta=2)  # default cap: 2 * B running groups
    assert capped.max_concurrent == 4 and capped.admit(0) == [0, 1, 2, 3]
    capped.done("t1-0-0")
    assert capped.done("t1-0-1") and capped.admit(0) == [4]  # a group finished: one slot, budget allows 6


def test_streaming_batch_is_the_first_complete_groups_and_the_tail_lands_later() -> None:
    f = BatchFormer(_trace(3, 2), "streaming", eta=2, max_concurrent=6)
    f.admit(0)
    for g in ("t0-1", "t1-0", "t1-1", "t2-0"):  # group 0 (step 0) is the slow tail
        f.done(f"{g}-0")
        f.done(f"{g}-1")
    batch = f.cut(0)
    assert batch is not None and {t.group for t in batch} == {"g0-1", "g1-0"}  # oldest complete, not step 0's
    assert f.batches == [[1, 2]] and f.staleness == [[0, 0, 0, 0]]
    f.done("t0-0-0")
    f.done("t0-0-1")
    assert f.cut(1) is not None and f.batches[1] == [0, 3]  # the tail joins a later batch (by creation order)
    assert f.staleness[1] == [1, 1, 1, 1]  # started at version 0, consumed at version 1
    assert f.step_staleness()[1] == {"mean": 1.0, "max": 1.0}
    assert f.cut(2) is None  # group 4 complete, group 5 not


def test_barrier_former_waits_for_its_own_step() -> None:
    f = BatchFormer(_trace(3, 2), "barrier", lag=1)
    assert f.admit(0) == [0, 1]
    for tid in ("t0-1-0", "t0-1-1", "t0-0-0"):
        f.done(tid)
    assert f.cut(0) is None  # group 0 still has a sample running
    f.done("t0-0-1")
    assert f.cut(0) is not None and f.admit(1) == [2, 3]
    with pytest.raises(ValueError):
        BatchFormer(_trace(1, 1), "bogus")


def _hand_trace() -> list[TrajectorySpec]:
    # step 0: a 30K-token tail (group a) and a short group; step 1: two short groups
    return [_spec("a", 0, "a", 30_000), _spec("b", 0, "b"), _spec("c", 1, "c"), _spec("d", 1, "d")]


@pytest.mark.parametrize("batching", ["streaming", "barrier"])
def test_engine_streaming_trains_past_the_tail_and_records_staleness(batching: str) -> None:
    trajs = _hand_trace()
    sim = Simulator(trajs, SimConfig(gpus=16, allocation="static_uniform", router="least_loaded",
                                     batching=batching, lag=2))
    res = sim.run()
    end = {r.id: r.end for r in sim.records}
    assert res.tokens == sum(t.total_tokens for t in trajs) and res.batching == batching
    if batching == "streaming":
        assert sim.train_start[0] < end["a"]  # step 0 trained b and c without waiting for the tail
        assert [sorted(t.id for t in sim.former.batch_specs(k)) for k in (0, 1)] == [["b", "c"], ["a", "d"]]
        assert sim.former.staleness == [[0, 0], [1, 1]] and res.staleness["max"] == 1.0
    else:
        assert sim.train_start[0] >= end["a"]
        assert [sorted(t.id for t in sim.former.batch_specs(k)) for k in (0, 1)] == [["a", "b"], ["c", "d"]]


def test_colocated_stays_synchronous_and_bad_knobs_are_refused() -> None:
    sim = Simulator(_hand_trace(), SimConfig(gpus=16, allocation="colocated", router="least_loaded"))
    assert sim.batching == "barrier" and sim.run().staleness["max"] == 0.0
    for bad in ({"eta": -1}, {"batching": "nope"}, {"max_concurrent": 0}):
        with pytest.raises(SimConfigError):
            Simulator(_hand_trace(), SimConfig(gpus=16, allocation="static_uniform", **bad))  # type: ignore[arg-type]


def test_job_state_cuts_by_creation_order_with_the_same_rule() -> None:
    js = JobState(steps=3, prompts_per_step=2, group_size=2, max_policy_lag=1)
    groups = []
    while js.can_admit():
        groups.append(js.admit(f"p{len(groups)}"))
    assert len(groups) == 4 == admission_room(0, 1, 2, 0)  # the shared budget: (lag + 0 + 1) * 2
    for g in (3, 1, 2):  # complete in reverse creation order
        for i in range(2):
            js.add(Trajectory(g, i, 10, 5, 0.0, [0]))
    batch = js.cut_batch()
    assert batch is not None and [g.gid for g in batch] == [1, 2]  # the oldest created, not the first completed
