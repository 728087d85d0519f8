"""Data parallelism and precision for GRPO trainer ranks: replicated (``ddp``) or sharded with FSDP2
(``fsdp``), fp32 master weights with bf16 compute.

Role: the parts of :class:`~libra.engines.trainer.GRPOTrainer` that depend on how the model is spread over
the ranks and held in memory. ``ddp``: every rank holds the whole model and optimizer, gradients are
all-reduced in flat buckets (the trainer does it). ``fsdp``: ``torch.distributed.fsdp.fully_shard`` (FSDP2)
on every decoder layer and on the root; parameters, gradients and AdamW state are sharded over the ranks
(DTensors), so a model whose weights, gradients and optimizer state do not fit one device trains over
several.

Contracts:

- **Precision.** The trainer's parameters, gradients and AdamW moments are fp32 whatever the compute dtype
  (``dtype``): an update at lr 1e-5 is far below a bf16 weight's resolution (about |w|/256) and would be
  rounded away. The compute dtype (:func:`check_compute_dtype`: fp32 or bf16; fp16 is refused with
  :class:`PrecisionUnsupported`, as it would need a gradient scaler) applies to the forward and backward
  passes only: ``torch.autocast`` under ``ddp`` (:func:`autocast`), FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` under ``fsdp``; gradients are reduced in
  fp32 either way. Weights leave the trainer for rollout engines in the compute dtype
  (:func:`full_state_items` ``dtype``); checkpoints keep fp32.
- :func:`choose_parallel` is pure: ``"ddp"`` or ``"fsdp"`` from the requested mode, the world size, the
  model's size and the device's memory budget (``auto``: FSDP when the replicated training state,
  :func:`training_state_bytes`, would take more than half of the slot's share of its device,
  ``memory_fraction`` x total, or of :data:`CPU_BUDGET_BYTES` on CPU; one rank never shards).
- :func:`shard_model` makes gradients reduce with a **sum** (divide factor 1): the trainer divides each
  micro-batch's loss by the global token count, so a sum over ranks is the whole batch's gradient, as in
  ``ddp``.
- :func:`full_state_items` yields every state-dict entry as a full CPU tensor. Under FSDP it is a
  collective: every rank must iterate it to the end, in the same order; so is :func:`fingerprint` of
  sharded tensors.
- :func:`fingerprint` identifies a set of tensors by their exact bits, computed where they live (no CPU
  copy): what ranks compare to check that their replicas are identical.

Not in this module: the objective (``grpo.py``), the step itself (``trainer.py``), checkpoint files
(``checkpoints.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["CPU_BUDGET_BYTES", "PARALLEL_MODES", "PrecisionUnsupported", "autocast", "check_compute_dtype",
           "choose_parallel", "fingerprint", "full_state_items", "shard_model", "training_state_bytes"]

PARALLEL_MODES = ("auto", "ddp", "fsdp")
CPU_BUDGET_BYTES = 16 * 1024**3  # what ``auto`` assumes one CPU rank may hold
MASTER_BYTES = 4 + 4 + 8  # per parameter: fp32 weight, fp32 gradient, AdamW's two fp32 moments


class PrecisionUnsupported(ValueError):
    """A compute dtype the trainer does not train in (fp16: no gradient scaler)."""


def check_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` if the trainer can compute in it (fp32, bf16); raises :class:`PrecisionUnsupported`."""
    if dtype in (torch.float32, torch.bfloat16):
        return dtype
    raise PrecisionUnsupported(f"the trainer does not train in {dtype}: fp16 would need a gradient scaler; use "
                               "bf16 (torch.bfloat16, with fp32 master weights) or fp32 (LIBRA_DTYPE=bf16 or fp32)")


def autocast(device_type: str, dtype: torch.dtype, sharded: bool) -> contextlib.AbstractContextManager[Any]:
    """The forward/backward passes' context: ``torch.autocast`` to a bf16 compute dtype on replicated fp32
    weights; nothing for fp32 or under FSDP (its mixed-precision policy casts the parameters itself)."""
    if dtype == torch.float32 or sharded:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def training_state_bytes(n_params: int, compute_bytes: int = 4, *, reference: bool = False) -> int:
    """Bytes one replica of training state takes: fp32 weights and gradients and AdamW's two fp32 moments
    (16 bytes a parameter), the compute dtype's copy of the weights when it is narrower (autocast keeps one
    for the pass), and a frozen reference model in the compute dtype (``reference``: ``kl_coef > 0``)."""
    extra = (compute_bytes if compute_bytes < 4 else 0) + (compute_bytes if reference else 0)
    return (MASTER_BYTES + extra) * n_params


def choose_parallel(requested: str, *, world_size: int, n_params: int, param_bytes: int, device_type: str,
                    device_memory_bytes: int | None = None, memory_fraction: float | None = None,
                    reference: bool = False) -> str:
    """``"ddp"`` or ``"fsdp"`` (see the module contracts). ``param_bytes`` is the compute dtype's size;
    ``memory_fraction`` the slot's share of the device (None: all of it). ``requested`` ``ddp``/``fsdp`` is
    kept as asked; an unknown mode raises ``ValueError`` naming the known ones."""
    if requested not in PARALLEL_MODES:
        raise ValueError(f"unknown parallel mode {requested!r} (known: {', '.join(PARALLEL_MODES)})")
    if requested != "auto":
        return requested
    if world_size <= 1:
        return "ddp"
    if device_type == "cuda" and device_memory_bytes:
        budget = int(device_memory_bytes * (memory_fraction if memory_fraction else 1.0))
    else:
        budget = CPU_BUDGET_BYTES
    need = training_state_bytes(n_params, param_bytes, reference=reference)
    return "fsdp" if need > budget // 2 else "ddp"


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks (``model.model.layers`` for HF decoder models; else every ModuleList's items)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return list(layers)
    return [m for ml in model.modules() if isinstance(ml, torch.nn.ModuleList) for m in ml]


def shard_model(model: torch.nn.Module, device_type: str, world_size: int,
                compute_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Apply FSDP2 to ``model`` in place over all ``world_size`` ranks of the default group (a 1-D mesh
    of ``device_type``); parameters move to the mesh's device, each rank keeping its shard (in their own
    dtype: fp32). A bf16 ``compute_dtype`` gathers them in bf16 for the passes and reduce-scatters the
    gradients in fp32. Returns it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_type, (world_size,))
    mp = MixedPrecisionPolicy()
    if compute_dtype != torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # a sum over ranks: the loss is already globally normalised
            m.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model


def full_state_items(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full CPU copy)`` for every entry of ``model.state_dict()`` (a collective under FSDP); floating
    entries cast to ``dtype`` when given (the compute dtype, for rollout engines)."""
    from torch.distributed.tensor import DTensor

    for name, value in model.state_dict().items():
        t: Any = value.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
        yield name, t.to("cpu", dtype=cast, copy=True)


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FP_CHUNK = 1 << 22  # elements per fingerprint chunk: bounds the int64 temporaries (2 x 32 MiB)
_MOD = 1 << 64


def _bits_sum(t: torch.Tensor) -> int:
    """A position-weighted sum (mod 2**64) of ``t``'s elements' bits, on ``t``'s device: integer arithmetic,
    so exact and independent of the reduction order."""
    flat = t.detach().contiguous().reshape(-1)
    ints = flat.view(_INT_VIEW[flat.element_size()])
    total = 0
    for start in range(0, ints.numel(), _FP_CHUNK):
        part = ints[start : start + _FP_CHUNK].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), dtype=torch.int64, device=part.device)
        weights.mul_(2654435761).add_(0x632BE5AB).bitwise_or_(1)  # odd: a changed element changes the sum
        total = (total + int((part * weights).sum())) % _MOD
    return total


def fingerprint(items: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A hex digest of named tensors' names, dtypes, shapes and exact bits, each reduced where it lives (a
    DTensor is gathered first: a collective). Equal tensors give equal digests on any rank."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, value in items:
        t: Any = value.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{_bits_sum(t)};".encode())
    return h.hexdigest()


def grad_norm_value(norm: torch.Tensor) -> float:
    """A float from ``clip_grad_norm_``'s result, which is a DTensor under FSDP."""
    from torch.distributed.tensor import DTensor

    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
