"""Typed payloads of ``train`` work: :class:`TrainArgs` (one GRPO step for one trainer rank, as the
broker's job host submits it), :class:`TrainPart` (one trajectory a rank trains on) and
:class:`TrainResult` (the rank's reply).

No I/O. The broker's job host (``libra.broker.job``) builds ``TrainArgs``, one work per rank per step;
the trainer role (``libra.actors.train_role``) parses them (a malformed mapping is a ``bad_request``
failure) and builds ``TrainResult``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from .payloads_base import Payload
from .payloads_refs import DataRef, WeightsRef

__all__ = ["TrainArgs", "TrainPart", "TrainResult"]

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
    OMIT_DEFAULT = ("parts", "micro_batches", "shards", "step", "checkpoint_optimizer", "keep_checkpoints")

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

    def __post_init__(self) -> None:
        if not self.parts and not self.shards:
            raise ValueError("field `shards`: train needs `parts` ([[{ref, advantage}, ...] per rank] with "
                             "`micro_batches`) or `shards` ([data-plane ref per rank])")
        if self.rank >= self.world_size:
            raise ValueError(f"field `rank`: {self.rank} is not below world_size {self.world_size}")


class TrainResult(Payload, frozen=True, kw_only=True):
    """The reply of one ``train`` work: the rank's metrics and, on rank 0, the published weights."""

    WHAT = "train result"
    OMIT_DEFAULT = ("checkpoint",)

    rank: NonNeg
    """The rank that trained."""
    metrics: dict[str, Any]
    """The trainer's step metrics (``loss``, ``grad_norm``, ``clip_frac``, ``kl_mean``, ...)."""
    weights_version: NonNeg
    """The policy version after this step."""
    checksum: str
    """sha256 over all parameters after the step: equal on every rank."""
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
