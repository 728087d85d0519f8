"""Next-token sampling for the HF rollout engine: greedy, temperature and nucleus (top-p) rows in one batch,
each row drawing its uniform number from its own CPU generator (so a request's seed fixes its tokens whatever
else shares the batch), and the log-probs RL needs: the policy's at temperature 1 and the sampled
distribution's.

On a GPU every read of a device value on the host waits for the queued kernels; the engine passes the rows'
greedy flags and whether any row uses top-p from the requests it already holds (``greedy_rows``, ``nucleus``),
so a decode step reads the device once (the engine's one ``tolist``) instead of once per row. Seen on an H100
at batch 32 (Qwen2-0.5B shape): 0.755x ``model.generate``'s tokens/s with a read per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["sample_next_tokens"]


def sample_next_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    generators: Sequence[torch.Generator],
    *,
    greedy_rows: Sequence[bool] | None = None,
    nucleus: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` [B, V] (float32).

    Row ``b`` is greedy (argmax) if ``temperatures[b] == 0``; otherwise it is drawn from
    ``softmax(logits[b] / temperatures[b])`` restricted to the smallest top-probability set whose mass
    reaches ``top_ps[b]`` (always at least one token), by inverse-CDF with one uniform number from
    ``generators[b]`` (a CPU generator). Returns ``(tokens [B] long, policy_logprobs [B],
    sampling_logprobs [B])``: ``policy_logprobs`` is ``log_softmax(logits)`` at the chosen token
    (temperature 1, full vocabulary); ``sampling_logprobs`` is the log-prob under the distribution
    actually sampled from (``0.0`` for greedy rows). ``greedy_rows`` (``temperatures[b] <= 0`` per row) and
    ``nucleus`` (any ``top_ps[b] < 1``), when the caller knows them on the host, save reading the tensors.
    """
    bsz, vocab = logits.shape
    policy_lp = torch.log_softmax(logits, dim=-1)
    greedy = temperatures <= 0
    if greedy_rows is None:
        greedy_rows = greedy.tolist()
    if nucleus is None:
        nucleus = bool((top_ps < 1.0).any())
    tokens = torch.argmax(logits, dim=-1)
    sampling_lp = torch.zeros(bsz, dtype=torch.float32, device=logits.device)
    if all(greedy_rows):
        return tokens, policy_lp.gather(1, tokens[:, None]).squeeze(1), sampling_lp
    temps = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    if nucleus:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= top_ps[:, None]  # the first token always has mass_before == 0
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    uniforms = torch.tensor(
        [0.0 if greedy_rows[b] else float(torch.rand((), generator=g)) for b, g in enumerate(generators)],
        dtype=probs.dtype,
        device=probs.device,
    )
    cdf = torch.cumsum(probs, dim=-1)
    targets = uniforms * cdf[:, -1]
    # right=True: first index with cdf > target, so zero-probability tokens can never be chosen.
    drawn = torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1).clamp_(max=vocab - 1)
    tokens = torch.where(greedy, tokens, drawn)
    chosen_p = probs.gather(1, tokens[:, None]).squeeze(1)
    sampling_lp = torch.where(greedy, sampling_lp, torch.log(chosen_p))
    return tokens, policy_lp.gather(1, tokens[:, None]).squeeze(1), sampling_lp
