"""The vLLM engine's arguments: prefix caching is on (checked with a stand-in ``vllm`` module, since vLLM is not
installed on the CPU test machine; the engine contract itself is tested in test_vllm_rollout.py)."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace

from libra.engines.vllm_rollout import VLLMRolloutEngine


class RecordingLLM:
    """Records the arguments ``vllm.LLM`` was built with."""

    made: list[dict] = []

    def __init__(self, **kwargs) -> None:
        RecordingLLM.made.append(kwargs)
        cfg = SimpleNamespace(get_vocab_size=lambda: 512, max_model_len=kwargs["max_model_len"])
        self.llm_engine = SimpleNamespace(model_config=cfg)


def fake_vllm(monkeypatch) -> None:
    mod = ModuleType("vllm")
    mod.LLM = RecordingLLM
    mod.__version__ = "0.0-test"
    monkeypatch.setitem(sys.modules, "vllm", mod)
    RecordingLLM.made.clear()


def test_vllm_runs_with_prefix_caching_on(monkeypatch, tmp_path) -> None:
    fake_vllm(monkeypatch)
    (tmp_path / "config.json").write_text("{}")
    VLLMRolloutEngine(tmp_path, max_num_seqs=4)
    (kwargs,) = RecordingLLM.made
    assert kwargs["enable_prefix_caching"] is True
    assert kwargs["max_num_seqs"] == 4 and kwargs["skip_tokenizer_init"] is True


def test_prefix_caching_can_be_turned_off_by_the_operator(monkeypatch, tmp_path) -> None:
    fake_vllm(monkeypatch)
    (tmp_path / "config.json").write_text("{}")
    VLLMRolloutEngine(tmp_path, enable_prefix_caching=False)  # e.g. from LIBRA_VLLM_ARGS
    assert RecordingLLM.made[-1]["enable_prefix_caching"] is False
