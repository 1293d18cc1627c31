"""tis.py: weights by hand, agreement gives 1, sequence level in float32, garbage in masked slots, metrics."""

import math

import pytest
import torch

import grpo
import tis as algo  # every test file names its algorithm `algo`, so that they diff line for line


def ratios_batch(ratios, mask):
    """learner and sampler logprobs [N, T] whose ratio learner / sampler is `ratios` where mask is true."""
    sampler = -torch.rand(len(ratios), len(ratios[0]), generator=torch.Generator().manual_seed(0)) - 0.5
    learner = sampler + torch.log(torch.tensor(ratios))
    return learner, sampler, torch.tensor(mask)


def test_weights_are_one_when_sampler_and_learner_agree():
    logprobs = -torch.rand(4, 6, generator=torch.Generator().manual_seed(1)) * 3
    mask = torch.arange(6)[None, :] < torch.tensor([[6], [3], [1], [4]])
    for level in ("token", "sequence"):
        for mode in ("truncate", "mask"):
            w = algo.tis_weights(logprobs, logprobs.clone(), mask, level=level, mode=mode, cap_min=0.5)
            assert (w[mask] == 1).all() and (w[~mask] == 0).all()
    m = algo.mismatch_metrics(logprobs, logprobs.clone(), mask)
    assert m == {
        "mismatch_log_ratio_mean": 0.0, "mismatch_kl_k3": 0.0, "mismatch_max_abs_diff": 0.0, "mismatch_trunc_frac": 0.0
    }


def test_token_weights_hand_computed():
    learner, sampler, mask = ratios_batch([[0.5, 3.0, 1.5, 9.0]], [[True, True, True, False]])
    cases = {
        ("truncate", None): [0.5, 2.0, 1.5, 0.0],  # TIS: min(rho, 2)
        ("truncate", 0.8): [0.8, 2.0, 1.5, 0.0],  # two-sided truncation
        ("mask", None): [0.5, 0.0, 1.5, 0.0],  # MIS: rho inside [0, 2], else 0
        ("mask", 0.8): [0.0, 0.0, 1.5, 0.0],  # MIS with a lower bound
    }
    for (mode, cap_min), expected in cases.items():
        w = algo.tis_weights(learner, sampler, mask, mode=mode, cap_min=cap_min)
        torch.testing.assert_close(w, torch.tensor([expected]))
    icepop = algo.tis_weights(learner, sampler, mask, cap=5.0, cap_min=0.5, mode="mask")
    torch.testing.assert_close(icepop, torch.tensor([[0.5, 3.0, 1.5, 0.0]]))


def test_sequence_weights_hand_computed():
    # Row 0: product 0.5 * 3 * 1.5 = 2.25, truncated to 2 / masked to 0. Row 1: 0.5 * 1.5 = 0.75, kept.
    learner, sampler, mask = ratios_batch(
        [[0.5, 3.0, 1.5, 9.0], [0.5, 1.5, 7.0, 7.0]], [[True, True, True, False], [True, True, False, False]]
    )
    truncated = algo.tis_weights(learner, sampler, mask, level="sequence")
    torch.testing.assert_close(truncated, torch.tensor([[2.0, 2.0, 2.0, 0.0], [0.75, 0.75, 0.0, 0.0]]))
    masked = algo.tis_weights(learner, sampler, mask, level="sequence", mode="mask")
    torch.testing.assert_close(masked, torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.75, 0.75, 0.0, 0.0]]))


def test_sequence_ratio_is_computed_in_float32_from_summed_log_ratios():
    """2000 tokens with a log-ratio of 1e-3 each: the sequence ratio is exp(2), in float32 even for bf16 inputs."""
    sampler = torch.full((1, 2000), -1.0)
    learner = sampler + 1e-3
    mask = torch.ones(1, 2000, dtype=torch.bool)
    w = algo.tis_weights(learner, sampler, mask, level="sequence", cap=100.0)
    assert w.dtype == torch.float32
    # each float32 log-ratio is off by u (the input -0.999's rounding) + u 1e-3, the sum of 2000 by 2000 u 2 more:
    # 3.6e-4 relative after exp; measured 2.6e-5 on both kernel paths; bf16 inputs give a ratio of 1
    torch.testing.assert_close(w, torch.full((1, 2000), math.exp(2.0)), rtol=3.6e-4, atol=0)
    # bf16 logprobs: the subtraction and sum happen after the cast to float32, so the result is float32.
    w16 = algo.tis_weights(learner.bfloat16(), sampler.bfloat16(), mask, level="sequence", cap=100.0)
    assert w16.dtype == torch.float32 and torch.isfinite(w16).all()
    # float64 stays float64.
    assert algo.tis_weights(learner.double(), sampler.double(), mask).dtype == torch.float64


def test_weights_are_detached():
    learner = torch.randn(2, 3, requires_grad=True)
    w = algo.tis_weights(learner, torch.randn(2, 3), torch.ones(2, 3))
    assert not w.requires_grad


def test_garbage_in_masked_slots_changes_nothing():
    learner, sampler, mask = ratios_batch(
        [[0.5, 3.0, 1.5, 1.0], [0.9, 1.1, 1.0, 1.0]], [[True, True, True, False], [True, True, False, False]]
    )
    dirty_learner = torch.where(mask, learner, torch.tensor([[math.nan, math.inf, -math.inf, math.nan]] * 2))
    dirty_sampler = torch.where(mask, sampler, torch.tensor([[math.inf, math.nan, math.inf, -math.inf]] * 2))
    for level in ("token", "sequence"):
        for mode in ("truncate", "mask"):
            clean = algo.tis_weights(learner, sampler, mask, level=level, mode=mode)
            dirty = algo.tis_weights(dirty_learner, dirty_sampler, mask.float(), level=level, mode=mode)
            torch.testing.assert_close(dirty, clean)
    assert algo.mismatch_metrics(dirty_learner, dirty_sampler, mask) == pytest.approx(
        algo.mismatch_metrics(learner, sampler, mask)
    )


def test_mismatch_metrics_hand_computed():
    learner, sampler, mask = ratios_batch([[0.5, 3.0, 1.5, 9.0]], [[True, True, True, False]])
    m = algo.mismatch_metrics(learner, sampler, mask)
    logs = [math.log(0.5), math.log(3.0), math.log(1.5)]
    assert m["mismatch_log_ratio_mean"] == pytest.approx(sum(logs) / 3, rel=1e-5)
    assert m["mismatch_kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in logs) / 3, rel=1e-5)
    assert m["mismatch_max_abs_diff"] == pytest.approx(math.log(3.0), rel=1e-5)
    assert m["mismatch_trunc_frac"] == pytest.approx(1 / 3)  # only rho = 3 is above the default cap of 2
    assert algo.mismatch_metrics(learner, sampler, mask, cap=1.2)["mismatch_trunc_frac"] == pytest.approx(2 / 3)


def test_unit_weights_leave_a_loss_unchanged_and_weights_scale_it():
    """The weights plug into any loss as is_weights: all-ones is a no-op; a constant c scales the loss by c."""
    gen = torch.Generator().manual_seed(2)
    logprobs = (-torch.rand(4, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    old = logprobs.detach() + 0.1 * torch.randn(4, 5, generator=gen, dtype=torch.float64)
    mask = torch.arange(5)[None, :] < torch.tensor([[5], [2], [3], [4]])
    adv = grpo.compute_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2)
    plain, _ = grpo.compute_loss(logprobs, old, adv, mask, 2)
    ones = algo.tis_weights(old, old.clone(), mask)
    weighted, _ = grpo.compute_loss(logprobs, old, adv, mask, 2, is_weights=ones)
    torch.testing.assert_close(weighted, plain)
    halves = algo.tis_weights(old, old - math.log(2.0), mask, level="sequence", mode="truncate", cap=0.5)
    halved, _ = grpo.compute_loss(logprobs, old, adv, mask, 2, is_weights=halves)
    torch.testing.assert_close(halved, plain * 0.5)


def test_unknown_level_or_mode_raises():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError):
        algo.tis_weights(x, x, x.bool(), level="prompt")
    with pytest.raises(ValueError):
        algo.tis_weights(x, x, x.bool(), mode="clip")
