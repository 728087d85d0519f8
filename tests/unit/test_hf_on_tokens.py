"""HFRolloutEngine.generate's ``on_tokens`` hook (what the serving process streams and times per token): one
call per sampling step, each request's tokens in order and equal to its result, across split batches."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from libra.engines.hf_rollout import HFRolloutEngine  # noqa: E402
from libra.engines.rollout_base import GenRequest  # noqa: E402
from libra.engines.tiny_model import ensure_tiny_model  # noqa: E402


def test_on_tokens_reports_every_token_of_every_request_in_order() -> None:
    eng = HFRolloutEngine(ensure_tiny_model(), max_batch_size=2)  # three requests: two batches
    reqs = [GenRequest([5, 6, 7], 4, seed=1), GenRequest([9] * 6, 2, seed=2), GenRequest([11, 12], 3, seed=3)]
    steps: list[list[tuple[int, int]]] = []
    results = eng.generate(reqs, on_tokens=steps.append)
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for step in steps:
        assert len({i for i, _ in step}) == len(step)  # one token per request per step
        for i, tok in step:
            seen[i].append(tok)
    assert [seen[i] for i in range(3)] == [r.token_ids for r in results]
    assert len(steps) == 4 + 2  # shortest prompts first: (req 2, req 0) for 4 steps, then (req 1) for 2
    assert eng.generate(reqs) == results  # no hook: the same results
