"""The planner-driven simulator drives the broker's own PlannerLoop (libra.broker.plan_decider): the decision
is one code path with an injected clock, and the simulator says what only it models."""

from __future__ import annotations

import itertools

import pytest

from libra.broker.plan_decider import PlannerLoop, PlannerSettings
from libra.policies.planner.types import Workload
from libra.sim.engine import SimConfig, Simulator
from libra.sim.workloads import generate


def _loop(**replanner: object) -> PlannerLoop:
    loop = PlannerLoop(PlannerSettings.from_dict({"allocation": "grp", "batch": 32, "replanner": dict(replanner),
                                                  "params": {"granularity": 8}}))
    for i in range(64):
        loop.observe(700, 800 + 300 * (i % 9), 1 + i % 4, 0.5 * (i % 3))
    return loop


def test_a_search_reads_no_clock_unless_its_caller_hands_one() -> None:
    loop = _loop()
    job = loop.start(16, 1.0)
    assert job is not None and job.run().seconds == 0.0 and job.decision is not None
    loop.finish(job, 1.0)
    ticks = itertools.count(0.0, 0.25)  # a fake clock: each read is a quarter second later
    job = loop.start(16, 2.0)
    assert job is not None and job.run(lambda: next(ticks)).seconds == 0.25
    loop.finish(job, 2.0)
    assert loop.decisions[-1]["search_s"] == 0.25


def test_rounds_count_in_the_callers_steps_and_a_profiled_plan_starts_the_cooldown() -> None:
    loop = _loop(plan_interval=5, cooldown_steps=2)
    wl = Workload.from_pairs([(700.0, 1500.0)] * 32)
    plan = loop.profile(16, wl, 0.0, step=3)
    assert loop.plan is plan and loop.replanner is not None and loop.replanner.last_replan == 3
    assert loop.decisions[-1]["reason"] == "profiled_plan"
    job = loop.start(16, 5.0, step=4)  # one step after the profiled plan: inside the cooldown
    assert job is not None and job.snapshot.step == 4
    job.run()
    assert loop.finish(job, 5.0) is None and loop.decisions[-1]["reason"] == "cooldown"
    job = loop.start(16, 6.0, step=10)  # step 10: the interval trigger fires
    assert job is not None
    job.run()
    loop.finish(job, 6.0)
    assert loop.decisions[-1]["step"] == 10 and loop.decisions[-1]["trigger"] == "interval"


@pytest.mark.parametrize("allocation", ["grp", "grp_ehp"])
def test_the_simulator_plans_through_the_broker_loop_and_says_what_is_modelled_only(allocation: str) -> None:
    trajs = generate("r2e", 4, 2, 16, 0)
    sim = Simulator(trajs, SimConfig(router="least_loaded", allocation=allocation, gpus=16, seed=0,
                                     allocation_params={"plan_interval": 1}))
    sim.run()
    alloc = sim.alloc
    assert alloc is not None and isinstance(alloc.loop, PlannerLoop)
    assert alloc.replanner is alloc.loop.replanner and alloc.core is alloc.loop.plan
    rounds = sum(1 for d in alloc.decisions if d["reason"] != "busy")
    assert alloc.loop.rounds == rounds >= 1  # every decision that was not skipped is a round of the loop
    assert [d["step"] for d in alloc.decisions if d["reason"] != "busy"] == \
        [d["step"] for d in alloc.loop.decisions if d["reason"] != "profiled_plan"][-rounds:]
    rep = alloc.report()
    assert rep["loop_rounds"] == rounds and "PlannerLoop" in rep["runtime"]
    ehp = [line for line in rep["modelled_only"] if line.startswith("EHP: the simulator's join is modelled, not the runtime's")]
    assert len(ehp) == (allocation == "grp_ehp")
    assert any("reconfiguration-cost feedback" in line for line in rep["modelled_only"])
