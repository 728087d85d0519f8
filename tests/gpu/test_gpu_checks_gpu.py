"""The GPU check's programs (``libra.bench.gpu_checks``) on CUDA, on the tiny model: bf16 training keeps fp32
master weights and learns at lr 1e-5; a hybrid slot's role switch rollout -> train -> rollout frees each role's
model and gives its CUDA memory back; a real CUDA out-of-memory error in a trainer step is a typed failure
(``TrainStepFailed``, code ``oom``) that leaves the weights as they were and the trainer able to train on, with
its memory returned. ``scripts/gpu-check.sh`` runs the same programs on the qwen2-0.5b shape. Skipped without
CUDA (the CPU runs are tests/unit/test_gpu_checks.py)."""

from __future__ import annotations

import pytest
import torch

from libra.bench import gpu_checks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_bf16_training_on_cuda_keeps_fp32_master_weights_and_learns(tmp_path) -> None:
    res = gpu_checks.bf16_learning(device="cuda:0", steps=5, lr=1e-5, scratch=tmp_path)
    assert res["ok"], res
    assert res["param_dtypes"] == ["float32"] and res["loss_last"] < res["loss_first"]
    assert res["bf16_over_fp32"] >= 0.8


def test_a_role_switch_on_cuda_frees_the_old_roles_model_and_memory(tmp_path) -> None:
    res = gpu_checks.switch_memory(device="cuda:0", scratch=tmp_path)
    assert res["ok"], res
    assert all(res["freed_without_gc"].values()) and all(res["memory_returned"].values())
    mem = res["memory_mib"]
    assert mem["train"]["allocated"] > mem["rollout_closed"]["allocated"]  # the trainer held memory of its own
    assert mem["end"]["allocated"] <= mem["start"]["allocated"] + gpu_checks.TOLERANCE_BYTES / gpu_checks.MIB


def test_a_real_cuda_oom_in_a_train_step_is_a_typed_failure_and_the_trainer_trains_on(tmp_path) -> None:
    res = gpu_checks.trainer_oom(device="cuda:0", scratch=tmp_path)
    assert res["ok"], res
    assert res["mode"] == "real allocation" and res["error_code"] == "oom"
    assert res["version_unchanged"] and res["recovered"] and res["memory_returned"]
