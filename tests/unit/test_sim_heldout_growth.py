"""Held-out replay: a trace file whose longest sequence doubles mid-run is replayed with every allocation to
the end. A training layout chosen with no headroom used to end the run at the first grown step
(``FleetError: training layout ... runs out of memory``); now the planner sizes training for the observed
growth, re-plans when the deployed layout no longer fits, and a step that outgrew its layout runs regrouped."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from libra.sim.engine import SimConfig, Simulator
from libra.sim.workload_profiles import get_profile
from libra.sim.workloads import generate
from libra.traces import TrajectorySpec, read_trace, write_trace

GROWTH = (1, 1, 1, 2, 4, 4)  # per step: the step-0 length mix, doubled at step 3 and again at step 4


def _scaled(t: TrajectorySpec, step: int, f: int) -> TrajectorySpec:
    turns = tuple(dataclasses.replace(u, gen_tokens=u.gen_tokens * f,
                                      payload_tokens=None if u.payload_tokens is None else u.payload_tokens * f)
                  for u in t.turns)
    return dataclasses.replace(t, id=f"{t.id}-s{step}", step=step, group=f"{t.group}-s{step}",
                               prompt_tokens=t.prompt_tokens * f, turns=turns)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = [t for t in generate("dapo_math", 1, 8, 16, 0) if t.step == 0]
    path = tmp_path_factory.mktemp("heldout") / "doubling.jsonl"
    write_trace(path, [_scaled(t, s, f) for s, f in enumerate(GROWTH) for t in base])
    return path


def test_the_trace_longest_sequence_doubles_mid_run(trace: Path) -> None:
    trajs = read_trace(trace)
    longest = [max(t.total_tokens for t in trajs if t.step == s) for s in range(len(GROWTH))]
    assert longest[3] == 2 * longest[2] and longest[4] == 2 * longest[3]


@pytest.mark.parametrize("allocation", ["grp_ehp", "grp", "grp_homogeneous", "static_uniform", "static_best",
                                        "hetero", "greedy"])
def test_every_allocation_replays_the_growing_trace_to_the_end(trace: Path, allocation: str) -> None:
    trajs = read_trace(trace)
    prof = get_profile("dapo_math")
    cfg = SimConfig(router="least_loaded", allocation=allocation, gpus=64, seed=0,
                    bucket_thresholds=prof.bucket_thresholds, size_thresholds=prof.size_thresholds)
    sim = Simulator(trajs, cfg)
    res = sim.run()  # no FleetError
    assert res.steps == len(GROWTH) and res.trajectories == len(trajs)
    if sim.alloc is not None:  # a planner allocation: every step trained on a layout that held its batch
        report = sim.alloc.report()
        assert report["oom_regroups"] >= 0 and all(c.tp * c.pp * c.dp >= 1 for c in sim.alloc.train_layouts)
        assert len(sim.alloc.train_layouts) == len(GROWTH)


def test_without_headroom_a_step_that_outgrew_its_layout_runs_regrouped_and_replans_at_once(
        trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from libra.policies.planner.online import Replanner

    monkeypatch.setattr(Replanner, "max_headroom", 1.0)  # no margin: the deployed layout is outgrown
    prof = get_profile("dapo_math")
    cfg = SimConfig(router="least_loaded", allocation="grp", gpus=64, seed=0,
                    bucket_thresholds=prof.bucket_thresholds, size_thresholds=prof.size_thresholds)
    sim = Simulator(read_trace(trace), cfg)
    assert sim.run().steps == len(GROWTH)
    assert sim.alloc is not None and sim.alloc.fleet is not None
    regroups = sim.alloc.fleet.regroups
    if regroups:  # the cost model put the grown batch beyond the deployed layout (today: tp4 -> tp8)
        assert sim.alloc.oom_regroups == len(regroups)
        assert all(new.tp * new.pp > old.tp * old.pp for _, old, new in regroups)
        after = [d for d in sim.alloc.decisions if d["t"] >= regroups[0][0]]
        assert any(d.get("trigger") == "train_oom" for d in after) or any(d["reason"] == "busy" for d in after)
