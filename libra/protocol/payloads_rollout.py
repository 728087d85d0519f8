"""Typed payloads of ``generate`` work: :class:`GenerateArgs` (one model turn), :class:`TurnContext` (the
turn's context as a delta), :class:`GenerateResult` (its reply) and :class:`RouteHints` (the fields of the
args the broker's rollout router reads); :class:`ContextDigest` is the context digest both ends compute.

A turn names its context in one of two forms. The whole form (``prompt_ids``: every token so far) is the
original one and stays valid. The delta form (``context``: a :class:`TurnContext`) carries only the tokens
added since the previous turn, the total length and digests, so the bytes through the broker per turn stay
O(new tokens): the rollout instance keeps the trajectory's context (and its KV cache) between turns, and on
a miss (evicted, or the trajectory moved to another instance) fetches it over the data plane, from the
previous instance (``holder``: its KV cache or its token ids) or from the session (``source``). A context
whose digest does not match is never generated from: the turn fails with ``context_mismatch``.

No I/O. Who uses them: episode sessions (``libra.rl.episode``) build ``GenerateArgs``; the rollout actor
(``libra.actors.rollout_role``) parses them, answering a malformed mapping with a ``bad_request``
failure, and builds ``GenerateResult``; the broker reads ``RouteHints`` leniently (a routing hint of the
wrong type is treated as absent, never fails the turn).

The oracle router's ``true_remaining`` (the trajectory's remaining response tokens) is simulator-only:
it is *not* a field of :class:`GenerateArgs` (the rollout actor ignores it); the broker reads it through
:class:`OracleHints`, which only the simulator's turns carry.
"""

from __future__ import annotations

import hashlib
import math
import sys
from array import array
from collections.abc import Iterable
from typing import Annotated, Any, Self

import msgspec

from .payloads_base import Payload
from .payloads_refs import DataRef, WeightsRef

__all__ = ["EMPTY_DIGEST", "ContextDigest", "GenerateArgs", "GenerateResult", "OracleHints", "RouteHints",
           "TurnContext", "context_digest", "ids_from_object", "ids_object"]

TokenId = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
Digest = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
_TYPECODE = next(c for c in ("I", "L") if array(c).itemsize == 4)


class ContextDigest:
    """The digest of a token sequence: blake2b (16 bytes, hex) of the ids as little-endian uint32, computed
    incrementally (:meth:`update` costs O(new tokens)), so a session and a rollout instance extend it turn by
    turn and compare. ``length`` is the number of tokens hashed. Raises ``ValueError`` for an id outside
    [0, 2**32)."""

    __slots__ = ("_h", "length")

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self._h = hashlib.blake2b(digest_size=16)
        self.length = 0
        self.update(ids)

    def update(self, ids: Iterable[int]) -> ContextDigest:
        try:
            a = array(_TYPECODE, ids)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None
        if sys.byteorder == "big":
            a.byteswap()
        self._h.update(a.tobytes())
        self.length += len(a)
        return self

    def copy(self) -> ContextDigest:
        other = ContextDigest.__new__(ContextDigest)
        other._h, other.length = self._h.copy(), self.length
        return other

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def context_digest(ids: Iterable[int]) -> str:
    """The :class:`ContextDigest` hex digest of ``ids``."""
    return ContextDigest(ids).hexdigest()


EMPTY_DIGEST = context_digest(())
_IDS_CHUNK = 1 << 20


def ids_object(ids: Iterable[int]) -> tuple[bytes, list[bytes]]:
    """A context's token ids as a data-plane object ``(header, chunks)``: the header is msgpack ``{"format":
    "ids1", "n", "digest"}``, the chunks the ids as little-endian uint32 (1 MiB each)."""
    a = array(_TYPECODE, ids)
    digest = ContextDigest(a).hexdigest()
    if sys.byteorder == "big":
        a.byteswap()
    raw = a.tobytes()
    header = msgspec.msgpack.encode({"format": "ids1", "n": len(a), "digest": digest})
    return header, [raw[i : i + _IDS_CHUNK] for i in range(0, len(raw), _IDS_CHUNK)] or [b""]


def ids_from_object(header: bytes, chunks: Iterable[bytes | memoryview]) -> array:
    """The token ids of an :func:`ids_object`; raises ``ValueError`` when the object is malformed or its ids
    do not hash to its digest."""
    try:
        meta = msgspec.msgpack.decode(header)
    except msgspec.DecodeError as exc:
        raise ValueError(f"context ids object: bad header ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != "ids1":
        raise ValueError("context ids object: unknown format")
    a = array(_TYPECODE)
    for c in chunks:
        a.frombytes(bytes(c))
    if sys.byteorder == "big":
        a.byteswap()
    if len(a) != meta.get("n") or ContextDigest(a).hexdigest() != meta.get("digest"):
        raise ValueError("context ids object: ids do not match their length and digest")
    return a


class TurnContext(Payload, frozen=True, kw_only=True):
    """A turn's context as a delta (``GenerateArgs.context``): the first ``prefix_len`` tokens are what the
    previous turn left (its context plus its generated tokens), ``new_ids`` what was appended since (tool
    output, a user message). Object names at ``holder``: ``NAME/kv`` (token ids + KV cache) and ``NAME/ids``
    (token ids); at ``source``: its ``name`` (the session's whole context)."""

    WHAT = "turn context"
    OMIT_DEFAULT = ("source", "holder")

    new_ids: list[TokenId] = msgspec.field(default_factory=list)
    """The tokens appended since the prefix (may be empty: the model continues its own turn)."""
    prefix_len: Annotated[int, msgspec.Meta(ge=0)]
    """Tokens before ``new_ids``: the context the previous turn ended with (0 on a trajectory's first turn)."""
    prefix_digest: Digest
    """:class:`ContextDigest` of the prefix (``EMPTY_DIGEST`` when ``prefix_len`` is 0)."""
    total_len: Annotated[int, msgspec.Meta(ge=1)]
    """``prefix_len + len(new_ids)``: the whole context's length."""
    digest: Digest
    """:class:`ContextDigest` of the whole context."""
    source: DataRef | None = None
    """The whole context's token ids on the session's data-plane server (re-prefill after a miss)."""
    holder: DataRef | None = None
    """The instance that served the previous turn (its ``GenerateResult.context_at``): KV transfer or ids."""

    def __post_init__(self) -> None:
        if self.total_len != self.prefix_len + len(self.new_ids):
            raise ValueError(f"field `total_len`: {self.total_len} != prefix_len {self.prefix_len} + "
                             f"{len(self.new_ids)} new ids")
        if self.prefix_len == 0 and self.prefix_digest != EMPTY_DIGEST:
            raise ValueError("field `prefix_digest`: an empty prefix has the empty digest")


class GenerateArgs(Payload, frozen=True, kw_only=True):
    """The args of one ``generate`` turn (``Submit.args`` / ``Assign.args``, kind ``generate``).

    Concurrent turns are batched by the rollout actor: one thread drains the queue of waiting turns (up
    to its ``max_batch``) and runs one engine call for all of them. ``weights`` is loaded between engine
    calls, never mid-turn (see :class:`GenerateResult` for what the reply says about it).
    """

    WHAT = "generate args"
    OMIT_DEFAULT = ("prompt_ids", "context", "seed", "prompt_id", "prompt_tokens", "step")

    prompt_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)] | None = None
    """The whole form: every token so far (chat-templated prompt, earlier turns, tool output), non-empty.
    Exactly one of ``prompt_ids`` and ``context`` is given."""
    context: TurnContext | None = None
    """The delta form (see :class:`TurnContext`): what a session sends once the instance holds the context."""
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
        if (self.prompt_ids is None) == (self.context is None):
            raise ValueError("field `prompt_ids`: a generate turn needs exactly one of `prompt_ids` (the whole "
                             "context) and `context` (a delta)")

    @property
    def total_len(self) -> int:
        """The whole context's length in tokens, in either form."""
        return len(self.prompt_ids) if self.prompt_ids is not None else self.context.total_len  # type: ignore[union-attr]


class GenerateResult(Payload, frozen=True, kw_only=True):
    """The reply of one ``generate`` turn (``WorkResult.output``).

    A failed weights fetch (trainer dead mid-transfer, corrupted chunk, superseded version) never fails
    the turn: the instance keeps its old version, generates with it and reports the error here.
    """

    WHAT = "generate result"
    OMIT_DEFAULT = ("context_at", "context_via", "prefill_tokens")

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
    context_at: DataRef | None = None
    """Where this instance now holds the trajectory's context (send it back as ``TurnContext.holder``)."""
    context_via: str | None = None
    """How the instance had the context: ``"cache"`` (its own KV), ``"local"`` (its own ids, KV dropped),
    ``"kv"`` (KV fetched from ``holder``), ``"ids"`` (ids fetched, then re-prefilled), ``"new"`` (a first
    turn) or ``"full"`` (the whole form)."""
    prefill_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """Tokens this turn fed through the model before its first new token (the part no cache covered)."""

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
