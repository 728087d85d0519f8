"""Typed payloads of ``generate`` work: :class:`GenerateArgs` (one model turn), :class:`GenerateResult`
(its reply) and :class:`RouteHints` (the fields of the args the broker's rollout router reads).

No I/O. Who uses them: episode sessions (``libra.rl.episode``) build ``GenerateArgs``; the rollout actor
(``libra.actors.rollout_role``) parses them, answering a malformed mapping with a ``bad_request``
failure, and builds ``GenerateResult``; the broker reads ``RouteHints`` leniently (a routing hint of the
wrong type is treated as absent, never fails the turn).

The oracle router's ``true_remaining`` (the trajectory's remaining response tokens) is simulator-only:
it is *not* a field of :class:`GenerateArgs` (the rollout actor ignores it); the broker reads it through
:class:`OracleHints`, which only the simulator's turns carry.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Self

import msgspec

from .payloads_base import Payload
from .payloads_refs import WeightsRef

__all__ = ["GenerateArgs", "GenerateResult", "OracleHints", "RouteHints"]

TokenId = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]


class GenerateArgs(Payload, frozen=True, kw_only=True):
    """The args of one ``generate`` turn (``Submit.args`` / ``Assign.args``, kind ``generate``).

    Concurrent turns are batched by the rollout actor: one thread drains the queue of waiting turns (up
    to its ``max_batch``) and runs one engine call for all of them. ``weights`` is loaded between engine
    calls, never mid-turn (see :class:`GenerateResult` for what the reply says about it).
    """

    WHAT = "generate args"
    OMIT_DEFAULT = ("seed", "prompt_id", "prompt_tokens", "step")

    prompt_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    """The whole token sequence so far (chat-templated prompt, earlier turns, tool output): non-empty."""
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] = 32
    """Most tokens this turn may generate (the episode caps it so the sequence stays in its budget)."""
    temperature: NonNegFloat = 1.0
    """Sampling temperature; 0 is greedy decoding (``top_p`` is then ignored)."""
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    stop_token_ids: list[TokenId] = msgspec.field(default_factory=list)
    """Generation stops after any of these (the stop token is part of the reply's ``token_ids``)."""
    seed: int | None = None
    """Makes this turn's sampling reproducible; None draws fresh entropy."""
    weights: WeightsRef | None = None
    """The weights the turn should run on: a newer version is fetched and loaded before the batch runs.
    None: the broker attaches the job's newest published version when it assigns the turn."""
    prompt_id: str | None = None
    """Routing hint: the same for every sample of one prompt (C-MLFQ's per-prompt prefix tree key)."""
    prompt_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """Routing hint: prompt length in tokens (read on a trajectory's first turn)."""
    step: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """Routing hint: the training step the trajectory belongs to."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature):
            raise ValueError("field `temperature`: must be finite")


class GenerateResult(Payload, frozen=True, kw_only=True):
    """The reply of one ``generate`` turn (``WorkResult.output``).

    A failed weights fetch (trainer dead mid-transfer, corrupted chunk, superseded version) never fails
    the turn: the instance keeps its old version, generates with it and reports the error here.
    """

    WHAT = "generate result"

    token_ids: list[int]
    """The generated tokens (a stop token, if one ended the turn, is the last)."""
    logprobs: list[float]
    """One rollout log-prob per generated token (the unmodified policy's: see ``libra.engines.rollout_base``)."""
    finish_reason: str
    """``"stop"`` (a stop token) or ``"length"`` (``max_new_tokens`` reached)."""
    weights_version: int
    """The weights version that produced *all* of this turn's tokens."""
    gen_tokens: Annotated[int, msgspec.Meta(ge=0)]
    """``len(token_ids)``: the broker's router learns output lengths from it."""
    load_s: NonNegFloat = 0.0
    """Seconds spent fetching and loading weights before this turn's batch (0 if none)."""
    fetch_s: NonNegFloat = 0.0
    """The data-plane (or torch.distributed) part of ``load_s``."""
    weights_via: str | None = None
    """``"dataplane"``, ``"torch"``, ``"file"``, or None when nothing was loaded for this batch."""
    weights_error: str | None = None
    """None, or why a wanted version could not be had (the turn then ran on the old version)."""
    batch: Annotated[int, msgspec.Meta(ge=1)] = 1
    """How many turns shared the engine call that produced this one."""

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"field `logprobs`: {len(self.logprobs)} log-probs for {len(self.token_ids)} tokens")


def _nonneg(x: Any) -> int | None:
    return x if type(x) is int and x >= 0 else None


class RouteHints(Payload, frozen=True, kw_only=True):
    """What the broker's rollout router reads from a ``generate`` turn's args (see :class:`GenerateArgs`
    for the meaning of each). Read with :meth:`from_args`, which never raises."""

    WHAT = "route hints"

    prompt_id: str | None = None
    prompt_tokens: int | None = None
    step: int | None = None

    @classmethod
    def from_args(cls, args: Any) -> Self:
        """The hints in ``args`` (any value); a hint of the wrong type (or a negative count) reads as None."""
        a = args if isinstance(args, dict) else {}
        pid = a.get("prompt_id")
        return cls(prompt_id=pid if isinstance(pid, str) else None, prompt_tokens=_nonneg(a.get("prompt_tokens")),
                   step=_nonneg(a.get("step")), **cls._extra(a))

    @staticmethod
    def _extra(a: dict[str, Any]) -> dict[str, Any]:
        return {}


class OracleHints(RouteHints, frozen=True, kw_only=True):
    """Simulator-only route hints: :class:`RouteHints` plus ``true_remaining``, the trajectory's true
    remaining response tokens, which only the oracle router uses. Runtime peers never send it and
    :class:`GenerateArgs` does not know it."""

    WHAT = "oracle route hints"
    OMIT_DEFAULT = ("true_remaining",)

    true_remaining: int | None = None
    """Response tokens (generated + tool-returned) still to come in this trajectory."""

    @staticmethod
    def _extra(a: dict[str, Any]) -> dict[str, Any]:
        return {"true_remaining": _nonneg(a.get("true_remaining"))}
