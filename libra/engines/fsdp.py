"""Data parallelism for GRPO trainer ranks: replicated (``ddp``) or sharded with FSDP2 (``fsdp``).

Role: the parts of :class:`~libra.engines.trainer.GRPOTrainer` that depend on how the model is spread over
the ranks. ``ddp``: every rank holds the whole model and optimizer, gradients are all-reduced in flat
buckets (the trainer does it). ``fsdp``: ``torch.distributed.fsdp.fully_shard`` (FSDP2) on every decoder
layer and on the root; parameters, gradients and AdamW state are sharded over the ranks (DTensors), so a
model whose weights, gradients and optimizer state do not fit one device trains over several.

Contracts:

- :func:`choose_parallel` is pure: ``"ddp"`` or ``"fsdp"`` from the requested mode, the world size, the
  model's size and the device's memory (``auto``: FSDP when the replicated training state would take more
  than half a device, or of :data:`CPU_BUDGET_BYTES` on CPU; one rank never shards).
- :func:`shard_model` makes gradients reduce with a **sum** (divide factor 1): the trainer divides each
  micro-batch's loss by the global token count, so a sum over ranks is the whole batch's gradient, as in
  ``ddp``.
- :func:`full_state_items` yields every state-dict entry as a full CPU tensor. Under FSDP it is a
  collective: every rank must iterate it to the end, in the same order.

Not in this module: the objective (``grpo.py``), the step itself (``trainer.py``), checkpoint files
(``checkpoints.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CPU_BUDGET_BYTES", "PARALLEL_MODES", "choose_parallel", "full_state_items", "is_sharded",
           "shard_model", "training_state_bytes"]

PARALLEL_MODES = ("auto", "ddp", "fsdp")
CPU_BUDGET_BYTES = 16 * 1024**3  # what ``auto`` assumes one CPU rank may hold


def training_state_bytes(n_params: int, param_bytes: int) -> int:
    """Bytes one replica of training state takes: weights, gradients and AdamW's two moments (all four in
    the parameters' dtype, as torch's AdamW keeps them)."""
    return 4 * n_params * param_bytes


def choose_parallel(requested: str, *, world_size: int, n_params: int, param_bytes: int, device_type: str,
                    device_memory_bytes: int | None = None) -> str:
    """``"ddp"`` or ``"fsdp"`` (see the module contracts). ``requested`` ``ddp``/``fsdp`` is kept as asked;
    an unknown mode raises ``ValueError`` naming the known ones."""
    if requested not in PARALLEL_MODES:
        raise ValueError(f"unknown parallel mode {requested!r} (known: {', '.join(PARALLEL_MODES)})")
    if requested != "auto":
        return requested
    if world_size <= 1:
        return "ddp"
    budget = device_memory_bytes if device_type == "cuda" and device_memory_bytes else CPU_BUDGET_BYTES
    return "fsdp" if training_state_bytes(n_params, param_bytes) > budget // 2 else "ddp"


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks (``model.model.layers`` for HF decoder models; else every ModuleList's items)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return list(layers)
    return [m for ml in model.modules() if isinstance(ml, torch.nn.ModuleList) for m in ml]


def shard_model(model: torch.nn.Module, device_type: str, world_size: int) -> torch.nn.Module:
    """Apply FSDP2 to ``model`` in place over all ``world_size`` ranks of the default group (a 1-D mesh
    of ``device_type``); parameters move to the mesh's device, each rank keeping its shard. Returns it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device_type, (world_size,))
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # a sum over ranks: the loss is already globally normalised
            m.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_items(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full CPU copy)`` for every entry of ``model.state_dict()`` (a collective under FSDP)."""
    from torch.distributed.tensor import DTensor

    for name, value in model.state_dict().items():
        t: Any = value.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        yield name, t.to("cpu", copy=True)


def grad_norm_value(norm: torch.Tensor) -> float:
    """A float from ``clip_grad_norm_``'s result, which is a DTensor under FSDP."""
    from torch.distributed.tensor import DTensor

    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
