"""cispo.py: hand-computed values, the formula as written, padding, garbage and micro-batching, for each
aggregation, and the REINFORCE/DAPO equivalences."""
# Bounds: two computations of a loss or gradient here are float64 (torch's default 1e-7 is over 1e6 times
# K u64 max|x| for K <= 72 terms); float32 metrics use pytest.approx's rel 1e-6 = 17 u = 2 sqrt(K) u at K = 72.

import math

import pytest
import torch

import cispo as algo  # every test file names its algorithm `algo`, so that they diff line for line
import dapo

AGGREGATIONS = ("prompt", "sample", "token")

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


def reference_loss(logprobs, old, adv, mask, group_size, aggregation="prompt", eps_max=5.0, eps_min=None,
                   kl_coef=0.0, ref=None, is_weights=None):
    """ScaleRL's CISPO as written, one completion and one token at a time: -sg(clip(rho, eps_min, eps_max)) A log pi,
    each completion's token sum over its unit's tokens (its prompt, itself or the batch), then the mean over units."""
    n, t_max = logprobs.shape
    total = 0.0
    for i in range(n):
        prompt = slice(i - i % group_size, i - i % group_size + group_size)
        length = int({"prompt": mask[prompt].sum(), "sample": mask[i].sum(), "token": mask.sum()}[aggregation])
        seq = 0.0
        for t in range(t_max):
            if not mask[i, t]:
                continue
            rho = torch.exp(logprobs[i, t] - old[i, t]).detach()
            term = -torch.clamp(rho, min=eps_min, max=eps_max) * adv[i] * logprobs[i, t]
            if ref is not None:
                x = ref[i, t] - logprobs[i, t]
                term = term + kl_coef * (torch.exp(x) - x - 1)
            if is_weights is not None:
                term = term * is_weights[i, t]
            seq = seq + term
        total = total + seq / max(length, 1)
    return total / {"prompt": n // group_size, "sample": n, "token": 1}[aggregation]


def test_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    adv = algo.compute_advantages(rewards, group_size=2)
    # Centred: [.5, -.5, 0, 0, -.5, .5]; unbiased std over all six: sqrt(4 * 0.25 / 5) = sqrt(0.2).
    a = 0.5 / math.sqrt(0.2)
    torch.testing.assert_close(adv, torch.tensor([a, -a, 0.0, 0.0, -a, a]))
    # "group": each group's own std of rewards, GRPO's z-score: [1, 0] -> +-0.5 / sqrt(0.5).
    g = 0.5 / math.sqrt(0.5)
    torch.testing.assert_close(
        algo.compute_advantages(rewards, 2, normalization="group"), torch.tensor([g, -g, 0.0, 0.0, -g, g])
    )
    with pytest.raises(ValueError):
        algo.compute_advantages(rewards, 2, normalization="prompt")


def test_batch_std_is_of_centred_advantages_not_raw_rewards():
    """ScaleRL divides by the std of the centred advantages; TRL's scale_rewards="batch" by the raw rewards' std."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    adv = algo.compute_advantages(rewards, 2)
    centred_std = math.sqrt((0.25 + 0.25) / 3)  # std of [.5, -.5, 0, 0] = 0.408
    raw_std = rewards.std().item()  # std of [1, 0, 1, 1] = 0.5
    assert adv[0].item() == pytest.approx(0.5 / centred_std)
    assert adv[0].item() != pytest.approx(0.5 / raw_std)


@pytest.mark.parametrize("normalization", ["batch", "group"])
def test_constant_groups_get_exactly_zero(normalization):
    # 0.7 seven times: the float32 mean is off by an ulp, so (r - mean) / std would be ulp / ulp, not 0.
    rewards = torch.tensor([0.7] * 7 + [1.0] * 3 + [0.0] * 4)
    adv = algo.compute_advantages(rewards, group_size=7, normalization=normalization)
    assert torch.isfinite(adv).all()
    assert (adv[:7] == 0).all()
    # A batch where every group is constant has batch std 0: A = 0 everywhere, never NaN.
    assert (algo.compute_advantages(torch.ones(8), 4) == 0).all()
    assert (algo.compute_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2) == 0).all()
    assert (algo.compute_advantages(torch.tensor([0.7] * 7), 7) == 0).all()  # and an ulp-off mean


def test_bad_group_size_raises():
    with pytest.raises(ValueError):
        algo.compute_advantages(torch.ones(5), 2)


def test_aggregation_names_what_loss_denominator_counts():
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)                    # one prompt, two completions
    counts = {"prompt": 1.0, "sample": 2.0, "token": 3.0}                        # prompts, completions, tokens
    assert algo.loss_denominator(mask, 2) == counts[algo.AGGREGATION]
    for aggregation in counts:  # the keyword sets the unit
        assert algo.loss_denominator(mask, 2, aggregation=aggregation) == counts[aggregation]


def test_loss_metrics_and_gradient_hand_computed():
    # One prompt, G = 2. Completion 0 (A = +1): log pi = -1 with rho = 6 (truncated to 5), log pi = -2 with rho = 1.
    # Completion 1 (A = -1): log pi = -0.5 with rho = 0.5, and a masked slot.
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, 3.0]], dtype=torch.float64, requires_grad=True)
    old = logprobs.detach() - torch.log(torch.tensor([[6.0, 1.0], [0.5, 1.0]], dtype=torch.float64))
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, m = algo.compute_loss(logprobs, old, adv, mask, group_size=2)
    # Token losses -w A log pi: -5 * 1 * -1 = 5, -1 * 1 * -2 = 2, -0.5 * -1 * -0.5 = -0.25; over the prompt's 3 tokens.
    assert loss.item() == pytest.approx((5 + 2 - 0.25) / 3)
    # Gradient -w A / 3: the truncated token (rho = 6) still pulls, with weight 5; PPO's clip would give it 0.
    torch.testing.assert_close(
        grad_of(loss, logprobs), torch.tensor([[-5 / 3, -1 / 3], [1 / 6, 0.0]], dtype=torch.float64)
    )
    assert m["clip_frac"] == pytest.approx(1 / 3)
    assert m["clip_frac_low"] == 0.0
    assert m["clip_frac_high"] == pytest.approx(1 / 3)
    assert m["ratio_mean"] == pytest.approx((6 + 1 + 0.5) / 3)
    assert m["kl_k3"] == pytest.approx(sum(r - 1 - math.log(r) for r in (6.0, 1.0, 0.5)) / 3)
    assert m["num_tokens"] == 3.0
    assert all(isinstance(v, float) for v in m.values())
    # The other aggregations: "sample" is the mean of the completions' token means, "token" the token mean.
    expected = {"sample": ((5 + 2) / 2 + -0.25) / 2, "token": (5 + 2 - 0.25) / 3}
    for aggregation in ("sample", "token"):
        loss, m = algo.compute_loss(logprobs, old, adv, mask, 2, aggregation=aggregation)
        assert loss.item() == pytest.approx(expected[aggregation])
    # A lower bound truncates rho = 0.5 up to 0.8.
    loss, m = algo.compute_loss(logprobs, old, adv, mask, 2, eps_min=0.8)
    assert loss.item() == pytest.approx((5 + 2 - 0.8 * 0.5) / 3)
    assert m["clip_frac_low"] == pytest.approx(1 / 3) and m["clip_frac"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_matches_the_formula_as_written(aggregation):
    logprobs, old, rewards, mask = random_batch()
    logprobs = (old + 0.8 * (logprobs - old)).detach().requires_grad_()
    adv = algo.compute_advantages(rewards, 4).double()
    w = torch.rand(mask.shape, dtype=torch.float64) + 0.5
    for eps_min, eps_max in ((None, 5.0), (0.9, 1.1)):
        kwargs = dict(aggregation=aggregation, eps_min=eps_min, eps_max=eps_max)
        loss, m = algo.compute_loss(logprobs, old, adv, mask, 4, is_weights=w, **kwargs)
        expected = reference_loss(logprobs, old, adv, mask, 4, is_weights=w, **kwargs)
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(grad_of(loss, logprobs), grad_of(expected, logprobs))
    assert 0 < m["clip_frac"] < 1


def test_kl_penalty_matches_the_formula():
    logprobs, old, rewards, mask = random_batch(seed=1)
    ref = old + 0.2 * torch.randn(old.shape, dtype=torch.float64)
    adv = algo.compute_advantages(rewards, 4).double()
    loss, m = algo.compute_loss(logprobs, old, adv, mask, 4, kl_coef=0.04, ref_logprobs=ref)
    expected = reference_loss(logprobs, old, adv, mask, 4, kl_coef=0.04, ref=ref)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad_of(loss, logprobs), grad_of(expected, logprobs))
    assert m["kl_ref"] > 0
    with pytest.raises(ValueError):
        algo.compute_loss(logprobs, old, adv, mask, 4, kl_coef=0.04)


def test_minimax_m1_original_is_reachable():
    """MiniMax-M1: GRPO's group z-score, rho clipped to [1 - eps_low, 1 + eps_high], per-prompt token mean."""
    logprobs, old, rewards, mask = random_batch(seed=1)
    adv = algo.compute_advantages(rewards, 4, normalization="group")
    z = torch.tensor([(r - g.mean()) / g.std() if g.std() > 0 else 0.0 for g in rewards.view(-1, 4) for r in g])
    torch.testing.assert_close(adv, z.float())
    loss, _ = algo.compute_loss(logprobs, old, adv, mask, 4, eps_min=1 - 0.2, eps_max=1 + 0.28)
    expected = reference_loss(logprobs, old, adv.double(), mask, 4, eps_min=0.8, eps_max=1.28)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad_of(loss, logprobs), grad_of(expected, logprobs))


def test_cispo_equals_reinforce_while_rho_below_eps_max():
    """While every rho < eps_max, CISPO's gradient is importance-weighted REINFORCE's, -rho A grad log pi: the
    gradient of the UNCLIPPED surrogate -rho A. PPO-style clipping (DAPO) would zero the tokens outside its range."""
    logprobs, old, rewards, mask = random_batch(seed=2)
    adv = algo.compute_advantages(rewards, 4).double()
    assert torch.exp(torch.where(mask, logprobs - old, 0.0)).max() < 5.0
    for aggregation in AGGREGATIONS:
        loss, m = algo.compute_loss(logprobs, old, adv, mask, 4, aggregation=aggregation)
        rho = torch.exp(torch.where(mask, logprobs - old, 0.0))
        surrogate = torch.where(mask, -rho * adv[:, None], 0.0)  # -rho A, differentiable through rho
        if aggregation == "token":
            reinforce = surrogate.sum() / mask.sum()
        elif aggregation == "sample":
            reinforce = (surrogate.sum(dim=1) / mask.sum(dim=1)).mean()
        else:
            reinforce = (surrogate.sum(dim=1).view(-1, 4).sum(dim=1) / mask.sum(dim=1).view(-1, 4).sum(dim=1)).mean()
        torch.testing.assert_close(grad_of(loss, logprobs), grad_of(reinforce, logprobs))
        assert m["clip_frac"] == 0.0
    dapo_loss, dapo_m = dapo.compute_loss(logprobs, old, adv, mask, 4)
    assert dapo_m["clip_frac"] > 0  # the same batch does trip DAPO's clip
    cispo_loss, _ = algo.compute_loss(logprobs, old, adv, mask, 4)
    assert not torch.allclose(grad_of(dapo_loss, logprobs), grad_of(cispo_loss, logprobs))


def test_unknown_aggregation_raises():
    logprobs, old, rewards, mask = random_batch()
    adv = algo.compute_advantages(rewards, 4)
    with pytest.raises(ValueError):
        algo.compute_loss(logprobs, old, adv, mask, 4, aggregation="batch")
    with pytest.raises(ValueError):
        algo.loss_denominator(mask, 4, aggregation="batch")


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_right_padding_changes_nothing(aggregation):
    logprobs, old, rewards, mask = random_batch(seed=2)
    adv = algo.compute_advantages(rewards, 4)
    loss, m = algo.compute_loss(logprobs, old, adv, mask, 4, aggregation=aggregation)
    padded = torch.cat([logprobs, torch.randn(logprobs.shape[0], 3, dtype=torch.float64)], dim=1)
    padded_old = torch.cat([old, torch.randn(old.shape[0], 3, dtype=torch.float64)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(mask.shape[0], 3, dtype=torch.bool)], dim=1)
    padded_loss, padded_m = algo.compute_loss(padded, padded_old, adv, padded_mask, 4, aggregation=aggregation)
    torch.testing.assert_close(padded_loss, loss)
    torch.testing.assert_close(grad_of(padded_loss, padded)[:, : mask.shape[1]], grad_of(loss, logprobs))
    assert padded_m == pytest.approx(m)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_garbage_in_masked_slots_changes_nothing(aggregation):
    logprobs, old, rewards, mask = random_batch(seed=3)
    adv = algo.compute_advantages(rewards, 4)
    ref = old - 0.1
    w = torch.rand(mask.shape, dtype=torch.float64)
    loss, m = algo.compute_loss(logprobs, old, adv, mask, 4, is_weights=w, kl_coef=0.04, ref_logprobs=ref,
                                aggregation=aggregation)
    dirty = with_garbage(logprobs, mask).requires_grad_()
    dirty_loss, dirty_m = algo.compute_loss(
        dirty, with_garbage(old, mask), adv, mask.float(), 4,
        is_weights=with_garbage(w, mask),
        kl_coef=0.04, ref_logprobs=with_garbage(ref, mask),
        aggregation=aggregation,
    )
    torch.testing.assert_close(dirty_loss, loss)
    dirty_grad = grad_of(dirty_loss, dirty)
    assert torch.isfinite(dirty_grad).all() and (dirty_grad[~mask] == 0).all()
    torch.testing.assert_close(dirty_grad, grad_of(loss, logprobs))
    assert dirty_m == pytest.approx(m)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_sum_to_the_full_batch(aggregation):
    logprobs, old, rewards, mask = random_batch(num_prompts=4, seed=4)
    adv = algo.compute_advantages(rewards, 4)
    full, _ = algo.compute_loss(logprobs, old, adv, mask, 4, aggregation=aggregation)
    full_grad = grad_of(full, logprobs)
    denominator = algo.loss_denominator(mask, 4, aggregation=aggregation, eps_max=5.0)
    assert denominator == {"prompt": 4.0, "sample": 16.0, "token": float(mask.sum())}[aggregation]
    total, total_grad = 0.0, torch.zeros_like(full_grad)
    for rows in (slice(0, 4), slice(4, 16)):  # split on group boundaries, unevenly
        part = logprobs.detach()[rows].requires_grad_()
        loss, _ = algo.compute_loss(
            part, old[rows], adv[rows], mask[rows], 4, denominator=denominator, aggregation=aggregation
        )
        total = total + loss.detach()
        total_grad[rows] = grad_of(loss, part)
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(total_grad, full_grad)


@pytest.mark.parametrize("num_prompts", [1, 3])
def test_on_policy_gradient_is_reinforce(num_prompts):
    """On-policy (rho = 1) nothing is clipped or truncated: DAPO's grad of rho A, CISPO's sg(rho) A grad log pi and
    REINFORCE's A grad log pi are one and the same. Aggregation must match: with one prompt, DAPO's per-prompt token
    mean IS the token mean; with several, DAPO = CISPO "prompt" and token-level REINFORCE = CISPO "token"."""
    logprobs, _, rewards, mask = random_batch(num_prompts=num_prompts, seed=3)
    old = logprobs.detach()
    adv = algo.compute_advantages(rewards, 4).double()
    reinforce = torch.where(mask, -adv[:, None] * logprobs, 0.0).sum() / mask.sum()
    reinforce_grad = grad_of(reinforce, logprobs)
    dapo_grad = grad_of(dapo.compute_loss(logprobs, old, adv, mask, 4)[0], logprobs)
    cispo_prompt_grad = grad_of(algo.compute_loss(logprobs, old, adv, mask, 4)[0], logprobs)
    cispo_token_grad = grad_of(algo.compute_loss(logprobs, old, adv, mask, 4, aggregation="token")[0], logprobs)
    torch.testing.assert_close(cispo_prompt_grad, dapo_grad)
    torch.testing.assert_close(cispo_token_grad, reinforce_grad)
    if num_prompts == 1:
        torch.testing.assert_close(dapo_grad, reinforce_grad)
