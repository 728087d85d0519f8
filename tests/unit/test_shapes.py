"""Model shapes for benchmarks (libra/engines/shapes.py): configs, parameter counts, deterministic builds."""

from __future__ import annotations

import json

import pytest
import torch

from libra.engines.shapes import SHAPES, build_random_model, param_count, shape_config, write_shape_dir


def test_param_count_matches_the_built_model_and_qwen2_sizes() -> None:
    m = build_random_model("tiny")
    assert sum(p.numel() for p in m.parameters()) == param_count("tiny")
    assert 0.45e9 < param_count("qwen2-0.5b") < 0.55e9  # Qwen2-0.5B: 494 M
    assert 1.4e9 < param_count("qwen2-1.5b") < 1.6e9  # Qwen2-1.5B: 1.54 B
    cfg = shape_config("qwen2-1.5b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (1536, 28, 2)


def test_same_seed_same_weights_and_callers_rng_untouched() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = build_random_model("tiny", seed=5), build_random_model("tiny", seed=5)
    assert torch.equal(torch.rand(1), before)
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(ta, tb)
    c = build_random_model("tiny", seed=6)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_unknown_shape_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="known: tiny"):
        shape_config("qwen2-72b")
    d = write_shape_dir("tiny", tmp_path / "m")
    assert json.loads((d / "config.json").read_text())["hidden_size"] == SHAPES["tiny"].hidden_size
