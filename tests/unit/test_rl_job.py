"""JobState: admission under the policy-lag bound, grouping, batch cutting, stale-group dropping."""

from __future__ import annotations

import pytest

from libra.broker.job_groups import JobState, Trajectory


def traj(gid: int, idx: int, reward: float, versions: list[int]) -> Trajectory:
    return Trajectory(gid, idx, 3, 2, reward, versions)


def fill(st: JobState, gid: int, version: int) -> bool:
    done = False
    for i in range(st.group_size):
        done = st.add(traj(gid, i, float(i), [version]))
    return done


def test_admission_runs_ahead_by_at_most_the_lag_bound() -> None:
    st = JobState(steps=10, prompts_per_step=2, group_size=2, max_policy_lag=1)
    admitted = []
    while st.can_admit():
        admitted.append(st.admit(f"p{len(admitted)}").gid)
    assert admitted == [0, 1, 2, 3]  # steps 0 and 1 nominally: version 0 + lag 1
    with pytest.raises(RuntimeError):
        st.admit("too early")
    for gid in (0, 1):
        fill(st, gid, 0)
    batch = st.cut_batch()
    assert [g.gid for g in batch] == [0, 1]
    assert not st.can_admit()  # still version 0 while training
    st.step_done(1)
    assert st.can_admit()
    assert st.admit("p4").gid == 4 and st.admit("p5").gid == 5 and not st.can_admit()


def test_lag_zero_is_synchronous() -> None:
    st = JobState(steps=3, prompts_per_step=1, group_size=2, max_policy_lag=0)
    st.admit("a")
    assert not st.can_admit()
    fill(st, 0, 0)
    assert st.cut_batch() is not None
    st.step_done(1)
    assert st.can_admit()


def test_batch_needs_complete_groups_and_one_step_at_a_time() -> None:
    st = JobState(steps=5, prompts_per_step=2, group_size=3, max_policy_lag=2)
    for _ in range(4):
        st.admit("x")
    assert fill(st, 0, 0)
    st.add(traj(1, 0, 1.0, [0]))
    assert st.cut_batch() is None  # group 1 incomplete
    st.add(traj(1, 1, 0.0, [0]))
    assert st.add(traj(1, 2, 0.0, [0]))
    b = st.cut_batch()
    assert b is not None and all(len(g.trajs) == 3 for g in b)
    fill(st, 2, 0)
    fill(st, 3, 0)
    assert st.cut_batch() is None  # one batch in training at a time
    st.step_done(1)
    assert [g.gid for g in st.cut_batch()] == [2, 3]


def test_stale_groups_are_dropped_and_their_slots_readmitted() -> None:
    st = JobState(steps=4, prompts_per_step=1, group_size=2, max_policy_lag=1)
    for _ in range(2):
        st.admit("x")
    fill(st, 0, 0)
    st.cut_batch()
    st.step_done(1)
    st.admit("y")  # group 2
    fill(st, 1, 0)
    st.cut_batch()
    st.step_done(2)  # version 2: group 1 trained at lag 1; anything from version 0 is now too stale
    st.add(traj(2, 0, 1.0, [0]))
    st.add(traj(2, 1, 0.0, [2]))  # oldest turn decides: lag 2 > 1
    assert st.cut_batch() is None
    assert st.dropped_groups == 1
    assert st.can_admit()  # the dropped group's slot is free again


def test_trajectory_version_is_its_oldest_turn_and_lag_is_measured_from_it() -> None:
    st = JobState(steps=2, prompts_per_step=1, group_size=2, max_policy_lag=1)
    st.admit("x")
    st.add(traj(0, 0, 1.0, [0, 1]))
    st.add(traj(0, 1, 0.0, [1, 1]))
    g = st.cut_batch()[0]
    assert g.min_version == 0 and st.lag_of(g) == 0


def test_groups_with_fewer_than_two_results_are_dropped() -> None:
    st = JobState(steps=2, prompts_per_step=1, group_size=2, max_policy_lag=0)
    st.admit("x")
    st.fail(0)
    assert st.add(traj(0, 1, 1.0, [0]))
    assert st.cut_batch() is None and st.dropped_groups == 1


def test_step_done_checks_the_version_sequence() -> None:
    st = JobState(steps=2, prompts_per_step=1, group_size=2, max_policy_lag=0)
    with pytest.raises(RuntimeError):
        st.step_done(1)
    st.admit("x")
    fill(st, 0, 0)
    st.cut_batch()
    with pytest.raises(RuntimeError, match="expected 1"):
        st.step_done(3)
    st.step_done(1)
    assert st.version == 1 and st.steps_done == 1 and not st.finished


def test_no_admission_beyond_the_step_count() -> None:
    st = JobState(steps=1, prompts_per_step=2, group_size=2, max_policy_lag=5)
    st.admit("a")
    st.admit("b")
    assert not st.can_admit()
