"""Rollout engine over Hugging Face transformers (CPU or GPU): the embedded default and the test engine.

Role: serve ``generate`` work for a rollout slot with any ``AutoModelForCausalLM`` checkpoint, and
take new weights in place when the trainer publishes a version.

Design: an explicit incremental decode loop rather than ``model.generate``. Prompts are left-padded
into one batch, prefilled once, then decoded one token per step with a ``DynamicCache``; explicit
``position_ids`` keep every row's positions equal to an unpadded run. The loop gives exact per-token
log-probs of the unmodified policy (see ``rollout_base`` for their meaning), per-request temperature,
top-p, seed and stop tokens, and drops finished rows from the batch and the KV cache so a long
request does not make short ones pay for it.

Contracts (beyond :class:`~libra.engines.rollout_base.RolloutEngine`):

- ``GenResult.logprobs`` equal a full forward pass over prompt + completion to float tolerance
  (tested to 1e-4 in fp32).
- Sampling with a ``seed`` draws from a per-request generator, so a seeded request's tokens do not
  depend on the other requests' seeds. (They can still differ across batch compositions in rare
  ties, because padded batches round differently in the last bits.)
- ``generate`` and ``load_weights`` hold one lock: weights never change mid-generation.
- Requests longer than the model's ``max_position_embeddings`` are refused with ``ValueError``.

Not in this module: tokenisation, chat templates, batching across calls (the actor decides what to
batch), anything about sockets.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # must precede the transformers import
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from libra.engines.rollout_base import GenRequest, GenResult, WeightsMismatch
from libra.logging import get_logger

__all__ = ["HFRolloutEngine", "sample_next_tokens"]

log = get_logger(__name__)


def cache_kwarg(model: Any) -> str:
    """The name ``model.forward`` takes the KV cache under: ``cache`` in transformers >= 5.24 (where
    ``past_key_values`` is deprecated), ``past_key_values`` before."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def sample_next_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` [B, V] (float32).

    Row ``b`` is greedy (argmax) if ``temperatures[b] == 0``; otherwise it is drawn from
    ``softmax(logits[b] / temperatures[b])`` restricted to the smallest top-probability set whose mass
    reaches ``top_ps[b]`` (always at least one token), by inverse-CDF with one uniform number from
    ``generators[b]`` (a CPU generator). Returns ``(tokens [B] long, policy_logprobs [B],
    sampling_logprobs [B])``: ``policy_logprobs`` is ``log_softmax(logits)`` at the chosen token
    (temperature 1, full vocabulary); ``sampling_logprobs`` is the log-prob under the distribution
    actually sampled from (``0.0`` for greedy rows).
    """
    bsz, vocab = logits.shape
    policy_lp = torch.log_softmax(logits, dim=-1)
    greedy = temperatures <= 0
    tokens = torch.argmax(logits, dim=-1)
    sampling_lp = torch.zeros(bsz, dtype=torch.float32, device=logits.device)
    if bool(greedy.all()):
        return tokens, policy_lp.gather(1, tokens[:, None]).squeeze(1), sampling_lp
    temps = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    if bool((top_ps < 1.0).any()):
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= top_ps[:, None]  # the first token always has mass_before == 0
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    uniforms = torch.tensor(
        [float(torch.rand((), generator=g)) if not bool(greedy[b]) else 0.0 for b, g in enumerate(generators)],
        dtype=probs.dtype,
        device=probs.device,
    )
    cdf = torch.cumsum(probs, dim=-1)
    targets = uniforms * cdf[:, -1]
    # right=True: first index with cdf > target, so zero-probability tokens can never be chosen.
    drawn = torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1).clamp_(max=vocab - 1)
    tokens = torch.where(greedy, tokens, drawn)
    chosen_p = probs.gather(1, tokens[:, None]).squeeze(1)
    sampling_lp = torch.where(greedy, sampling_lp, torch.log(chosen_p))
    return tokens, policy_lp.gather(1, tokens[:, None]).squeeze(1), sampling_lp


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
    ) -> None:
        from transformers import AutoModelForCausalLM

        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"HFRolloutEngine: no config.json in model_dir {str(path)!r}")
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
        self._init(model.to(device), max_batch_size=max_batch_size, weights_version=weights_version)
        self.model_dir: Path | None = path

    @classmethod
    def from_model(cls, model: Any, *, max_batch_size: int = 32, weights_version: int = 0) -> HFRolloutEngine:
        """Wrap an already-loaded causal LM (kept on its current device and dtype)."""
        self = cls.__new__(cls)
        self._init(model, max_batch_size=max_batch_size, weights_version=weights_version)
        self.model_dir = None
        return self

    def _init(self, model: Any, *, max_batch_size: int, weights_version: int) -> None:
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
        pad = getattr(cfg, "pad_token_id", None)
        self._pad_id: int = int(pad) if pad is not None else 0  # masked out; any id works
        self.device: torch.device = next(model.parameters()).device

    # -- RolloutEngine -------------------------------------------------------------------------

    @property
    def weights_version(self) -> int:
        """The weights version the next ``generate`` uses."""
        return self._version

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Generate every request; results in request order (see the module contracts).

        Raises ``ValueError`` naming the request index for a token id outside the vocabulary or a
        request longer than ``max_position_embeddings``.
        """
        for i, req in enumerate(requests):
            self._check_request(i, req)
        results: list[GenResult | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        with self._lock, torch.inference_mode():
            version = self._version
            for start in range(0, len(order), self.max_batch_size):
                idx = order[start : start + self.max_batch_size]
                for i, res in zip(idx, self._generate_batch([requests[i] for i in idx], version)):
                    results[i] = res
        return [r for r in results if r is not None]

    def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state_dict`` into the model in place and set :attr:`weights_version` to ``version``.

        Waits for a running ``generate`` to finish. The state dict must name exactly the model's
        ``state_dict()`` entries with the same shapes (dtype and device are converted); otherwise
        raises :class:`WeightsMismatch` and leaves the weights untouched.
        """
        with self._lock:
            own = self.model.state_dict()
            missing = sorted(set(own) - set(state_dict))
            unexpected = sorted(set(state_dict) - set(own))
            if missing or unexpected:
                raise WeightsMismatch(
                    f"weights version {version}: {len(missing)} missing {missing[:5]}, "
                    f"{len(unexpected)} unexpected {unexpected[:5]}"
                )
            for name, tensor in state_dict.items():
                if tuple(tensor.shape) != tuple(own[name].shape):
                    raise WeightsMismatch(
                        f"weights version {version}: {name!r} has shape {tuple(tensor.shape)}, "
                        f"model expects {tuple(own[name].shape)}"
                    )
            with torch.no_grad():
                for name, tensor in state_dict.items():
                    own[name].copy_(tensor)
            self._version = int(version)
        log.info("weights_loaded", version=int(version), tensors=len(state_dict))

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

    def _generate_batch(self, reqs: Sequence[GenRequest], version: int) -> list[GenResult]:
        from transformers import DynamicCache

        dev = self.device
        bsz = len(reqs)
        lens = [len(r.prompt_ids) for r in reqs]
        width = max(lens)
        ids = torch.full((bsz, width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((bsz, width), dtype=torch.long)
        for b, r in enumerate(reqs):
            ids[b, width - lens[b] :] = torch.tensor(list(r.prompt_ids), dtype=torch.long)
            mask[b, width - lens[b] :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp_(min=0)
        mask = mask.to(dev)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids.to(dev),
            attention_mask=mask,
            position_ids=positions.to(dev),
            **{self._cache_kw: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :].float()

        rows = list(range(bsz))  # cache row j serves request rows[j]
        next_pos = torch.tensor(lens, dtype=torch.long, device=dev)
        temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
        top_ps = torch.tensor([r.top_p for r in reqs], dtype=torch.float32, device=dev)
        gens = [self._generator(r.seed) for r in reqs]
        stops = [frozenset(r.stop_token_ids) for r in reqs]
        toks: list[list[int]] = [[] for _ in reqs]
        lps: list[list[float]] = [[] for _ in reqs]
        slps: list[list[float]] = [[] for _ in reqs]
        reasons: list[str] = ["length"] * bsz

        while True:
            chosen, lp, slp = sample_next_tokens(logits, temps, top_ps, [gens[b] for b in rows])
            keep: list[int] = []
            for j, (b, t, a, s) in enumerate(zip(rows, chosen.tolist(), lp.tolist(), slp.tolist())):
                toks[b].append(t)
                lps[b].append(a)
                slps[b].append(s)
                if t in stops[b]:
                    reasons[b] = "stop"
                elif len(toks[b]) < reqs[b].max_new_tokens:
                    keep.append(j)
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
                finish_reason="stop" if reasons[b] == "stop" else "length",
                weights_version=version,
                sampling_logprobs=slps[b],
                num_prompt_tokens=lens[b],
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
