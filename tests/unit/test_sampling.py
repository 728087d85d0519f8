"""The HF engine's sampler (libra/engines/sampling.py): the rows' greedy and top-p flags given from the host
pick exactly what reading them from the tensors picks, and a decode step reads the device a fixed number of times
whatever the batch size (on a GPU each read waits for the queued kernels; with one read per row, batch 32 of a
Qwen2-0.5B shape ran at 0.755x ``model.generate`` on an H100)."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from libra.engines.hf_rollout import HFRolloutEngine
from libra.engines.rollout_base import GenRequest
from libra.engines.sampling import sample_next_tokens
from libra.engines.tiny_model import ensure_tiny_model


def _gens(n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(100 + k) for k in range(n)]


def test_host_flags_pick_what_the_tensors_pick_in_a_mixed_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    temps = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 1.0])
    top_ps = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.8, 1.0])
    read = sample_next_tokens(logits, temps, top_ps, _gens(6))
    told = sample_next_tokens(logits, temps, top_ps, _gens(6), greedy_rows=(temps <= 0).tolist(), nucleus=True)
    for a, b in zip(read, told):
        assert torch.equal(a, b)
    assert read[0][0] == logits[0].argmax() and read[0][3] == logits[3].argmax()  # the greedy rows
    assert bool((read[2][[1, 2, 4, 5]] < 0).all()) and bool((read[2][[0, 3]] == 0).all())  # sampling log-probs


def test_all_greedy_rows_skip_the_draw() -> None:
    logits = torch.randn(3, 20)
    tok, lp, slp = sample_next_tokens(logits, torch.zeros(3), torch.ones(3), _gens(3), greedy_rows=[True] * 3,
                                      nucleus=False)
    assert torch.equal(tok, logits.argmax(-1)) and torch.equal(slp, torch.zeros(3))
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1))


@contextmanager
def _count_reads() -> Iterator[collections.Counter]:
    """Count the host's reads of tensor values (``bool``, ``tolist``, ``item``)."""
    counts: collections.Counter = collections.Counter()
    orig = {n: getattr(torch.Tensor, n) for n in ("__bool__", "tolist", "item")}

    def wrap(name):
        fn = orig[name]

        def counted(self, *a, **k):
            counts[name] += 1
            return fn(self, *a, **k)
        return counted

    for n in orig:
        setattr(torch.Tensor, n, wrap(n))
    try:
        yield counts
    finally:
        for n, fn in orig.items():
            setattr(torch.Tensor, n, fn)


def test_a_decode_step_reads_the_device_as_often_at_batch_8_as_at_batch_2() -> None:
    eng = HFRolloutEngine(str(ensure_tiny_model()), device="cpu", max_batch_size=8)

    def reads(batch: int) -> int:
        reqs = [GenRequest(prompt_ids=[5, 6, 7, 8], max_new_tokens=6, seed=k, temperature=1.0 if k % 2 else 0.0)
                for k in range(batch)]
        eng.generate(reqs)  # warm
        with _count_reads() as counts:
            out = eng.generate(reqs)
        assert all(len(r.token_ids) == 6 for r in out)
        return sum(counts.values())

    small, large = reads(2), reads(8)
    assert large == small, (small, large)  # with a read per row, batch 8 made 84 reads in 6 tokens
    assert large <= 2 * 6  # at most two reads a token: the engine's one tolist, and one the model makes
