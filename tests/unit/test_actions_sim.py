"""Action simulator: accounting invariants, determinism, policy orderings on small clusters, GPU and quota
models, the CLI and the GPU-pool search. Small clusters keep every run well under a second."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from libra.sim.action_workloads import MOPD_LOADS, coding, deepsearch, make_workload, mopd
from libra.sim.actions_engine import ActionSim
from libra.sim.actions_sim import SimConfig, SimError, main, min_gpu_pool, run_sim

SMALL = SimConfig(batch=96, cpu_nodes=2, cores_per_node=64)


@pytest.mark.parametrize("scheduler", ["tangram", "per_trajectory", "fixed_dop"])
def test_every_action_completes_and_act_adds_up(scheduler: str) -> None:
    cfg = replace(SMALL, scheduler=scheduler)
    sim = ActionSim(cfg)
    res = sim.run()
    planned = sum(len(t.steps) for t in coding(cfg.batch, cfg.seed * 100_003).trajectories)
    assert res["actions"] == planned == len(sim.acts)
    b = res["act_breakdown_s"]
    assert res["act_mean_s"] == pytest.approx(b["queue"] + b["exec"] + b["overhead"])
    assert all(q >= 0 and e > 0 and o >= 0 for q, e, o, _c in sim.acts)
    assert 0 < res["cores_used"] <= cfg.core_budget
    assert not sim.queue and not len(sim.running)
    assert all(sim.free[n] == cfg.cores_per_node for n in sim.node_names)  # everything returned


def test_runs_are_deterministic() -> None:
    a = run_sim(replace(SMALL, batch=40))
    b = run_sim(replace(SMALL, batch=40))
    for k in ("sim_wall_s", "sched_wall_s"):
        a.pop(k), b.pop(k)
    assert a == b


def test_pooled_elastic_cores_beat_per_trajectory_sandboxes_on_the_same_budget() -> None:
    tangram = run_sim(SMALL)
    even = run_sim(replace(SMALL, scheduler="per_trajectory", sandbox_cores="even"))  # 128 // 96 = 1 core each
    peak = run_sim(replace(SMALL, scheduler="per_trajectory"))  # default: sized for the peak DoP (16)
    assert (even["sandbox_cores"], peak["sandbox_cores"]) == (1, 16)
    assert tangram["act_mean_s"] < even["act_mean_s"] < peak["act_mean_s"]
    assert peak["act_breakdown_s"]["queue"] > tangram["act_breakdown_s"]["queue"]  # waiting for a whole sandbox
    assert tangram["step_time_s"]["mean"] < even["step_time_s"]["mean"]


def test_at_low_load_tangram_runs_elastic_actions_wide() -> None:
    cfg = replace(SMALL, batch=8)
    tangram = run_sim(cfg)
    dop4 = run_sim(replace(cfg, scheduler="fixed_dop", dop=4))
    assert tangram["act_breakdown_s"]["exec"] < dop4["act_breakdown_s"]["exec"]
    assert tangram["act_breakdown_s"]["queue"] == pytest.approx(0.0)


def test_static_gpu_deployments_vs_evict_on_execution_pool() -> None:
    cfg = SimConfig(workload="mopd", batch=256, gpu_pool=40)
    static = run_sim(replace(cfg, scheduler="per_trajectory"))
    pooled = run_sim(replace(cfg, gpu_pool=16))
    assert static["gpus_used"] == 36  # 9 teachers x one TP-4 replica
    assert static["act_breakdown_s"]["overhead"] == 0.0
    assert pooled["gpus_used"] == 16
    assert pooled["gpu_restores"] > 0 and pooled["act_breakdown_s"]["overhead"] > 0  # restores are paid
    assert pooled["gpu_hits"] + pooled["gpu_restores"] == pooled["actions"]


def test_min_gpu_pool_returns_the_first_pool_within_the_ratio() -> None:
    cfg = SimConfig(workload="mopd", batch=512, workload_params={"think_mean_s": MOPD_LOADS["burst"]})
    out = min_gpu_pool(cfg, ratio=1.25, candidates=[4, 8, 12, 16, 36])
    base = out["baseline"]["act_mean_s"]
    tried = out["tried"]
    assert len(tried) >= 2  # a single TP-4 cell is not enough for 512 trajectories ...
    assert all(row["act_mean_s"] > 1.25 * base for row in tried[:-1])
    assert out["tangram"] is not None  # ... but a pool well under the static 36 GPUs is
    assert out["tangram"]["act_mean_s"] <= 1.25 * base
    assert out["tangram"]["gpus_used"] == tried[-1]["gpus"] < out["baseline"]["gpus_used"]


def test_teachers_co_resident_in_gpu_memory_restore_less_than_exclusive_cells() -> None:
    cfg = SimConfig(workload="mopd", batch=256, gpu_pool=8)  # 9 teachers, two TP-4 cells
    exclusive = run_sim(replace(cfg, gpu_mem_gb=None))
    sim = ActionSim(cfg)  # default: 80 GB GPUs, 8 GB workspace -> seven 10 GB shards per GPU
    shared = sim.run()
    assert (shared["gpu_mem_gb"], shared["gpu_workspace_gb"], exclusive["gpu_mem_gb"]) == (80.0, 8.0, None)
    for r in (exclusive, shared):
        assert r["gpu_hits"] + r["gpu_restores"] == r["actions"]
        assert r["gpus_used"] == 8
    assert shared["gpu_restores"] < exclusive["gpu_restores"] / 4
    assert shared["gpu_evictions"] < exclusive["gpu_evictions"]
    assert shared["act_breakdown_s"]["overhead"] < exclusive["act_breakdown_s"]["overhead"]
    assert shared["act_mean_s"] < exclusive["act_mean_s"]
    assert sim.placement is not None and sim.placement.busy_gpus == 0 and sim.free["gpu"] == 8
    assert max(max(row) for row in sim.placement.memory_used()) <= 72.0
    with pytest.raises(SimError, match="gpu_workspace_gb"):
        run_sim(replace(cfg, gpu_workspace_gb=80.0))


@pytest.mark.parametrize("pooled", [True, False])
def test_search_calls_respect_the_api_rate_limit(pooled: bool) -> None:
    cfg = SimConfig(workload="deepsearch", batch=256, gpu_pool=8, workload_params={"rps": 20.0, "burst": 5.0})
    sim = ActionSim(cfg if pooled else replace(cfg, scheduler="per_trajectory"))
    sim.run()
    starts = sorted(sim.quota_starts)
    assert len(starts) == sum(1 for t in deepsearch(256, 0).trajectories for _th, a in t.steps if a.kind == "quota")
    j = 0
    for i, t in enumerate(starts):  # any 1-second window: at most rate + burst calls
        while starts[j] < t - 1.0:
            j += 1
        assert i - j + 1 <= 20 + 5 + 1


def test_mopd_load_calibrations_scale_the_think_time_not_the_calls() -> None:
    light, burst = mopd(256, 1), mopd(256, 1, think_mean_s=MOPD_LOADS["burst"])
    assert light.params["think_mean_s"] == MOPD_LOADS["breakdown"] > MOPD_LOADS["burst"]  # the default is "breakdown"
    assert [len(t.steps) for t in light.trajectories] == [len(t.steps) for t in burst.trajectories]
    ratio = MOPD_LOADS["breakdown"] / MOPD_LOADS["burst"]
    for a, b in zip(light.trajectories, burst.trajectories):
        assert [th for th, _ in a.steps] == pytest.approx([th * ratio for th, _ in b.steps])
        assert [act for _, act in a.steps] == [act for _, act in b.steps]


def test_workload_generators_are_seeded_and_validated() -> None:
    assert mopd(64, 3) == mopd(64, 3)
    assert make_workload("coding", 10, 1).trajectories == coding(10, 1).trajectories
    with pytest.raises(ValueError, match="unknown action workload"):
        make_workload("chess", 10)
    with pytest.raises(ValueError, match="batch"):
        coding(0)


def test_bad_config_names_the_field() -> None:
    with pytest.raises(SimError, match="scheduler must be one of"):
        run_sim(SimConfig(scheduler="sjf"))
    with pytest.raises(SimError, match="batch"):
        run_sim(SimConfig(batch=0))
    with pytest.raises(SimError, match="unknown parameter"):
        run_sim(SimConfig(batch=4, scheduler_params={"nope": 1}))


def test_cli_prints_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--workload", "coding", "--batch", "24", "--cpu-nodes", "1", "--scheduler", "fixed_dop", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("act_mean_s", "act_p99_s", "cores_used", "gpus_used", "step_time_s", "trajectories_per_s"):
        assert key in out
    assert set(out["step_time_s"]) == {"mean", "p50", "p99"}
    assert main(["--batch", "0"]) == 2


def test_actions_bench_rejects_an_unknown_mopd_load(capsys: pytest.CaptureFixture[str]) -> None:
    from libra.bench import actions_sched

    with pytest.raises(SystemExit) as exc:
        actions_sched.main(["--skip-latency", "--skip-sim", "--mopd-loads", "breakdown,heavy"])
    assert exc.value.code == 2
    assert "unknown or empty ['heavy']" in capsys.readouterr().err


def test_waiting_for_a_resident_teacher_restores_less_and_loses_no_call() -> None:
    cfg = SimConfig(workload="mopd", batch=512, gpu_pool=8, workload_params={"think_mean_s": MOPD_LOADS["burst"]})
    wait = run_sim(cfg)
    eager = run_sim(replace(cfg, gpu_wait_for_resident=False))
    assert wait["gpu_waits"] > 0 and eager["gpu_waits"] == 0
    assert wait["gpu_restores"] < eager["gpu_restores"]
    for r in (wait, eager):
        assert r["actions"] == sum(len(t.steps) for t in mopd(512, 0, think_mean_s=MOPD_LOADS["burst"]).trajectories)
        assert r["gpu_hits"] + r["gpu_restores"] == r["actions"]
