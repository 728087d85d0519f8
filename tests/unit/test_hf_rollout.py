"""HF rollout engine (libra.engines.hf_rollout) and the tiny offline model it is tested on."""

from __future__ import annotations

import threading

import pytest
import torch

from libra.engines.hf_rollout import HFRolloutEngine, sample_next_tokens
from libra.engines.rollout_base import GenRequest, RolloutEngine, WeightsMismatch
from libra.engines.tiny_model import (
    TinyModelError,
    TinyModelSpec,
    build_tiny_tokenizer,
    ensure_tiny_model,
)
from libra.weights.format import pack_state_dict, unpack_state_dict


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def engine(model_dir):
    return HFRolloutEngine(model_dir, max_batch_size=32)


def full_forward_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """Reference: one forward pass over prompt + completion, no cache, no padding."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    n = len(prompt)
    return [logp[n - 1 + k, t].item() for k, t in enumerate(completion)]


def mixed_requests() -> list[GenRequest]:
    settings = [(0.0, 1.0), (1.0, 1.0), (0.7, 1.0), (1.3, 0.5), (1.0, 0.9)]
    return [
        GenRequest(
            prompt_ids=[2, *range(10 + i, 10 + i + 1 + 3 * i)],  # prompt lengths 2..23: real left padding
            max_new_tokens=6 + 3 * i,
            temperature=settings[i % 5][0],
            top_p=settings[i % 5][1],
            seed=100 + i,
        )
        for i in range(8)
    ]


# -- tiny model ---------------------------------------------------------------------------------


def test_tiny_model_is_deterministic_and_loads_with_auto_classes(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    other = ensure_tiny_model(tmp_path / "again")
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is untouched
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (other / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert ensure_tiny_model(other) == other  # cached: no rebuild, same path

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.vocab_size == len(tok)
    assert tok.pad_token == "<|pad|>" and tok.eos_token == "<|im_end|>"
    text = "What is 12 + 30? café 🎉\n  def f(x): return x"
    assert tok.encode(text) == build_tiny_tokenizer().encode(text)  # what we train is what loads
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_model_llama_variant_and_spec_guard(tmp_path):
    from transformers import AutoTokenizer

    spec = TinyModelSpec(arch="llama", seed=3)
    path = ensure_tiny_model(tmp_path / "llama", spec)
    assert '"LlamaForCausalLM"' in (path / "config.json").read_text()
    assert AutoTokenizer.from_pretrained(path).encode("x = 42") == build_tiny_tokenizer().encode("x = 42")
    with pytest.raises(TinyModelError, match="another spec"):
        ensure_tiny_model(path, TinyModelSpec(arch="llama", seed=4))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "data.txt").write_text("user data")
    with pytest.raises(TinyModelError, match="not a Libra tiny-model"):
        ensure_tiny_model(tmp_path / "junk")
    with pytest.raises(ValueError, match="divisible"):
        TinyModelSpec(hidden_size=64, num_heads=3)


# -- generation ---------------------------------------------------------------------------------


def test_engine_satisfies_protocol(engine):
    assert isinstance(engine, RolloutEngine)


def test_logprobs_equal_full_forward_pass(engine):
    reqs = mixed_requests()
    results = engine.generate(reqs)
    assert len(results) == len(reqs)
    for req, res in zip(reqs, results):
        assert len(res.token_ids) == len(res.logprobs) == len(res.sampling_logprobs) == req.max_new_tokens
        assert res.finish_reason == "length" and res.weights_version == 0
        assert res.num_prompt_tokens == len(req.prompt_ids)
        want = full_forward_logprobs(engine.model, list(req.prompt_ids), res.token_ids)
        assert res.logprobs == pytest.approx(want, abs=1e-4)


def test_greedy_picks_argmax_and_sampling_logprobs_follow_temperature(engine):
    prompt = [2, 40, 41, 42]
    greedy = engine.generate([GenRequest(prompt_ids=prompt, max_new_tokens=5, temperature=0.0)])[0]
    assert greedy.sampling_logprobs == [0.0] * 5
    ids = prompt[:]
    for tok in greedy.token_ids:
        with torch.no_grad():
            assert int(engine.model(torch.tensor([ids])).logits[0, -1].argmax()) == tok
        ids.append(tok)
    # at temperature 1 and top_p 1 the sampling distribution is the policy itself
    plain = engine.generate([GenRequest(prompt_ids=prompt, max_new_tokens=5, seed=7)])[0]
    assert plain.sampling_logprobs == pytest.approx(plain.logprobs, abs=1e-5)


def test_stop_token_ends_request_and_is_included(engine):
    prompt = [2, 30, 31]
    free = engine.generate([GenRequest(prompt_ids=prompt, max_new_tokens=12, temperature=0.0)])[0]
    stop_at = next(k for k in range(2, 12) if free.token_ids[k] not in free.token_ids[:k])
    stop_tok = free.token_ids[stop_at]
    reqs = [
        GenRequest(prompt_ids=prompt, max_new_tokens=12, temperature=0.0, stop_token_ids=[stop_tok]),
        GenRequest(prompt_ids=[2, 50, 51, 52, 53], max_new_tokens=9, seed=1),  # keeps running after
    ]
    stopped, other = engine.generate(reqs)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: stop_at + 1]
    assert stopped.logprobs == pytest.approx(free.logprobs[: stop_at + 1], abs=1e-5)
    assert other.finish_reason == "length" and len(other.token_ids) == 9
    assert other.logprobs == pytest.approx(full_forward_logprobs(engine.model, [2, 50, 51, 52, 53], other.token_ids),
                                           abs=1e-4)


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    reqs = mixed_requests()
    first = engine.generate(reqs)
    again = engine.generate(reqs)
    alone = engine.generate([reqs[3]])[0]
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert alone.token_ids == first[3].token_ids
    other_seed = engine.generate([GenRequest(**{**_fields(reqs[1]), "seed": 999})])[0]
    assert other_seed.token_ids != first[1].token_ids


def _fields(req: GenRequest) -> dict:
    return {f: getattr(req, f) for f in GenRequest.__slots__}


def test_split_batches_give_the_same_results_in_request_order(model_dir, engine):
    reqs = [GenRequest(prompt_ids=[2] * (9 - i) + [60 + i], max_new_tokens=4 + i, temperature=0.0)
            for i in range(7)]  # longest prompt first: internal sorting must not leak into the order
    small = HFRolloutEngine.from_model(engine.model, max_batch_size=2)
    big = engine.generate(reqs)
    split = small.generate(reqs)
    assert [r.token_ids for r in big] == [r.token_ids for r in split]
    assert [len(r.token_ids) for r in big] == [4 + i for i in range(7)]


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for seed in range(200):
        tok, _, slp = sample_next_tokens(logits, torch.tensor([1.0]), torch.tensor([0.75]),
                                         [torch.Generator().manual_seed(seed)])
        seen.add(int(tok))
        want = {0: 0.5 / 0.8, 1: 0.3 / 0.8}[int(tok)]  # renormalised over the nucleus {0, 1}
        assert slp.item() == pytest.approx(torch.log(torch.tensor(want)).item(), abs=1e-6)
    assert seen == {0, 1}


# -- weights ------------------------------------------------------------------------------------


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def test_load_weights_in_place_and_version_recorded(model_dir):
    eng = HFRolloutEngine(model_dir)
    req = GenRequest(prompt_ids=[2, 11, 12, 13], max_new_tokens=8, seed=5)
    before = eng.generate([req])[0]
    new = perturbed(eng.model.state_dict(), seed=1)
    param_ids = [id(p) for p in eng.model.parameters()]
    # through the wire format, as it travels between hosts
    received, _ = unpack_state_dict(*pack_state_dict(new, version=4, chunk_size=1000))
    eng.load_weights(4, received)
    assert eng.weights_version == 4
    assert [id(p) for p in eng.model.parameters()] == param_ids  # in place
    after = eng.generate([req])[0]
    assert after.weights_version == 4
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)
    assert after.logprobs == pytest.approx(full_forward_logprobs(eng.model, [2, 11, 12, 13], after.token_ids),
                                           abs=1e-4)
    for k, v in new.items():
        assert torch.equal(eng.model.state_dict()[k], v)


def test_load_weights_rejects_mismatch_and_keeps_old_weights(model_dir):
    eng = HFRolloutEngine(model_dir)
    state = {k: v.clone() for k, v in eng.model.state_dict().items()}
    missing = dict(state)
    missing.pop("lm_head.weight")
    with pytest.raises(WeightsMismatch, match="1 missing"):
        eng.load_weights(1, missing)
    wrong = dict(perturbed(state, 2))
    wrong["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightsMismatch, match="lm_head.weight"):
        eng.load_weights(1, wrong)
    assert eng.weights_version == 0
    assert all(torch.equal(eng.model.state_dict()[k], v) for k, v in state.items())


def test_load_weights_waits_for_running_generate(model_dir):
    eng = HFRolloutEngine(model_dir)
    req = GenRequest(prompt_ids=[2, 20, 21], max_new_tokens=6, temperature=0.0)
    old_model_copy = HFRolloutEngine(model_dir).model
    in_forward, release = threading.Event(), threading.Event()
    original = eng.model.forward
    calls = []

    def gated_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # first decode step: generation is in flight
            in_forward.set()
            release.wait(timeout=30)
        return original(*args, **kwargs)

    eng.model.forward = gated_forward
    out: list = []
    gen_thread = threading.Thread(target=lambda: out.extend(eng.generate([req])))
    gen_thread.start()
    assert in_forward.wait(timeout=30)
    load_thread = threading.Thread(target=eng.load_weights, args=(1, perturbed(eng.model.state_dict(), 3)))
    load_thread.start()
    load_thread.join(timeout=0.3)
    assert load_thread.is_alive()  # blocked on the engine lock, not swapping weights mid-generation
    release.set()
    gen_thread.join(timeout=30)
    load_thread.join(timeout=30)
    eng.model.forward = original
    (res,) = out
    assert res.weights_version == 0
    assert res.logprobs == pytest.approx(full_forward_logprobs(old_model_copy, [2, 20, 21], res.token_ids), abs=1e-4)
    assert eng.weights_version == 1


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_ids": []}, "prompt_ids must not be empty"),
        ({"prompt_ids": [1, -2]}, "non-negative"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
    ],
)
def test_request_validation(kwargs, message):
    base = {"prompt_ids": [1, 2], "max_new_tokens": 4}
    with pytest.raises(ValueError, match=message):
        GenRequest(**{**base, **kwargs})


def test_engine_rejects_requests_the_model_cannot_serve(engine):
    with pytest.raises(ValueError, match="request 1: prompt token id 99999 outside the vocabulary"):
        engine.generate([GenRequest(prompt_ids=[1], max_new_tokens=1),
                         GenRequest(prompt_ids=[99999], max_new_tokens=1)])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([GenRequest(prompt_ids=[1, 2], max_new_tokens=5000)])
    with pytest.raises(FileNotFoundError, match="no config.json"):
        HFRolloutEngine("/nonexistent/model")
    assert engine.generate([]) == []
