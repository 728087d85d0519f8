"""Trajectory contexts kept between turns: the LRU cache (libra.engines.kv_cache), the context digest
(libra.protocol.payloads_rollout), and the HF engine reusing, exporting and importing KV on the tiny model."""

from __future__ import annotations

from array import array

import pytest
import torch

from libra.engines.hf_rollout import HFRolloutEngine
from libra.engines.kv_cache import ContextEntry, KVCache, pack_context, unpack_context
from libra.engines.rollout_base import GenRequest
from libra.engines.tiny_model import ensure_tiny_model
from libra.weights.format import pack_state_dict, unpack_state_dict
from libra.protocol.payloads_base import PayloadError
from libra.protocol.payloads_rollout import (
    EMPTY_DIGEST,
    ContextDigest,
    GenerateArgs,
    context_digest,
)


def entry(n_tokens: int, kv_tokens: int, *, layers: int = 2, version: int = 0) -> ContextEntry:
    ids = array("I", range(n_tokens))
    kv = tuple((torch.zeros(1, 1, kv_tokens, 8), torch.zeros(1, 1, kv_tokens, 8)) for _ in range(layers))
    return ContextEntry(ids, ContextDigest(ids), kv, kv_tokens, version)


# -- digest --------------------------------------------------------------------------------------------------


def test_digest_extends_turn_by_turn_to_the_digest_of_the_whole_context() -> None:
    turns = [[1, 2, 3], [400, 5], [], [2**32 - 1, 0, 7]]
    d = ContextDigest()
    assert d.hexdigest() == EMPTY_DIGEST and d.length == 0
    seen: list[int] = []
    for t in turns:
        before = d.copy()
        d.update(t)
        seen += t
        assert d.hexdigest() == context_digest(seen) and d.length == len(seen)
        assert before.length == len(seen) - len(t)  # copies are independent
    assert context_digest([1, 2]) != context_digest([2, 1]) != context_digest([1, 2, 0])
    assert context_digest([256]) != context_digest([1, 0])  # ids, not bytes: no ambiguity across boundaries
    with pytest.raises(ValueError, match="2\\*\\*32"):
        ContextDigest([2**32])
    with pytest.raises(ValueError):
        ContextDigest([-1])


def test_turn_context_payload_checks_lengths_and_digests() -> None:
    ok = {"new_ids": [5, 6], "prefix_len": 3, "prefix_digest": context_digest([1, 2, 3]), "total_len": 5,
          "digest": context_digest([1, 2, 3, 5, 6])}
    g = GenerateArgs.from_wire({"context": ok})
    assert g.total_len == 5 and g.prompt_ids is None
    assert GenerateArgs.from_wire(g.to_wire()) == g
    with pytest.raises(PayloadError, match="total_len"):
        GenerateArgs.from_wire({"context": {**ok, "total_len": 4}})
    with pytest.raises(PayloadError, match="empty prefix"):
        GenerateArgs.from_wire({"context": {**ok, "prefix_len": 0, "total_len": 2}})
    with pytest.raises(PayloadError, match="prefix_digest"):
        GenerateArgs.from_wire({"context": {**ok, "prefix_digest": "xyz"}})
    with pytest.raises(PayloadError, match="exactly one of"):
        GenerateArgs.from_wire({"context": ok, "prompt_ids": [1]})


# -- the LRU cache --------------------------------------------------------------------------------------------


def test_cache_evicts_least_recently_used_to_fit_its_budget() -> None:
    one = entry(10, 9).nbytes
    c = KVCache(3 * one)
    for k in "abc":
        assert c.put(k, entry(10, 9)) == []
    assert c.used_bytes == 3 * one and c.free_bytes == 0
    assert c.get("a") is not None  # a is now the most recently used
    assert c.put("d", entry(10, 9)) == ["b"]
    assert c.keys() == ["c", "a", "d"]
    assert c.get("c", touch=False) is not None and c.put("e", entry(10, 9)) == ["c"]
    c.put("a", entry(10, 9))  # replacing frees the old entry first
    assert c.used_bytes == 3 * one and c.stats["evictions"] == 2
    c.drop("a")
    assert "a" not in c and c.used_bytes == 2 * one


def test_an_entry_larger_than_the_budget_keeps_its_ids_and_drops_its_kv() -> None:
    c = KVCache(entry(10, 9).nbytes - 1)
    c.put("big", entry(10, 9))
    e = c.get("big")
    assert e is not None and e.kv is None and e.kv_len == 0 and list(e.ids) == list(range(10))
    assert c.stats["kv_dropped"] == 1 and c.used_bytes == 40
    with pytest.raises(ValueError, match="budget_bytes"):
        KVCache(-1)


def test_new_weights_drop_every_kv_and_keep_the_ids() -> None:
    c = KVCache(1 << 20)
    c.put("a", entry(10, 9))
    c.drop_kv()
    e = c.get("a")
    assert e is not None and e.kv is None and c.used_bytes == 40


def test_packed_context_round_trips_and_a_wrong_digest_is_refused() -> None:
    e = entry(6, 5)
    tensors, meta = pack_context(e, with_kv=True)
    back = unpack_context(*unpack_state_dict(*pack_state_dict(tensors, metadata=meta))[:1], meta)
    assert list(back.ids) == list(e.ids) and back.kv_len == 5 and back.kv is not None and len(back.kv) == 2
    ids_only = unpack_context(*pack_context(e, with_kv=False))
    assert ids_only.kv is None and ids_only.digest.hexdigest() == e.digest.hexdigest()
    with pytest.raises(ValueError, match="digest"):
        unpack_context(tensors, {**meta, "digest": context_digest([9])})


# -- the engine ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def run_turns(engines, sessions, contexts, turns=4):
    """Run ``turns`` turns of each trajectory; turn t runs on ``engines[t]`` (a migration when it changes).
    Returns every turn's results."""
    contexts = [list(c) for c in contexts]
    out = []
    for t in range(turns):
        eng = engines[t]
        reqs = [GenRequest(prompt_ids=c, max_new_tokens=4 + 2 * i, temperature=[1.0, 0.0, 0.8][i % 3], seed=10 * t + i)
                for i, c in enumerate(contexts)]
        res = eng.generate(reqs, sessions=sessions)
        out.append(res)
        for i, r in enumerate(res):
            contexts[i] += r.token_ids + [300 + t, 301, 302 + i]  # tool output appended after every turn
    return out


def test_sticky_turns_reuse_the_cache_and_match_re_prefill(model_dir) -> None:
    cached, plain = HFRolloutEngine(model_dir), HFRolloutEngine(model_dir)
    prompts = [[2, *range(10, 40)], [2, *range(50, 57)], [2, *range(70, 120)]]
    a = run_turns([cached] * 4, ["t0", "t1", "t2"], prompts)
    b = run_turns([plain] * 4, None, prompts)
    for ta, tb in zip(a, b):
        for x, y in zip(ta, tb):
            assert x.token_ids == y.token_ids
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
    # after the first turn only the new tokens are fed: prompt - cached = the tool output + the last token
    assert [r.cached_tokens for r in a[0]] == [0, 0, 0]
    for t in range(1, 4):
        assert all(r.num_prompt_tokens - r.cached_tokens == 4 for r in a[t])
    assert cached.kv_cache.stats["hits"] == 9 and len(cached.kv_cache) == 3


def test_a_prompt_that_differs_from_the_cached_ids_is_prefilled_in_full(model_dir) -> None:
    eng, ref = HFRolloutEngine(model_dir), HFRolloutEngine(model_dir)
    first = eng.generate([GenRequest(prompt_ids=[2, 11, 12, 13], max_new_tokens=3, temperature=0.0)], ["s"])[0]
    other = [2, 11, 99, 13, *first.token_ids, 5]  # same length, one id changed inside the cached part
    r = eng.generate([GenRequest(prompt_ids=other, max_new_tokens=3, temperature=0.0)], ["s"])[0]
    assert r.cached_tokens == 0
    assert r.logprobs == pytest.approx(ref.generate([GenRequest(prompt_ids=other, max_new_tokens=3,
                                                                temperature=0.0)])[0].logprobs, abs=1e-4)


def test_new_weights_make_the_next_turn_prefill_again(model_dir) -> None:
    eng = HFRolloutEngine(model_dir)
    r = eng.generate([GenRequest(prompt_ids=[2, 11, 12], max_new_tokens=3, temperature=0.0)], ["s"])[0]
    eng.load_weights(1, {k: v.clone() for k, v in eng.model.state_dict().items()})
    nxt = [2, 11, 12, *r.token_ids, 9]
    r2 = eng.generate([GenRequest(prompt_ids=nxt, max_new_tokens=2, temperature=0.0)], ["s"])[0]
    assert r2.cached_tokens == 0
    assert eng.generate([GenRequest(prompt_ids=nxt + r2.token_ids + [8], max_new_tokens=2, temperature=0.0)],
                        ["s"])[0].cached_tokens == len(nxt) + 1


@pytest.mark.parametrize("mode", ["kv", "ids"])
def test_a_migrated_trajectory_continues_exactly_as_without_migration(model_dir, mode) -> None:
    """Turns 0-1 on instance A, turns 2-3 on instance B: with B given A's KV (``kv``) or only A's ids
    (``ids``: B re-prefills), every token and log-prob equals a run that never moved."""
    a, b, alone = HFRolloutEngine(model_dir), HFRolloutEngine(model_dir), HFRolloutEngine(model_dir)
    prompts = [[2, *range(20, 45)], [2, *range(60, 70)]]
    sessions = ["m0", "m1"]

    class Moving:  # turns 0-1 on a; before turn 2 each context moves to b over the wire format
        def __init__(self) -> None:
            self.turn = 0

        def generate(self, reqs, sessions):
            if self.turn == 2:
                for s in sessions:
                    tensors, meta = pack_context(a.context(s), with_kv=mode == "kv")
                    header, chunks = pack_state_dict(tensors, metadata=meta)
                    sd, hdr = unpack_state_dict(header, chunks)
                    b.import_context(s, unpack_context(sd, hdr.metadata))
            eng = a if self.turn < 2 else b
            self.turn += 1
            return eng.generate(reqs, sessions)

    mover = Moving()
    moved = run_turns([mover] * 4, sessions, prompts)
    still = run_turns([alone] * 4, sessions, prompts)
    for tm, ts in zip(moved, still):
        for x, y in zip(tm, ts):
            assert x.token_ids == y.token_ids
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
    cached_on_b = [r.cached_tokens for r in moved[2]]
    if mode == "kv":
        assert all(c > 0 for c in cached_on_b)  # B continued from A's KV
    else:
        assert cached_on_b == [0, 0]  # B re-prefilled from the ids
    assert all(r.cached_tokens > 0 for r in moved[3])  # and sticks on B from then on
