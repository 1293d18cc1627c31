"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization.

Paper
    Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    arXiv 2503.14476, equation 8 (sections 3.1-3.4).

Equation (J is maximised; compute_loss returns -J)
    A_i      = (r_i - mean_g r) / std_g r                                  group z-score, same on every token
    r_{i,t}  = pi_theta(y_{i,t}) / pi_old(y_{i,t})                         token ratio
    J        = mean_prompts 1/(sum_i |y_i|) sum_i sum_t [ min(r_{i,t} A_i, clip(r_{i,t}, 1-eps_low, 1+eps_high) A_i)
                                                          - beta KL_{i,t} ]
    KL_{i,t} = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1                 k3 estimator, per token, >= 0
    A_i, r_{i,t} and KL_{i,t} are GRPO's; DAPO has no KL term (beta = 0). The rest of the recipe lives in two helpers
    the trainer calls:
    filter_groups     dynamic sampling: keep only the groups with mixed accuracy (0 < acc < 1)
    overlong_penalty  soft overlong punishment R_len(|y|), added to the correctness reward

Aggregation unit
    The prompt: per prompt, the token sum over its G completions over their total number of tokens (equation 8), then
    the mean over prompts. verl (loss_agg_mode="token-mean") and TRL (loss_type="dapo") divide by the whole batch's
    tokens instead (cispo.py's aggregation="token"); with one prompt they agree. loss_denominator counts prompts: N / G.
    AGGREGATION names the unit, for a trainer that splits a group across micro-batches.

Defaults and their source
    clip_eps_low  = 0.2    paper, clip-higher (section 3.1)
    clip_eps_high = 0.28   paper; the larger upper range lets low-probability tokens grow (fights entropy collapse)
    overlong_penalty: max_len = 20480, cache_len = 4096, the paper's L_max and L_cache (sections 3.4 and 4.1)
    kl_coef  = 0.0   no KL penalty, as in DAPO, Dr. GRPO, GSPO, CISPO and ScaleRL: a verifiable reward leaves no
                     reward model to exploit, and the penalty costs a reference-model forward pass.

Deviations from the paper
    - Dynamic sampling's loop (sample more prompts until the batch is full) and overlong filtering (masking truncated
      samples) are the trainer's; filter_groups only says which groups to keep.
    - A group whose rewards are all equal has std 0 and the paper's A is undefined; we set A = 0 there. We add no
      epsilon to the std (TRL adds 1e-4, verl 1e-6), so other groups get the exact z-score.
    - is_weights (e.g. TIS, for the sampler/learner mismatch) multiply the per-token loss.
    - The KL term is part of the per-token loss, so is_weights multiply it too. As in every implementation, it is
      evaluated on the tokens sampled from pi_old, not from pi_theta.
    - kl_coef and ref_logprobs add grpo.py's KL penalty, an option the paper does not have; kl_coef = 0 is its loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATION = "prompt"  # what loss_denominator counts (docstring: Aggregation unit)


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
    """Number of aggregation units in `mask` [N, T]; here prompts: N / G.

    compute_loss returns (sum over units of a per-unit term) / denominator. A trainer that splits a batch into
    micro-batches (never splitting a group) passes the whole batch's loss_denominator to every micro-batch call;
    the micro-batch losses, and their gradients, then sum to the full-batch ones. Fully masked units still count:
    to leave a prompt out of the loss, drop its rows rather than mask them. Takes (and ignores) compute_loss's
    hyperparameters, so a trainer can pass the same keywords to both.
    """
    return float(_grouped(mask, group_size).shape[0])


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
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.28,
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
        clip_eps_low: lower clip range, ratio clipped from below at 1 - clip_eps_low.
        clip_eps_high: upper clip range, ratio clipped from above at 1 + clip_eps_high (clip-higher).
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
    low, high = 1.0 - clip_eps_low, 1.0 + clip_eps_high                       # clip-higher: high - 1 > 1 - low
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

    # Prompt-level aggregation: a prompt's token sum over its G completions / their total tokens is one unit.
    tokens_per_prompt = _grouped(mask.sum(dim=1), group_size).sum(dim=1).clamp(min=1)          # [P]
    unit_terms = _grouped(token_loss.sum(dim=1), group_size).sum(dim=1) / tokens_per_prompt    # [P]
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
# DAPO's recipe: dynamic sampling and soft overlong punishment
# ----------------------------------------------------------------------------------------------------------------


def filter_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Dynamic sampling's filter, which prompts carry a learning signal: keep [N / G] bool, true for a group whose
    rewards [N] are not all equal (0 < accuracy < 1). The others have A = 0, hence no gradient; DAPO drops them and
    samples more prompts until the batch is full. Pass the correctness rewards, before overlong_penalty: the paper
    filters on accuracy.
    """
    groups = _grouped(rewards.detach(), group_size)                           # [P, G]
    return ~(groups == groups[:, :1]).all(dim=1)                              # [P]


def overlong_penalty(lengths: Tensor, max_len: int = 20480, cache_len: int = 4096) -> Tensor:
    """Soft overlong punishment R_len(|y|) (section 3.4), to add to the correctness reward: [N] float32 in [-1, 0]
    for lengths [N] in tokens. max_len is L_max, the generation budget; cache_len is L_cache, the ramp before it.

        R_len = 0                                           if |y| <= max_len - cache_len
              = ((max_len - cache_len) - |y|) / cache_len   if max_len - cache_len < |y| <= max_len
              = -1                                          if |y| > max_len
    """
    lengths = lengths.detach().float()                                        # [N]
    free = max_len - cache_len                                                # no penalty up to here
    ramp = (free - lengths) / cache_len                                       # [N], 0 -> -1 across the cache
    return torch.where(lengths <= free, 0.0, torch.where(lengths <= max_len, ramp, -1.0))


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
