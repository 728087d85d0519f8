"""Typed payloads of ``train`` work: :class:`TrainArgs` (one GRPO step for one trainer rank, as the
broker's job host submits it), :class:`TrainPart` (one trajectory a rank trains on) and
:class:`TrainResult` (the rank's reply).

No I/O. The broker's job host (``libra.broker.job_host``) builds ``TrainArgs``, one work per rank per step;
the trainer role (``libra.actors.train_role``) parses them (a malformed mapping is a ``bad_request``
failure) and builds ``TrainResult``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from .payloads_base import Payload
from .payloads_refs import DataRef, WeightsRef

__all__ = ["ElasticArgs", "TrainArgs", "TrainPart", "TrainResult"]

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]


class TrainPart(Payload, frozen=True, kw_only=True):
    """One trajectory a rank trains on, as the broker's dispatch assigned it."""

    WHAT = "train part"
    OMIT_DEFAULT = ("index",)

    ref: DataRef
    """Where its tensors are: the episode runner's data-plane server that produced it."""
    advantage: float
    """Its group-relative advantage (computed by the broker from the group's rewards)."""
    index: int | None = None
    """Its position in the step's batch (informational)."""


class ElasticArgs(Payload, frozen=True, kw_only=True):
    """One step's elastic data-parallel group, decided by the broker's Elastic Hybrid Pool
    (``libra.broker.ehp``, ``allocation = "grp_ehp"``). Every work of the step carries the same group; an
    actor's rank is its position in ``members`` (core ranks first, hybrid replicas after them), and a
    member re-forms the gloo group (``libra.engines.elastic_dp``) when ``generation`` changes."""

    WHAT = "elastic group"
    OMIT_DEFAULT = ("zero", "joining", "join_from", "snapshot")

    generation: Annotated[int, msgspec.Meta(ge=1)]
    """The group's generation: bumped by the broker whenever ``members`` change."""
    members: Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(min_length=1)]
    """Actor ids in rank order; ``members[0]`` hosts the rendezvous store on ``master_port``."""
    zero: list[str] = msgspec.field(default_factory=list)
    """Members that contribute zero gradients this step (joining replicas): they get no trajectories."""
    joining: list[str] = msgspec.field(default_factory=list)
    """Members that first load the core's state (weights and optimizer) from ``join_from``."""
    join_from: DataRef | None = None
    """Where the joining members fetch the state: rank 0 publishes it there (``snapshot``) before its step."""
    snapshot: str | None = None
    """Rank 0: publish its state (weights and optimizer, before this step) on its data plane under this name."""

    def __post_init__(self) -> None:
        if len(set(self.members)) != len(self.members):
            raise ValueError("field `members`: an actor is listed twice")
        if not set(self.zero) <= set(self.members) or not set(self.joining) <= set(self.zero):
            raise ValueError("field `joining`: joining members must contribute zeros and zero members must be members")
        if self.joining and (self.join_from is None or self.snapshot is None):
            raise ValueError("field `join_from`: joining members need the state's ref and rank 0 its `snapshot` name")
        if self.members[0] in self.zero:
            raise ValueError("field `zero`: rank 0 is a core rank and trains")


class TrainArgs(Payload, frozen=True, kw_only=True):
    """The args of one ``train`` work (name ``grpo``).

    The data is either ``parts`` (per rank, the trajectories the broker's dispatch gave it) with
    ``micro_batches`` (per rank, positions into its list), or ``shards`` (one packed data-plane shard
    per rank, see ``libra.rl.shards``). The first ``train`` work fixes the actor's rank (``rank``) and
    joins the gloo group; later works use that rank whatever their ``rank`` says (the driver submits one
    work per rank per step and a trainer holds one at a time, so each rank gets exactly one), and the
    rank fetches ``parts[its rank]`` (from every runner holding one, a few transfers at a time) or
    ``shards[its rank]``. A shard or trajectory that cannot be fetched fails the work with
    ``shard_fetch_failed``.
    """

    WHAT = "train args"
    OMIT_DEFAULT = ("parts", "micro_batches", "shards", "step", "checkpoint_optimizer", "keep_checkpoints", "elastic",
                    "job")

    parts: list[list[TrainPart]] = msgspec.field(default_factory=list)
    """Per rank, the trajectories it trains on."""
    micro_batches: list[list[list[NonNeg]]] = msgspec.field(default_factory=list)
    """Per rank, its micro-batches as positions into its ``parts`` list (each position exactly once);
    missing: one micro-batch of everything."""
    shards: list[DataRef] = msgspec.field(default_factory=list)
    """Per rank, one packed shard (the alternative to ``parts``)."""
    world_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    """Trainer ranks in the group."""
    rank: NonNeg = 0
    """This work's rank (used by the first work an actor gets; see above)."""
    master_port: NonNeg = 0
    """The gloo group's rendezvous port on 127.0.0.1 (needed when ``world_size > 1``)."""
    step: int | None = None
    """The training step (informational)."""
    grpo: dict[str, Any] = msgspec.field(default_factory=dict)
    """``libra.engines.trainer.GRPOConfig`` fields (used when the rank's trainer is created)."""
    checkpoint: str | None = None
    """A directory rank 0 saves a checkpoint to after this step, or None."""
    checkpoint_optimizer: bool = False
    """Whether the checkpoint includes the optimizer state (the bulk of its size)."""
    keep_checkpoints: NonNeg = 0
    """After saving, keep only the newest this many ``step<N>`` checkpoints beside it (0: keep all)."""
    elastic: ElasticArgs | None = None
    """The step's elastic DP group (the broker's EHP); None: the fixed group of ``world_size`` ranks."""
    job: str = ""
    """The job whose step this is (the broker's job host fills it): rank 0 tags the weights it publishes with
    it, so a job-scoped client key may fetch them (``libra.dataplane.access``); "": untagged."""

    def __post_init__(self) -> None:
        if not self.parts and not self.shards:
            raise ValueError("field `shards`: train needs `parts` ([[{ref, advantage}, ...] per rank] with "
                             "`micro_batches`) or `shards` ([data-plane ref per rank])")
        if self.rank >= self.world_size:
            raise ValueError(f"field `rank`: {self.rank} is not below world_size {self.world_size}")
        if self.elastic is not None and len(self.elastic.members) != self.world_size:
            raise ValueError(f"field `elastic`: {len(self.elastic.members)} members for world_size {self.world_size}")


class TrainResult(Payload, frozen=True, kw_only=True):
    """The reply of one ``train`` work: the rank's metrics and, on rank 0, the published weights."""

    WHAT = "train result"
    OMIT_DEFAULT = ("checkpoint", "member", "generation", "restored_version", "zero")

    rank: NonNeg
    """The rank that trained."""
    metrics: dict[str, Any]
    """The trainer's step metrics (``loss``, ``grad_norm``, ``clip_frac``, ``kl_mean``, ...)."""
    weights_version: NonNeg
    """The policy version after this step."""
    checksum: str
    """A fingerprint of the rank's weights after the step (``GRPOTrainer.weights_fingerprint``: the fp32
    master weights' exact bits, computed on the device): equal on every rank whose replica is identical."""
    weights: WeightsRef | None = None
    """Rank 0: the ref rollout instances fetch the new weights from (the newest two versions stay
    fetchable); None on other ranks."""
    publish_s: NonNegFloat = 0.0
    """Rank 0: seconds to serialise and register the weights."""
    shard_sequences: NonNeg = 0
    """Sequences this rank trained on."""
    shard_tokens: NonNeg = 0
    """Tokens this rank trained on."""
    shard_fetch_s: NonNegFloat = 0.0
    """Seconds fetching this rank's data."""
    shard_bytes: NonNeg = 0
    """Bytes fetched for this rank's data."""
    shard_sources: NonNeg = 0
    """Distinct data-plane servers fetched from."""
    checkpoint: str | None = None
    """Rank 0: where the checkpoint was saved, when the args asked for one."""
    member: str | None = None
    """Elastic steps: the actor id that trained (its position in the group's members is ``rank``)."""
    generation: int | None = None
    """Elastic steps: the group generation this rank stepped in."""
    restored_version: int | None = None
    """Elastic steps: the weights version of the core state a joining member loaded before this step."""
    zero: bool = False
    """Elastic steps: this member contributed zero gradients (its zero-gradient step)."""
