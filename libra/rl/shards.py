"""The wire form of one trainer rank's training shard: a dict of flat tensors for the data plane.

Role: the job driver encodes each rank's share of a batch (chosen by ``libra.policies.parallelism.dispatch``) with
:func:`encode_shard` and publishes it on its :class:`~libra.dataplane.DataPlaneServer`; the trainer rank
fetches it and rebuilds the :class:`~libra.engines.grpo.TrainBatch` with :func:`decode_shard`. The
chunked, CRC-checked ``libra.weights.format`` format carries it, so a shard is verified exactly like
weights.

Layout: ``lengths`` int64 ``[k]``; ``input_ids`` int32, ``loss_mask`` uint8 and ``rollout_logprobs``
float32, each the ``k`` sequences laid end to end; ``advantages`` float32 ``[k]``; ``traj_index`` int64
``[k]`` (position in the whole batch). The header metadata holds ``micro_batches`` (positions into the
shard) and ``step``/``rank``.

An episode runner publishes each finished trajectory as a one-sequence shard (:func:`encode_trajectory`,
advantage 0: the broker computes advantages when the batch is cut); a trainer rank fetches the ones the
broker's dispatch gave it and joins them with :func:`merge_trajectories`, which sets the advantages.

Contract: ``decode_shard(*encode_shard(...))`` returns the same sequences, masks and micro-batches;
log-probs and advantages are rounded to float32 (the precision the trainer computes in). Inconsistent
input raises ``ValueError`` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["decode_shard", "encode_shard", "encode_trajectory", "merge_trajectories"]


def encode_shard(input_ids: Sequence[Sequence[int]], loss_mask: Sequence[Sequence[int]],
                 rollout_logprobs: Sequence[Sequence[float]], advantages: Sequence[float], *,
                 traj_index: Sequence[int], micro_batches: Sequence[Sequence[int]], step: int,
                 rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, metadata)`` for :meth:`~libra.dataplane.DataPlaneServer.publish_state_dict`."""
    k = len(input_ids)
    if not (len(loss_mask) == len(rollout_logprobs) == len(advantages) == len(traj_index) == k):
        raise ValueError("encode_shard: input_ids, loss_mask, rollout_logprobs, advantages and traj_index "
                         "must be equally long")
    flat_ids = [t for s in input_ids for t in s]
    tensors = {
        "lengths": torch.tensor([len(s) for s in input_ids], dtype=torch.int64),
        "input_ids": torch.tensor(flat_ids, dtype=torch.int32),
        "loss_mask": torch.tensor([m for s in loss_mask for m in s], dtype=torch.uint8),
        "rollout_logprobs": torch.tensor([x for s in rollout_logprobs for x in s], dtype=torch.float32),
        "advantages": torch.tensor([float(a) for a in advantages], dtype=torch.float32),
        "traj_index": torch.tensor(list(traj_index), dtype=torch.int64),
    }
    n = len(flat_ids)
    if tensors["loss_mask"].numel() != n or tensors["rollout_logprobs"].numel() != n:
        raise ValueError("encode_shard: every sequence's loss_mask and rollout_logprobs must match its input_ids")
    return tensors, {"micro_batches": [list(mb) for mb in micro_batches], "step": step, "rank": rank}


def decode_shard(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> tuple[Any, list[list[int]]]:
    """``(TrainBatch, micro_batches)`` from a fetched shard; raises ``ValueError`` if it is inconsistent."""
    from libra.engines.grpo import TrainBatch

    try:
        lengths = [int(x) for x in tensors["lengths"].tolist()]
        ids, mask = tensors["input_ids"].tolist(), tensors["loss_mask"].tolist()
        lps, adv = tensors["rollout_logprobs"].tolist(), tensors["advantages"].tolist()
    except KeyError as exc:
        raise ValueError(f"training shard lacks tensor {exc}") from None
    if not (len(ids) == len(mask) == len(lps) == sum(lengths)) or len(adv) != len(lengths):
        raise ValueError(f"training shard is inconsistent: {len(lengths)} sequences of {sum(lengths)} tokens, "
                         f"{len(ids)} ids, {len(mask)} mask, {len(lps)} log-probs, {len(adv)} advantages")
    cut, pos = [], 0
    for n in lengths:
        cut.append((pos, pos + n))
        pos += n
    batch = TrainBatch([ids[a:b] for a, b in cut], [mask[a:b] for a, b in cut], [lps[a:b] for a, b in cut],
                       [float(x) for x in adv])
    micro = [[int(i) for i in mb] for mb in metadata.get("micro_batches") or []]
    if sorted(i for mb in micro for i in mb) != list(range(len(lengths))):
        raise ValueError("training shard's micro_batches do not cover its sequences exactly once")
    return batch, micro


def encode_trajectory(input_ids: Sequence[int], loss_mask: Sequence[int], rollout_logprobs: Sequence[float], *,
                      meta: Mapping[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One trajectory as a one-sequence shard (advantage 0); ``meta`` (group, index, ...) rides in the header."""
    tensors, header = encode_shard([list(input_ids)], [list(loss_mask)], [list(rollout_logprobs)], [0.0],
                                   traj_index=[0], micro_batches=[[0]], step=0, rank=0)
    header["trajectory"] = dict(meta or {})
    return tensors, header


def merge_trajectories(items: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, Any]]],
                       advantages: Sequence[float]) -> Any:
    """A :class:`~libra.engines.grpo.TrainBatch` of fetched one-or-more-sequence shards, in order, with
    ``advantages`` (one per sequence) replacing theirs. Raises ``ValueError`` if the counts differ."""
    from libra.engines.grpo import TrainBatch

    ids: list[list[int]] = []
    mask: list[list[int]] = []
    lps: list[list[float]] = []
    for tensors, metadata in items:
        b, _ = decode_shard(tensors, metadata)
        ids += b.input_ids
        mask += b.loss_mask
        lps += b.rollout_logprobs
    if len(advantages) != len(ids):
        raise ValueError(f"merge_trajectories: {len(ids)} sequences but {len(advantages)} advantages")
    return TrainBatch(ids, mask, lps, [float(a) for a in advantages])
