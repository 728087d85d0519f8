"""Realistic model shapes for benchmarks: randomly initialised transformers Qwen2 models built in code.

Role: speed and memory checks need a model of a real size, not a real checkpoint (random weights cost the
same FLOPs and bytes as trained ones, and nothing has to be downloaded or carried). Each shape is a
:class:`ModelShape` in :data:`SHAPES`; :func:`shape_config` turns it into a ``transformers.Qwen2Config``,
:func:`build_random_model` into a model, and :func:`write_shape_dir` into a directory that
``GRPOTrainer(dir, random_init=True)`` (and anything reading ``config.json``) accepts without weights.

Shapes: ``tiny`` (plumbing; about 0.1 M parameters), ``qwen2-0.5b`` and ``qwen2-1.5b`` (the published
Qwen2 configurations: layers, widths, heads, KV heads, vocabulary, tied embeddings).

Contracts: the same shape and seed give bit-identical weights, whatever the caller's RNG state (the build
forks the RNG). An unknown shape name raises ``ValueError`` naming the known ones.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SHAPES", "ModelShape", "build_random_model", "param_count", "shape_config", "write_shape_dir"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The size of a decoder-only (Qwen2) model."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6


SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048),
    "qwen2-0.5b": ModelShape(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, vocab_size=151936),
    "qwen2-1.5b": ModelShape(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                             num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
}


def _shape(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r} (known: {', '.join(SHAPES)})") from None


def shape_config(name: str) -> Any:  # -> transformers.Qwen2Config
    """The ``transformers.Qwen2Config`` of shape ``name``."""
    from transformers import Qwen2Config

    s = _shape(name)
    return Qwen2Config(
        hidden_size=s.hidden_size, intermediate_size=s.intermediate_size, num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads, num_key_value_heads=s.num_key_value_heads,
        vocab_size=s.vocab_size, max_position_embeddings=s.max_position_embeddings,
        tie_word_embeddings=s.tie_word_embeddings, rope_theta=s.rope_theta, rms_norm_eps=s.rms_norm_eps,
        bos_token_id=0, eos_token_id=1, pad_token_id=0,
    )


def param_count(name: str) -> int:
    """Parameters of shape ``name`` (tied embeddings counted once), computed from the shape alone."""
    s = _shape(name)
    h, kv = s.hidden_size, s.num_key_value_heads * (s.hidden_size // s.num_attention_heads)
    attn = h * h + h + 2 * (h * kv + kv) + h * h  # q (+bias), k and v (+bias), o
    layer = attn + 3 * h * s.intermediate_size + 2 * h
    head = 0 if s.tie_word_embeddings else s.vocab_size * h
    return s.vocab_size * h + s.num_hidden_layers * layer + h + head


def build_random_model(name: str, *, seed: int = 0, dtype: Any = None, device: Any = "cpu") -> Any:
    """A randomly initialised ``Qwen2ForCausalLM`` of shape ``name`` (deterministic in ``seed``)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(shape_config(name), dtype=dtype or torch.float32)
    return model.to(device)


def write_shape_dir(name: str, path: str | os.PathLike[str]) -> Path:
    """Write shape ``name``'s ``config.json`` (no weights) to ``path``; returns the directory."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    shape_config(name).save_pretrained(out)
    (out / "libra_shape.json").write_text(json.dumps({"shape": name}))
    return out
