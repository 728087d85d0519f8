"""The vLLM engine's arguments: prefix caching is on (checked with the stand-in ``vllm`` module of
test_vllm_rollout.py, since vLLM is not installed in the main venv; the engine against real vLLM is tested in
the vLLM lane, tests/vllm/)."""

from __future__ import annotations

from test_vllm_rollout import FakeLLM, install_fake_vllm  # tests/unit

from libra.engines.vllm_rollout import VLLMRolloutEngine


def test_vllm_runs_with_prefix_caching_on(monkeypatch, tmp_path) -> None:
    install_fake_vllm(monkeypatch)
    (tmp_path / "config.json").write_text("{}")
    VLLMRolloutEngine(tmp_path, max_num_seqs=4)
    (kwargs,) = FakeLLM.made
    assert kwargs["enable_prefix_caching"] is True
    assert kwargs["max_num_seqs"] == 4 and kwargs["skip_tokenizer_init"] is True
    assert kwargs["logprobs_mode"] == "raw_logprobs"


def test_prefix_caching_can_be_turned_off_by_the_operator(monkeypatch, tmp_path) -> None:
    install_fake_vllm(monkeypatch)
    (tmp_path / "config.json").write_text("{}")
    VLLMRolloutEngine(tmp_path, enable_prefix_caching=False)  # e.g. from LIBRA_VLLM_ARGS
    assert FakeLLM.made[-1]["enable_prefix_caching"] is False
