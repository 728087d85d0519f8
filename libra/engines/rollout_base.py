"""The rollout-engine interface shared by the transformers and vLLM engines.

Role: one small contract that actors, the episode runner and tests program against, so that a
rollout slot can run either engine (or a fake) without knowing which.

Contracts:

- Engines work on token ids only; tokenisation and chat templating happen in the caller.
- ``generate(requests)`` returns one :class:`GenResult` per request, **in request order**.
- ``GenResult.logprobs[i]`` is ``log π(token_i | prompt, token_<i)`` under the **unmodified policy**:
  softmax of the model's raw logits at temperature 1, over the full vocabulary, with no top-p
  truncation, computed with the weights of ``GenResult.weights_version``. This is the behaviour-policy
  log-prob GRPO's importance ratio needs (``π_θ / π_rollout``; the trainer recomputes ``π_θ`` the same
  way). It is *not* the probability of the distribution the token was actually drawn from when
  ``temperature != 1`` or ``top_p < 1``; engines that can report that too put it in
  ``GenResult.sampling_logprobs`` (temperature-scaled, top-p renormalised; ``0.0`` for greedy
  tokens), otherwise ``None``. vLLM's default ``logprobs_mode="raw_logprobs"`` has the same meaning
  as ``logprobs`` here.
- A generated stop token is included in ``token_ids`` (and has a log-prob); ``finish_reason`` is
  ``"stop"`` then, and ``"length"`` when ``max_new_tokens`` tokens were generated without a stop.
  Engines stop only on ``stop_token_ids``: the model's own eos is not implied, callers list it.
- Cancelling a running turn: an engine whose ``cancellable`` attribute is True takes
  ``generate(..., cancelled=[check or None per request])``; a request whose ``check()`` returns True leaves
  its batch at the next decode step with ``finish_reason == "cancelled"``, keeping the
  tokens it drew so far, and its context is not kept for a next turn (its trajectory goes on elsewhere). The
  other requests of the batch run on unchanged. An engine without the attribute cannot interrupt a call:
  callers then wait for it (vLLM's offline ``generate`` is one such call).
- ``load_weights(version, state_dict)`` replaces the weights in place and is never applied in the middle
  of a ``generate`` call: every token of a result comes from one weights version, recorded in the
  result.

Not in this module: any engine implementation or framework import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = [
    "EngineCrashed",
    "EngineError",
    "EngineOutOfMemory",
    "EngineUnavailable",
    "FinishReason",
    "GenRequest",
    "GenResult",
    "RolloutEngine",
    "WeightsMismatch",
]

FinishReason = Literal["stop", "length", "cancelled"]


class EngineError(RuntimeError):
    """Base class of rollout-engine failures."""


class EngineUnavailable(EngineError):
    """The engine's backend (e.g. vLLM, CUDA) is not installed or not usable on this machine."""


class EngineOutOfMemory(EngineError):
    """The engine ran out of device memory serving a call (e.g. an out-of-memory error inside vLLM's worker).
    The rollout role fails that batch's turns with ``oom`` and lowers its batch; the engine may still serve."""


class EngineCrashed(EngineError):
    """The engine can serve nothing more (its worker process died, its core is dead). The rollout role fails
    the batch's turns with ``engine_failed``, closes this engine and builds a new one."""


class WeightsMismatch(EngineError, ValueError):
    """A state dict does not fit the engine's model (missing/unexpected names, wrong shapes)."""


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One generation request, on token ids.

    ``temperature == 0`` means greedy decoding (``top_p`` is then ignored). ``seed`` makes sampling
    reproducible for that request; ``None`` draws fresh entropy. Raises ``ValueError`` naming the field
    on invalid values.
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError("GenRequest.prompt_ids must not be empty")
        if any((not isinstance(t, int)) or t < 0 for t in self.prompt_ids):
            bad = next(t for t in self.prompt_ids if (not isinstance(t, int)) or t < 0)
            raise ValueError(f"GenRequest.prompt_ids must be non-negative ints, got {bad!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"GenRequest.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"GenRequest.temperature must be finite and >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"GenRequest.top_p must be in (0, 1], got {self.top_p!r}")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"GenRequest.stop_token_ids must be non-negative ints, got {list(self.stop_token_ids)!r}")


@dataclass(frozen=True, slots=True)
class GenResult:
    """The completion of one :class:`GenRequest` (see the module docstring for log-prob semantics).

    ``len(token_ids) == len(logprobs)`` (and ``== len(sampling_logprobs)`` when present).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weights_version: int
    sampling_logprobs: list[float] | None = None
    num_prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from a cache (not fed through the model this call)


@runtime_checkable
class RolloutEngine(Protocol):
    """What every rollout engine provides. Implementations: ``HFRolloutEngine`` (hf_rollout.py),
    ``VLLMRolloutEngine`` (vllm_rollout.py).
    """

    @property
    def weights_version(self) -> int:
        """The version of the weights the next ``generate`` call will use."""
        ...

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Generate a completion for every request; results in request order. Raises ``ValueError``
        for a request the model cannot serve (e.g. a token id outside the vocabulary)."""
        ...

    def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Replace the weights in place (waits for a running ``generate``); raises
        :class:`WeightsMismatch` if ``state_dict`` does not fit the model."""
        ...
