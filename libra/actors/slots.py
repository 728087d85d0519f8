"""Slot discovery: how many GPU and CPU slots this host offers, and which GPU each slot sees. No torch import.

GPUs are counted with NVML (``nvidia-ml-py``), but only those this process may use: when Slurm or
Kubernetes set ``CUDA_VISIBLE_DEVICES`` (indices, GPU UUIDs or MIG ids), its entries are the host's GPUs,
in that order, and NVML's others are not counted (:func:`allowed_gpus`, pure). With no driver or no GPU
this says why and returns zero GPUs; the caller starts CPU slots only.

Each slot's CUDA environment (:func:`slot_cuda_env`, pure: the parent's environment in, the slot's
settings out):

- ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` everywhere, so CUDA numbers GPUs as NVML does (CUDA's default puts the
  fastest first).
- ``gpuN`` and ``gpuN.K`` (another engine on GPU N) see GPU ``N``: the ``N``-th entry of the parent's
  ``CUDA_VISIBLE_DEVICES`` when it has one (never an NVML index written over it), else ``N``. A GPU action
  slot whose model services are given ``G`` GPUs (``--service-gpus G``) sees GPUs ``N .. N+G-1``. When the
  parent's list was given, it also travels as ``LIBRA_NODE_CUDA_DEVICES`` (for TP groups that span GPUs,
  :func:`libra.engines.device.tp_groups.cuda_visible_for`).
- ``cpuN`` sees no GPU (``CUDA_VISIBLE_DEVICES=""``): its engines and its ``reward_model`` service run on
  the CPU instead of taking GPU memory outside every slot's budget. Model services get GPUs only on a GPU
  slot (``--service-gpus``; a CPU slot refuses them, ``libra.actors.topology``).
- ``LIBRA_SLOT_CUDA`` names the slot these settings were made for: a runtime started without the
  supervisor (a systemd unit) makes its own (:func:`runtime_cuda_env`), one started by it keeps them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from libra.engines.device.errors import DeviceConfigError
from libra.engines.device.slots import parse_slot
from libra.engines.device.tp_groups import NODE_DEVICES_ENV

__all__ = ["VISIBLE_ENV", "ORDER_ENV", "GpuDiscovery", "GpuEngineSlot", "allowed_gpus", "discover_gpus",
           "parent_visible", "place_gpu_roles", "resolve_slots", "runtime_cuda_env", "slot_cuda_env"]

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
ORDER_ENV = "CUDA_DEVICE_ORDER"
SLOT_CUDA_ENV = "LIBRA_SLOT_CUDA"  # the slot whose CUDA settings this environment already holds


def parent_visible(environ: Mapping[str, str]) -> list[str] | None:
    """The entries of ``environ``'s ``CUDA_VISIBLE_DEVICES`` (None when unset; ``[]`` when it hides every
    GPU). As CUDA does, the list ends at the first empty or negative entry."""
    raw = environ.get(VISIBLE_ENV)
    if raw is None:
        return None
    out: list[str] = []
    for e in (x.strip() for x in raw.split(",")):
        if not e or e.startswith("-"):
            break
        out.append(e)
    return out


def _uuid(u: str) -> str:
    u = u.strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def allowed_gpus(nvml_uuids: Sequence[str], visible: Sequence[str] | None) -> list[tuple[str, int | None]]:
    """The GPUs this process may use, in ``CUDA_VISIBLE_DEVICES`` order: ``(entry, NVML index)`` per GPU,
    the entry being what a slot on that GPU gets (the NVML index itself when ``visible`` is None). A MIG id's
    NVML index is None. As CUDA does, the list ends at the first entry that names no GPU (an index past NVML's
    count, a UUID prefix matching none or several)."""
    if visible is None:
        return [(str(i), i) for i in range(len(nvml_uuids))]
    out: list[tuple[str, int | None]] = []
    for e in visible:
        if e.isdigit():
            if int(e) >= len(nvml_uuids):
                break
            out.append((e, int(e)))
        elif e.upper().startswith("MIG-"):
            out.append((e, None))
        else:
            hits = [i for i, u in enumerate(nvml_uuids) if _uuid(u).startswith(_uuid(e))]
            if len(hits) != 1:
                break
            out.append((e, hits[0]))
    return out


def slot_cuda_env(slot: str, parent: Mapping[str, str], *, service_gpus: int = 0) -> dict[str, str]:
    """The CUDA settings of ``slot``'s environment given the supervisor's ``parent`` environment (see the
    module docstring). Raises :class:`~libra.engines.device.errors.SlotNameError` for a bad slot name and
    :class:`~libra.engines.device.errors.DeviceConfigError` for a GPU the parent may not use."""
    kind, n, _ = parse_slot(slot)
    out = {ORDER_ENV: "PCI_BUS_ID", SLOT_CUDA_ENV: slot}
    if kind == "cpu":
        out[VISIBLE_ENV] = ""
        return out
    if service_gpus < 0:
        raise DeviceConfigError(f"service GPUs must be >= 0, got {service_gpus}")
    count = max(1, service_gpus)
    entries = parent_visible(parent)
    if entries is None:
        out[VISIBLE_ENV] = ",".join(str(i) for i in range(n, n + count))
        return out
    if n + count > len(entries):
        raise DeviceConfigError(f"slot {slot} needs GPU(s) {n}..{n + count - 1}, but {VISIBLE_ENV}="
                                f"{parent.get(VISIBLE_ENV)!r} lists {len(entries)}")
    out[VISIBLE_ENV] = ",".join(entries[n:n + count])
    out[NODE_DEVICES_ENV] = ",".join(entries)
    return out


@dataclass(frozen=True, slots=True)
class GpuDiscovery:
    count: int
    names: tuple[str, ...]
    reason: str  # why count is what it is, in words


def discover_gpus(environ: Mapping[str, str] | None = None) -> GpuDiscovery:
    """The GPUs this process may use: NVML's, restricted to ``environ``'s ``CUDA_VISIBLE_DEVICES``."""
    visible = parent_visible(os.environ if environ is None else environ)
    if visible == []:
        return GpuDiscovery(0, (), f"{VISIBLE_ENV} is empty: no GPU may be used")
    try:
        import pynvml
    except ImportError:
        return GpuDiscovery(0, (), "nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return GpuDiscovery(0, (), f"NVML unavailable ({exc}); no NVIDIA driver on this host")
    try:
        total = pynvml.nvmlDeviceGetCount()
        uuids, all_names = [], []
        for i in range(total):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name, uuid = pynvml.nvmlDeviceGetName(h), pynvml.nvmlDeviceGetUUID(h)
            all_names.append(name.decode() if isinstance(name, bytes) else str(name))
            uuids.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
        allowed = allowed_gpus(uuids, visible)
        names = tuple(all_names[i] if i is not None else "MIG device" for _, i in allowed)
        n = len(allowed)
        if visible is not None:
            why = f"{n} of NVML's {total} GPU(s) allowed by {VISIBLE_ENV}={','.join(visible)}"
        else:
            why = f"{n} GPU(s) found by NVML" if n else "NVML reports no GPUs"
        return GpuDiscovery(n, names, why)
    except pynvml.NVMLError as exc:
        return GpuDiscovery(0, (), f"NVML query failed: {exc}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def resolve_slots(cpu_slots: int | None, gpu_slots: str) -> tuple[list[str], str]:
    """Slot names for this host and a sentence about the GPUs. ``gpu_slots`` is ``auto`` or an int."""
    if gpu_slots == "auto":
        d = discover_gpus()
        n_gpu, why = d.count, d.reason
    else:
        try:
            n_gpu = int(gpu_slots)
        except ValueError:
            raise ValueError(f"--gpu-slots must be 'auto' or a number, got {gpu_slots!r}") from None
        if n_gpu < 0:
            raise ValueError("--gpu-slots must be >= 0")
        why = f"{n_gpu} GPU slot(s) requested"
    n_cpu = cpu_slots if cpu_slots is not None else max(1, (os.cpu_count() or 1) - 1)
    if n_cpu < 0:
        raise ValueError("--cpu-slots must be >= 0")
    return [f"gpu{i}" for i in range(n_gpu)] + [f"cpu{i}" for i in range(n_cpu)], why


@dataclass(frozen=True, slots=True)
class GpuEngineSlot:
    """One engine slot placed on a GPU: its name (``gpuN``, or ``gpuN.K`` for the K-th extra engine sharing GPU
    N), its role, the GPU and how many engine slots share that GPU (their memory budget is split)."""

    slot: str
    role: str
    gpu: int
    sharing: int


def place_gpu_roles(roles: list[str], n_gpus: int) -> list[GpuEngineSlot]:
    """Spread engine slots (``roles``, e.g. ``['rollout', 'rollout', 'train']``) over ``n_gpus`` GPUs round
    robin: slot k goes to GPU ``k % n_gpus``. The first slot on a GPU is ``gpuN`` (a slot the broker's planner
    can lay plans on), later ones ``gpuN.K``. Raises ValueError with no GPU to place on."""
    if not roles:
        return []
    if n_gpus < 1:
        raise ValueError(f"{len(roles)} GPU engine slot(s) asked for but no GPU is available")
    per_gpu: dict[int, int] = {}
    placed = []
    for k, role in enumerate(roles):
        g = k % n_gpus
        n = per_gpu.get(g, 0)
        per_gpu[g] = n + 1
        placed.append((f"gpu{g}" if n == 0 else f"gpu{g}.{n}", role, g))
    return [GpuEngineSlot(s, r, g, per_gpu[g]) for s, r, g in placed]


def runtime_cuda_env(slot: str, environ: Mapping[str, str]) -> dict[str, str]:
    """What a slot's runtime must still set in its own environment: nothing when its supervisor already did
    (``LIBRA_SLOT_CUDA`` names this slot), else :func:`slot_cuda_env` of the environment it was started
    with (a runtime started directly, e.g. by a systemd unit, as ``--slot gpu0.1``)."""
    if environ.get(SLOT_CUDA_ENV) == slot:
        return {}
    return slot_cuda_env(slot, environ)
