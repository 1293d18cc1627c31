"""CISPO: Clipped IS-weight Policy Optimization, in ScaleRL's form.

Paper
    MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
    arXiv 2506.13585, section 3.1 (CISPO). The form and defaults here are ScaleRL's: Khatri et al. 2025,
    "The Art of Scaling Reinforcement Learning Compute for LLMs", arXiv 2510.13786 (its loss and advantages).

Equation (J is maximised; compute_loss returns -J)
    A_i      = (r_i - mean_g r) / std(all r_j - mean_g' r in the batch)   batch-level normalisation of centred A
    r_{i,t}  = pi_theta(y_{i,t}) / pi_old(y_{i,t})                         token ratio
    J        = mean_P 1/sum_i |y_i| sum_i sum_t [ sg(min(r_{i,t}, eps_max)) A_i log pi_theta(y_{i,t}) - beta KL_{i,t} ]
    KL_{i,t} = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1                 k3 estimator, per token, >= 0
    REINFORCE with a truncated, DETACHED importance weight (mean_P: over prompts): a truncated token keeps its gradient
    (weight eps_max) where PPO's clip would zero it. MiniMax-M1's original: normalization="group", aggregation="prompt",
    eps_min=1 - eps_low_IS (very large there: no lower bound), eps_max=1 + eps_high_IS (not published), no KL term.

Aggregation unit
    aggregation="prompt" (ScaleRL's, DAPO's): per prompt, the token sum over its G completions over their total
    tokens, then the mean over prompts; loss_denominator counts prompts: N / G. "token": one mean over every masked
    token of the batch; it counts masked tokens. "sample" (GRPO's): the token mean within each completion, then the
    mean over completions; it counts completions: N.
    AGGREGATION names the unit, for a trainer that splits a group across micro-batches.

Defaults and their source
    eps_max       = 5.0       ScaleRL: an absolute cap, not 1 + eps (4, 5 and 8 performed the same)
    eps_min       = None      ScaleRL: no lower bound
    aggregation   = "prompt"  ScaleRL (its ablation compares "sample" and "token")
    normalization = "batch"   ScaleRL (its ablation compares "group", GRPO's per-prompt std)
    kl_coef  = 0.0   no KL penalty, as in DAPO, Dr. GRPO, GSPO, CISPO and ScaleRL: a verifiable reward leaves no
                     reward model to exploit, and the penalty costs a reference-model forward pass.

Deviations from the paper
    - The convention for the cap differs: ScaleRL and TRL (`epsilon_high`) use an absolute cap; MiniMax-M1 and verl
      use 1 + eps_high (verl also bounds below at 1 - clip_ratio_low). We implement ScaleRL's. TRL's
      scale_rewards="batch" divides by the std of the raw rewards; we use ScaleRL's std of the centred advantages.
    - A group whose rewards are all equal has std 0 and the paper's A is undefined; we set A = 0 there. We add no
      epsilon to the std (TRL adds 1e-4, verl 1e-6), so other groups get the exact z-score.
      With normalization="batch" it is centred to exactly 0 too; a batch of constant groups gets A = 0, never NaN.
      The batch std is over the rows passed in: drop zero-variance groups first (ScaleRL does) to keep them out.
    - is_weights (e.g. TIS, for the sampler/learner mismatch) multiply the per-token loss.
      ScaleRL's pi_old is the generator's logprob, which covers that mismatch: pass those as old_logprobs.
    - The KL term is part of the per-token loss, so is_weights multiply it too. As in every implementation, it is
      evaluated on the tokens sampled from pi_old, not from pi_theta.
    - kl_coef and ref_logprobs add grpo.py's KL penalty, an option the paper does not have; kl_coef = 0 is its loss.
    - MiniMax-M1's unified form adds an optional PPO-style token mask M_{i,t}; we implement plain CISPO (M = 1).
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATION = "prompt"  # what loss_denominator counts (docstring: Aggregation unit)


# ----------------------------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------------------------


def compute_advantages(rewards: Tensor, group_size: int, *, normalization: str = "batch") -> Tensor:
    """Group-centred reward over a std: A_i = (r_i - mean_g r) / std, std of the batch or of the group.

    Args:
        rewards: [N] one scalar per completion, N = num_prompts * group_size, each prompt's completions contiguous.
        group_size: G, completions per prompt.
        normalization: "batch" (ScaleRL): one std of ALL centred advantages; "group" (GRPO, MiniMax-M1): each group's.

    Returns:
        advantages: [N] float32; exactly 0 for a group whose rewards are all equal (never NaN).
    """
    groups = _grouped(rewards.detach().float(), group_size)                   # [P, G]
    centred = groups - groups.mean(dim=1, keepdim=True)                       # [P, G]
    std = groups.std(dim=1, keepdim=True)                                     # [P, 1], unbiased as in TRL and verl
    # Compare rewards, not std > 0: the mean of equal floats can be off by an ulp, and ulp / ulp is not 0.
    constant = (groups == groups[:, :1]).all(dim=1, keepdim=True)             # [P, 1]
    if normalization == "batch":
        # One std of the centred advantages (constant groups: exact zeros); 0 only if all are constant, then A = 0.
        std = torch.where(constant, 0.0, centred).std()                       # [], unbiased
    elif normalization != "group":
        raise ValueError(f"normalization must be 'batch' or 'group', not {normalization!r}")
    advantages = torch.where(constant, 0.0, centred / std)                    # [P, G]
    return advantages.flatten()                                               # [N]


# ----------------------------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------------------------


def loss_denominator(mask: Tensor, group_size: int, *, aggregation: str = AGGREGATION, **hyperparameters: object) -> float:
    """Number of aggregation units in `mask` [N, T]; here prompts N / G, completions N or masked tokens (at least 1).

    compute_loss returns (sum over units of a per-unit term) / denominator. A trainer that splits a batch into
    micro-batches (never splitting a group) passes the whole batch's loss_denominator to every micro-batch call;
    the micro-batch losses, and their gradients, then sum to the full-batch ones. Fully masked units still count:
    to leave a prompt out of the loss, drop its rows rather than mask them. Takes (and ignores) compute_loss's
    hyperparameters, so a trainer can pass the same keywords to both.
    """
    if aggregation == "prompt":
        return float(_grouped(mask, group_size).shape[0])
    if aggregation == "sample":
        return float(mask.shape[0])
    if aggregation == "token":
        return max(float(mask.bool().sum()), 1.0)                             # an empty batch gives loss 0, not NaN
    raise ValueError(f"aggregation must be 'prompt', 'sample' or 'token', not {aggregation!r}")


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
    eps_max: float = 5.0,
    eps_min: float | None = None,
    aggregation: str = AGGREGATION,
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
        eps_max: absolute cap on the detached importance weight (MiniMax-M1: 1 + eps_high_IS).
        eps_min: absolute lower bound on it, or None for none (MiniMax-M1: 1 - eps_low_IS).
        aggregation: "prompt", "sample" or "token"; see the module docstring.
        kl_coef: beta of the k3 KL penalty to the reference policy; needs ref_logprobs when non-zero.

    Returns:
        loss: scalar to minimise.
        metrics: python floats. clip_frac (fraction of masked tokens whose weight was truncated; split into
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

    # The importance weight is truncated to [low, high] and DETACHED; it scales a REINFORCE term A * log pi, so a
    # truncated token still pulls (with weight high or low), where PPO's clip would stop it.
    low, high = (0.0 if eps_min is None else eps_min), eps_max                # ratio >= 0: 0.0 is no lower bound
    token_loss = -ratio.clamp(low, high).detach() * adv * logprobs            # [N, T]
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

    if aggregation == "prompt":
        # Prompt-level (the default): a prompt's token sum over its G completions / their tokens is one unit.
        tokens_per_prompt = _grouped(mask.sum(dim=1), group_size).sum(dim=1).clamp(min=1)      # [P]
        unit_terms = _grouped(token_loss.sum(dim=1), group_size).sum(dim=1) / tokens_per_prompt  # [P]
    elif aggregation == "sample":
        # Sample-level aggregation (GRPO's): the token mean within each completion is one unit.
        tokens_per_completion = mask.sum(dim=1).clamp(min=1)                  # [N]
        unit_terms = token_loss.sum(dim=1) / tokens_per_completion            # [N]
    elif aggregation == "token":
        unit_terms = token_loss                                               # [N, T], token-level: each token a unit
    else:
        raise ValueError(f"aggregation must be 'prompt', 'sample' or 'token', not {aggregation!r}")
    if denominator is None:
        denominator = loss_denominator(mask, group_size, aggregation=aggregation)
    loss = unit_terms.sum() / denominator

    clipped_low = (ratio < low) & mask                                        # [N, T], whatever the sign of A
    clipped_high = (ratio > high) & mask                                      # [N, T]
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
