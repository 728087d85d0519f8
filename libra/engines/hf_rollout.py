"""Rollout engine over Hugging Face transformers (CPU or GPU): the embedded default and the test engine.

Role: serve ``generate`` work for a rollout slot with any ``AutoModelForCausalLM`` checkpoint, and
take new weights in place when the trainer publishes a version.

Design: an explicit incremental decode loop rather than ``model.generate``. Prompts are left-padded
into one batch, prefilled once, then decoded one token per step with a ``DynamicCache``; explicit
``position_ids`` keep every row's positions equal to an unpadded run. The loop gives exact per-token
log-probs of the unmodified policy (see ``rollout_base`` for their meaning), per-request temperature,
top-p, seed and stop tokens, and drops finished rows from the batch and the KV cache so a long
request does not make short ones pay for it.

Context cache: a request made with a session key (``generate(requests, sessions=[...])``, the trajectory
id) keeps that trajectory's context in :attr:`HFRolloutEngine.kv_cache` (a
:class:`~libra.engines.kv_cache.KVCache`, LRU within ``kv_cache_bytes``): token ids, digest and KV. Its next
turn feeds only the tokens the cached KV does not cover; rows with different cached lengths share a batch
with their cached KV left-padded and masked. KV is reused only when the prompt starts with exactly the
cached ids and the weights version is the one that computed it (new weights drop all cached KV, keeping
the ids). ``GenResult.cached_tokens`` says how many prompt tokens came from the cache.

Contracts (beyond :class:`~libra.engines.rollout_base.RolloutEngine`):

- ``GenResult.logprobs`` equal a full forward pass over prompt + completion to float tolerance
  (tested to 1e-4 in fp32).
- Sampling with a ``seed`` draws from a per-request generator, so a seeded request's tokens do not
  depend on the other requests' seeds. (They can still differ across batch compositions in rare
  ties, because padded batches round differently in the last bits.)
- ``generate`` and ``load_weights`` hold one lock: weights never change mid-generation.
- Requests longer than the model's ``max_position_embeddings`` are refused with ``ValueError``; that limit is
  :attr:`HFRolloutEngine.max_model_len` (the name vLLM uses), so the rollout role can fail only the over-long
  turn before a batch runs.
- :meth:`HFRolloutEngine.close` drops the model and every cached context (so a role switch frees them); the
  engine serves nothing after it (:class:`~libra.engines.rollout_base.EngineError`). Idempotent.

Not in this module: tokenisation, chat templates, batching across calls (the actor decides what to
batch), anything about sockets.
"""

from __future__ import annotations

import os
import threading
from array import array
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # must precede the transformers import
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

# Imported with this module, not by the first from_pretrained: it imports torch._dynamo, whose first import leaves
# its callers' frames in a reference cycle (torch.fx.wrap keeps its own frame), and an engine's constructor frame
# (holding the engine) must not be one of them, or the engine outlives its close until a garbage collection.
import transformers.generation.utils  # noqa: E402, F401

from libra.engines.kv_cache import ContextEntry, KVCache
from libra.engines.sampling import sample_next_tokens
from libra.engines.rollout_base import (
    EngineError,
    GenRequest,
    GenResult,
    WeightsMismatch,
)
from libra.logging import get_logger
from libra.protocol.payloads_rollout import ContextDigest
from libra.weights.packed import PackedWeights

__all__ = ["HFRolloutEngine", "sample_next_tokens"]

log = get_logger(__name__)

DEFAULT_KV_CACHE_BYTES = 1 << 30  # trajectory contexts kept between turns (KV tensors + ids)


def cache_kwarg(model: Any) -> str:
    """The name ``model.forward`` takes the KV cache under: ``cache`` in transformers >= 5.24 (where
    ``past_key_values`` is deprecated), ``past_key_values`` before."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _shape_in(state_dict: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """A tensor's shape in ``state_dict``, without decoding a packed one."""
    if isinstance(state_dict, PackedWeights):
        return state_dict.shape(name)
    return tuple(state_dict[name].shape)


def _names_to_write(own: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of ``state_dict`` to copy into the model's tensors ``own``: all but the second name of a
    weight tied in both (the model's two names are one memory, and the source gives both the same tensor)."""
    first: dict[tuple[int, int], str] = {}  # (data_ptr, numel) of a model tensor -> the first name written
    names = []
    for name in state_dict:
        t = own[name]
        key = (t.data_ptr(), t.numel())
        prior = first.get(key) if t.numel() else None
        if prior is not None and _same_source(state_dict, name, prior):
            continue
        first.setdefault(key, name)
        names.append(name)
    return names


def _same_source(state_dict: Mapping[str, torch.Tensor], a: str, b: str) -> bool:
    if isinstance(state_dict, PackedWeights):
        return (state_dict.alias_of(a) or a) == (state_dict.alias_of(b) or b)
    return state_dict[a] is state_dict[b]


class HFRolloutEngine:
    """A :class:`~libra.engines.rollout_base.RolloutEngine` over a transformers causal LM.

    Build with ``HFRolloutEngine(model_dir)`` (loads ``AutoModelForCausalLM`` offline) or
    ``HFRolloutEngine.from_model(model)`` (wraps a model already in memory). ``max_batch_size`` caps
    how many requests are decoded together; larger calls are split (shortest prompts first, which
    keeps left padding small). ``dtype`` defaults to float32.

    Mutation rule: the model's weights change only inside :meth:`load_weights`, under the same lock
    as :meth:`generate`.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 32,
        weights_version: int = 0,
        attn_implementation: str | None = "sdpa",
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    ) -> None:
        from transformers import AutoModelForCausalLM

        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"HFRolloutEngine: no config.json in model_dir {str(path)!r}")
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
        self._init(model.to(device), max_batch_size=max_batch_size, weights_version=weights_version,
                   kv_cache_bytes=kv_cache_bytes)
        self.model_dir: Path | None = path

    @classmethod
    def from_model(cls, model: Any, *, max_batch_size: int = 32, weights_version: int = 0,
                   kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES) -> HFRolloutEngine:
        """Wrap an already-loaded causal LM (kept on its current device and dtype)."""
        self = cls.__new__(cls)
        self._init(model, max_batch_size=max_batch_size, weights_version=weights_version,
                   kv_cache_bytes=kv_cache_bytes)
        self.model_dir = None
        return self

    def _init(self, model: Any, *, max_batch_size: int, weights_version: int, kv_cache_bytes: int) -> None:
        if max_batch_size < 1:
            raise ValueError(f"HFRolloutEngine.max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval()
        self._cache_kw = cache_kwarg(model)
        self.max_batch_size = max_batch_size
        self._version = int(weights_version)
        self._lock = threading.Lock()
        cfg = model.config
        self.vocab_size: int = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions: int | None = getattr(cfg, "max_position_embeddings", None)
        self.max_model_len: int | None = self.max_positions  # prompt + max_new_tokens above it: refused
        self._closed = False
        pad = getattr(cfg, "pad_token_id", None)
        self._pad_id: int = int(pad) if pad is not None else 0  # masked out; any id works
        self.device: torch.device = next(model.parameters()).device
        self._dtype: torch.dtype = next(model.parameters()).dtype
        self.kv_cache = KVCache(kv_cache_bytes)
        from transformers import DynamicCache

        # a sliding-window layer keeps only its window: its KV cannot be reused for a longer context
        self._kv_reusable = not any(getattr(layer, "is_sliding", False)
                                    for layer in DynamicCache(config=model.config).layers)

    # -- RolloutEngine -------------------------------------------------------------------------

    @property
    def weights_version(self) -> int:
        """The weights version the next ``generate`` uses."""
        return self._version

    cancellable = True  # generate(..., cancelled=[...]) stops a cancelled row at its next step (rollout_base)

    def generate(self, requests: Sequence[GenRequest], sessions: Sequence[str | None] | None = None,
                 on_tokens: Callable[[list[tuple[int, int]]], None] | None = None,
                 cancelled: Sequence[Callable[[], bool] | None] | None = None) -> list[GenResult]:
        """Generate every request; results in request order (see the module contracts). ``sessions[i]``
        (a trajectory id, or None) keeps request ``i``'s context in :attr:`kv_cache` for its next turn.
        ``on_tokens`` (optional) is called after each sampling step with ``(request index, token id)`` for
        every request that got a token in it (what a serving process streams and times per token).
        ``cancelled[i]`` (optional) is asked after each step: True ends request ``i`` there with
        ``finish_reason == "cancelled"`` and no context kept.

        Raises ``ValueError`` naming the request index for a token id outside the vocabulary or a
        request longer than ``max_position_embeddings``, or for ``sessions`` of another length.
        """
        for i, req in enumerate(requests):
            self._check_request(i, req)
        keys = list(sessions) if sessions is not None else [None] * len(requests)
        if len(keys) != len(requests):
            raise ValueError(f"{len(keys)} sessions for {len(requests)} requests")
        checks = list(cancelled) if cancelled is not None else [None] * len(requests)
        if len(checks) != len(requests):
            raise ValueError(f"{len(checks)} cancel checks for {len(requests)} requests")
        results: list[GenResult | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        with self._lock, torch.inference_mode():
            if self._closed:
                raise EngineError("HFRolloutEngine: generate on a closed engine")
            version = self._version
            for start in range(0, len(order), self.max_batch_size):
                idx = order[start : start + self.max_batch_size]
                step = None if on_tokens is None else (
                    lambda got, idx=idx: on_tokens([(idx[j], t) for j, t in got]))
                for i, res in zip(idx, self._generate_batch([requests[i] for i in idx], version,
                                                            [keys[i] for i in idx], step, [checks[i] for i in idx])):
                    results[i] = res
        return [r for r in results if r is not None]

    def close(self) -> None:
        """Drop the model and every cached context (see the module contracts); waits for a running call."""
        with self._lock:
            self._closed = True
            self.kv_cache.clear()
            self.model = None

    def context(self, session: str) -> ContextEntry | None:
        """The context this engine holds for ``session`` (None if none), without marking it used."""
        return self.kv_cache.get(session, touch=False)

    def import_context(self, session: str, entry: ContextEntry) -> None:
        """Hold ``entry`` (e.g. fetched from another instance) as ``session``'s context; its KV is moved to
        this engine's device and dtype, and dropped when it is not the current weights version's."""
        if entry.kv is not None and (entry.version != self._version or not self._kv_reusable):
            entry = entry.without_kv()
        elif entry.kv is not None:
            entry = ContextEntry(entry.ids, entry.digest, tuple(
                (k.to(self.device, self._dtype), v.to(self.device, self._dtype)) for k, v in entry.kv),
                entry.kv_len, entry.version)
        self.kv_cache.put(session, entry)

    def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state_dict`` into the model in place and set :attr:`weights_version` to ``version``.

        Waits for a running ``generate`` to finish. The state dict must name exactly the model's
        ``state_dict()`` entries with the same shapes (dtype and device are converted); otherwise
        raises :class:`WeightsMismatch` and leaves the weights untouched. A
        :class:`~libra.weights.packed.PackedWeights` is decoded straight into the model's tensors (no
        intermediate copy); a weight tied in the model (one tensor under two names) is written once when the
        state dict ties it too (the same tensor, or a packed alias).
        """
        with self._lock:
            if self._closed:
                raise EngineError("HFRolloutEngine: load_weights on a closed engine")
            own = self.model.state_dict()
            missing = sorted(set(own) - set(state_dict))
            unexpected = sorted(set(state_dict) - set(own))
            if missing or unexpected:
                raise WeightsMismatch(
                    f"weights version {version}: {len(missing)} missing {missing[:5]}, "
                    f"{len(unexpected)} unexpected {unexpected[:5]}"
                )
            for name in state_dict:
                shape = _shape_in(state_dict, name)
                if shape != tuple(own[name].shape):
                    raise WeightsMismatch(
                        f"weights version {version}: {name!r} has shape {shape}, "
                        f"model expects {tuple(own[name].shape)}"
                    )
            written = 0
            with torch.no_grad():
                for name in _names_to_write(own, state_dict):
                    if isinstance(state_dict, PackedWeights):
                        state_dict.copy_into(name, own[name])
                    else:
                        own[name].copy_(state_dict[name])
                    written += 1
            self._version = int(version)
            self.kv_cache.drop_kv()  # KV computed with the old weights is not this policy's
        log.info("weights_loaded", version=int(version), tensors=len(state_dict), written=written)

    # -- internals -----------------------------------------------------------------------------

    def _check_request(self, i: int, req: GenRequest) -> None:
        top = max(req.prompt_ids)
        if top >= self.vocab_size:
            raise ValueError(f"request {i}: prompt token id {top} outside the vocabulary (size {self.vocab_size})")
        if req.stop_token_ids and max(req.stop_token_ids) >= self.vocab_size:
            raise ValueError(f"request {i}: stop token id {max(req.stop_token_ids)} outside the vocabulary")
        total = len(req.prompt_ids) + req.max_new_tokens
        if self.max_positions is not None and total > self.max_positions:
            raise ValueError(
                f"request {i}: prompt ({len(req.prompt_ids)}) + max_new_tokens ({req.max_new_tokens}) = {total} "
                f"exceeds the model's max_position_embeddings ({self.max_positions})"
            )

    def _reusable(self, key: str | None, req: GenRequest, version: int) -> ContextEntry | None:
        """The cached context whose KV this request may reuse (same ids, same weights version), or None."""
        if key is None:
            return None
        e = self.kv_cache.get(key)
        ok = (e is not None and e.kv is not None and self._kv_reusable and e.version == version
              and e.kv_prefix_matches(req.prompt_ids))
        self.kv_cache.stats["hits" if ok else "misses"] += 1
        return e if ok else None

    def _past_cache(self, reuse: Sequence[ContextEntry | None], width: int) -> Any:
        """A DynamicCache of the rows' cached KV, each left-padded to ``width`` positions (zeros, masked)."""
        from transformers import DynamicCache

        if width == 0:
            return DynamicCache(config=self.model.config)
        like = next(e for e in reuse if e is not None).kv
        assert like is not None
        layers = []
        for li, (k0, v0) in enumerate(like):
            ks, vs = [], []
            for e in reuse:
                n = e.kv_len if e is not None else 0
                k = e.kv[li][0] if e is not None and e.kv is not None else k0[:, :, :0]
                v = e.kv[li][1] if e is not None and e.kv is not None else v0[:, :, :0]
                if n < width:
                    pad = (1, k0.shape[1], width - n, k0.shape[3])
                    k = torch.cat([k.new_zeros(pad), k], dim=2)
                    v = torch.cat([v.new_zeros((1, v0.shape[1], width - n, v0.shape[3])), v], dim=2)
                ks.append(k)
                vs.append(v)
            layers.append((torch.cat(ks, 0) if len(ks) > 1 else ks[0], torch.cat(vs, 0) if len(vs) > 1 else vs[0]))
        return DynamicCache(ddp_cache_data=layers, config=self.model.config)

    def _keep_context(self, key: str, req: GenRequest, toks: list[int], reused: ContextEntry | None, cache: Any,
                      mask: torch.Tensor, j: int, version: int) -> None:
        """Store row ``j``'s context (prompt + generated ids, and the KV of every position fed) as ``key``."""
        prompt = req.prompt_ids
        valid = mask[j].nonzero().squeeze(1)
        if valid.numel() != len(prompt) + len(toks) - 1:
            raise EngineError(f"KV cache of {valid.numel()} positions for {len(prompt)} + {len(toks)} - 1 tokens")
        whole = valid.numel() == mask.shape[1] and mask.shape[0] == 1
        kv = tuple((layer.keys, layer.values) if whole else
                   (layer.keys[j : j + 1].index_select(2, valid), layer.values[j : j + 1].index_select(2, valid))
                   for layer in cache.layers)
        ids = array("I", prompt)
        if reused is not None and len(prompt) >= len(reused.ids) and ids[: len(reused.ids)] == reused.ids:
            digest = reused.digest.copy().update(ids[len(reused.ids) :])
        else:
            digest = ContextDigest(ids)
        ids.extend(toks)
        digest.update(toks)
        self.kv_cache.put(key, ContextEntry(ids, digest, kv, valid.numel(), version))

    def _prefill(self, reqs: Sequence[GenRequest], reuse: Sequence[ContextEntry | None],
                 past: Sequence[int]) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """One forward pass over every row's prompt tail not covered by its cached KV (``past`` positions of
        ``reuse``), left-padded, on top of that KV (:meth:`_past_cache`). Returns the last position's logits
        (fp32), the KV cache and the attention mask (cached positions, then the tail's)."""
        dev = self.device
        bsz = len(reqs)
        tails = [len(r.prompt_ids) - p for r, p in zip(reqs, past)]
        pw, width = max(past), max(tails)
        ids = torch.full((bsz, width), self._pad_id, dtype=torch.long)
        tail_mask = torch.zeros((bsz, width), dtype=torch.long)
        past_mask = torch.zeros((bsz, pw), dtype=torch.long)
        for b, r in enumerate(reqs):
            ids[b, width - tails[b] :] = torch.tensor(list(r.prompt_ids[past[b] :]), dtype=torch.long)
            tail_mask[b, width - tails[b] :] = 1
            past_mask[b, pw - past[b] :] = 1
        positions = (tail_mask.cumsum(dim=1) - 1).clamp_(min=0) + torch.tensor(past, dtype=torch.long)[:, None]
        mask = torch.cat([past_mask, tail_mask], dim=1).to(dev)
        cache = self._past_cache(reuse, pw)
        out = self.model(
            input_ids=ids.to(dev),
            attention_mask=mask,
            position_ids=positions.to(dev),
            **{self._cache_kw: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].float(), cache, mask

    def _generate_batch(self, reqs: Sequence[GenRequest], version: int, keys: Sequence[str | None],
                        on_tokens: Callable[[list[tuple[int, int]]], None] | None,
                        checks: Sequence[Callable[[], bool] | None]) -> list[GenResult]:
        """One batch: the prefill (:meth:`_prefill`), then one decode step per token until every row ends (or
        is cancelled: ``checks``)."""
        dev = self.device
        bsz = len(reqs)
        lens = [len(r.prompt_ids) for r in reqs]
        reuse = [self._reusable(k, r, version) for k, r in zip(keys, reqs)]
        past = [e.kv_len if e is not None else 0 for e in reuse]
        logits, cache, mask = self._prefill(reqs, reuse, past)

        rows = list(range(bsz))  # cache row j serves request rows[j]
        next_pos = torch.tensor(lens, dtype=torch.long, device=dev)
        temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
        top_ps = torch.tensor([r.top_p for r in reqs], dtype=torch.float32, device=dev)
        greedy = [r.temperature <= 0 for r in reqs]  # on the host: no device read per row and token
        nucleus = any(r.top_p < 1.0 for r in reqs)
        gens = [self._generator(r.seed) for r in reqs]
        stops = [frozenset(r.stop_token_ids) for r in reqs]
        toks: list[list[int]] = [[] for _ in reqs]
        lps: list[list[float]] = [[] for _ in reqs]
        slps: list[list[float]] = [[] for _ in reqs]
        reasons: list[str] = ["length"] * bsz

        while True:
            chosen, lp, slp = sample_next_tokens(logits, temps, top_ps, [gens[b] for b in rows],
                                                 greedy_rows=[greedy[b] for b in rows], nucleus=nucleus)
            # one device read a token for all three (token ids < 2**53 are exact in float64)
            host_t, host_lp, host_slp = torch.stack([chosen.double(), lp.double(), slp.double()]).tolist()
            if on_tokens is not None:
                on_tokens([(b, int(t)) for b, t in zip(rows, host_t)])
            keep: list[int] = []
            for j, (b, t, a, s) in enumerate(zip(rows, map(int, host_t), host_lp, host_slp)):
                toks[b].append(t)
                lps[b].append(a)
                slps[b].append(s)
                if t in stops[b]:
                    reasons[b] = "stop"
                elif checks[b] is not None and checks[b]():  # type: ignore[misc]
                    reasons[b] = "cancelled"  # its trajectory goes on elsewhere: no context kept
                    continue
                elif len(toks[b]) < reqs[b].max_new_tokens:
                    keep.append(j)
                    continue
                key = keys[b]
                if key is not None:  # finished: keep its context before it leaves the batch
                    self._keep_context(key, reqs[b], toks[b], reuse[b], cache, mask, j, version)
            if not keep:
                break
            if len(keep) < len(rows):  # compact: finished rows leave the batch and the KV cache
                sel = torch.tensor(keep, dtype=torch.long, device=dev)
                cache.batch_select_indices(sel)
                mask, next_pos, chosen = mask[sel], next_pos[sel], chosen[sel]
                temps, top_ps = temps[sel], top_ps[sel]
                rows = [rows[j] for j in keep]
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
            out = self.model(
                input_ids=chosen[:, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
                **{self._cache_kw: cache},
                use_cache=True,
            )
            next_pos = next_pos + 1
            logits = out.logits[:, -1, :].float()

        return [
            GenResult(
                token_ids=toks[b],
                logprobs=lps[b],
                finish_reason=reasons[b],  # type: ignore[arg-type]
                weights_version=version,
                sampling_logprobs=slps[b],
                num_prompt_tokens=lens[b],
                cached_tokens=past[b],
            )
            for b in range(bsz)
        ]

    @staticmethod
    def _generator(seed: int | None) -> torch.Generator:
        gen = torch.Generator()
        if seed is None:
            gen.seed()  # fresh OS entropy
        else:
            gen.manual_seed(int(seed))
        return gen
