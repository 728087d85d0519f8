"""The prefix_cache benchmark's parts at small sizes: the sticky and re-prefill runs produce the same tokens,
the sticky one feeds only each turn's new tokens, and the delta form carries fewer broker bytes per turn."""

from __future__ import annotations

import pytest

from libra.bench.prefix_cache import bench_bytes, bench_latency
from libra.engines.hf_rollout import HFRolloutEngine
from libra.engines.tiny_model import ensure_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return HFRolloutEngine(ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def test_sticky_and_re_prefill_agree_and_sticky_feeds_only_the_new_tokens(engine) -> None:
    r = bench_latency(engine, context=64, turns=3, new_tokens=4, tool_tokens=5, seed=1)
    assert r["same_tokens"] and r["max_logprob_diff"] < 1e-4
    assert r["prefill_tokens"]["sticky"] == [64, 6, 6]  # the tool output and the last generated token
    assert r["prefill_tokens"]["reprefill"] == [64, 73, 82]
    assert len(engine.kv_cache) == 0  # the bench leaves nothing behind


def test_deltas_carry_a_constant_number_of_bytes_per_turn() -> None:
    b = bench_bytes(context=2048, turns=4, new_tokens=4, tool_tokens=16)
    delta, whole = b["delta"]["turn_bytes"], b["whole"]["turn_bytes"]
    assert max(delta[1:]) - min(delta[1:]) < 16  # independent of the context ...
    assert max(delta) < 2048  # ... and of the prompt, which went over the data plane too
    assert whole == sorted(whole) and whole[0] > 2 * 2048  # the whole form grows and starts above the prompt
    assert b["ratio"] > 5
