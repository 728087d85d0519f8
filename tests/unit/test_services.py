"""ServiceManager (evict-on-execution model services) with real tiny transformers models on CPU:
restore on demand, LRU eviction order, bit-identical scores across evict + restore, concurrent calls,
typed errors, and the ``reward_model`` actor tool."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import pytest
import torch

from libra.actors.tools import ToolError, WorkContext, action_tools
from libra.engines.services import (
    ServiceError,
    ServiceManager,
    UnknownService,
    service_tools,
)
from libra.engines.tiny_model import TinyModelSpec, ensure_tiny_model

TEXTS = ("What is 12 + 30? The answer is 42.", "def add(a, b):\n    return a + b\n", "The capital of France")


@pytest.fixture(scope="module")
def paths() -> dict[str, str]:
    return {name: str(ensure_tiny_model(spec=TinyModelSpec(seed=seed))) for name, seed in (("a", 0), ("b", 1), ("c", 2))}


def reference_score(path: str, text: str) -> float:
    """The score computed directly with transformers, independent of the manager."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        logits = model(input_ids=ids).logits.float()
    return float(torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).mean())


def manager(paths: dict[str, str], budget: int = 2, max_replicas: int | None = 1, **kw) -> ServiceManager:  # type: ignore[no-untyped-def]
    m = ServiceManager(device="cpu", budget=budget, max_replicas=max_replicas, **kw)
    for name, path in paths.items():
        m.register_pretrained(name, path)
    return m


@pytest.fixture
def mgr(paths: dict[str, str]) -> Iterator[ServiceManager]:
    yield manager(paths)


def test_registered_services_start_evicted_and_restore_on_demand(mgr: ServiceManager) -> None:
    assert mgr.services() == ["a", "b", "c"] and mgr.resident() == {}
    first = mgr.score("a", TEXTS[0])
    assert first["restored"] is True and first["evicted"] == [] and first["device"] == "cpu"
    assert mgr.resident() == {"a": 1} and mgr.storage_devices("a") == {"cpu"}
    again = mgr.score("a", TEXTS[0])
    assert again["restored"] is False and again["score"] == first["score"]
    assert mgr.stats() == {"hits": 1, "restores": 1, "evictions": 0}
    assert mgr.events == [("restore", "a")]


def test_lru_eviction_order(mgr: ServiceManager) -> None:
    mgr.score("a", TEXTS[0])
    mgr.score("b", TEXTS[0])
    out = mgr.score("c", TEXTS[0])  # budget 2: a is least recently used
    assert out["evicted"] == ["a"] and mgr.resident() == {"b": 1, "c": 1}
    assert mgr.storage_devices("b") == {"cpu"} and mgr.storage_devices("a") == set()  # a's replica is gone
    mgr.score("b", TEXTS[1])  # b becomes most recent; c is now the LRU
    out = mgr.score("a", TEXTS[1])
    assert out["evicted"] == ["c"] and mgr.resident() == {"a": 1, "b": 1}
    assert mgr.events == [("restore", "a"), ("restore", "b"), ("evict", "a"), ("restore", "c"),
                          ("evict", "c"), ("restore", "a")]
    assert mgr.stats() == {"hits": 1, "restores": 4, "evictions": 2}


def test_scores_identical_before_and_after_evict_and_restore(mgr: ServiceManager, paths: dict[str, str]) -> None:
    before = [mgr.score("a", t)["score"] for t in TEXTS]
    for t, s in zip(TEXTS, before):
        assert math.isclose(s, reference_score(paths["a"], t), rel_tol=1e-5, abs_tol=1e-6)
    assert mgr.evict_all() == 1 and mgr.resident() == {}
    mgr.score("b", TEXTS[0])
    mgr.score("c", TEXTS[0])  # a's chunk was reused by others in between
    after = [mgr.score("a", t) for t in TEXTS]
    assert after[0]["restored"] is True and [r["score"] for r in after] == before  # bit-identical
    assert len({round(mgr.score(n, TEXTS[0])["score"], 6) for n in "abc"}) == 3  # different models differ


def test_evicted_replica_holds_only_meta_tensors(mgr: ServiceManager) -> None:
    mgr.score("a", TEXTS[0])
    rep = next(iter(mgr._replicas.values()))
    assert {t.device.type for t in rep.model.parameters()} == {"cpu"}
    mgr.evict_all()
    assert {t.device.type for t in rep.model.parameters()} == {"meta"}
    assert {t.device.type for t in rep.model.buffers()} == {"meta"}


def test_concurrent_calls_are_safe_and_correct(paths: dict[str, str]) -> None:
    mgr = manager(paths, budget=2, max_replicas=None)
    expected = {n: reference_score(paths[n], TEXTS[0]) for n in "abc"}
    results: list[tuple[str, float]] = []
    errors: list[Exception] = []

    def worker(k: int) -> None:
        try:
            for j in range(6):
                name = "abc"[(k + j) % 3]
                results.append((name, mgr.score(name, TEXTS[0])["score"]))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 48
    for name, score in results:
        assert math.isclose(score, expected[name], rel_tol=1e-5, abs_tol=1e-6), name
    st = mgr.stats()
    assert st["hits"] + st["restores"] == 48
    assert sum(mgr.resident().values()) <= 2
    assert st["restores"] - st["evictions"] == sum(mgr.resident().values())
    assert all(not busy for _, _, busy in mgr._placement.replicas().values())


def test_busy_pool_fails_typed_after_wait(paths: dict[str, str]) -> None:
    mgr = manager({"a": paths["a"]}, budget=1, wait_s=0.0)
    rid, _rep, _restored, _ = mgr._acquire("a")  # hold the only chunk
    with pytest.raises(ServiceError) as ei:
        mgr.score("a", TEXTS[0])
    assert ei.value.code == "busy"
    mgr._release(rid)
    assert mgr.score("a", TEXTS[0])["restored"] is True  # the held replica was never restored


def test_unknown_service_and_bad_text(mgr: ServiceManager) -> None:
    with pytest.raises(UnknownService) as ei:
        mgr.score("nope", TEXTS[0])
    assert ei.value.code == "unknown_service" and "'nope'" in str(ei.value) and "a, b, c" in str(ei.value)
    with pytest.raises(ServiceError) as ei2:
        mgr.score("a", 42)  # type: ignore[arg-type]
    assert ei2.value.code == "bad_request"


def test_reward_model_tool(mgr: ServiceManager) -> None:
    tool = service_tools(mgr)["reward_model"]
    ctx = WorkContext("w1", "t1", 10.0)
    out = tool({"service": "b", "text": TEXTS[2]}, ctx)
    assert out["service"] == "b" and out["score"] == mgr.score("b", TEXTS[2])["score"] and out["tokens"] >= 2
    with pytest.raises(ToolError) as ei:
        tool({"service": "zzz", "text": "hello world"}, ctx)
    assert ei.value.code == "unknown_service" and "zzz" in ei.value.message
    with pytest.raises(ToolError) as ei:
        tool({"text": "hello"}, ctx)
    assert ei.value.code == "bad_request"


def test_action_tools_offers_reward_model_with_the_default_service() -> None:
    tools = action_tools(enable_sandbox=False)
    assert "reward_model" in tools and "reward_model" not in action_tools(enable_sandbox=False, enable_services=False)
    out = tools["reward_model"]({"service": "tiny_reward", "text": TEXTS[0]}, WorkContext("w", None, 5.0))
    assert out["service"] == "tiny_reward" and out["restored"] is True and out["score"] < 0
    assert WorkContext("w", None, 1.0).cores == 1
