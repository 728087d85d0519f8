"""Which path a weights version takes from the trainer to a rollout engine, decided by where the two ends'
tensors actually live (not by whether CUDA is visible), and how the bytes are cut into broadcast buckets.

Pure functions and plain records (no I/O besides :func:`local_end`, which asks torch about a device):

- :func:`choose_backend`: ``nccl`` only between two *different* CUDA devices (the same GPU twice cannot
  form an NCCL pair: that was the hang when a CPU trainer and a CPU rollout engine shared one visible GPU);
  ``cuda_ipc`` when both ends are the same physical GPU (a device-to-device copy of the publisher's
  buffer, opened by CUDA IPC); ``gloo`` whenever either end is on the CPU, or a GPU's identity is unknown.
- :func:`plan_buckets`: tensors grouped by dtype, in order, into buckets of at most ``bucket_bytes`` (a
  tensor larger than that gets a bucket of its own), so a broadcast never needs one buffer the size of
  the whole model.

The data plane (``libra.dataplane``) stays the path for CPU-only clusters and the fallback across hosts
when torch.distributed cannot connect.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BACKENDS", "DEFAULT_BUCKET_BYTES", "DeviceEnd", "choose_backend", "local_end", "plan_buckets"]

BACKENDS = ("gloo", "nccl", "cuda_ipc")
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class DeviceEnd:
    """Where one end's tensors live: ``host`` (its host name), ``kind`` (``cpu`` or ``cuda``) and, on a GPU,
    ``uuid`` (the physical device's UUID, the same whatever ``CUDA_VISIBLE_DEVICES`` numbers it as)."""

    host: str
    kind: str
    uuid: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "cuda"):
            raise ValueError(f"DeviceEnd.kind must be 'cpu' or 'cuda', got {self.kind!r}")

    def to_wire(self) -> dict[str, Any]:
        return {"host": self.host, "kind": self.kind, "uuid": self.uuid}

    @classmethod
    def from_wire(cls, data: Any) -> DeviceEnd:
        if not isinstance(data, dict):
            raise ValueError(f"a device end must be a map, got {type(data).__name__}")
        host, kind, uuid = data.get("host"), data.get("kind"), data.get("uuid")
        if not isinstance(host, str) or not isinstance(kind, str) or not (uuid is None or isinstance(uuid, str)):
            raise ValueError(f"bad device end {data!r}")
        return cls(host, kind, uuid)


def choose_backend(src: DeviceEnd, dst: DeviceEnd) -> str:
    """The transport for weights living on ``src`` to a receiver on ``dst`` (see the module docstring)."""
    if src.kind != "cuda" or dst.kind != "cuda":
        return "gloo"
    if src.uuid is None or dst.uuid is None:
        return "gloo"  # cannot tell whether they are one GPU: NCCL would hang if they were
    if src.uuid == dst.uuid:
        return "cuda_ipc" if src.host == dst.host else "gloo"  # one UUID on two hosts: a broken report
    return "nccl"


def local_end(device: Any) -> DeviceEnd:
    """The :class:`DeviceEnd` of ``device`` (a torch device or its name) in this process."""
    import torch

    dev = torch.device(device)
    host = socket.gethostname()
    if dev.type != "cuda":
        return DeviceEnd(host, "cpu")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return DeviceEnd(host, "cuda", str(uuid) if uuid is not None else None)


def plan_buckets(entries: Sequence[tuple[str, str, int, int]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 ) -> list[tuple[str, list[int]]]:
    """``entries``: ``(name, dtype, numel, itemsize)`` in state-dict order. Returns buckets as ``(dtype,
    [entry indices])``: each bucket one dtype, entries in their order, at most ``bucket_bytes`` unless
    it holds a single larger tensor; every entry exactly once. ``bucket_bytes < 1`` raises ``ValueError``."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    open_: dict[str, tuple[list[int], int]] = {}
    done: list[tuple[str, list[int]]] = []
    for i, (_, dtype, numel, itemsize) in enumerate(entries):
        nbytes = numel * itemsize
        idx, size = open_.get(dtype, ([], 0))
        if idx and size + nbytes > bucket_bytes:
            done.append((dtype, idx))
            idx, size = [], 0
        open_[dtype] = ([*idx, i], size + nbytes)
    done.extend((dt, idx) for dt, (idx, _) in open_.items() if idx)
    return done
