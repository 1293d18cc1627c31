"""gspo.py: hand-computed values, the formula as written, padding, garbage, micro-batching and GSPO-token."""
# Bounds: two computations of a loss or gradient here are float64 (torch's default 1e-7 is over 1e6 times
# K u64 max|x| for K <= 72 terms); float32 metrics use pytest.approx's rel 1e-6 = 17 u = 2 sqrt(K) u at K = 72.

import math

import pytest
import torch

import gspo as algo  # every test file names its algorithm `algo`, so that they diff line for line


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


def near(old: torch.Tensor, scale: float, seed: int = 0) -> torch.Tensor:
    """logprobs within about `scale` of old, with grad: GSPO's clip range is tiny, so test near it."""
    gen = torch.Generator().manual_seed(seed)
    return (old + scale * torch.randn(old.shape, generator=gen, dtype=torch.float64)).requires_grad_()


def reference_loss(logprobs, old, adv, mask, clip_eps_low=3e-4, clip_eps_high=4e-4, kl_coef=0.0, ref=None,
                   is_weights=None):
    """GSPO as written, one completion at a time: s_i = exp(mean_t log ratio), one clipped term per sequence, plus
    each token's KL, times the mean of its is_weights (gspo.py's documented choice), then the mean over sequences."""
    n, t_max = logprobs.shape
    total = 0.0
    for i in range(n):
        tokens = [t for t in range(t_max) if mask[i, t]]
        s = torch.exp(sum(logprobs[i, t] - old[i, t] for t in tokens) / len(tokens))  # the MEAN, not the sum
        seq = -torch.minimum(s * adv[i], torch.clamp(s, 1 - clip_eps_low, 1 + clip_eps_high) * adv[i])
        seq_total = 0.0
        for t in tokens:  # the sequence term sits on every token, beside that token's KL
            term = seq
            if ref is not None:
                x = ref[i, t] - logprobs[i, t]
                term = term + kl_coef * (torch.exp(x) - x - 1)
            if is_weights is not None:
                term = term * is_weights[i, t]
            seq_total = seq_total + term
        total = total + seq_total / len(tokens)
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
    # Completion 0 (A = -1): token log-ratios 0.1 and -0.1, so s_0 = exp(0) = 1, inside the clip range.
    # Completion 1 (A = +1): log-ratios 0.3 and 0.1 and a masked slot, s_1 = exp(0.2) = 1.22 (the MEAN: a sum would
    # give exp(0.4)), clipped to 1 + 4e-4.
    old = torch.zeros(2, 3, dtype=torch.float64)
    logprobs = torch.tensor([[0.1, -0.1, 5.0], [0.3, 0.1, 9.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, False]])
    adv = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    loss, m = algo.compute_loss(logprobs, old, adv, mask, group_size=2)
    # Completion 0: -s_0 A_0 = 1. Completion 1: -(1 + 4e-4). Mean over completions.
    assert loss.item() == pytest.approx((1.0 - 1.0004) / 2)
    # Completion 1 is clipped: no gradient. Completion 0: d(-s_0 A_0)/dlogp_t = -A_0 s_0 / (|y_0| N) = 1 / 4.
    torch.testing.assert_close(
        grad_of(loss, logprobs), torch.tensor([[0.25, 0.25, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    )
    assert m["clip_frac"] == 0.5  # of sequences
    assert m["clip_frac_low"] == 0.0
    assert m["clip_frac_high"] == 0.5
    assert m["ratio_mean"] == pytest.approx((1.0 + math.exp(0.2)) / 2)
    assert m["kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in (0.1, -0.1, 0.3, 0.1)) / 4)
    assert m["num_tokens"] == 4.0
    assert all(isinstance(v, float) for v in m.values())


def test_sequence_ratio_is_a_mean_so_it_does_not_grow_with_length():
    """The same log-ratios repeated twice give the same s_i: the clip range does not depend on the length."""
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    log_ratios = torch.tensor([[1e-4, 2e-4, 1e-4, 2e-4], [1e-4, 2e-4, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    _, m = algo.compute_loss(log_ratios, torch.zeros_like(log_ratios), adv, mask, 2)
    assert m["ratio_mean"] == pytest.approx(math.exp(1.5e-4))
    assert m["clip_frac"] == 0.0  # a sum (6e-4 and 3e-4) would clip the longer one


def test_matches_the_formula_as_written():
    logprobs, old, rewards, mask = random_batch()
    logprobs = near(old, 2e-3)
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


def test_gspo_token_equals_gspo_with_per_sequence_advantages():
    logprobs, old, rewards, mask = random_batch(seed=1)
    logprobs = near(old, 2e-3)
    adv = algo.compute_advantages(rewards, 4).double()
    seq, seq_m = algo.compute_loss(logprobs, old, adv, mask, 4)
    tok, tok_m = algo.compute_loss(logprobs, old, adv, mask, 4, token_level=True)
    # The same per-sequence advantage written on every token is the same thing.
    tok_2d, _ = algo.compute_loss(logprobs, old, adv[:, None].expand(mask.shape), mask, 4, token_level=True)
    torch.testing.assert_close(tok, seq)
    torch.testing.assert_close(tok_2d, seq)
    seq_grad = grad_of(seq, logprobs)
    torch.testing.assert_close(grad_of(tok, logprobs), seq_grad)
    torch.testing.assert_close(grad_of(tok_2d, logprobs), seq_grad)
    assert tok_m == pytest.approx(seq_m) and 0 < seq_m["clip_frac"] < 1


@pytest.mark.parametrize("token_level", [False, True])
def test_right_padding_changes_nothing(token_level):
    logprobs, old, rewards, mask = random_batch(seed=2)
    adv = algo.compute_advantages(rewards, 4)
    loss, m = algo.compute_loss(logprobs, old, adv, mask, 4, token_level=token_level)
    padded = torch.cat([logprobs, torch.randn(logprobs.shape[0], 3, dtype=torch.float64)], dim=1)
    padded_old = torch.cat([old, torch.randn(old.shape[0], 3, dtype=torch.float64)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(mask.shape[0], 3, dtype=torch.bool)], dim=1)
    padded_loss, padded_m = algo.compute_loss(padded, padded_old, adv, padded_mask, 4, token_level=token_level)
    torch.testing.assert_close(padded_loss, loss)
    torch.testing.assert_close(grad_of(padded_loss, padded)[:, : mask.shape[1]], grad_of(loss, logprobs))
    assert padded_m == pytest.approx(m)


@pytest.mark.parametrize("token_level", [False, True])
def test_garbage_in_masked_slots_changes_nothing(token_level):
    logprobs, old, rewards, mask = random_batch(seed=3)
    adv = algo.compute_advantages(rewards, 4)
    ref = old - 0.1
    w = torch.rand(mask.shape, dtype=torch.float64)
    loss, m = algo.compute_loss(logprobs, old, adv, mask, 4, is_weights=w, kl_coef=0.04, ref_logprobs=ref,
                                token_level=token_level)
    dirty = with_garbage(logprobs, mask).requires_grad_()
    dirty_loss, dirty_m = algo.compute_loss(
        dirty, with_garbage(old, mask), adv, mask.float(), 4,
        is_weights=with_garbage(w, mask),
        kl_coef=0.04, ref_logprobs=with_garbage(ref, mask),
        token_level=token_level,
    )
    torch.testing.assert_close(dirty_loss, loss)
    dirty_grad = grad_of(dirty_loss, dirty)
    assert torch.isfinite(dirty_grad).all() and (dirty_grad[~mask] == 0).all()
    torch.testing.assert_close(dirty_grad, grad_of(loss, logprobs))
    assert dirty_m == pytest.approx(m)


def test_garbage_in_masked_slots_of_per_token_advantages_changes_nothing():
    logprobs, old, rewards, mask = random_batch(seed=3)
    adv = algo.compute_advantages(rewards, 4)
    adv_2d = with_garbage(adv[:, None].expand(mask.shape).double(), mask)
    dirty_loss, _ = algo.compute_loss(logprobs, old, adv_2d, mask, 4, token_level=True)
    torch.testing.assert_close(dirty_loss, algo.compute_loss(logprobs, old, adv, mask, 4)[0])


def test_micro_batches_sum_to_the_full_batch():
    logprobs, old, rewards, mask = random_batch(num_prompts=4, seed=4)
    logprobs = near(old, 2e-3)
    adv = algo.compute_advantages(rewards, 4)
    full, _ = algo.compute_loss(logprobs, old, adv, mask, 4)
    full_grad = grad_of(full, logprobs)
    denominator = algo.loss_denominator(mask, 4, clip_eps_low=3e-4, clip_eps_high=4e-4)
    assert denominator == 16.0  # completions
    total, total_grad = 0.0, torch.zeros_like(full_grad)
    for rows in (slice(0, 4), slice(4, 16)):  # split on group boundaries, unevenly
        part = logprobs.detach()[rows].requires_grad_()
        loss, _ = algo.compute_loss(part, old[rows], adv[rows], mask[rows], 4, denominator=denominator)
        total = total + loss.detach()
        total_grad[rows] = grad_of(loss, part)
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(total_grad, full_grad)


def test_gspo_token_lets_per_token_advantages_flow():
    """Unclipped, token t of completion i gets -w_{i,t} A_{i,t} s_i / (|y_i| N): its own advantage (and is_weight)
    times the sequence ratio."""
    logprobs, old, _, mask = random_batch(seed=2)
    logprobs = near(old, 1e-5)  # nothing clipped
    adv = torch.randn(mask.shape, dtype=torch.float64)
    w = torch.rand(mask.shape, dtype=torch.float64) + 0.5
    loss, m = algo.compute_loss(logprobs, old, adv, mask, 4, is_weights=w, token_level=True)
    assert m["clip_frac"] == 0.0
    lengths = mask.sum(dim=1, keepdim=True)
    s = torch.exp(torch.where(mask, logprobs - old, 0.0).sum(dim=1, keepdim=True) / lengths).detach()
    expected = torch.where(mask, -w * adv * s / lengths / mask.shape[0], 0.0)
    torch.testing.assert_close(grad_of(loss, logprobs), expected)
    with pytest.raises(ValueError):
        algo.compute_loss(logprobs, old, adv, mask, 4)  # per-token advantages need token_level=True
