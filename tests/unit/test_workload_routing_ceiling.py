"""first_return_ceiling: the modal bucket given the first tool return's features (issue #27 item 4)."""

from __future__ import annotations

from libra.sim.workload_routing import CEILING_FEATURES, first_return_ceiling
from libra.traces import TrajectorySpec, Turn


def _traj(i: int, step: int, status: str, tail: int, seconds: float = 1.0) -> TrajectorySpec:
    turns = (Turn(100, "bash", seconds, 200, status), Turn(tail))
    return TrajectorySpec(f"t{i}", f"p{i}", step, f"g{i}@{step}", 50, turns)


def test_a_key_that_decides_the_bucket_reaches_full_accuracy_and_the_prior_does_not() -> None:
    # A failure's remaining run is 20K tokens (long bucket), a success's 100 (short), half and half.
    trajs = [_traj(10 * s + k, s, "failure" if k % 2 else "success", 20_000 if k % 2 else 100)
             for s in range(4) for k in range(6)]
    c = first_return_ceiling(trajs, (4000, 12000, 30000))
    assert c["decisions"] == 18  # steps 1..3 scored, 6 first returns each
    assert c["key"] == 1.0
    assert c["none"] == 0.5  # the prior's mode is right for one status only
    assert set(CEILING_FEATURES) <= set(c)


def test_latency_adds_what_the_key_lacks() -> None:
    # Same key, but slow calls (10 s) precede long runs and fast ones (0.5 s) short runs.
    trajs = [_traj(10 * s + k, s, "success", 20_000 if k % 2 else 100, 10.0 if k % 2 else 0.5)
             for s in range(3) for k in range(4)]
    c = first_return_ceiling(trajs, (4000, 12000, 30000))
    assert c["key"] == 0.5 and c["key+latency"] == 1.0
