"""GRPO maths as pure functions: group-relative advantages, the clipped token-level surrogate, the k3
KL estimator, loss aggregation, and the training-batch layout the trainer feeds them.

Role: the one place the training objective, its settings (:class:`GRPOConfig`) and its batch layout
(:class:`TrainBatch`, token-balanced micro-batching and sharding) are defined; ``trainer.py`` only feeds
them a model. Everything here is a pure function of its arguments (no modules, no state, no I/O), so it is
tested against an independent loop implementation.

Conventions (shapes ``[B, T]`` unless stated):

- Token ``t`` of sequence ``b`` contributes only where ``loss_mask[b, t]`` is true: model-generated
  tokens. Prompt tokens, padding and tool/environment output inside a multi-turn trajectory have
  mask 0, so they get no loss and no gradient.
- ``logprobs`` are the current policy's ``log π_θ(token)`` (with gradient); ``rollout_logprobs``
  are the behaviour policy's log-probs recorded by the rollout engine at sampling time (temperature
  1, full vocabulary; see ``rollout_base``). The importance ratio ``π_θ / π_rollout`` is taken
  against the **rollout** log-probs, so tokens sampled by an older weights version (asynchronous,
  off-policy rollout) are corrected, and the clip bounds how far one step moves from the sampler.
- Per token: ``ratio = exp(logprobs - rollout_logprobs)``;
  ``surrogate = min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``;
  ``loss_tok = -surrogate + kl_coef * k3`` with
  ``k3 = exp(ref - logprobs) - (ref - logprobs) - 1`` (Schulman's unbiased, non-negative estimator of
  ``KL(π_θ || π_ref)``), ``A`` the sequence's advantage broadcast over its tokens.
- Aggregation ``"token_mean"`` (default): ``sum(loss_tok * mask) / normalizer`` where ``normalizer``
  defaults to ``mask.sum()``, i.e. every generated token in the batch weighs the same (long answers
  are not down-weighted, as in DAPO). Pass the *global* token count as ``normalizer`` when a batch is
  split into micro-batches or across data-parallel ranks: the summed gradients are then exactly those
  of the whole batch. ``"seq_mean_token_mean"`` averages tokens within a sequence, then sequences (the
  original GRPO paper's form); its ``normalizer`` is the global number of sequences.
- Sampling temperature: both log-probs are taken at temperature 1 (see ``rollout_base``), so with
  ``temperature != 1`` rollouts the ratio compares the two *policies*, as in PPO, rather than
  re-weighting for the tempered sampling distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from libra.engines.rollout_base import GenResult

__all__ = [
    "Aggregation",
    "GRPOConfig",
    "GRPOLossOutput",
    "TrainBatch",
    "group_advantages",
    "grpo_loss",
    "k3_kl",
    "partition_by_tokens",
    "split_balanced",
    "token_logprobs",
]

Aggregation = Literal["token_mean", "seq_mean_token_mean"]


@dataclass(frozen=True, slots=True)
class GRPOConfig:
    """Optimisation and objective settings of :class:`~libra.engines.trainer.GRPOTrainer` (the terms are
    defined above).

    ``micro_batch_tokens`` bounds the padded tokens (sequences x longest length) of one forward/backward
    pass; a longer single sequence gets a micro-batch of its own.
    """

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_low: float = 0.2
    clip_high: float | None = None
    kl_coef: float = 0.0
    aggregation: Aggregation = "token_mean"
    micro_batch_tokens: int = 4096

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"GRPOConfig.lr must be a positive number, got {self.lr!r}")
        if self.max_grad_norm <= 0:
            raise ValueError(f"GRPOConfig.max_grad_norm must be > 0, got {self.max_grad_norm!r}")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"GRPOConfig.micro_batch_tokens must be >= 1, got {self.micro_batch_tokens!r}")
        if self.kl_coef < 0:
            raise ValueError(f"GRPOConfig.kl_coef must be >= 0, got {self.kl_coef!r}")
        if self.aggregation not in ("token_mean", "seq_mean_token_mean"):
            raise ValueError(
                f"unknown aggregation: {self.aggregation!r} (known: 'seq_mean_token_mean', 'token_mean')"
            )


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: torch.Tensor | Sequence[int],
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages: ``(r - mean_g) / (std_g + eps)`` per group ``g``, or ``r - mean_g``
    when ``scale_by_std`` is false (Dr. GRPO's variant, which avoids up-weighting easy/hard groups).

    ``rewards`` and ``group_ids`` are 1-D and equally long; samples of one prompt share a group id
    (groups need not be contiguous). ``std_g`` is the unbiased sample standard deviation; a group of
    one sample has advantage 0. Returns a float32 tensor shaped like ``rewards``. Raises
    ``ValueError`` on mismatched lengths or non-finite rewards.
    """
    # float64 statistics: in float32 the mean of identical rewards can miss them by an ulp, and dividing that
    # by a tiny std gives a constant group a large spurious advantage (found by the property test)
    r = torch.as_tensor(rewards, dtype=torch.float64)
    g = torch.as_tensor(group_ids)
    if r.ndim != 1 or g.ndim != 1 or r.shape != g.shape:
        raise ValueError(f"rewards {tuple(r.shape)} and group_ids {tuple(g.shape)} must be 1-D of equal length")
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite")
    if r.numel() == 0:
        return r.to(torch.float32)
    _, inverse = torch.unique(g, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, r) / count
    centred = r - mean[inverse]
    # a group whose rewards are all equal carries no signal: exactly zero (not rounding noise / eps)
    lo = torch.full((n_groups,), float("inf"), dtype=torch.float64).scatter_reduce(0, inverse, r, "amin")
    hi = torch.full((n_groups,), float("-inf"), dtype=torch.float64).scatter_reduce(0, inverse, r, "amax")
    centred = torch.where((lo == hi)[inverse], torch.zeros_like(centred), centred)
    if not scale_by_std:
        return centred.to(torch.float32)
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, centred * centred)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))  # unbiased; single-sample groups have centred == 0
    return (centred / (std[inverse] + eps)).to(torch.float32)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)`` gathered at ``targets``: ``[B, T, V], [B, T] -> [B, T]`` (float32 math).

    For a causal LM's output on ``input_ids`` the caller passes ``logits[:, :-1]`` and
    ``input_ids[:, 1:]``.
    """
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(π_θ || π_ref)``: ``exp(d) - d - 1`` with ``d = ref - logprobs``."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


@dataclass(frozen=True, slots=True)
class GRPOLossOutput:
    """``loss`` (scalar, with gradient) and detached diagnostics summed over masked tokens, so that
    micro-batches can be added before dividing by ``num_tokens``."""

    loss: torch.Tensor
    num_tokens: int
    clipped_tokens: float
    ratio_sum: float
    kl_sum: float


def grpo_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    aggregation: Aggregation = "token_mean",
    normalizer: float | None = None,
) -> GRPOLossOutput:
    """The GRPO objective for one (micro-)batch; see the module docstring for the formula.

    ``advantages`` is ``[B]`` (one per sequence) or ``[B, T]`` (per token). ``clip_high`` defaults to
    ``clip_low`` (symmetric PPO clip; a larger value is DAPO's clip-higher). ``ref_logprobs`` is
    required when ``kl_coef > 0``. ``normalizer`` overrides the denominator (see module docstring).
    Raises ``ValueError`` on shape mismatches, a missing reference, or an unknown aggregation.
    """
    if logprobs.shape != rollout_logprobs.shape or logprobs.shape != loss_mask.shape or logprobs.ndim != 2:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, rollout_logprobs {tuple(rollout_logprobs.shape)} and "
            f"loss_mask {tuple(loss_mask.shape)} must all be [B, T]"
        )
    if advantages.ndim == 1:
        if advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(f"advantages has {advantages.shape[0]} rows, logprobs has {logprobs.shape[0]}")
        adv = advantages[:, None].to(logprobs.dtype)
    elif advantages.shape == logprobs.shape:
        adv = advantages.to(logprobs.dtype)
    else:
        raise ValueError(f"advantages must be [B] or [B, T], got {tuple(advantages.shape)}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if clip_low < 0 or (clip_high is not None and clip_high < 0):
        raise ValueError(f"clip bounds must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    high = clip_low if clip_high is None else clip_high
    mask = loss_mask.to(logprobs.dtype)

    ratio = torch.exp(logprobs - rollout_logprobs.to(logprobs.dtype))
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = None
    if ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs.to(logprobs.dtype))
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl

    if aggregation == "token_mean":
        denom = float(mask.sum()) if normalizer is None else float(normalizer)
        loss = (per_token * mask).sum() / max(denom, 1.0)
    elif aggregation == "seq_mean_token_mean":
        seq_tokens = mask.sum(dim=1)
        seq_loss = (per_token * mask).sum(dim=1) / seq_tokens.clamp(min=1.0)
        has_tokens = (seq_tokens > 0).to(logprobs.dtype)
        denom = float(has_tokens.sum()) if normalizer is None else float(normalizer)
        loss = (seq_loss * has_tokens).sum() / max(denom, 1.0)
    else:
        raise ValueError(f"unknown aggregation: {aggregation!r} (known: 'seq_mean_token_mean', 'token_mean')")

    with torch.no_grad():
        was_clipped = (clipped < unclipped) & (mask > 0)  # the clip was the active branch of the min
        stats = GRPOLossOutput(
            loss=loss,
            num_tokens=int(mask.sum()),
            clipped_tokens=float(was_clipped.sum()),
            ratio_sum=float((ratio * mask).sum()),
            kl_sum=float((kl * mask).sum()) if kl is not None else 0.0,
        )
    return stats


# -- the objective's data layout -------------------------------------------------------------


def split_balanced(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Split sequence indices into exactly ``parts`` groups with near-equal token totals.

    Longest-first greedy (each sequence goes to the group with the fewest tokens so far; ties to the
    lower group index), so the result is deterministic: every data-parallel rank computes the same
    split. Groups may be empty; indices inside a group are ascending.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    groups: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        g = min(range(parts), key=lambda k: (totals[k], k))
        groups[g].append(i)
        totals[g] += lengths[i]
    return [sorted(g) for g in groups]


def partition_by_tokens(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Micro-batches for gradient accumulation: the fewest balanced groups (see :func:`split_balanced`)
    whose padded size (members x longest member) is at most ``max_tokens``; a sequence longer than
    ``max_tokens`` gets a group of its own. Empty groups are dropped; every index appears once.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    n = len(lengths)
    if n == 0:
        return []
    k = max(1, -(-sum(lengths) // max_tokens))
    while True:
        groups = [g for g in split_balanced(lengths, k) if g]
        if k >= n or all(len(g) == 1 or len(g) * max(lengths[i] for i in g) <= max_tokens for g in groups):
            return groups
        k += 1


@dataclass(frozen=True, slots=True)
class TrainBatch:
    """A batch of full token sequences (prompt + completion, possibly multi-turn) for GRPO.

    Per sequence ``b``, all lists are as long as ``input_ids[b]``: ``loss_mask[b][t]`` is 1 where token
    ``t`` was generated by the model (0 for prompt, tool output, padding) and ``rollout_logprobs[b][t]``
    is the rollout engine's log-prob of token ``t`` (read only where the mask is 1). Token 0 cannot be
    predicted, so its mask must be 0. ``advantages[b]`` is the sequence's advantage. Raises
    ``ValueError`` naming the sequence and field on inconsistent input.
    """

    input_ids: list[list[int]]
    loss_mask: list[list[int]]
    rollout_logprobs: list[list[float]]
    advantages: list[float]

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        for name in ("loss_mask", "rollout_logprobs", "advantages"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"TrainBatch.{name} has {len(getattr(self, name))} entries, input_ids has {n}")
        for b in range(n):
            length = len(self.input_ids[b])
            if length == 0:
                raise ValueError(f"TrainBatch sequence {b} is empty")
            if len(self.loss_mask[b]) != length or len(self.rollout_logprobs[b]) != length:
                raise ValueError(
                    f"TrainBatch sequence {b}: input_ids has {length} tokens but loss_mask has "
                    f"{len(self.loss_mask[b])} and rollout_logprobs {len(self.rollout_logprobs[b])}"
                )
            if self.loss_mask[b][0]:
                raise ValueError(f"TrainBatch sequence {b}: loss_mask[0] must be 0 (nothing predicts token 0)")
            if any(m not in (0, 1) for m in self.loss_mask[b]):
                raise ValueError(f"TrainBatch sequence {b}: loss_mask values must be 0 or 1")
            if not math.isfinite(self.advantages[b]):
                raise ValueError(f"TrainBatch sequence {b}: advantage {self.advantages[b]!r} is not finite")
            if any(m and not math.isfinite(x) for m, x in zip(self.loss_mask[b], self.rollout_logprobs[b])):
                raise ValueError(f"TrainBatch sequence {b}: a masked-in rollout log-prob is not finite")

    @classmethod
    def from_rollouts(
        cls, prompts: Sequence[Sequence[int]], results: Sequence[GenResult], advantages: Sequence[float]
    ) -> TrainBatch:
        """Single-turn sequences: prompt tokens (mask 0) followed by each result's tokens (mask 1)."""
        if not (len(prompts) == len(results) == len(advantages)):
            raise ValueError(f"{len(prompts)} prompts, {len(results)} results, {len(advantages)} advantages")
        return cls(
            input_ids=[[*p, *r.token_ids] for p, r in zip(prompts, results)],
            loss_mask=[[0] * len(p) + [1] * len(r.token_ids) for p, r in zip(prompts, results)],
            rollout_logprobs=[[0.0] * len(p) + list(r.logprobs) for p, r in zip(prompts, results)],
            advantages=[float(a) for a in advantages],
        )

    def __len__(self) -> int:
        return len(self.input_ids)

    def lengths(self) -> list[int]:
        """Token count of every sequence."""
        return [len(s) for s in self.input_ids]

    def num_loss_tokens(self) -> int:
        """Number of tokens that get loss (mask 1)."""
        return sum(sum(m) for m in self.loss_mask)

    def num_sequences_with_loss(self) -> int:
        """Number of sequences with at least one loss token."""
        return sum(1 for m in self.loss_mask if any(m))

    def select(self, indices: Sequence[int]) -> TrainBatch:
        """The sub-batch of the given sequence indices, in that order."""
        return TrainBatch(
            input_ids=[self.input_ids[i] for i in indices],
            loss_mask=[self.loss_mask[i] for i in indices],
            rollout_logprobs=[self.rollout_logprobs[i] for i in indices],
            advantages=[self.advantages[i] for i in indices],
        )

    def shard(self, rank: int, world_size: int) -> TrainBatch:
        """This rank's token-balanced share of the batch (:func:`split_balanced`; same on every rank)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must be in [0, {world_size})")
        return self.select(split_balanced(self.lengths(), world_size)[rank])

    def to_tensors(
        self, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ``(input_ids, attention_mask, loss_mask, rollout_logprobs, advantages)``:
        ``[B, T]`` long, ``[B, T]`` long, ``[B, T]`` float, ``[B, T]`` float, ``[B]`` float."""
        bsz, width = len(self), max(self.lengths(), default=0)
        ids = torch.zeros((bsz, width), dtype=torch.long)
        attn = torch.zeros((bsz, width), dtype=torch.long)
        mask = torch.zeros((bsz, width), dtype=torch.float32)
        lp = torch.zeros((bsz, width), dtype=torch.float32)
        for b, seq in enumerate(self.input_ids):
            n = len(seq)
            ids[b, :n] = torch.tensor(seq, dtype=torch.long)
            attn[b, :n] = 1
            mask[b, :n] = torch.tensor(self.loss_mask[b], dtype=torch.float32)
            lp[b, :n] = torch.tensor(self.rollout_logprobs[b], dtype=torch.float32)
        adv = torch.tensor(self.advantages, dtype=torch.float32)
        return ids.to(device), attn.to(device), mask.to(device), lp.to(device), adv.to(device)
