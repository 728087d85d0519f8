"""Tensor-parallel groups on a node: which GPUs a group's member owns, their ``CUDA_VISIBLE_DEVICES``, the
largest TP degree each rollout engine serves, and the engine labels an actor reports in its hello.

The broker lays TP groups out on aligned blocks of consecutive GPUs inside one node (rank order = GPU
order). The supervisor gives GPU slots the node's GPU count (``LIBRA_NODE_GPUS``) and, when the node's list
was given by Slurm or Kubernetes, its entries (``LIBRA_NODE_CUDA_DEVICES``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .errors import DeviceConfigError
from .slots import slot_gpu_index

__all__ = ["NODE_DEVICES_ENV", "NODE_GPUS_ENV", "cuda_visible_for", "engine_labels", "engine_labels_from_env",
           "group_devices", "max_tp_for"]

NODE_GPUS_ENV = "LIBRA_NODE_GPUS"
#: The host's GPUs as the supervisor was allowed to see them (its ``CUDA_VISIBLE_DEVICES`` entries: indices,
#: UUIDs or MIG ids), set in GPU slots' environment when that list was given; GPU ``N`` is its ``N``-th entry.
NODE_DEVICES_ENV = "LIBRA_NODE_CUDA_DEVICES"


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
