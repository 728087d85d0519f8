"""Dtype names an operator may give (``LIBRA_DTYPE``, ``--dtype``, ``[broker.engines] dtype``) → torch's.

``auto`` (the device's default: ``bfloat16`` on a GPU, ``float32`` on the CPU), ``bf16``, ``fp16``, ``fp32``
or the torch names; anything else raises :class:`~libra.engines.device.errors.DeviceConfigError`.
"""

from __future__ import annotations

from .errors import DeviceConfigError

__all__ = ["DTYPE_ENV", "parse_dtype"]

DTYPE_ENV = "LIBRA_DTYPE"

_DTYPES = {"auto": "auto", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
           "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32"}


def parse_dtype(name: str) -> str:
    """``'bf16'`` → ``'bfloat16'`` etc.; ``'auto'`` stays ``'auto'``. Raises :class:`DeviceConfigError`."""
    key = str(name).strip().lower()
    if key not in _DTYPES:
        raise DeviceConfigError(f"unknown dtype {name!r} (known: auto, bf16, fp16, fp32)")
    return _DTYPES[key]
