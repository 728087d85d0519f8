"""GPU memory and utilisation of a GPU slot, sampled with NVML (``nvidia-ml-py``) and reported to the broker.

Role: ``libra status`` and the broker's Prometheus metrics show, per GPU actor, how much of its GPU's memory
is used and how busy the GPU is. A GPU slot's runtime starts a :class:`GpuSampler` thread that reads NVML
every ``every_s`` seconds and posts a :class:`~libra.actors.state.GpuSampled` event; the actor core sends the
sample to the broker in a ``Heartbeat`` (``gpu``). NVML is imported lazily: on a host without it (or without
a driver) :func:`sample_gpu` returns ``{}`` and the sampler stops after saying why once.

Sample keys (floats): ``index`` (the physical GPU), ``memory_used_bytes``, ``memory_total_bytes``,
``utilization_pct`` (the share of the last sample period a kernel ran, NVML's ``gpu`` utilisation).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from libra.logging import get_logger

__all__ = ["GpuSampler", "sample_gpu"]

log = get_logger("libra.actors.gpu")


def sample_gpu(index: int, nvml: Any = None) -> dict[str, float]:
    """One NVML reading of physical GPU ``index`` (see the module keys); ``{}`` when NVML is unusable.
    ``nvml`` stands in for the ``pynvml`` module (tests); it must already be initialised when given."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return {}
        try:
            nvml.nvmlInit()
        except Exception:  # noqa: BLE001 - NVMLError: no driver
            return {}
    try:
        h = nvml.nvmlDeviceGetHandleByIndex(index)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        util = nvml.nvmlDeviceGetUtilizationRates(h)
    except Exception:  # noqa: BLE001 - NVMLError: a GPU that went away, a driver that broke
        return {}
    return {"index": float(index), "memory_used_bytes": float(mem.used), "memory_total_bytes": float(mem.total),
            "utilization_pct": float(util.gpu)}


class GpuSampler:
    """A daemon thread that posts ``make_event(sample_gpu(index))`` every ``every_s`` seconds until stopped or
    until NVML gives nothing (then it logs once and ends)."""

    def __init__(self, index: int, post: Callable[[Any], None], make_event: Callable[[dict[str, float]], Any], *,
                 every_s: float = 5.0, nvml: Any = None) -> None:
        self.index, self.post, self.make_event, self.every_s, self.nvml = index, post, make_event, every_s, nvml
        self._stop = threading.Event()
        self.samples = 0
        self.thread = threading.Thread(target=self._run, name="libra-gpu-sampler", daemon=True)

    def start(self) -> GpuSampler:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            s = sample_gpu(self.index, self.nvml)
            if not s:
                log.info("gpu_sampling_off", gpu=self.index, reason="NVML is not usable on this host")
                return
            self.samples += 1
            self.post(self.make_event(s))
            self._stop.wait(self.every_s)
