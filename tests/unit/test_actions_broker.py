"""The action simulator's broker model (libra.sim.actions_broker): every action goes through BrokerState and its
placement; what only the policy-level model has is said, never credited. Small clusters keep runs short."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from libra.sim.action_workloads import coding, mopd
from libra.sim.actions_broker import BrokerActionSim, tool_table
from libra.sim.actions_sim import SimConfig, SimError, main, run_sim

SMALL = SimConfig(batch=48, cpu_nodes=2, cores_per_node=32, model="broker")


@pytest.mark.parametrize("scheduler", ["tangram", "per_trajectory", "fixed_dop"])
def test_every_action_is_submitted_to_the_broker_and_answered_once(scheduler: str) -> None:
    cfg = replace(SMALL, scheduler=scheduler)
    sim = BrokerActionSim(cfg)
    res = sim.run()
    planned = sum(len(t.steps) for t in coding(cfg.batch, cfg.seed * 100_003).trajectories)
    assert res["model"] == "broker" and res["actions"] == planned
    assert res["broker_stats"]["submitted"] == res["broker_stats"]["completed"] == planned
    assert "failed" not in res["broker_stats"] and "duplicates" not in res["broker_stats"]
    b = res["act_breakdown_s"]
    assert res["act_mean_s"] == pytest.approx(b["queue"] + b["exec"] + b["overhead"])
    assert 0 < res["cores_used"] <= cfg.core_budget
    assert not sim.running and not sim.pending and sim.cores_now == 0  # everything came back
    assert not sim.broker.works  # the broker holds nothing at the end


def test_the_broker_grants_the_cores_an_action_runs_with() -> None:
    # at low load the broker's tangram placement runs elastic actions wider than a fixed DoP of 4
    cfg = replace(SMALL, batch=8)
    tangram = run_sim(cfg)
    dop4 = run_sim(replace(cfg, scheduler="fixed_dop", dop=4))
    assert tangram["act_breakdown_s"]["exec"] < dop4["act_breakdown_s"]["exec"]


def test_uncontended_fixed_dop_matches_the_policy_model() -> None:
    # nothing queues and every action gets its fixed DoP in both models: the same execution times
    cfg = replace(SMALL, batch=16, scheduler="fixed_dop")
    broker, policy = run_sim(cfg), run_sim(replace(cfg, model="policy"))
    assert broker["act_breakdown_s"]["queue"] == policy["act_breakdown_s"]["queue"] == pytest.approx(0.0)
    assert broker["act_breakdown_s"]["exec"] == pytest.approx(policy["act_breakdown_s"]["exec"], rel=0.02)


def test_the_broker_knows_declared_tools_not_each_calls_duration() -> None:
    wl = coding(32, 0)
    tools = tool_table(wl)
    assert set(tools) == {a.tool for t in wl.trajectories for _, a in t.steps}
    assert tools["build_test"]["max_cpu"] > tools["build_test"]["cpu"] == 1
    assert tools["edit"]["max_cpu"] == tools["edit"]["cpu"] == 1
    res = run_sim(replace(SMALL, batch=8))
    assert any("declared mean duration" in line for line in res["modelled_only"])


def test_gpu_service_calls_are_placed_by_the_broker_on_gpu_actors() -> None:
    cfg = SimConfig(workload="mopd", batch=64, gpu_pool=16, cpu_nodes=1, cores_per_node=8, model="broker")
    res = run_sim(cfg)
    calls = sum(len(t.steps) for t in mopd(cfg.batch, cfg.seed * 100_003).trajectories)
    assert res["actions"] == calls == res["gpu_restores"] + res["gpu_hits"]
    assert res["gpus_used"] == 16 and res["gpu_restores"] >= 1
    # the broker's service pools run the GPU memory model and the wait-or-restore rule the policy model has
    assert not any("co-residency" in line for line in res["modelled_only"])
    assert tool_table(mopd(8, 0), {"gpu_mem_gb": 80.0, "wait_for_resident": True})["teacher_logprobs"]["gpu_mem_gb"] == 80


def test_quota_workloads_are_refused_with_the_reason() -> None:
    with pytest.raises(SimError, match=r"quota.*#19.*--model policy"):
        run_sim(SimConfig(workload="deepsearch", batch=16, model="broker"))
    assert run_sim(SimConfig(workload="deepsearch", batch=16, model="policy"))["actions"] > 0


def test_policy_model_is_labelled_and_the_cli_defaults_to_the_broker(capsys: pytest.CaptureFixture[str]) -> None:
    res = run_sim(replace(SMALL, batch=8, model="policy"))
    assert res["model"] == "policy" and "not the broker's placement" in res["modelled_only"][0]
    assert main(["--workload", "coding", "--batch", "8", "--cpu-nodes", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "broker"
    assert main(["--workload", "coding", "--batch", "8", "--cpu-nodes", "1", "--model", "policy"]) == 0
    out = capsys.readouterr().out
    assert "modelled-only: model policy" in out
    with pytest.raises(SimError, match="model"):
        run_sim(replace(SMALL, model="bogus"))
