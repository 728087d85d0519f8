"""The trainer's process group and collectives: joining and leaving it, small CPU tensors, gradients, and the
step's status flags.

Role: what :class:`~libra.engines.trainer.GRPOTrainer` reduces across its data-parallel ranks. Every
collective is a no-op for a world of one. NCCL reduces device tensors only, so a CPU tensor goes through the
device there; gloo is given CPU tensors (a CUDA tensor is staged through the CPU: correct whatever the build's
gloo supports on CUDA).

The step's status rides in the small all-reduce that already exists before the gradient all-reduce
(:func:`failure_flags`, :func:`failed_ranks`): one entry counts CUDA out-of-memory failures, one any other
failure, one carries a bit per failed rank (ranks below 52), so every rank learns within that one collective
whether the step must be abandoned, and nobody waits in a gradient all-reduce for a rank that will not come.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from libra.logging import get_logger

__all__ = ["BUCKET_ELEMENTS", "FLAG_SLOTS", "DistConfig", "all_reduce_cpu", "all_reduce_grads", "broadcast_params",
           "failed_ranks", "failure_flags", "join_group", "leave_group"]

log = get_logger("libra.engines.trainer")

BUCKET_ELEMENTS = 32 * 1024 * 1024  # gradient all-reduce bucket (elements)
FLAG_SLOTS = 3  # oom count, other-failure count, failed-rank bits
_RANK_BITS = 52  # ranks whose bit a float64 sum carries exactly


@dataclass(frozen=True, slots=True)
class DistConfig:
    """How this rank joins the data-parallel group. ``backend`` defaults to NCCL on CUDA, gloo otherwise."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    backend: str | None = None
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not (0 <= self.rank < self.world_size):
            raise ValueError(f"DistConfig: rank {self.rank} must be in [0, world_size={self.world_size})")
        if not (0 < self.master_port < 65536):
            raise ValueError(f"DistConfig.master_port must be in 1..65535, got {self.master_port}")


def join_group(cfg: DistConfig, device: torch.device) -> bool:
    """Join (or reuse) the default process group as ``cfg`` says; True when this call created it. Raises
    ``ValueError`` when a group of another rank or size exists already."""
    backend = cfg.backend or ("nccl" if device.type == "cuda" else "gloo")
    if dist.is_initialized():
        if dist.get_rank() != cfg.rank or dist.get_world_size() != cfg.world_size:
            raise ValueError(f"a process group already exists as rank {dist.get_rank()}/{dist.get_world_size()}, "
                             f"but DistConfig says {cfg.rank}/{cfg.world_size}")
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)  # needs an index: the trainer resolves a bare "cuda"
    from libra.engines.rendezvous import pin_interfaces

    pin_interfaces(cfg.master_addr)  # several hosts: connect over the interface that reaches rank 0
    dist.init_process_group(backend=backend, init_method=f"tcp://{cfg.master_addr}:{cfg.master_port}",
                            rank=cfg.rank, world_size=cfg.world_size, timeout=timedelta(seconds=cfg.timeout_s))
    log.info("trainer_joined_group", rank=cfg.rank, world_size=cfg.world_size, backend=backend)
    return True


def leave_group(world_size: int, rank: int, barrier_s: float) -> None:
    """Meet the other ranks at a bounded barrier, then destroy the default group (a dead peer costs at most
    ``barrier_s``)."""
    if not dist.is_initialized():
        return
    if world_size > 1:
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=barrier_s))
            else:
                dist.barrier()
        except Exception as e:  # noqa: BLE001 - a dead peer: leave anyway
            log.warning("trainer_close_barrier_failed", rank=rank, error=repr(e))
    dist.destroy_process_group()


def _staged(t: torch.Tensor) -> bool:
    """Whether ``t`` must go through the CPU for this backend (gloo, a device tensor)."""
    return t.device.type != "cpu" and dist.get_backend() == "gloo"


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
    """Sum the gradients of ``params`` over ranks in flat buckets (one collective per ~32 M elements), in the
    gradients' dtype (fp32: the trainer's master parameters are fp32)."""
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
    if _staged(flat):
        host = flat.cpu()
        dist.all_reduce(host)
        flat.copy_(host)
    else:
        dist.all_reduce(flat)
    pos = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[pos : pos + n].view_as(g))
        pos += n


def broadcast_params(params: Sequence[torch.Tensor], world_size: int, src: int = 0) -> None:
    """Overwrite every rank's ``params`` with rank ``src``'s (identical replicas from the first step on)."""
    if world_size == 1:
        return
    with torch.no_grad():
        for p in params:
            if _staged(p.data):
                host = p.data.cpu()
                dist.broadcast(host, src=src)
                p.data.copy_(host)
            else:
                dist.broadcast(p.data, src=src)


def failure_flags(code: str | None, rank: int) -> list[float]:
    """This rank's :data:`FLAG_SLOTS` status entries: zeros when its passes succeeded (``code`` None), else a
    count under ``"oom"`` or ``"step_failed"`` and its rank's bit."""
    if code is None:
        return [0.0] * FLAG_SLOTS
    bit = float(2**rank) if rank < _RANK_BITS else 0.0
    return [1.0 if code == "oom" else 0.0, 0.0 if code == "oom" else 1.0, bit]


def failed_ranks(flags: Sequence[float]) -> tuple[str | None, list[int]]:
    """From the all-reduced flags: the step's failure code (``"oom"`` when any rank ran out of memory, else
    ``"step_failed"``; None when none failed) and the failed ranks below 52 that the bits name."""
    oom, other, bits = (int(round(x)) for x in flags[:FLAG_SLOTS])
    if oom + other == 0:
        return None, []
    return ("oom" if oom else "step_failed"), [r for r in range(_RANK_BITS) if bits >> r & 1]
