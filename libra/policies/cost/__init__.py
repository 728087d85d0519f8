"""Cost models of the Global Resource Planner: profiles, rollout (serving) and training.

Role: the single import point for cost modelling (docs/papers.md §1.3.3). The implementation is split
by responsibility:

- ``cost/profiles.py``: :class:`HardwareProfile` / :class:`ModelProfile` and their TOML loaders
  (:func:`load_hardware`, :func:`load_model`; :class:`ProfileError` on an unknown name or a bad file);
- ``cost/rollout.py``: :class:`RolloutCostModel` (KV capacity, OOM, prefill and decode steps,
  steady batch, O(1) ``segment_cost``, ``tokens_per_s``) and its validation against the paper's
  measured throughputs (:data:`CALIBRATION_TARGETS`, :func:`calibration_report`);
- ``cost/training.py``: :class:`TrainingCostModel` (per-layer costs with interference, TP/EP
  communication, an explicit 1F1B simulation over per-micro-batch lengths, exposed DP communication,
  the memory model with OOM).

Everything here is pure (no I/O besides reading a profile file, no clocks, no global state).
"""

from __future__ import annotations

from libra.policies.cost.profiles import (
    HardwareProfile,
    ModelProfile,
    ProfileError,
    RolloutCalibration,
    TrainingCalibration,
    known_hardware,
    known_models,
    load_hardware,
    load_model,
)
from libra.policies.cost.rollout import (
    CALIBRATION_TARGETS,
    CostModelError,
    RolloutCostModel,
    batch_latency,
    bucket_throughput,
    calibration_report,
)
from libra.policies.cost.training import (
    TrainConfig,
    TrainEstimate,
    TrainingCoefficients,
    TrainingCostModel,
    simulate_1f1b,
)

__all__ = [
    "CALIBRATION_TARGETS",
    "CostModelError",
    "HardwareProfile",
    "ModelProfile",
    "ProfileError",
    "RolloutCalibration",
    "RolloutCostModel",
    "TrainConfig",
    "TrainEstimate",
    "TrainingCalibration",
    "TrainingCoefficients",
    "TrainingCostModel",
    "batch_latency",
    "bucket_throughput",
    "calibration_report",
    "known_hardware",
    "known_models",
    "load_hardware",
    "load_model",
    "simulate_1f1b",
    "training_time_ratio",
]


def training_time_ratio(hardware: HardwareProfile, model: ModelProfile) -> float:
    """Training-step time growth from 1K- to 32K-token sequences for the *same number of sequences*
    (512 x 1K vs 512 x 32K, TP-8 on one node, micro-batch 1), the basis of the paper's Fig. 2a (3.9x,
    docs/papers.md §1.7); a validation fact, not a fitting target."""
    tm = TrainingCostModel(hardware, model)
    cfg = TrainConfig(tp=min(8, hardware.gpus_per_node), pp=1, dp=1, micro_batch=1)
    return tm.step_time(cfg, [32768] * 512) / tm.step_time(cfg, [1024] * 512)

