"""Slot names: ``gpuN`` (``gpuN.K`` for the K-th extra engine sharing GPU N) and ``cpuN``.

Anything else raises :class:`~libra.engines.device.errors.SlotNameError`. The supervisor sets
``CUDA_VISIBLE_DEVICES`` per slot (``libra.actors.slots.slot_cuda_env``: GPU N's entry of the host's list),
so a GPU slot's GPU is always the first visible one.
"""

from __future__ import annotations

import re

from .errors import SlotNameError

__all__ = ["parse_slot", "slot_gpu_index"]

_SLOT = re.compile(r"(gpu|cpu)(0|[1-9][0-9]*)(?:\.([1-9][0-9]*))?")


def parse_slot(slot: str) -> tuple[str, int, int]:
    """``(kind, N, K)`` of a slot name: ``gpu3`` → ``("gpu", 3, 0)``, ``gpu3.1`` → ``("gpu", 3, 1)`` (the
    second engine on GPU 3), ``cpu2`` → ``("cpu", 2, 0)``. Anything else raises :class:`SlotNameError`."""
    m = _SLOT.fullmatch(slot) if isinstance(slot, str) else None
    if m is None or (m.group(1) == "cpu" and m.group(3) is not None):
        raise SlotNameError(f"slot names are gpuN, gpuN.K (K >= 1: another engine on GPU N) or cpuN, got {slot!r}")
    return m.group(1), int(m.group(2)), int(m.group(3) or 0)


def slot_gpu_index(slot: str) -> int | None:
    """The GPU a slot sits on: ``gpu3`` → 3, ``gpu3.1`` → 3 (a second engine on GPU 3), ``cpu0`` → None.
    A malformed ``gpu`` name raises :class:`SlotNameError`."""
    if not slot.startswith("gpu"):
        return None
    return parse_slot(slot)[1]
