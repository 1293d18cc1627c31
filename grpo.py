"""GRPO: Group Relative Policy Optimization, with PPO's clipped surrogate.

Paper
    Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
    arXiv 2402.03300, section 4.1 (outcome supervision).

Equation (J is maximised; compute_loss returns -J)
    A_i      = (r_i - mean_g r) / std_g r                                  group z-score, same on every token
    r_{i,t}  = pi_theta(y_{i,t}) / pi_old(y_{i,t})                         token ratio
    J        = 1/G sum_i 1/|y_i| sum_t [ min(r_{i,t} A_i, clip(r_{i,t}, 1-eps, 1+eps) A_i) - beta KL_{i,t} ]
    KL_{i,t} = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1                 k3 estimator, per token, >= 0

Aggregation unit
    The completion ("sample-level"): the token mean within each completion, then the mean over completions.
    loss_denominator counts completions: N.
    AGGREGATION names the unit, for a trainer that splits a group across micro-batches.

Defaults and their source
    clip_eps = 0.2   the paper does not state eps; 0.2 is PPO's convention (TRL and verl use it too).
    kl_coef  = 0.0   no KL penalty, as in DAPO, Dr. GRPO, GSPO, CISPO and ScaleRL: a verifiable reward leaves no
                     reward model to exploit, and the penalty costs a reference-model forward pass.

Deviations from the paper
    - Many prompts per batch: the loss is the mean over all N completions (every prompt has G of them, so this is
      the mean over prompts of the paper's per-group 1/G sum).
    - A group whose rewards are all equal has std 0 and the paper's A is undefined; we set A = 0 there. We add no
      epsilon to the std (TRL adds 1e-4, verl 1e-6), so other groups get the exact z-score.
    - is_weights (e.g. TIS, for the sampler/learner mismatch) multiply the per-token loss.
    - The KL term is part of the per-token loss, so is_weights multiply it too. As in every implementation, it is
      evaluated on the tokens sampled from pi_old, not from pi_theta.
    - beta: the paper used 0.04 (kl_coef=0.04 with ref_logprobs gives its loss); we default to 0 (see above).
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATION = "sample"  # what loss_denominator counts (docstring: Aggregation unit)


# ----------------------------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------------------------


def compute_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Group z-score: A_i = (r_i - mean_g r) / std_g r.

    Args:
        rewards: [N] one scalar per completion, N = num_prompts * group_size, each prompt's completions contiguous.
        group_size: G, completions per prompt.

    Returns:
        advantages: [N] float32; exactly 0 for a group whose rewards are all equal (never NaN).
    """
    groups = _grouped(rewards.detach().float(), group_size)                   # [P, G]
    centred = groups - groups.mean(dim=1, keepdim=True)                       # [P, G]
    std = groups.std(dim=1, keepdim=True)                                     # [P, 1], unbiased as in TRL and verl
    # Compare rewards, not std > 0: the mean of equal floats can be off by an ulp, and ulp / ulp is not 0.
    constant = (groups == groups[:, :1]).all(dim=1, keepdim=True)             # [P, 1]
    advantages = torch.where(constant, 0.0, centred / std)                    # [P, G]
    return advantages.flatten()                                               # [N]


# ----------------------------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------------------------


def loss_denominator(mask: Tensor, group_size: int, **hyperparameters: object) -> float:
    """Number of aggregation units in `mask` [N, T]; here completions: N.

    compute_loss returns (sum over units of a per-unit term) / denominator. A trainer that splits a batch into
    micro-batches (never splitting a group) passes the whole batch's loss_denominator to every micro-batch call;
    the micro-batch losses, and their gradients, then sum to the full-batch ones. Fully masked units still count:
    to leave a prompt out of the loss, drop its rows rather than mask them. Takes (and ignores) compute_loss's
    hyperparameters, so a trainer can pass the same keywords to both.
    """
    return float(mask.shape[0])


def compute_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    group_size: int,
    is_weights: Tensor | None = None,
    denominator: float | None = None,
    ref_logprobs: Tensor | None = None,
    *,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """The loss, -J, and its metrics.

    Args (the batch's inputs first; the keyword-only ones after them are the hyper-parameters):
        logprobs: [N, T] log pi_theta of the sampled tokens; carries the gradient.
        old_logprobs: [N, T] log pi_old, the behaviour policy; treated as a constant.
        advantages: [N] from compute_advantages; treated as a constant.
        mask: [N, T] bool or float, true where a token counts. Masked slots may hold anything, NaN and inf included.
        group_size: G, completions per prompt, contiguous.
        is_weights: [N, T] or None; detached per-token weights (e.g. TIS) multiplied into the per-token loss.
        denominator: None divides by this call's own loss_denominator (a plain mean). A micro-batch passes the full
            batch's loss_denominator instead, so that the micro-batch losses sum to the full-batch loss.
        ref_logprobs: [N, T] log pi_ref or None; when given, metric kl_ref is its k3 estimate of KL(pi_theta || pi_ref).
        clip_eps: PPO clip range, ratio clipped to [1 - clip_eps, 1 + clip_eps].
        kl_coef: beta of the k3 KL penalty to the reference policy; needs ref_logprobs when non-zero.

    Returns:
        loss: scalar to minimise.
        metrics: python floats. clip_frac (fraction of masked tokens where the clip removes the gradient; split into
            clip_frac_low and clip_frac_high), ratio_mean (mean token ratio), kl_k3 (k3 estimate of
            KL(pi_old || pi_theta)), num_tokens (masked tokens).
    """
    mask = mask.bool()                                                        # [N, T]
    # Sanitise before any arithmetic: garbage in masked slots must reach neither exp() nor the gradient. Work in
    # at least float32: a bf16 ratio has 3 significant digits, too few to see a clip range.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    logprobs = torch.where(mask, logprobs.to(dtype), 0.0)                     # [N, T]
    old_logprobs = torch.where(mask, old_logprobs.detach().to(dtype), 0.0)    # [N, T]
    log_ratio = logprobs - old_logprobs                                       # [N, T], 0 where masked
    ratio = torch.exp(log_ratio)                                              # [N, T]
    adv = advantages.detach()[:, None]                                        # [N, 1], the same on every token

    # PPO's pessimistic bound: once the ratio has left [low, high] in the direction the advantage favours, the
    # clipped branch wins the min and the token stops pulling.
    low, high = 1.0 - clip_eps, 1.0 + clip_eps
    token_loss = -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)    # [N, T]
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs ref_logprobs")
    if ref_logprobs is not None:
        # k3 estimate of KL(pi_theta || pi_ref), added to the loss (not to the reward), as in DeepSeekMath eqs. 3-4.
        ref_log_ratio = torch.where(mask, ref_logprobs.detach().to(dtype), 0.0) - logprobs  # [N, T]
        kl_ref = torch.expm1(ref_log_ratio) - ref_log_ratio                   # [N, T], from log(pi_ref / pi_theta)
        token_loss = token_loss + kl_coef * kl_ref
    if is_weights is not None:
        token_loss = token_loss * torch.where(mask, is_weights.detach(), 0.0)
    token_loss = torch.where(mask, token_loss, 0.0)                           # [N, T]

    # Sample-level aggregation: the token mean within each completion is one unit.
    tokens_per_completion = mask.sum(dim=1).clamp(min=1)                      # [N]
    unit_terms = token_loss.sum(dim=1) / tokens_per_completion                # [N]
    if denominator is None:
        denominator = loss_denominator(mask, group_size)
    loss = unit_terms.sum() / denominator

    clipped_low = (ratio < low) & (adv < 0) & mask                            # [N, T]
    clipped_high = (ratio > high) & (adv > 0) & mask                          # [N, T]
    metrics = {
        "clip_frac": _masked_mean(clipped_low | clipped_high, mask),
        "clip_frac_low": _masked_mean(clipped_low, mask),
        "clip_frac_high": _masked_mean(clipped_high, mask),
        "ratio_mean": _masked_mean(ratio, mask),
        "kl_k3": _masked_mean(torch.expm1(log_ratio) - log_ratio, mask),   # r - 1 - log r, >= 0
        "num_tokens": float(mask.sum()),
    }
    if ref_logprobs is not None:
        metrics["kl_ref"] = _masked_mean(kl_ref, mask)
    return loss, metrics


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------


def _grouped(x: Tensor, group_size: int) -> Tensor:
    """[N, ...] -> [N / group_size, group_size, ...]; each prompt's completions are contiguous."""
    if group_size < 1 or x.shape[0] % group_size != 0:
        raise ValueError(f"batch of {x.shape[0]} is not a whole number of groups of {group_size}")
    return x.reshape(x.shape[0] // group_size, group_size, *x.shape[1:])


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    """Mean of x over the true entries of mask (0.0 when there are none), as a python float for logging."""
    x = torch.where(mask, x.detach().float(), 0.0)
    return float(x.sum() / mask.sum().clamp(min=1))
