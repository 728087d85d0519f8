"""CUDA IPC for :mod:`libra.weights.torch_dist`: a publisher's GPU buffers opened by a fetcher on the same GPU.

A CUDA IPC handle names its device by the *exporting* process's index, and two processes number devices
differently whenever their ``CUDA_VISIBLE_DEVICES`` differ (the publisher sees the GPU as ``cuda:1``, the
fetcher, given only that GPU, as ``cuda:0``). So the publisher sends its device's UUID (the same in every
process) with the handles, and the fetcher opens them on its own index for that UUID
(:func:`device_index_for_uuid`, pure), or raises :class:`DeviceNotVisible` when it cannot see that GPU.

The handles travel as msgpack-able values: torch's own tensor reduction, with its types named as
``module:qualname`` and resolved only inside ``torch`` on the way back.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch

from libra.dataplane.errors import DataPlaneError, TransferCorrupted

__all__ = ["DeviceNotVisible", "device_index_for_uuid", "dtype_named", "ipc_handle", "ipc_open",
           "local_device_uuids", "normalize_uuid"]

_DEVICE_ARG = 6  # reduce_tensor's args: (cls, size, stride, offset, storage_cls, dtype, device, handle, ...)


class DeviceNotVisible(DataPlaneError):
    """The publisher's GPU (named by UUID) is not one of the devices this process can see."""


def dtype_named(name: str, what: str) -> torch.dtype:
    """The torch dtype spelled ``name`` (``"float32"`` or ``"torch.float32"``); :class:`TransferCorrupted`
    saying that ``what`` names an unknown dtype otherwise."""
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise TransferCorrupted(f"{what} names an unknown dtype {name!r}")
    return dt


def normalize_uuid(uuid: str) -> str:
    """One spelling of a GPU UUID: NVML and ``CUDA_VISIBLE_DEVICES`` write ``GPU-xxxxxxxx-...``, torch's
    device properties ``xxxxxxxx-...``. MIG UUIDs (``MIG-...``) keep their prefix."""
    u = str(uuid).strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def device_index_for_uuid(uuid: str, local_uuids: Sequence[str]) -> int:
    """This process's index of the GPU whose UUID is ``uuid``, given the UUIDs of its visible devices in
    index order; raises :class:`DeviceNotVisible` if it is not among them."""
    want = normalize_uuid(uuid)
    if not want:
        raise DeviceNotVisible("a CUDA IPC answer names no device UUID")
    for i, u in enumerate(local_uuids):
        if normalize_uuid(u) == want:
            return i
    raise DeviceNotVisible(f"the publisher's GPU {uuid} is not visible here ({len(local_uuids)} visible device(s); "
                           "check CUDA_VISIBLE_DEVICES)")


def local_device_uuids() -> list[str]:
    """The UUIDs of this process's visible CUDA devices, in index order (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def ipc_handle(t: torch.Tensor) -> list[Any]:
    """A CUDA tensor's IPC handle as msgpack-able values (torch's own reduction, with its types named)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    return [f"{a.__module__}:{a.__qualname__}" if isinstance(a, type)
            else str(a) if isinstance(a, (torch.dtype, torch.device)) else a for a in args]


def _resolve(name: str) -> Any:
    module, _, qual = name.partition(":")
    if not module.startswith("torch"):
        raise TransferCorrupted(f"a CUDA IPC handle names a non-torch type {name!r}")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def ipc_open(handle: list[Any], device_index: int) -> torch.Tensor:
    """The tensor behind ``handle``, opened on this process's ``device_index`` (from
    :func:`device_index_for_uuid`, not the index the publisher wrote)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(handle)
    args[0], args[4], args[5] = _resolve(args[0]), _resolve(args[4]), dtype_named(args[5], "a CUDA IPC handle")
    args[1], args[2] = torch.Size(args[1]), tuple(args[2])
    args[_DEVICE_ARG] = int(device_index)
    return rebuild_cuda_tensor(*args)
