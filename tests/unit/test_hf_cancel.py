"""Cancelling a running turn in HFRolloutEngine (``generate(..., cancelled=[...])``): the cancelled row leaves
its batch at the next decode step with ``finish_reason == "cancelled"`` and its tokens so far, keeps no context
for a next turn, and the other row of the batch runs to its full length with the tokens it draws alone."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("transformers")

from libra.engines.hf_rollout import HFRolloutEngine  # noqa: E402
from libra.engines.rollout_base import GenRequest  # noqa: E402
from libra.engines.tiny_model import ensure_tiny_model  # noqa: E402


def test_a_cancelled_row_stops_at_its_next_step_and_the_other_row_finishes() -> None:
    eng = HFRolloutEngine(ensure_tiny_model(), max_batch_size=2)
    reqs = [GenRequest([5, 6, 7], 40, seed=1), GenRequest([9, 10, 11], 12, seed=2)]
    stop = threading.Event()
    steps = 0

    def on_tokens(got: list[tuple[int, int]]) -> None:
        nonlocal steps
        steps += 1
        if steps == 3:
            stop.set()  # e.g. the broker revoked request 0's work while its third token was drawn

    a, b = eng.generate(reqs, sessions=["t0", "t1"], on_tokens=on_tokens, cancelled=[stop.is_set, None])
    assert (a.finish_reason, len(a.token_ids), len(a.logprobs)) == ("cancelled", 3, 3)
    assert (b.finish_reason, len(b.token_ids)) == ("length", 12)
    assert eng.context("t0") is None and eng.context("t1") is not None  # a cancelled turn keeps no context
    alone = HFRolloutEngine(ensure_tiny_model(), max_batch_size=2).generate([reqs[1]])[0]
    assert alone.token_ids == b.token_ids  # the batch-mate drew the same tokens
    assert a.token_ids == alone_prefix(reqs[0], 3)


def alone_prefix(req: GenRequest, n: int) -> list[int]:
    return HFRolloutEngine(ensure_tiny_model(), max_batch_size=1).generate([req])[0].token_ids[:n]


def test_cancel_checks_must_match_the_requests() -> None:
    eng = HFRolloutEngine(ensure_tiny_model(), max_batch_size=2)
    with pytest.raises(ValueError, match="cancel checks"):
        eng.generate([GenRequest([5], 2)], cancelled=[None, None])
