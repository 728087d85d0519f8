"""The two mechanisms that put the ablation's EHP rung below its C-MLFQ rung (issue #27), pinned.

1. The simulator's hybrid joins move on when a training step *starts*, as the broker's pool does
   (``ElasticPool.plan_step``): a replica whose GPUs switched to training before the step starts is that
   step's zero-gradient member and trains from the next step on. They used to move on only when a step
   ended, so a replica that switched while the trainer waited for rollout data (every re-plan on the
   rollout-bound ablation: the plan lands after the search charge) sat out one more step.
2. ``Replanner.headroom`` is the growth of the longest sequence *seen*, so a round in which only a few short
   requests finished does not read as growth when the next round is back at the usual longest (it forced a
   predicted-slower layout on the EHP rung, and only there).
"""

from __future__ import annotations

from libra.broker.hybrid import JoinState
from libra.broker.pools import Role
from libra.policies.planner.allocators import Replanner, make_allocator
from libra.sim.sim_ehp import end_step, register_joins, start_step


def _roles() -> dict[str, Role]:
    roles = {f"n0/gpu{i}": Role("train", group="core", rank=i) for i in range(2)}
    roles |= {f"n1/gpu{i}": Role("train", group="new", rank=i) for i in range(2)}
    return roles


def test_a_replica_live_when_a_step_starts_is_its_zero_member_and_trains_from_the_next_step() -> None:
    hybrids: dict = {}
    register_joins(hybrids, _roles(), live={"core"})
    assert set(hybrids) == {"new"} and hybrids["new"].state is JoinState.FETCHING_STATE
    # step 3 starts before the new group's GPUs have switched: not a member yet
    assert start_step(hybrids, {"core"}, 3) == []
    end_step(hybrids, [], 3)
    # they switched while the trainer waited for data: step 4 starts with them as its zero-gradient member
    zero = start_step(hybrids, {"core", "new"}, 4)
    assert zero == [("new", hybrids["new"].generation)]
    end_step(hybrids, zero, 4)
    rep = hybrids["new"]
    assert rep.state is JoinState.ZERO_SYNC and rep.zero_steps == 1
    # and it trains with real data from step 5 on (the old model: from step 6)
    assert start_step(hybrids, {"core", "new"}, 5) == []
    assert rep.state is JoinState.ACTIVE and rep.joined_step == 5


def test_a_join_cancelled_during_its_zero_step_is_not_advanced() -> None:
    hybrids: dict = {}
    register_joins(hybrids, _roles(), live={"core"})
    zero = start_step(hybrids, {"core", "new"}, 1)
    register_joins(hybrids, {k: r for k, r in _roles().items() if r.group == "core"}, live={"core", "new"})
    assert hybrids == {}
    end_step(hybrids, zero, 1)  # nothing to advance, and no error


def test_headroom_is_the_growth_of_the_longest_sequence_seen_not_a_dip_and_back() -> None:
    alloc = make_allocator("grp", hardware="a800", model="qwen3-14b", n_gpus=16, global_batch=16, group_size=16)
    rp = Replanner(alloc)
    rp.longest.extend([40484.0, 6525.0, 3607.0, 35213.0])  # measured per-round maxima on the ablation, seed 0
    assert rp.headroom == 1.0  # was 2.0 (35,213 / 3,607 capped): a worse layout applied whatever its gain
    rp.longest.clear()
    rp.longest.extend([10000.0, 20000.0])  # the longest sequence really doubled
    assert rp.headroom == 2.0
    rp.longest.clear()
    rp.longest.extend([20000.0, 5000.0, 30000.0])  # a dip, then beyond the longest seen: 1.5x growth
    assert rp.headroom == 1.5
