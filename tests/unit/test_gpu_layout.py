"""Which slots a host starts on its GPUs (``libra actors --gpu-roles``, ``[actors] rollout_gpus``), on CPU."""

from __future__ import annotations

import pytest

from libra.actors.__main__ import gpu_layout, slot_arguments
from libra.actors.slots import GpuEngineSlot, place_gpu_roles
from libra.config import ConfigError
from libra.rl.config import ActorsConfig, job_from_mapping
from libra.rl.driver import engine_gpu_counts


def test_engine_slots_spread_over_the_gpus_and_share_when_fewer() -> None:
    assert place_gpu_roles(["rollout", "rollout", "train", "train"], 1) == [
        GpuEngineSlot("gpu0", "rollout", 0, 4), GpuEngineSlot("gpu0.1", "rollout", 0, 4),
        GpuEngineSlot("gpu0.2", "train", 0, 4), GpuEngineSlot("gpu0.3", "train", 0, 4)]
    assert [(p.slot, p.gpu, p.sharing) for p in place_gpu_roles(["rollout", "train", "train"], 2)] == [
        ("gpu0", 0, 2), ("gpu1", 1, 1), ("gpu0.1", 0, 2)]
    with pytest.raises(ValueError, match="no GPU"):
        place_gpu_roles(["rollout"], 0)


def test_gpu_layout_sets_each_slots_gpu_and_never_makes_gpus_action_slots_by_default() -> None:
    slots, role_of, env, fallback, why = gpu_layout(["rollout", "train"], [], 2, "hybrid", "/m")
    assert slots == ["gpu0", "gpu1"] and role_of == {"gpu0": "rollout", "gpu1": "train"} and not fallback
    assert env["gpu1"] == {"LIBRA_ENGINES_PER_GPU": "1"}  # the GPU itself comes from the name (slot_cuda_env)
    # no GPU on this host: the engine slots run on the CPU, and the sentence says so
    slots, _, _, fallback, why = gpu_layout(["rollout", "train"], [], 0, "hybrid", "/m")
    assert slots == [] and fallback == ["rollout", "train"] and "no GPU" in why
    # one slot per GPU: hybrid engines (directed by the broker), or none at all without a model
    slots, role_of, env, _, _ = gpu_layout(None, ["gpu0", "gpu1"], 2, "hybrid", "/m")
    assert role_of == {"gpu0": "hybrid", "gpu1": "hybrid"} and env["gpu1"] == {}
    slots, _, _, _, why = gpu_layout(None, ["gpu0"], 1, "hybrid", None)
    assert slots == [] and "--model-dir" in why
    assert gpu_layout(None, ["gpu0"], 1, "action", None)[1] == {"gpu0": "action"}  # only when asked for
    args = slot_arguments(["gpu0", "cpu0"], ["action"], "", "h", {"gpu0": "rollout"})
    assert args == {"gpu0": ["--role", "rollout"], "cpu0": ["--role", "action"]}


def test_actors_table_takes_gpu_counts_per_role_or_auto() -> None:
    assert ActorsConfig().rollout_gpus == "auto" and ActorsConfig().dtype == "auto"
    cfg = job_from_mapping({"actors": {"rollout": 2, "trainer": 2, "rollout_gpus": 1, "trainer_gpus": "auto",
                                       "dtype": "bf16", "gpu_memory_fraction": 0.4}})
    assert engine_gpu_counts(cfg.actors, (1, "1 GPU(s) found by NVML"))[:2] == (1, 2)
    r, t, why = engine_gpu_counts(ActorsConfig(rollout=2, trainer=2), (0, "nvidia-ml-py is not installed"))
    assert (r, t) == (0, 0) and "run on the CPU" in why  # the same job file on a laptop
    for bad, msg in (({"rollout_gpus": 3}, "rollout_gpus"), ({"trainer_gpus": "all"}, "trainer_gpus"),
                     ({"dtype": "int4"}, "dtype"), ({"gpu_memory_fraction": 2.0}, "gpu_memory_fraction")):
        with pytest.raises(ConfigError, match=msg):
            job_from_mapping({"actors": bad})
