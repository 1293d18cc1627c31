"""GSPO: Group Sequence Policy Optimization, one clipped ratio per sequence.

Paper
    Zheng et al. 2025, "Group Sequence Policy Optimization",
    arXiv 2507.18071 (the GSPO objective and its GSPO-token variant).

Equation (J is maximised; compute_loss returns -J)
    A_i      = (r_i - mean_g r) / std_g r                                  group z-score, same on every token
    r_{i,t}  = pi_theta(y_{i,t}) / pi_old(y_{i,t})                         token ratio
    s_i      = exp( 1/|y_i| sum_t log r_{i,t} )                            sequence ratio (geometric mean of r_{i,t})
    J        = 1/G sum_i [ min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i) - beta 1/|y_i| sum_t KL_{i,t} ]
    KL_{i,t} = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1                 k3 estimator, per token, >= 0
    A_i and KL_{i,t} are GRPO's; GSPO has no KL term (beta = 0). Pitfall: s_i is the MEAN of the token log-ratios,
    not the sum (a sum makes the ratio and the clip scale with the length of the sequence).
    GSPO-token (token_level=True): s_{i,t} = sg(s_i) pi_theta(y_{i,t}) / sg(pi_theta(y_{i,t})), equal to s_i in
    value, and J = 1/G sum_i 1/|y_i| sum_t min(s_{i,t} A_{i,t}, clip(s_{i,t}, ...) A_{i,t}); with A_{i,t} = A_i it
    has exactly GSPO's gradient, and it lets per-token advantages A_{i,t} ([N, T]) flow.

Aggregation unit
    The completion ("sample-level"): the token mean within each completion, then the mean over completions.
    GSPO has one clipped term per sequence; written on every token, its token mean is that very term (GRPO's code).
    loss_denominator counts completions: N.
    AGGREGATION names the unit, for a trainer that splits a group across micro-batches.

Defaults and their source
    clip_eps_low  = 3e-4   paper; the ranges are tiny because s_i is a per-token geometric mean
    clip_eps_high = 4e-4   paper (ScaleRL found 3e-3 and 5e-3 better for its 8B model)
    token_level   = False  the plain sequence-level GSPO
    kl_coef  = 0.0   no KL penalty, as in DAPO, Dr. GRPO, GSPO, CISPO and ScaleRL: a verifiable reward leaves no
                     reward model to exploit, and the penalty costs a reference-model forward pass.

Deviations from the paper
    - Many prompts per batch: the loss is the mean over all N completions (every prompt has G of them, so this is
      the mean over prompts of the paper's per-group 1/G sum).
    - A group whose rewards are all equal has std 0 and the paper's A is undefined; we set A = 0 there. We add no
      epsilon to the std (TRL adds 1e-4, verl 1e-6), so other groups get the exact z-score.
    - is_weights (e.g. TIS, for the sampler/learner mismatch) multiply the per-token loss.
      The sequence term sits on every token, so the token mean makes it scale by the MEAN of its is_weights (per
      token in GSPO-token). A sequence-level weight (tis.tis_weights(level="sequence")) is constant along the row
      and multiplies it exactly.
    - The KL term is part of the per-token loss, so is_weights multiply it too. As in every implementation, it is
      evaluated on the tokens sampled from pi_old, not from pi_theta.
    - kl_coef and ref_logprobs add grpo.py's KL penalty, an option the paper does not have; kl_coef = 0 is its loss.
    - Metrics: clip_frac, clip_frac_low/high and ratio_mean are over sequences, not tokens (kl_k3 is per token).
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
    clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4,
    token_level: bool = False,
    kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """The loss, -J, and its metrics.

    Args (the batch's inputs first; the keyword-only ones after them are the hyper-parameters):
        logprobs: [N, T] log pi_theta of the sampled tokens; carries the gradient.
        old_logprobs: [N, T] log pi_old, the behaviour policy; treated as a constant.
        advantages: [N] from compute_advantages, or [N, T] per-token ones with token_level; treated as a constant.
        mask: [N, T] bool or float, true where a token counts. Masked slots may hold anything, NaN and inf included.
        group_size: G, completions per prompt, contiguous.
        is_weights: [N, T] or None; detached per-token weights (e.g. TIS) multiplied into the per-token loss.
        denominator: None divides by this call's own loss_denominator (a plain mean). A micro-batch passes the full
            batch's loss_denominator instead, so that the micro-batch losses sum to the full-batch loss.
        ref_logprobs: [N, T] log pi_ref or None; when given, metric kl_ref is its k3 estimate of KL(pi_theta || pi_ref).
        clip_eps_low: lower clip range, sequence ratio clipped from below at 1 - clip_eps_low.
        clip_eps_high: upper clip range, sequence ratio clipped from above at 1 + clip_eps_high.
        token_level: GSPO-token, s_{i,t} = sg(s_i) pi / sg(pi); same value and, with [N] advantages, same gradient.
        kl_coef: beta of the k3 KL penalty to the reference policy; needs ref_logprobs when non-zero.

    Returns:
        loss: scalar to minimise.
        metrics: python floats. clip_frac (fraction of SEQUENCES where the clip removes the gradient; split into
            clip_frac_low and clip_frac_high), ratio_mean (mean sequence ratio), kl_k3 (per-token k3 estimate of
            KL(pi_old || pi_theta)), num_tokens (masked tokens).
    """
    if advantages.dim() == 2 and not token_level:
        raise ValueError("per-token advantages [N, T] need token_level=True")
    mask = mask.bool()                                                        # [N, T]
    # Sanitise before any arithmetic: garbage in masked slots must reach neither exp() nor the gradient. Work in
    # at least float32: a bf16 ratio has 3 significant digits, too few to see a clip range.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    logprobs = torch.where(mask, logprobs.to(dtype), 0.0)                     # [N, T]
    old_logprobs = torch.where(mask, old_logprobs.detach().to(dtype), 0.0)    # [N, T]
    log_ratio = logprobs - old_logprobs                                       # [N, T], 0 where masked
    # Sequence ratio: exp of the MEAN token log-ratio over the completion's own tokens.
    seq_log_ratio = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)  # [N, 1]
    if token_level:
        # GSPO-token: log s_{i,t} = sg(log s_i) + log pi - sg(log pi); the value stays s_i, the gradient is per token.
        seq_log_ratio = seq_log_ratio.detach() + (logprobs - logprobs.detach())  # [N, T]
    ratio = torch.exp(seq_log_ratio).expand_as(log_ratio)                     # [N, T], s_i on every token of y_i
    adv = advantages.detach()                                                 # [N], or [N, T] for GSPO-token
    adv = adv[:, None] if adv.dim() == 1 else torch.where(mask, adv, 0.0)     # [N, 1] or [N, T]

    # PPO's pessimistic bound: once the ratio has left [low, high] in the direction the advantage favours, the
    # clipped branch wins the min and the token stops pulling.
    low, high = 1.0 - clip_eps_low, 1.0 + clip_eps_high                       # on s_i: whole sequences stop
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
    # The unit is a sequence: clip fractions and ratio_mean count sequences that have at least one token.
    has_tokens = mask.any(dim=1)                                              # [N]
    metrics = {
        "clip_frac": _masked_mean((clipped_low | clipped_high).any(dim=1), has_tokens),
        "clip_frac_low": _masked_mean(clipped_low.any(dim=1), has_tokens),
        "clip_frac_high": _masked_mean(clipped_high.any(dim=1), has_tokens),
        "ratio_mean": _masked_mean(ratio[:, 0], has_tokens),
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
