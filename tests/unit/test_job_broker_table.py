"""The job file's ``[broker]`` table: every bad value fails at load time with the broker core's own message,
named by table and key; the defaults become Libra's broker table (grp_ehp, C-MLFQ, Tangram) and hybrid slots;
``policy = "static"`` is today's fixed split."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest

from libra.config import ConfigError
from libra.rl.broker_table import (action_scheduler, broker_mapping, broker_toml, engine_roles, hardware_profile,
                                   with_policy)
from libra.rl.config import JobConfig, job_from_mapping


def _job(broker: dict[str, Any], **tables: Any) -> JobConfig:
    return job_from_mapping({"broker": broker, **tables})


def _error(broker: dict[str, Any], **tables: Any) -> str:
    with pytest.raises(ConfigError) as exc:
        _job(broker, **tables)
    return str(exc.value)


def test_an_unknown_policy_is_named() -> None:
    assert "[broker] policy: unknown policy 'fast' (known: libra, static)" in _error({"policy": "fast"})


def test_an_unknown_allocation_names_the_planner_table_and_key() -> None:
    msg = _error({"planner": {"allocation": "fast"}})
    assert "[broker.planner] allocation: unknown allocation 'fast'" in msg and "grp_ehp" in msg


@pytest.mark.parametrize(("planner", "needle"), [
    ({"interval_s": 0}, "[broker.planner] interval_s must be > 0"),
    ({"hardware": "tpu9"}, "[broker.planner] unknown hardware profile: 'tpu9'"),
    ({"objective": "fastest"}, "[broker.planner] params or replanner: PlannerConfig.objective"),
    ({"allocation": "colocated"}, "[broker.planner] 'colocated' time-shares"),
    ({"nonsense": 1}, "[broker.planner]: unknown key(s) nonsense"),
    ({"ehp": {"min_rollout": -1}}, "[broker.planner.ehp] min_rollout must be >= 0"),
        ({"ehp": {"warmup_steps": -1}}, "warmup_steps must be >= 0, got -1"),
    ({"ehp": {"borrow": 2}}, "[broker.planner.ehp] unknown key(s) borrow"),
    ({"allocation": "grp", "ehp": {"min_rollout": 1}}, "[broker.planner.ehp]: the Elastic Hybrid Pool runs under"),
    ({"objective": "throughput", "params": {"objective": "pipeline"}}, "[broker.planner] objective: given twice"),
])
def test_a_planner_option_the_core_rejects_is_named(planner: dict[str, Any], needle: str) -> None:
    assert needle in _error({"planner": planner})


def test_buckets_must_ascend_and_be_whole() -> None:
    down = [{"name": "long", "tp": 1, "max_tokens": 4096}, {"name": "short", "tp": 1, "max_tokens": 512}]
    assert "[broker] buckets must ascend by max_tokens: got [4096, 512]" in _error({"buckets": down})
    assert "[broker] buckets[0]: need name, tp and max_tokens" in _error({"buckets": [{"name": "a"}]})
    assert "[broker] buckets[0]: bucket 'a': tp must be" in _error({"buckets": [{"name": "a", "tp": 0, "max_tokens": 9}]})
    same = [{"name": "a", "tp": 1, "max_tokens": 5}, {"name": "a", "tp": 1, "max_tokens": 9}]
    assert "[broker] buckets: names must differ" in _error({"buckets": same})


def test_router_scheduler_and_engines_use_the_core_registries() -> None:
    assert "[broker] router: unknown router: 'nope'" in _error({"router": "nope"})
    assert "[broker] router: router 'cmlfq': unknown parameter 'x'" in _error({"router_params": {"x": 1}})
    assert "[broker] action_scheduler: unknown scheduler 'lifo'" in _error({"action_scheduler": "lifo"})
    assert "[broker.engines] dtype must be one of" in _error({"engines": {"dtype": "int3"}})
    assert "[broker] policy" not in _error({"nonsense": 1}) and "unknown key(s) nonsense" in _error({"nonsense": 1})


def test_static_runs_without_a_planner() -> None:
    assert "policy = \"static\" runs without a planner" in _error({"policy": "static", "planner": {"allocation": "grp"}})


def test_the_default_is_libra_grp_ehp_cmlfq_tangram_and_hybrid_slots() -> None:
    cfg = _job({}, actors={"rollout": 2, "trainer": 2}, grpo={"group_size": 4}, job={"prompts_per_step": 3},
               model={"name": "tiny"})
    assert cfg.broker.policy == "libra"
    table, notes = broker_mapping(cfg, ())
    assert table["router"] == "cmlfq" and table["action_scheduler"] == "tangram" and "buckets" not in table
    assert table["planner"] == {"allocation": "grp_ehp", "hardware": "cpu", "model": "tiny", "group_size": 4, "batch": 12}
    assert "policy libra" in notes
    assert engine_roles(cfg, 0, 0) == ("hybrid=2,train=2,action=1,episode=1", None)
    assert engine_roles(cfg, 2, 1) == ("hybrid=0,train=1,action=1,episode=1", "hybrid=2,train=1")
    # the written table is what the broker loads: [broker] with [broker.planner] as a sub-table
    assert tomllib.loads(broker_toml(table))["broker"] == table


def test_static_is_todays_fixed_split() -> None:
    cfg = _job({"policy": "static"}, actors={"rollout": 2, "trainer": 1})
    table, _ = broker_mapping(cfg, ())
    assert table == {"heartbeat_s": 2.0, "router": "cmlfq", "action_scheduler": ""}  # "": first come first served
    assert engine_roles(cfg, 0, 0) == ("rollout=2,train=1,action=1,episode=1", None)
    assert action_scheduler(_job({"policy": "static"}, actors={"tools": ["my_tools"]})) == "tangram"
    assert with_policy(cfg, "libra").broker.policy == "libra"


def test_the_deprecated_actors_scheduler_still_works_and_may_not_disagree() -> None:
    assert action_scheduler(_job({"policy": "static"}, actors={"action_scheduler": "fixed_dop"})) == "fixed_dop"
    assert action_scheduler(_job({}, actors={"action_scheduler": "fcfs"})) == "fcfs"
    assert action_scheduler(_job({"action_scheduler": "fcfs"})) == "fcfs"
    assert "disagree" in _error({"action_scheduler": "tangram"}, actors={"action_scheduler": "fixed_dop"})


def test_planner_keys_given_win_over_the_defaults() -> None:
    cfg = _job({"planner": {"hardware": "h100", "model": "qwen3-4b", "interval_s": 30, "objective": "pipeline",
                            "ehp": {"min_rollout": 2}}})
    planner = broker_mapping(cfg, ())[0]["planner"]
    assert planner["hardware"] == "h100" and planner["model"] == "qwen3-4b" and planner["interval_s"] == 30
    assert planner["params"] == {"objective": "pipeline"} and planner["ehp"] == {"min_rollout": 2}


def test_the_hardware_profile_follows_the_gpu() -> None:
    assert hardware_profile(())[0] == "cpu"
    assert hardware_profile(("NVIDIA H100 80GB HBM3",))[0] == "h100"
    assert hardware_profile(("NVIDIA H200",))[0] == "h200"
    prof, why = hardware_profile(("NVIDIA GeForce RTX 4090",))
    assert prof == "a800" and "no bundled hardware profile" in why


def test_the_resolved_config_round_trips_through_toml() -> None:
    cfg = _job({"buckets": [{"name": "s", "tp": 1, "max_tokens": 256}, {"name": "l", "tp": 1, "max_tokens": 4096}],
                "planner": {"ehp": {"force": [[1, 1]]}}})
    again = job_from_mapping(tomllib.loads(cfg.to_toml()))
    assert again.broker == cfg.broker


def test_fsdp_trainers_keep_a_fixed_split_and_refuse_the_pool_by_name() -> None:
    # the Elastic Hybrid Pool joins whole data-parallel replicas: sharded (FSDP) ranks default to plain GRP rounds
    cfg = _job({}, grpo={"parallel": "fsdp"}, model={"name": "tiny"})
    table, _ = broker_mapping(cfg, ())
    assert table["planner"]["allocation"] == "grp"
    msg = _error({"planner": {"allocation": "grp_ehp"}}, grpo={"parallel": "fsdp"})
    assert "[broker.planner] allocation = \"grp_ehp\" needs [grpo] parallel = ddp or auto" in msg and "'fsdp'" in msg
