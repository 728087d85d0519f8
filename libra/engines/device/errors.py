"""The errors of an engine's device settings: one base class, so a caller can catch them all.

:class:`SlotNameError` (a slot name none of ``gpuN``, ``gpuN.K``, ``cpuN``) and :class:`TPUnsupported` (a
tensor-parallel degree the rollout engine cannot serve) are kinds of :class:`DeviceConfigError`.
"""

from __future__ import annotations

__all__ = ["DeviceConfigError", "SlotNameError", "TPUnsupported"]


class DeviceConfigError(ValueError):
    """A device setting that cannot be honoured (unknown dtype, a memory fraction outside (0, 1], ...)."""


class SlotNameError(DeviceConfigError):
    """A slot name that is none of ``gpuN``, ``gpuN.K`` (K >= 1) or ``cpuN``."""


class TPUnsupported(DeviceConfigError):
    """A tensor-parallel degree the actor's rollout engine cannot serve (the HF engine serves TP 1 only)."""
