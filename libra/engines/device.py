"""Where an actor's engines run: device, dtype and memory budget from the slot and the configuration.

Role: one small, pure decision that the rollout and training roles both follow, so that an actor on a GPU
slot runs its engines on its GPU(s) and an actor on a CPU slot (or on a host without CUDA) runs them on the
CPU exactly as before.

Rules (:func:`choose_placement`):

- A slot named ``gpuN`` (``gpuN.K`` for the K-th extra engine sharing GPU N) runs on ``cuda:0``: the
  supervisor sets ``CUDA_VISIBLE_DEVICES`` per slot (``libra.actors.slots.slot_cuda_env``: GPU N's entry
  of the host's list), so the slot's GPU is always the first visible one. Its dtype is ``bfloat16`` unless
  configured otherwise. Slot names other than ``gpuN``, ``gpuN.K`` and ``cpuN`` raise
  :class:`SlotNameError` (:func:`parse_slot`).
- A ``cpuN`` slot, or a GPU slot on a host where CUDA is not usable, runs on ``cpu`` in ``float32`` unless a
  dtype is configured; the fallback says why in :attr:`Placement.reason`.
- The memory budget is a fraction of the GPU's memory (``torch.cuda.set_per_process_memory_fraction`` for the
  HF engine and the trainer, ``gpu_memory_utilization`` for vLLM). ``0`` means automatic: 0.9 shared evenly
  by the engines on that GPU (``LIBRA_ENGINES_PER_GPU``). It means nothing on the CPU.

Configuration reaches a slot through its environment (set by ``python -m libra.actors --dtype ...
--gpu-memory-fraction ...`` or by ``python -m libra run`` from the job's ``[actors]`` table):
``LIBRA_DTYPE`` (``auto``, ``bf16``, ``fp16``, ``fp32`` or the torch names), ``LIBRA_GPU_MEMORY_FRACTION``
and ``LIBRA_ENGINES_PER_GPU``.

Also here: the TP-group helpers (which GPUs a group's leader owns; which rollout engine can serve a TP
degree) and the CUDA out-of-memory test the roles use. torch is imported only inside functions that probe
or use CUDA, so this module is importable anywhere.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DTYPE_ENV", "DeviceConfigError", "ENGINES_PER_GPU_ENV", "MEMORY_FRACTION_ENV", "NODE_DEVICES_ENV",
           "NODE_GPUS_ENV", "Placement", "SlotNameError", "TPUnsupported", "apply_memory_budget", "choose_placement",
           "cuda_visible_for", "engine_labels", "engine_labels_from_env", "free_cuda_cache", "group_devices",
           "is_cuda_oom", "max_tp_for", "parse_dtype", "parse_slot", "placement_from_env", "slot_gpu_index",
           "trainer_backend", "with_settings"]

DTYPE_ENV = "LIBRA_DTYPE"
MEMORY_FRACTION_ENV = "LIBRA_GPU_MEMORY_FRACTION"
ENGINES_PER_GPU_ENV = "LIBRA_ENGINES_PER_GPU"

_DTYPES = {"auto": "auto", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
           "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32"}

#: The share of a GPU's memory the engines on it may use together when no budget is configured.
AUTO_MEMORY_SHARE = 0.9


class DeviceConfigError(ValueError):
    """A device setting that cannot be honoured (unknown dtype, a memory fraction outside (0, 1], ...)."""


class SlotNameError(DeviceConfigError):
    """A slot name that is none of ``gpuN``, ``gpuN.K`` (K >= 1) or ``cpuN``."""


class TPUnsupported(DeviceConfigError):
    """A tensor-parallel degree the actor's rollout engine cannot serve (the HF engine serves TP 1 only)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one engine runs. ``device`` is a torch device string; ``dtype`` a torch dtype name;
    ``memory_fraction`` the share of the GPU's memory this engine may take (``None`` on the CPU)."""

    device: str
    dtype: str
    memory_fraction: float | None
    reason: str

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)


def parse_dtype(name: str) -> str:
    """``'bf16'`` → ``'bfloat16'`` etc.; ``'auto'`` stays ``'auto'``. Raises :class:`DeviceConfigError`."""
    key = str(name).strip().lower()
    if key not in _DTYPES:
        raise DeviceConfigError(f"unknown dtype {name!r} (known: auto, bf16, fp16, fp32)")
    return _DTYPES[key]


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


def choose_placement(slot: str, *, cuda_devices: int, dtype: str = "auto", memory_fraction: float = 0.0,
                     engines_per_gpu: int = 1) -> Placement:
    """The placement of an engine on ``slot`` when ``cuda_devices`` CUDA devices are visible to it (see the
    module rules). Pure: the caller probes CUDA."""
    want = parse_dtype(dtype)
    if not 0.0 <= memory_fraction <= 1.0:
        raise DeviceConfigError(f"GPU memory fraction must be within (0, 1] (0: automatic), got {memory_fraction!r}")
    if engines_per_gpu < 1:
        raise DeviceConfigError(f"engines per GPU must be >= 1, got {engines_per_gpu!r}")
    gpu = slot_gpu_index(slot)
    if gpu is not None and cuda_devices > 0:
        frac = memory_fraction or round(AUTO_MEMORY_SHARE / engines_per_gpu, 4)
        return Placement("cuda:0", "bfloat16" if want == "auto" else want, frac,
                         f"slot {slot} on GPU {gpu} ({cuda_devices} visible)")
    why = (f"slot {slot} is a GPU slot but CUDA is not usable here: CPU" if gpu is not None
           else f"slot {slot} is a CPU slot")
    return Placement("cpu", "float32" if want == "auto" else want, None, why)


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver is "no CUDA", not a crash
        return 0


def placement_from_env(slot: str, environ: Mapping[str, str] | None = None,
                       cuda_devices: int | None = None) -> Placement:
    """:func:`choose_placement` with the settings of the slot's environment (see the module docstring) and
    the CUDA devices torch sees (probed unless ``cuda_devices`` is given)."""
    env = os.environ if environ is None else environ
    raw_frac = env.get(MEMORY_FRACTION_ENV, "").strip() or "0"
    raw_per = env.get(ENGINES_PER_GPU_ENV, "").strip() or "1"
    try:
        frac, per = float(raw_frac), int(raw_per)
    except ValueError:
        raise DeviceConfigError(f"{MEMORY_FRACTION_ENV}={raw_frac!r} / {ENGINES_PER_GPU_ENV}={raw_per!r}: "
                                "expected a number and an integer") from None
    n = _cuda_devices() if cuda_devices is None and slot.startswith("gpu") else (cuda_devices or 0)
    return choose_placement(slot, cuda_devices=n, dtype=env.get(DTYPE_ENV, "auto") or "auto",
                            memory_fraction=frac, engines_per_gpu=per)


def with_settings(p: Placement, slot: str, config: Mapping[str, Any],
                  environ: Mapping[str, str] | None = None) -> Placement:
    """``p`` with a directive's engine settings (``dtype``, ``gpu_memory_fraction``, from the broker's
    ``[broker.engines]``) applied on the same device; ``p`` itself when the directive carries none."""
    if "dtype" not in config and "gpu_memory_fraction" not in config:
        return p
    env = os.environ if environ is None else environ
    try:
        per = int(env.get(ENGINES_PER_GPU_ENV, "1") or 1)
    except ValueError:
        per = 1
    return choose_placement(slot, cuda_devices=1 if p.on_gpu else 0, dtype=str(config.get("dtype", "auto")),
                            memory_fraction=float(config.get("gpu_memory_fraction", 0.0)), engines_per_gpu=per)


def apply_memory_budget(p: Placement) -> None:
    """Cap this process's share of its GPU at ``p.memory_fraction`` (nothing on the CPU)."""
    if not p.on_gpu or p.memory_fraction is None:
        return
    import torch

    torch.cuda.set_per_process_memory_fraction(p.memory_fraction, torch.device(p.device))


def group_devices(slot: str, rank: int, tp: int) -> tuple[int, ...]:
    """The physical GPUs of the TP group whose member ``rank`` sits on ``slot``. The broker lays TP groups
    out on aligned blocks of consecutive GPUs inside one node, rank order = GPU order, so the group's GPUs
    are ``index - rank .. index - rank + tp - 1``. Raises :class:`DeviceConfigError` for a CPU slot or a
    rank that does not fit."""
    idx = slot_gpu_index(slot)
    if idx is None:
        raise DeviceConfigError(f"slot {slot!r} is not a GPU slot: it cannot join a TP group")
    if tp < 1 or not 0 <= rank < tp:
        raise DeviceConfigError(f"TP group: rank {rank} outside a group of {tp}")
    first = idx - rank
    if first < 0:
        raise DeviceConfigError(f"TP group: slot {slot!r} cannot be rank {rank} of an aligned block")
    return tuple(range(first, first + tp))


def max_tp_for(engine: str, gpus_on_node: int) -> int:
    """The largest rollout TP degree an engine can serve: 1 for ``hf``; every GPU of the node for ``vllm``."""
    if engine == "hf":
        return 1
    if engine == "vllm":
        return max(1, gpus_on_node)
    raise DeviceConfigError(f"unknown rollout engine {engine!r} (known: hf, vllm)")


def engine_labels(slot: str, role: str, engine: str, gpus_on_node: int) -> dict[str, Any]:
    """What an actor tells the broker in its hello labels about its engines: ``engine`` (the rollout engine)
    and ``max_tp`` (the largest rollout TP group it can lead; the planner plans no larger one). A CPU slot
    reports ``max_tp`` 1; a role without a rollout engine (``train``, ``action``, ``episode``) reports none, so
    it does not cap the rollout groups of the actors that do roll out."""
    if role not in ("rollout", "hybrid"):
        return {"engine": engine}
    if slot_gpu_index(slot) is None:
        return {"engine": engine, "max_tp": 1}
    return {"engine": engine, "max_tp": max_tp_for(engine, gpus_on_node)}


NODE_GPUS_ENV = "LIBRA_NODE_GPUS"
#: The host's GPUs as the supervisor was allowed to see them (its ``CUDA_VISIBLE_DEVICES`` entries: indices,
#: UUIDs or MIG ids), set in GPU slots' environment when that list was given; GPU ``N`` is its ``N``-th entry.
NODE_DEVICES_ENV = "LIBRA_NODE_CUDA_DEVICES"


def cuda_visible_for(gpus: tuple[int, ...] | list[int], environ: Mapping[str, str] | None = None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value naming the node's GPUs ``gpus`` (e.g. a TP group's
    :func:`group_devices`): their entries in ``$LIBRA_NODE_CUDA_DEVICES`` when the node's list was given by
    Slurm or Kubernetes, else the indices themselves. Raises :class:`DeviceConfigError` past its end."""
    env = os.environ if environ is None else environ
    raw = env.get(NODE_DEVICES_ENV)
    if raw is None:
        return ",".join(str(g) for g in gpus)
    entries = [e.strip() for e in raw.split(",") if e.strip()]
    bad = [g for g in gpus if not 0 <= g < len(entries)]
    if bad:
        raise DeviceConfigError(f"GPU(s) {bad} are outside this node's {len(entries)} visible GPU(s) ({raw!r})")
    return ",".join(entries[g] for g in gpus)


def engine_labels_from_env(slot: str, role: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """:func:`engine_labels` with the engine ``$LIBRA_ROLLOUT_ENGINE`` names (``hf`` by default) and the node's
    GPU count ``$LIBRA_NODE_GPUS`` (set by the supervisor; 1 when unset)."""
    env = os.environ if environ is None else environ
    engine = env.get("LIBRA_ROLLOUT_ENGINE", "hf").strip().lower() or "hf"
    try:
        gpus = int(env.get(NODE_GPUS_ENV, "1") or 1)
    except ValueError:
        gpus = 1
    if engine not in ("hf", "vllm"):
        return {"engine": engine, "max_tp": 1}  # the role refuses the name itself, with its own message
    return engine_labels(slot, role, engine, gpus)


def trainer_backend(p: Placement, environ: Mapping[str, str] | None = None) -> str | None:
    """The trainer ranks' ``torch.distributed`` backend: None (the trainer's own rule: NCCL on CUDA, gloo on
    the CPU) unless this GPU is shared with other engine slots (``$LIBRA_ENGINES_PER_GPU`` > 1), where two
    ranks may sit on one device, which NCCL refuses: gloo then."""
    env = os.environ if environ is None else environ
    try:
        shared = int(env.get(ENGINES_PER_GPU_ENV, "1") or 1) > 1
    except ValueError:
        shared = False
    return "gloo" if p.on_gpu and shared else None


def is_cuda_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA out-of-memory error (``torch.cuda.OutOfMemoryError``, or the RuntimeError
    older code paths raise with CUDA's message)."""
    try:
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    except ImportError:
        pass
    return isinstance(exc, RuntimeError) and "CUDA out of memory" in str(exc)


def free_cuda_cache() -> None:
    """Give the caching allocator's free blocks back (after an OOM); nothing without CUDA."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
