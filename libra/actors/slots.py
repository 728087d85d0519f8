"""Slot discovery: how many GPU and CPU slots this host offers. No torch import.

GPUs are counted with NVML (``nvidia-ml-py``). With no driver or no GPU this says why and returns
zero GPUs; the caller starts CPU slots only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuDiscovery:
    count: int
    names: tuple[str, ...]
    reason: str  # why count is what it is, in words


def discover_gpus() -> GpuDiscovery:
    try:
        import pynvml
    except ImportError:
        return GpuDiscovery(0, (), "nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return GpuDiscovery(0, (), f"NVML unavailable ({exc}); no NVIDIA driver on this host")
    try:
        n = pynvml.nvmlDeviceGetCount()
        names = []
        for i in range(n):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return GpuDiscovery(n, tuple(names), f"{n} GPU(s) found by NVML" if n else "NVML reports no GPUs")
    except pynvml.NVMLError as exc:
        return GpuDiscovery(0, (), f"NVML query failed: {exc}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def resolve_slots(cpu_slots: int | None, gpu_slots: str) -> tuple[list[str], str]:
    """Slot names for this host and a sentence about the GPUs. ``gpu_slots`` is ``auto`` or an int."""
    if gpu_slots == "auto":
        d = discover_gpus()
        n_gpu, why = d.count, d.reason
    else:
        try:
            n_gpu = int(gpu_slots)
        except ValueError:
            raise ValueError(f"--gpu-slots must be 'auto' or a number, got {gpu_slots!r}") from None
        if n_gpu < 0:
            raise ValueError("--gpu-slots must be >= 0")
        why = f"{n_gpu} GPU slot(s) requested"
    n_cpu = cpu_slots if cpu_slots is not None else max(1, (os.cpu_count() or 1) - 1)
    if n_cpu < 0:
        raise ValueError("--cpu-slots must be >= 0")
    return [f"gpu{i}" for i in range(n_gpu)] + [f"cpu{i}" for i in range(n_cpu)], why


@dataclass(frozen=True, slots=True)
class GpuEngineSlot:
    """One engine slot placed on a GPU: its name (``gpuN``, or ``gpuN.K`` for the K-th extra engine sharing GPU
    N), its role, the GPU and how many engine slots share that GPU (their memory budget is split)."""

    slot: str
    role: str
    gpu: int
    sharing: int


def place_gpu_roles(roles: list[str], n_gpus: int) -> list[GpuEngineSlot]:
    """Spread engine slots (``roles``, e.g. ``['rollout', 'rollout', 'train']``) over ``n_gpus`` GPUs round
    robin: slot k goes to GPU ``k % n_gpus``. The first slot on a GPU is ``gpuN`` (a slot the broker's planner
    can lay plans on), later ones ``gpuN.K``. Raises ValueError with no GPU to place on."""
    if not roles:
        return []
    if n_gpus < 1:
        raise ValueError(f"{len(roles)} GPU engine slot(s) asked for but no GPU is available")
    per_gpu: dict[int, int] = {}
    placed = []
    for k, role in enumerate(roles):
        g = k % n_gpus
        n = per_gpu.get(g, 0)
        per_gpu[g] = n + 1
        placed.append((f"gpu{g}" if n == 0 else f"gpu{g}.{n}", role, g))
    return [GpuEngineSlot(s, r, g, per_gpu[g]) for s, r, g in placed]
