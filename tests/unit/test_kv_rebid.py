"""Re-bids by KV use: the actor core re-bids when its KV credit moves past the threshold (not below it), the
broker's credit follows a re-bid (and a re-bid never ends a directive's drain), and the readers of HF's KV cache
and vLLM's scheduler gauges (a stand-in ``LLM``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from libra.actors.rollout_role import attach_kv_reports
from libra.actors.state import (ActorIdentity, ActorState, KvUse, Received, Reconfigured, SendMsg, Start, kv_credit)
from libra.broker.events import PeerMessage, Send
from libra.broker.state import BrokerConfig, BrokerState
from libra.engines.kv_cache import ContextEntry, KVCache
from libra.engines.kv_use import engine_kv_use, vllm_kv_use
from libra.protocol import messages as m
from libra.protocol.payloads_rollout import ContextDigest


def ready(capacity: int = 10, threshold: float = 0.1) -> ActorState:
    ident = ActorIdentity("h/gpu0", "h", "gpu0", 1, {"generate": ["default"]})
    a = ActorState(ident, ["generate"], capacity, kv_rebid_threshold=threshold)
    a.handle(Start(), 0.0)
    a.handle(Received(m.Welcome("s", "b", 1.0, 3, 1 << 20)), 0.0)
    return a


def bids(out: list) -> list[m.Bid]:
    return [c.msg for c in out if isinstance(c, SendMsg) and isinstance(c.msg, m.Bid)]


def test_kv_credit_is_the_sequences_of_the_current_size_that_fit() -> None:
    assert kv_credit(0.0, 0, 10) == 10  # nothing held: no size to go by
    assert kv_credit(0.5, 2, 10) == 4  # 2 contexts fill half: 4 fit
    assert kv_credit(1.0, 3, 10) == 3
    assert kv_credit(0.1, 5, 10) == 10  # capped by the batch size
    assert kv_credit(1.0, 0, 10) == 10
    with pytest.raises(ValueError, match="used"):
        KvUse(1.5, 1)
    with pytest.raises(ValueError, match="seqs"):
        KvUse(0.5, -1)
    with pytest.raises(ValueError, match="kv_rebid_threshold"):
        ready(threshold=2.0)


def test_the_actor_rebids_when_the_credit_crosses_the_threshold_and_not_below_it() -> None:
    a = ready(capacity=10, threshold=0.1)  # re-bid on a move of more than 1 sequence
    assert bids(a.handle(KvUse(0.1, 1), 1.0)) == []  # credit 10: unchanged
    assert bids(a.handle(KvUse(1.0, 9), 1.1)) == []  # credit 9: a move of 1 is not more than 10%
    (b,) = bids(a.handle(KvUse(1.0, 8), 1.2))  # credit 8: a move of 2
    assert (b.kinds, b.capacity, b.rebid) == (["generate"], 8, True) and a.capacity == 8
    assert bids(a.handle(KvUse(1.0, 7), 1.3)) == []  # 8 -> 7: below the threshold again
    (b,) = bids(a.handle(KvUse(0.25, 1), 1.4))  # contexts shrank: 4 fit
    assert b.capacity == 4
    (b,) = bids(a.handle(KvUse(0.0, 0), 1.5))  # all gone: back to the batch size
    assert b.capacity == 10 and a.rebids == 3


def test_no_rebid_while_draining_and_a_switch_resets_the_credit() -> None:
    a = ready(capacity=10, threshold=0.0)
    bids(a.handle(KvUse(1.0, 2), 1.0))
    assert a.capacity == 2
    a.handle(Received(m.Directive(7, ["generate"], "finish", {"role": "rollout", "tp": 1})), 2.0)
    assert bids(a.handle(KvUse(1.0, 5), 2.1)) == []  # draining: the switch ends in its own bid
    (b,) = bids(a.handle(Reconfigured(7), 2.2))
    assert b.capacity == 10 and not b.rebid  # a new role: the credit starts afresh


def test_attach_kv_reports_reads_the_threshold_and_wires_rollout_roles() -> None:
    from libra.actors.rollout_role import RolloutRole

    role = RolloutRole.__new__(RolloutRole)  # no engine or batcher: only the hook is wired here
    role.on_kv_use = None
    posted: list = []
    a = ready()
    assert attach_kv_reports({("generate", "*"): role.generate}, posted.append, a, {"LIBRA_KV_REBID_THRESHOLD": "0.25"}) == 1
    assert a.kv_rebid_threshold == 0.25
    role.on_kv_use(0.5, 3)
    assert posted == [KvUse(0.5, 3)]
    from libra.actors.roles import HybridRole

    hybrid = HybridRole.__new__(HybridRole)  # the default GPU role: it hands the hook to each engine it builds
    hybrid.on_kv_use = None
    assert attach_kv_reports({("generate", "*"): hybrid.generate, ("train", "grpo"): hybrid.train}, posted.append,
                             a, {}) == 1
    hybrid.on_kv_use(1.0, 2)
    assert posted[-1] == KvUse(1.0, 2) and a.kv_rebid_threshold == 0.1
    with pytest.raises(ValueError, match="within"):
        attach_kv_reports({}, posted.append, a, {"LIBRA_KV_REBID_THRESHOLD": "3"})
    with pytest.raises(ValueError, match="not a number"):
        attach_kv_reports({}, posted.append, a, {"LIBRA_KV_REBID_THRESHOLD": "lots"})


def _broker_with_actor(capacity: int) -> tuple[BrokerState, float]:
    s = BrokerState(BrokerConfig(heartbeat_s=1.0, liveness=3))
    s.handle(PeerMessage(b"c", m.ClientHello("client", 1)), 0.0)
    s.handle(PeerMessage(b"a", m.ActorHello("h/gpu0", "h", "gpu0", 1, {"generate": ["*"]}, ["generate"], capacity)), 0.0)
    s.handle(PeerMessage(b"a", m.Bid(["generate"], capacity)), 0.0)
    return s, 0.0


def _assigned(out: list) -> list[m.Assign]:
    return [c.msg for c in out if isinstance(c, Send) and isinstance(c.msg, m.Assign)]


def test_the_broker_credit_follows_a_rebid() -> None:
    s, now = _broker_with_actor(4)
    sess = s.actors[b"a"]
    s.handle(PeerMessage(b"a", m.Bid(["generate"], 1, True)), now)  # KV nearly full: one sequence fits
    assert sess.capacity == 1
    out = []
    for i in range(3):
        out += s.handle(PeerMessage(b"c", m.Submit(f"r{i}", "generate", "", {"prompt_ids": [1, 2]}, f"t{i}", 60.0)), now)
    assert len(_assigned(out)) == 1 and len(sess.held) == 1  # the credit, not the slot count, bounds dispatch
    out = s.handle(PeerMessage(b"a", m.Bid(["generate"], 3, True)), now)  # contexts freed: more credit
    assert len(_assigned(out)) == 2 and len(sess.held) == 3
    s.validate()


def test_a_rebid_never_ends_a_directive_drain() -> None:
    s, now = _broker_with_actor(4)
    s.direct("h/gpu0", ["generate"], now, config={"role": "rollout", "tp": 1})
    sess = s.actors[b"a"]
    s.handle(PeerMessage(b"a", m.Bid(["generate"], 2, True)), now)  # sent before the actor saw the directive
    assert sess.directive is not None and sess.capacity == 4
    s.handle(PeerMessage(b"a", m.Bid(["generate"], 4)), now)  # the drain's own bid
    assert sess.directive is None


def _entry(n_tokens: int) -> ContextEntry:
    ids = list(range(n_tokens))
    from array import array

    kv = ((torch.zeros(1, 1, n_tokens, 4), torch.zeros(1, 1, n_tokens, 4)),)
    return ContextEntry(array("I", ids), ContextDigest(ids), kv, n_tokens, 0)


def test_hf_reading_follows_the_kv_cache_as_contexts_grow() -> None:
    per_token = 2 * 4 * 4 + 4  # K and V of 4 float32 values, plus the id
    cache = KVCache(100 * per_token)
    engine = SimpleNamespace(kv_cache=cache)
    assert engine_kv_use(engine) == (0.0, 0)
    cache.put("t1", _entry(10))
    cache.put("t2", _entry(10))
    assert engine_kv_use(engine) == pytest.approx((0.2, 2))
    cache.put("t1", _entry(40))
    cache.put("t2", _entry(40))
    used, seqs = engine_kv_use(engine)  # type: ignore[misc]
    assert seqs == 2 and used == pytest.approx(0.8)
    assert kv_credit(used, seqs, 8) == 2  # the credit drops as the contexts grow


class _Metric:
    def __init__(self, name: str, value: object) -> None:
        self.name, self.value = name, value


def test_vllm_reader_takes_the_scheduler_gauges_of_a_stand_in_llm() -> None:
    v1 = SimpleNamespace(get_metrics=lambda: [_Metric("vllm:num_requests_running", 6),
                                              _Metric("vllm:kv_cache_usage_perc", 0.75),
                                              _Metric("vllm:prompt_tokens_total", 1000)])
    assert vllm_kv_use(v1) == (0.75, 6)
    v0 = SimpleNamespace(get_metrics=lambda: [_Metric("vllm:gpu_cache_usage_perc", 0.5)])
    assert vllm_kv_use(v0) == (0.5, 0)
    assert engine_kv_use(SimpleNamespace(llm=v1)) == (0.75, 6)
    assert vllm_kv_use(SimpleNamespace()) is None  # no metrics API
    assert vllm_kv_use(SimpleNamespace(get_metrics=lambda: [_Metric("vllm:kv_cache_usage_perc", "n/a")])) is None

    def broken() -> list:
        raise RuntimeError("stats disabled")

    assert vllm_kv_use(SimpleNamespace(get_metrics=broken)) is None
    assert engine_kv_use(SimpleNamespace(kv_use=lambda: (2.0, 3))) == (1.0, 3)  # a stand-in engine, clamped
