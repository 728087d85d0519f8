"""GRPO maths (libra.engines.grpo) against an independent, loop-based reference implementation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.engines.grpo import group_advantages, grpo_loss, k3_kl, token_logprobs

# ---------------------------------------------------------------------------------------------
# Reference implementations: plain Python loops over sequences and tokens, scalar torch ops only.
# ---------------------------------------------------------------------------------------------


def ref_advantages(rewards: list[float], groups: list[int], scale: bool, eps: float) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        mean = sum(members) / len(members)
        if not scale:
            out.append(r - mean)
            continue
        var = sum((m - mean) ** 2 for m in members) / max(len(members) - 1, 1)
        out.append((r - mean) / (math.sqrt(var) + eps))
    return out


def ref_loss(lp, old, adv, mask, *, clip_low, clip_high, ref=None, kl_coef=0.0, aggregation="token_mean", norm=None):
    """Loop over sequences b and tokens t; returns a scalar tensor built from scalar ops."""
    bsz, width = lp.shape
    seq_losses = []
    total = lp.new_zeros(())
    count = 0
    for b in range(bsz):
        seq_total = lp.new_zeros(())
        seq_count = 0
        for t in range(width):
            if mask[b][t] == 0:
                continue
            a = adv[b] if adv.ndim == 1 else adv[b, t]
            ratio = torch.exp(lp[b, t] - old[b, t])
            lo, hi = 1.0 - clip_low, 1.0 + clip_high
            clipped_ratio = torch.clamp(ratio, lo, hi)
            term = -torch.minimum(ratio * a, clipped_ratio * a)
            if kl_coef > 0:
                diff = ref[b, t] - lp[b, t]
                term = term + kl_coef * (torch.exp(diff) - diff - 1.0)
            seq_total = seq_total + term
            seq_count += 1
        total = total + seq_total
        count += seq_count
        if seq_count:
            seq_losses.append(seq_total / seq_count)
    if aggregation == "token_mean":
        return total / (norm if norm is not None else count)
    return sum(seq_losses) / (norm if norm is not None else len(seq_losses))


def fixed_batch(seed: int = 0, bsz: int = 5, width: int = 9):
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(bsz, width, generator=gen, dtype=torch.float64) * 3 - 0.05
    old = lp + 0.4 * torch.randn(bsz, width, generator=gen, dtype=torch.float64)  # ratios well past the clip
    ref = lp + 0.3 * torch.randn(bsz, width, generator=gen, dtype=torch.float64)
    adv = torch.randn(bsz, generator=gen, dtype=torch.float64)
    mask = (torch.rand(bsz, width, generator=gen) > 0.35).to(torch.float64)
    mask[:, 0] = 0
    mask[2] = 0  # a sequence with no generated tokens at all
    mask[3, 1:4] = 1
    return lp, old, ref, adv, mask


# ---------------------------------------------------------------------------------------------


def test_group_advantages_match_reference_for_interleaved_groups():
    rewards = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 2.0, 1.0, 3.0]
    groups = [7, 3, 7, 3, 7, 3, 9, 9, 5]  # non-contiguous groups and a singleton (5)
    for scale in (True, False):
        got = group_advantages(rewards, groups, scale_by_std=scale, eps=1e-6).tolist()
        want = ref_advantages(rewards, groups, scale, 1e-6)
        assert got == pytest.approx(want, abs=1e-6)
    assert group_advantages(rewards, groups)[8].item() == 0.0  # singleton group


def test_group_advantages_all_equal_rewards_give_zero():
    adv = group_advantages([1.0, 1.0, 1.0, 1.0], [0, 0, 0, 0])
    assert torch.equal(adv, torch.zeros(4))


@given(
    st.lists(st.tuples(st.floats(-10, 10), st.integers(0, 3)), min_size=1, max_size=24),
    st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_group_advantages_property(rows, scale):
    rewards = [r for r, _ in rows]
    groups = [g for _, g in rows]
    got = group_advantages(rewards, groups, scale_by_std=scale).tolist()
    want = ref_advantages(rewards, groups, scale, 1e-6)
    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-3)


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="equal length"):
        group_advantages([1.0, 2.0], [0])
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")], [0, 0])


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.2, 0.28)])
def test_loss_and_gradients_match_loop_reference(aggregation, kl_coef, clip):
    lp, old, ref, adv, mask = fixed_batch()
    lp_a = lp.clone().requires_grad_(True)
    out = grpo_loss(
        lp_a, old, adv, mask, clip_low=clip[0], clip_high=clip[1],
        ref_logprobs=ref, kl_coef=kl_coef, aggregation=aggregation,
    )
    out.loss.backward()

    lp_b = lp.clone().requires_grad_(True)
    want = ref_loss(lp_b, old, adv, mask, clip_low=clip[0], clip_high=clip[1], ref=ref,
                    kl_coef=kl_coef, aggregation=aggregation)
    want.backward()

    assert out.loss.item() == pytest.approx(want.item(), abs=1e-5)
    assert torch.allclose(lp_a.grad, lp_b.grad, atol=1e-5, rtol=0)
    assert torch.all(lp_a.grad[mask == 0] == 0)  # prompt/tool/padding tokens get no gradient
    assert out.num_tokens == int(mask.sum())
    # the batch really exercises both branches of the clip
    assert 0 < out.clipped_tokens < out.num_tokens


def test_gradients_through_logits_match_reference():
    gen = torch.Generator().manual_seed(3)
    bsz, width, vocab = 3, 6, 11
    logits = torch.randn(bsz, width, vocab, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, vocab, (bsz, width), generator=gen)
    old = -torch.rand(bsz, width, generator=gen, dtype=torch.float64) * 3
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.ones(bsz, width, dtype=torch.float64)
    mask[1, 3:] = 0

    la = logits.clone().requires_grad_(True)
    lp = token_logprobs(la, targets).double()
    grpo_loss(lp, old, adv, mask).loss.backward()

    lb = logits.clone().requires_grad_(True)
    rows = []
    for b in range(bsz):
        row = []
        for t in range(width):
            z = lb[b, t]
            row.append(z[targets[b, t]] - torch.log(torch.sum(torch.exp(z))))
        rows.append(torch.stack(row))
    lp_ref = torch.stack(rows)
    ref_loss(lp_ref, old, adv, mask, clip_low=0.2, clip_high=0.2).backward()
    assert torch.allclose(la.grad, lb.grad, atol=1e-5, rtol=0)


def test_micro_batches_with_global_normalizer_sum_to_whole_batch():
    lp, old, ref, adv, mask = fixed_batch(seed=5, bsz=6)
    whole = lp.clone().requires_grad_(True)
    grpo_loss(whole, old, adv, mask, ref_logprobs=ref, kl_coef=0.1).loss.backward()

    parts = lp.clone().requires_grad_(True)
    total_tokens = float(mask.sum())
    summed = 0.0
    for idx in ([0, 4], [1, 2, 5], [3]):
        i = torch.tensor(idx)
        out = grpo_loss(parts[i], old[i], adv[i], mask[i], ref_logprobs=ref[i], kl_coef=0.1,
                        normalizer=total_tokens)
        out.loss.backward()
        summed += out.loss.item()
    whole_loss = grpo_loss(lp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1).loss.item()
    assert summed == pytest.approx(whole_loss, abs=1e-10)
    assert torch.allclose(parts.grad, whole.grad, atol=1e-12)


def test_per_token_advantages_equal_broadcast_sequence_advantages():
    lp, old, _, adv, mask = fixed_batch(seed=9)
    a = grpo_loss(lp, old, adv, mask).loss
    b = grpo_loss(lp, old, adv[:, None].expand_as(lp), mask).loss
    assert a.item() == pytest.approx(b.item(), abs=1e-12)


def test_on_policy_loss_is_minus_mean_advantage():
    # ratio == 1 everywhere: the surrogate is the advantage itself, nothing is clipped.
    lp, _, _, adv, mask = fixed_batch(seed=11)
    out = grpo_loss(lp, lp.clone(), adv, mask)
    want = -(adv[:, None] * mask).sum() / mask.sum()
    assert out.loss.item() == pytest.approx(want.item(), abs=1e-12)
    assert out.clipped_tokens == 0
    assert out.ratio_sum == pytest.approx(float(mask.sum()))


def test_k3_is_non_negative_and_zero_on_policy():
    gen = torch.Generator().manual_seed(1)
    lp = -torch.rand(1000, generator=gen) * 5
    ref = -torch.rand(1000, generator=gen) * 5
    assert torch.all(k3_kl(lp, ref) >= 0)
    assert torch.all(k3_kl(lp, lp) == 0)


def test_grpo_loss_rejects_bad_input():
    lp, old, _, adv, mask = fixed_batch()
    with pytest.raises(ValueError, match="must all be"):
        grpo_loss(lp, old[:, :-1], adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(lp, old, adv[:-1], mask)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="unknown aggregation: 'sum'"):
        grpo_loss(lp, old, adv, mask, aggregation="sum")  # type: ignore[arg-type]
