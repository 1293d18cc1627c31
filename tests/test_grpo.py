"""grpo.py: hand-computed values, the formula as written, padding, garbage and micro-batching."""
# Bounds: two computations of a loss or gradient here are float64 (torch's default 1e-7 is over 1e6 times
# K u64 max|x| for K <= 72 terms); float32 metrics use pytest.approx's rel 1e-6 = 17 u = 2 sqrt(K) u at K = 72.

import math

import pytest
import torch

import grpo as algo  # every test file names its algorithm `algo`, so that they diff line for line


def random_batch(num_prompts: int = 3, group_size: int = 4, max_len: int = 6, seed: int = 0):
    """float64 logprobs [N, T] (with grad), old_logprobs [N, T], rewards [N], bool mask [N, T] of varied lengths."""
    gen = torch.Generator().manual_seed(seed)
    n = num_prompts * group_size
    lengths = torch.randint(1, max_len + 1, (n,), generator=gen)
    mask = torch.arange(max_len)[None, :] < lengths[:, None]
    old = -2 * torch.rand(n, max_len, generator=gen, dtype=torch.float64) - 0.05
    # A spread of 0.3 in log-ratio puts a good share of the tokens outside the clip range.
    logprobs = (old + 0.3 * torch.randn(n, max_len, generator=gen, dtype=torch.float64)).requires_grad_()
    rewards = torch.randint(0, 2, (n,), generator=gen).double()
    return logprobs, old, rewards, mask


def with_garbage(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x with NaN, inf and -inf in its masked slots."""
    garbage = torch.tensor([math.nan, math.inf, -math.inf], dtype=x.dtype).repeat(x.numel() // 3 + 1)[: x.numel()]
    return torch.where(mask, x.detach(), garbage.view_as(x))


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


def reference_loss(logprobs, old, adv, mask, clip_eps=0.2, kl_coef=0.0, ref=None, is_weights=None):
    """DeepSeekMath's equation as written, one completion and one token at a time."""
    n, t_max = logprobs.shape
    total = 0.0
    for i in range(n):
        length = int(mask[i].sum())
        seq = 0.0
        for t in range(t_max):
            if not mask[i, t]:
                continue
            r = torch.exp(logprobs[i, t] - old[i, t])
            term = -torch.minimum(r * adv[i], torch.clamp(r, 1 - clip_eps, 1 + clip_eps) * adv[i])
            if ref is not None:
                x = ref[i, t] - logprobs[i, t]
                term = term + kl_coef * (torch.exp(x) - x - 1)
            if is_weights is not None:
                term = term * is_weights[i, t]
            seq = seq + term
        total = total + seq / max(length, 1)
    return total / n


def test_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    adv = algo.compute_advantages(rewards, group_size=3)
    # [1, 0, 0]: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3).
    s = math.sqrt(1 / 3)
    expected = [(2 / 3) / s, -(1 / 3) / s, -(1 / 3) / s, (1 / 3) / s, (1 / 3) / s, -(2 / 3) / s, 0.0, 0.0, 0.0]
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_constant_groups_get_exactly_zero():
    # 0.7 seven times: the float32 mean is off by an ulp, so (r - mean) / std would be ulp / ulp, not 0.
    rewards = torch.tensor([0.7] * 7 + [1.0, 0.0] * 3 + [0.0])
    adv = algo.compute_advantages(rewards, group_size=7)
    assert torch.isfinite(adv).all()
    assert (adv[:7] == 0).all()
    assert (algo.compute_advantages(torch.ones(8), 4) == 0).all()


def test_bad_group_size_raises():
    with pytest.raises(ValueError):
        algo.compute_advantages(torch.ones(5), 2)


def test_aggregation_names_what_loss_denominator_counts():
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)                    # one prompt, two completions
    counts = {"prompt": 1.0, "sample": 2.0, "token": 3.0}                        # prompts, completions, tokens
    assert algo.loss_denominator(mask, 2) == counts[algo.AGGREGATION]


def test_loss_metrics_and_gradient_hand_computed():
    # Completion 0 (A = +1): ratios 1.5 (clipped high to 1.2) and 1.0. Completion 1 (A = -1): ratio 0.5 (clipped
    # low to 0.8), and one masked token.
    old = torch.zeros(2, 2, dtype=torch.float64)
    logprobs = torch.log(torch.tensor([[1.5, 1.0], [0.5, 7.0]], dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, m = algo.compute_loss(logprobs, old, adv, mask, group_size=2)
    # Completion 0: mean(-1.2, -1.0) = -1.1. Completion 1: -min(-0.5, -0.8) = 0.8. Mean over completions: -0.15.
    assert loss.item() == pytest.approx(-0.15)
    # Clipped tokens give no gradient; the one unclipped token gives -r A / (|y_0| N) = -1 / 4.
    torch.testing.assert_close(
        grad_of(loss, logprobs), torch.tensor([[0.0, -0.25], [0.0, 0.0]], dtype=torch.float64)
    )
    assert m["clip_frac"] == pytest.approx(2 / 3)
    assert m["clip_frac_low"] == pytest.approx(1 / 3)
    assert m["clip_frac_high"] == pytest.approx(1 / 3)
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["kl_k3"] == pytest.approx(((0.5 - math.log(1.5)) + 0.0 + (-0.5 - math.log(0.5))) / 3)
    assert m["num_tokens"] == 3.0
    assert all(isinstance(v, float) for v in m.values())


def test_matches_the_formula_as_written():
    logprobs, old, rewards, mask = random_batch()
    adv = algo.compute_advantages(rewards, 4).double()
    w = torch.rand(mask.shape, dtype=torch.float64) + 0.5
    loss, m = algo.compute_loss(logprobs, old, adv, mask, 4, is_weights=w)
    expected = reference_loss(logprobs, old, adv, mask, is_weights=w)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad_of(loss, logprobs), grad_of(expected, logprobs))
    assert 0 < m["clip_frac"] < 1


def test_kl_penalty_matches_the_formula():
    logprobs, old, rewards, mask = random_batch(seed=1)
    ref = old + 0.2 * torch.randn(old.shape, dtype=torch.float64)
    adv = algo.compute_advantages(rewards, 4).double()
    loss, m = algo.compute_loss(logprobs, old, adv, mask, 4, kl_coef=0.04, ref_logprobs=ref)
    expected = reference_loss(logprobs, old, adv, mask, kl_coef=0.04, ref=ref)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad_of(loss, logprobs), grad_of(expected, logprobs))
    assert m["kl_ref"] > 0
    with pytest.raises(ValueError):
        algo.compute_loss(logprobs, old, adv, mask, 4, kl_coef=0.04)


def test_right_padding_changes_nothing():
    logprobs, old, rewards, mask = random_batch(seed=2)
    adv = algo.compute_advantages(rewards, 4)
    loss, m = algo.compute_loss(logprobs, old, adv, mask, 4)
    padded = torch.cat([logprobs, torch.randn(logprobs.shape[0], 3, dtype=torch.float64)], dim=1)
    padded_old = torch.cat([old, torch.randn(old.shape[0], 3, dtype=torch.float64)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(mask.shape[0], 3, dtype=torch.bool)], dim=1)
    padded_loss, padded_m = algo.compute_loss(padded, padded_old, adv, padded_mask, 4)
    torch.testing.assert_close(padded_loss, loss)
    torch.testing.assert_close(grad_of(padded_loss, padded)[:, : mask.shape[1]], grad_of(loss, logprobs))
    assert padded_m == pytest.approx(m)


def test_garbage_in_masked_slots_changes_nothing():
    logprobs, old, rewards, mask = random_batch(seed=3)
    adv = algo.compute_advantages(rewards, 4)
    ref = old - 0.1
    w = torch.rand(mask.shape, dtype=torch.float64)
    loss, m = algo.compute_loss(logprobs, old, adv, mask, 4, is_weights=w, kl_coef=0.04, ref_logprobs=ref)
    dirty = with_garbage(logprobs, mask).requires_grad_()
    dirty_loss, dirty_m = algo.compute_loss(
        dirty, with_garbage(old, mask), adv, mask.float(), 4,
        is_weights=with_garbage(w, mask),
        kl_coef=0.04, ref_logprobs=with_garbage(ref, mask),
    )
    torch.testing.assert_close(dirty_loss, loss)
    dirty_grad = grad_of(dirty_loss, dirty)
    assert torch.isfinite(dirty_grad).all() and (dirty_grad[~mask] == 0).all()
    torch.testing.assert_close(dirty_grad, grad_of(loss, logprobs))
    assert dirty_m == pytest.approx(m)


def test_micro_batches_sum_to_the_full_batch():
    logprobs, old, rewards, mask = random_batch(num_prompts=4, seed=4)
    adv = algo.compute_advantages(rewards, 4)
    full, _ = algo.compute_loss(logprobs, old, adv, mask, 4)
    full_grad = grad_of(full, logprobs)
    denominator = algo.loss_denominator(mask, 4, clip_eps=0.2)
    assert denominator == 16.0  # completions
    total, total_grad = 0.0, torch.zeros_like(full_grad)
    for rows in (slice(0, 4), slice(4, 16)):  # split on group boundaries, unevenly
        part = logprobs.detach()[rows].requires_grad_()
        loss, _ = algo.compute_loss(part, old[rows], adv[rows], mask[rows], 4, denominator=denominator)
        total = total + loss.detach()
        total_grad[rows] = grad_of(loss, part)
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(total_grad, full_grad)


def test_on_policy_gradient_is_reinforce():
    """With ratio 1 nothing is clipped: REINFORCE with per-completion length weights, -A_i / (|y_i| N) per token."""
    logprobs, _, rewards, mask = random_batch(seed=5)
    adv = algo.compute_advantages(rewards, 4).double()
    loss, m = algo.compute_loss(logprobs, logprobs.detach(), adv, mask, 4)
    expected = -adv[:, None] / mask.sum(dim=1, keepdim=True) / mask.shape[0] * mask
    torch.testing.assert_close(grad_of(loss, logprobs), expected)
    assert m["clip_frac"] == 0.0 and m["ratio_mean"] == pytest.approx(1.0) and m["kl_k3"] == pytest.approx(0.0)
