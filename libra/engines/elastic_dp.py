"""Elastic data parallelism: a per-step DP group re-formed from a rendezvous store by generation number.

Role: the trainer side of the Elastic Hybrid Pool (docs/papers.md §1.3.5). The broker's EHP
(``libra.broker.ehp``) tells every member of a training step who the members are (their order is their
rank), the group's **generation** and the rendezvous port; a member whose generation changed leaves the
old group and joins the new one. Core ranks keep their ranks (they come first in the member list); a
hybrid replica joins as one more whole data-parallel replica and leaves again, and nothing else changes.

Contracts:

- :class:`ElasticGroup` holds one ``torch.distributed.TCPStore`` (hosted by the member of rank 0, the
  first core rank, which never changes; the others connect as clients) and forms the default process
  group of generation ``g`` on a ``PrefixStore("libra-dp/g/", store)``. :meth:`ElasticGroup.ensure` is a
  no-op when the generation, rank and size are unchanged; it must be called by every member of the new
  generation (it blocks until all of them have arrived). gloo on CPU, NCCL on CUDA.
- A joining replica gets the core's state as :func:`snapshot` (model weights ``model.*`` and AdamW's
  per-parameter state ``opt.N.*``, CPU copies) published by rank 0 on its data plane, and loads it with
  :func:`restore` (raises :class:`SnapshotError` naming what does not fit). After a restore the joiner's
  model and optimizer equal rank 0's bit for bit.
- During its zero-gradient step(s) a joiner trains on an empty shard: it contributes zero tokens and zero
  gradients to the sums, which leaves the step mathematically identical to "not joined", and it applies
  the same reduced gradient with the same optimizer state, so after the step it holds the core's weights
  (tested against a run without the joiner).
- A join does not stall the core (``bench ehp_join``): the joiner forms the group and contributes its
  zero gradient first, and loads the snapshot only after the all-reduce, before its optimizer applies the
  reduced gradient (``GRPOTrainer.train_step(before_update=...)``); every member calls :meth:`ElasticGroup.ensure`
  on a thread of its own while it runs its passes, whose collectives all come after them
  (``train_step(group_ready=...)``): nothing else may use ``torch.distributed`` meanwhile.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ElasticGroup", "GroupSpec", "SnapshotError", "restore", "snapshot"]

_PREFIX = "libra-dp"


class SnapshotError(ValueError):
    """A state snapshot does not fit this model or optimizer (names, shapes or parameter count)."""


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One step's DP group as the broker decided it: ``members`` in rank order, this member's ``rank``."""

    generation: int
    rank: int
    world_size: int
    host: str
    port: int

    def __post_init__(self) -> None:
        if self.generation < 1:
            raise ValueError(f"GroupSpec.generation must be >= 1, got {self.generation}")
        if self.world_size < 1 or not (0 <= self.rank < self.world_size):
            raise ValueError(f"GroupSpec: rank {self.rank} must be in [0, world_size={self.world_size})")
        if not (0 < self.port < 65536):
            raise ValueError(f"GroupSpec.port must be in 1..65535, got {self.port}")


class ElasticGroup:
    """The process's membership in the elastic DP group (see the module contracts)."""

    def __init__(self, backend: str = "gloo", timeout_s: float = 300.0) -> None:
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s)
        self.store: Any = None
        self.current: GroupSpec | None = None
        self.formed = 0  # groups this process joined

    def ensure(self, spec: GroupSpec) -> bool:
        """Be a member of ``spec``'s group; True when a group was (re)formed. Leaves the previous one."""
        if self.current == spec:
            return False
        if self.current is not None and (self.current.host, self.current.port) != (spec.host, spec.port):
            self.store = None  # a different rendezvous: a new job
        self.leave()
        if spec.world_size > 1:
            if self.store is None:
                self.store = dist.TCPStore(spec.host, spec.port, is_master=spec.rank == 0, timeout=self.timeout,
                                           wait_for_workers=False)
            prefixed = dist.PrefixStore(f"{_PREFIX}/{spec.generation}/", self.store)
            dist.init_process_group(self.backend, store=prefixed, rank=spec.rank, world_size=spec.world_size,
                                    timeout=self.timeout)
        self.current = spec
        self.formed += 1
        return True

    def leave(self) -> None:
        """Leave the current group (the rendezvous store stays for the next generation). Idempotent."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.current = None

    def close(self) -> None:
        self.leave()
        self.store = None


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """CPU copies of the weights (``model.NAME``) and of the optimizer's per-parameter state
    (``opt.I.KEY``, ``I`` the parameter's position in the optimizer's groups)."""
    out = {f"model.{k}": v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for key, val in optimizer.state.get(p, {}).items():
            t = val if isinstance(val, torch.Tensor) else torch.tensor(val)
            out[f"opt.{i}.{key}"] = t.detach().to("cpu", copy=True)
    return out


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, torch.Tensor]) -> None:
    """Load a :func:`snapshot` into ``model`` and ``optimizer`` (same architecture and parameter order)."""
    weights = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    own = model.state_dict()
    if set(weights) != set(own):
        missing, extra = sorted(set(own) - set(weights))[:5], sorted(set(weights) - set(own))[:5]
        raise SnapshotError(f"snapshot weights do not fit the model: missing {missing}, unexpected {extra}")
    for k, v in weights.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise SnapshotError(f"snapshot weight {k!r} has shape {tuple(v.shape)}, the model {tuple(own[k].shape)}")
    model.load_state_dict(weights)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    per: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in state.items():
        if k.startswith("opt."):
            _, i, key = k.split(".", 2)
            if not i.isdigit() or int(i) >= len(params):
                raise SnapshotError(f"snapshot optimizer entry {k!r} names no parameter (the optimizer has "
                                    f"{len(params)})")
            per.setdefault(int(i), {})[key] = v
    optimizer.state.clear()
    for i, entries in per.items():
        p = params[i]
        optimizer.state[p] = {key: (t.to(p.device) if t.dim() else t.clone()) for key, t in entries.items()}
