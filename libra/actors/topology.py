"""What an action actor tells the broker about its resources (its hello labels). No torch import.

- CPU: the CPU ids this process may run on (its affinity, the cores its sandboxes pin actions to) and the
  NUMA node of each, read from ``/sys/devices/system/node/node*/cpulist``; a host without that directory
  reports every CPU on node 0. Actors of one host report the same ids, and the broker's placement shares
  them among those actors (``libra/broker/core_pools.py``).
- GPU: a ``gpu`` slot runs its model services on ``service_gpus`` GPUs (default 1, the slot's GPU). On a
  host where NVML finds no GPU the slot still reports them, runs the services on CPU (simulated one-GPU
  chunks, ``libra/engines/services.py``) and says so with ``gpu_emulated = True``: that is how a CPU-only
  machine exercises the broker's GPU-service placement with real processes.

The labels are :class:`~libra.protocol.payloads_actions.ActorResources` as a plain mapping.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from libra.engines.sandbox.cores import read_numa_nodes
from libra.protocol.payloads_actions import ActorResources

__all__ = ["action_labels", "cpu_topology"]


def cpu_topology(cpus: Iterable[int] | None = None, root: str = "/sys/devices/system/node"
                 ) -> tuple[list[int], list[int]]:
    """``(cpu ids, NUMA node of each)`` for ``cpus`` (default: this process's affinity), NUMA from ``root``."""
    ids = sorted(set(cpus if cpus is not None else os.sched_getaffinity(0)))
    if not ids:
        raise ValueError("no CPU ids to report")
    numa = read_numa_nodes(root)
    return ids, [numa.get(c, 0) for c in ids]


def action_labels(slot: str, service_gpus: int | None = None, *, gpu_present: bool | None = None,
                  root: str = "/sys/devices/system/node") -> dict[str, object]:
    """Hello labels of an action actor in ``slot`` (``cpuN`` or ``gpuN``): see the module docstring.
    ``gpu_present`` (default: asked of NVML) says whether the slot's GPUs are real."""
    cpus, numa = cpu_topology(root=root)
    gpus = 0
    if slot.startswith("gpu"):
        gpus = 1 if service_gpus is None else service_gpus
    elif service_gpus:
        raise ValueError(f"--service-gpus is for gpu slots; {slot!r} is a CPU slot")
    if gpus < 0:
        raise ValueError(f"service GPUs must be >= 0, got {gpus}")
    if gpus and gpu_present is None:
        from .slots import discover_gpus

        gpu_present = discover_gpus().count > 0
    res = ActorResources(cores=len(cpus), cpus=cpus, numa=numa, gpus=gpus, gpu_emulated=bool(gpus) and not gpu_present)
    return res.to_wire()
