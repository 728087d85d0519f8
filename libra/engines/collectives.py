"""The trainer's collectives over the current default process group: small CPU tensors and gradients.

Role: what :class:`~libra.engines.trainer.GRPOTrainer` reduces across its data-parallel ranks. Both are
no-ops for a world of one. NCCL reduces device tensors only, so a CPU tensor goes through the device there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BUCKET_ELEMENTS", "all_reduce_cpu", "all_reduce_grads"]

BUCKET_ELEMENTS = 32 * 1024 * 1024  # gradient all-reduce bucket (elements)


def all_reduce_cpu(t: torch.Tensor, world_size: int, device: torch.device, op: Any = None) -> None:
    """Reduce (sum, or ``op``) a small CPU tensor over ranks, in place (via ``device`` for NCCL)."""
    if world_size == 1:
        return
    op = dist.ReduceOp.SUM if op is None else op
    if dist.get_backend() == "nccl":
        moved = t.to(device)
        dist.all_reduce(moved, op=op)
        t.copy_(moved.cpu())
    else:
        dist.all_reduce(t, op=op)


def all_reduce_grads(params: Sequence[torch.Tensor], world_size: int) -> None:
    """Sum the gradients of ``params`` over ranks in flat buckets (one collective per ~32 M elements)."""
    if world_size == 1:
        return
    bucket: list[torch.Tensor] = []
    size = 0
    for p in params:
        bucket.append(p.grad)
        size += p.grad.numel()
        if size >= BUCKET_ELEMENTS:
            _reduce_bucket(bucket)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(bucket)


def _reduce_bucket(grads: list[torch.Tensor]) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    pos = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[pos : pos + n].view_as(g))
        pos += n
