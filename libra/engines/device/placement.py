"""Where an actor's engines run: device, dtype and memory budget from the slot and the configuration.

Role: one small, pure decision that the rollout and training roles both follow, so that an actor on a GPU
slot runs its engines on its GPU(s) and an actor on a CPU slot (or on a host without CUDA) runs them on the
CPU exactly as before.

Rules (:func:`choose_placement`):

- A slot named ``gpuN`` (``gpuN.K`` for the K-th extra engine sharing GPU N) runs on ``cuda:0``: the
  supervisor sets ``CUDA_VISIBLE_DEVICES`` per slot (``libra.actors.slots.slot_cuda_env``: GPU N's entry
  of the host's list), so the slot's GPU is always the first visible one. Its dtype is ``bfloat16`` unless
  configured otherwise. Slot names other than ``gpuN``, ``gpuN.K`` and ``cpuN`` raise
  :class:`~libra.engines.device.errors.SlotNameError` (:func:`~libra.engines.device.slots.parse_slot`).
- A ``cpuN`` slot, or a GPU slot on a host where CUDA is not usable, runs on ``cpu`` in ``float32`` unless a
  dtype is configured; the fallback says why in :attr:`Placement.reason`.
- The memory budget is a fraction of the GPU's memory (``torch.cuda.set_per_process_memory_fraction`` for the
  HF engine and the trainer, ``gpu_memory_utilization`` for vLLM). ``0`` means automatic: 0.9 shared evenly
  by the engines on that GPU (``LIBRA_ENGINES_PER_GPU``). It means nothing on the CPU.

Configuration reaches a slot through its environment (set by ``python -m libra.actors --dtype ...
--gpu-memory-fraction ...`` or by ``python -m libra run`` from the job's ``[actors]`` table):
``LIBRA_DTYPE`` (``auto``, ``bf16``, ``fp16``, ``fp32`` or the torch names), ``LIBRA_GPU_MEMORY_FRACTION``
and ``LIBRA_ENGINES_PER_GPU``.

Elsewhere in this package: slot names (``slots``), dtype names (``dtypes``), TP groups and engine labels
(``tp_groups``), CUDA discovery and out-of-memory helpers (``cuda``), the errors (``errors``). torch is
imported only inside functions that use CUDA, so every module here is importable anywhere.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .cuda import cuda_device_count
from .dtypes import DTYPE_ENV, parse_dtype
from .errors import DeviceConfigError
from .slots import slot_gpu_index

__all__ = ["ENGINES_PER_GPU_ENV", "MEMORY_FRACTION_ENV", "Placement", "apply_memory_budget", "choose_placement",
           "placement_from_env", "trainer_backend", "with_settings"]

MEMORY_FRACTION_ENV = "LIBRA_GPU_MEMORY_FRACTION"
ENGINES_PER_GPU_ENV = "LIBRA_ENGINES_PER_GPU"

#: The share of a GPU's memory the engines on it may use together when no budget is configured.
AUTO_MEMORY_SHARE = 0.9


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one engine runs. ``device`` is a torch device string; ``dtype`` a torch dtype name;
    ``memory_fraction`` the share of the GPU's memory this engine may take (``None`` on the CPU)."""

    device: str
    dtype: str
    memory_fraction: float | None
    reason: str

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)


def choose_placement(slot: str, *, cuda_devices: int, dtype: str = "auto", memory_fraction: float = 0.0,
                     engines_per_gpu: int = 1) -> Placement:
    """The placement of an engine on ``slot`` when ``cuda_devices`` CUDA devices are visible to it (see the
    module rules). Pure: the caller probes CUDA."""
    want = parse_dtype(dtype)
    if not 0.0 <= memory_fraction <= 1.0:
        raise DeviceConfigError(f"GPU memory fraction must be within (0, 1] (0: automatic), got {memory_fraction!r}")
    if engines_per_gpu < 1:
        raise DeviceConfigError(f"engines per GPU must be >= 1, got {engines_per_gpu!r}")
    gpu = slot_gpu_index(slot)
    if gpu is not None and cuda_devices > 0:
        frac = memory_fraction or round(AUTO_MEMORY_SHARE / engines_per_gpu, 4)
        return Placement("cuda:0", "bfloat16" if want == "auto" else want, frac,
                         f"slot {slot} on GPU {gpu} ({cuda_devices} visible)")
    why = (f"slot {slot} is a GPU slot but CUDA is not usable here: CPU" if gpu is not None
           else f"slot {slot} is a CPU slot")
    return Placement("cpu", "float32" if want == "auto" else want, None, why)


def placement_from_env(slot: str, environ: Mapping[str, str] | None = None,
                       cuda_devices: int | None = None) -> Placement:
    """:func:`choose_placement` with the settings of the slot's environment (see the module docstring) and
    the CUDA devices torch sees (probed unless ``cuda_devices`` is given)."""
    env = os.environ if environ is None else environ
    raw_frac = env.get(MEMORY_FRACTION_ENV, "").strip() or "0"
    raw_per = env.get(ENGINES_PER_GPU_ENV, "").strip() or "1"
    try:
        frac, per = float(raw_frac), int(raw_per)
    except ValueError:
        raise DeviceConfigError(f"{MEMORY_FRACTION_ENV}={raw_frac!r} / {ENGINES_PER_GPU_ENV}={raw_per!r}: "
                                "expected a number and an integer") from None
    n = cuda_device_count() if cuda_devices is None and slot.startswith("gpu") else (cuda_devices or 0)
    return choose_placement(slot, cuda_devices=n, dtype=env.get(DTYPE_ENV, "auto") or "auto",
                            memory_fraction=frac, engines_per_gpu=per)


def with_settings(p: Placement, slot: str, config: Mapping[str, Any],
                  environ: Mapping[str, str] | None = None) -> Placement:
    """``p`` with a directive's engine settings (``dtype``, ``gpu_memory_fraction``, from the broker's
    ``[broker.engines]``) applied on the same device; ``p`` itself when the directive carries none."""
    if "dtype" not in config and "gpu_memory_fraction" not in config:
        return p
    env = os.environ if environ is None else environ
    try:
        per = int(env.get(ENGINES_PER_GPU_ENV, "1") or 1)
    except ValueError:
        per = 1
    return choose_placement(slot, cuda_devices=1 if p.on_gpu else 0, dtype=str(config.get("dtype", "auto")),
                            memory_fraction=float(config.get("gpu_memory_fraction", 0.0)), engines_per_gpu=per)


def apply_memory_budget(p: Placement) -> None:
    """Cap this process's share of its GPU at ``p.memory_fraction`` (nothing on the CPU)."""
    if not p.on_gpu or p.memory_fraction is None:
        return
    import torch

    torch.cuda.set_per_process_memory_fraction(p.memory_fraction, torch.device(p.device))


def trainer_backend(p: Placement, environ: Mapping[str, str] | None = None) -> str | None:
    """The trainer ranks' ``torch.distributed`` backend: None (the trainer's own rule: NCCL on CUDA, gloo on
    the CPU) unless this GPU is shared with other engine slots (``$LIBRA_ENGINES_PER_GPU`` > 1), where two
    ranks may sit on one device, which NCCL refuses: gloo then."""
    env = os.environ if environ is None else environ
    try:
        shared = int(env.get(ENGINES_PER_GPU_ENV, "1") or 1) > 1
    except ValueError:
        shared = False
    return "gloo" if p.on_gpu and shared else None
