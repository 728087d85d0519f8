"""Where a job's slots go on a multi-node allocation (``deploy/slurm/libra.sbatch``): pure, no I/O.

``libra run`` puts every slot of ``[actors]`` on one host; on ``N`` nodes the batch script runs one ``libra
actors`` per node (:mod:`libra.rl.node_launch`), and each computes the same layout and takes its own part:

- **Trainer ranks** (``[actors] trainer``) all go on node 0, the broker's node: their process group, and the
  Elastic Hybrid Pool's, meets on one host's loopback (``libra.actors.elastic_train``: one host for now).
- **Rollout slots** (``[actors] rollout``) go one at a time to the node with the most engine room left: its
  GPUs less the engines already there (node 0 counts its trainer ranks; a tie goes to the lower node). Under
  ``[broker] policy = "libra"`` those on node 0 are ``hybrid`` (the pool may borrow them as trainer replicas,
  in the trainers' group on that host) and those elsewhere ``rollout``; under ``"static"`` all are ``rollout``.
- Engines run on the node's GPUs (``--gpu-roles``; several share a GPU when there are more engines than
  GPUs); on a node without GPUs they are CPU slots.
- **Action slots** (``[actors] action``) and then the one **episode runner** each go to the node with the
  fewest slots so far (a tie goes to the higher node: away from the broker, the driver and the trainers).

``gpus_per_node`` is the same for every node (Slurm's ``--gpus-per-node``): each node computes the whole
layout, so the nodes agree on it without talking to each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["NodeSlots", "lay_out", "roles_text"]

_ORDER = ("train", "hybrid", "rollout", "action", "episode")


@dataclass(slots=True)
class NodeSlots:
    """One node's slots: role → count on its GPUs (``--gpu-roles``) and on its CPUs (``--roles``)."""

    gpu: dict[str, int] = field(default_factory=dict)
    cpu: dict[str, int] = field(default_factory=dict)

    def add(self, role: str, on_gpu: bool) -> None:
        where = self.gpu if on_gpu else self.cpu
        where[role] = where.get(role, 0) + 1

    @property
    def engines(self) -> int:
        return sum(n for r, n in (*self.gpu.items(), *self.cpu.items()) if r not in ("action", "episode"))

    @property
    def total(self) -> int:
        return sum(self.gpu.values()) + sum(self.cpu.values())


def roles_text(counts: dict[str, int]) -> str:
    """``{"train": 2, "action": 1}`` → ``"train=2,action=1"`` (the ``--roles`` syntax), in a fixed order."""
    return ",".join(f"{r}={counts[r]}" for r in sorted(counts, key=_ORDER.index) if counts[r])


def lay_out(*, rollout: int, trainer: int, action: int, policy: str, nodes: int,
            gpus_per_node: int) -> list[NodeSlots]:
    """The slots of each of ``nodes`` nodes (see the module docstring). Raises ValueError for counts that
    make no cluster."""
    if nodes < 1:
        raise ValueError(f"a job needs at least one node, got {nodes}")
    if gpus_per_node < 0 or min(rollout, trainer, action) < 0:
        raise ValueError("GPU and slot counts must be >= 0")
    if policy not in ("libra", "static"):
        raise ValueError(f"[broker] policy must be 'libra' or 'static', got {policy!r}")
    on_gpu = gpus_per_node > 0
    out = [NodeSlots() for _ in range(nodes)]
    for _ in range(trainer):
        out[0].add("train", on_gpu)
    for _ in range(rollout):
        i = max(range(nodes), key=lambda k: (gpus_per_node - out[k].engines, -k))
        out[i].add("hybrid" if policy == "libra" and i == 0 else "rollout", on_gpu)
    for role in ["action"] * action + ["episode"]:
        i = min(range(nodes), key=lambda k: (out[k].total, -k))
        out[i].add(role, False)
    return out
