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
