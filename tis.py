"""TIS: truncated importance sampling, for the mismatch between the sampler and the learner.

Paper
    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (blog post; no arXiv
    id). Masked importance sampling (MIS) and sequence-level weights follow Liu et al. 2025, "When Speed Kills
    Stability: Demystifying RL Collapse from the Training-Inference Mismatch" (blog post); IcePop is the token-level
    mask of inclusionAI's Ring-1T report ("Every Step Evolves", arXiv 2510.18855, 2025).

Equation (w is detached; the trainer multiplies it into the per-token loss: compute_loss(..., is_weights=w))
    rho_{i,t} = pi_learner_old(y_{i,t}) / pi_sampler(y_{i,t})                  learner under the sampling weights
    level="token", mode="truncate"    w_{i,t} = min(rho_{i,t}, C)          (TIS)
    level="sequence"                  rho_i = exp(sum_t log rho_{i,t}), in float32, on every token of y_i
    mode="mask"                       w = rho if cap_min <= rho <= C else 0    (MIS; IcePop: token level, [0.5, 5])
    Why: the sampler (vLLM) and the learner (FSDP) give different probabilities to the same tokens under the SAME
    weights (other kernels, precision, batch shapes). The losses take pi_old from the learner, but the tokens were
    drawn from pi_sampler; the correction is the importance weight pi_learner_old / pi_sampler, truncated so that a
    few tokens the sampler found unlikely cannot blow up the variance.

Aggregation unit
    None: tis.py is not a loss. Its weights are per token, [N, T], and enter the loss's per-token term before that
    loss aggregates it; level="sequence" writes the sequence's weight on each of its tokens.

Defaults and their source
    cap     = 2.0         Yao et al.'s recipe (C = 2). PipelineRL's paper truncates at c = 5.
    level   = "token"     TIS; "sequence" is unbiased but of much higher variance.
    mode    = "truncate"  TIS; "mask" drops the outlier tokens (or sequences) instead of capping them.
    cap_min = None        no lower bound (TIS has none; with mode="truncate" a cap_min clamps from below too).

Conventions
    - learner_logprobs are the learner's logprobs under the weights the sampler used (pi_old), without gradient.
      They are not the logprobs being trained: this ratio is learner_old / sampler, not current / old.
    - Both sides must see the same distribution: the learner divides the logits by the sampling temperature, the
      sampler reports logprobs after temperature, and neither applies top-p/top-k alone. mismatch_metrics is how
      to notice when they do not.
    - The sequence ratio is built from the sum of log-ratios in (at least) float32: a product of hundreds of
      ratios, or a sum in bf16, is meaningless. Weights are 0 outside the mask.
"""

from __future__ import annotations

import torch
from torch import Tensor


# ----------------------------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------------------------


def tis_weights(
    learner_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    *,
    cap: float = 2.0,
    level: str = "token",
    mode: str = "truncate",
    cap_min: float | None = None,
) -> Tensor:
    """Importance weights pi_learner_old / pi_sampler, truncated or masked, to pass as is_weights.

    Args:
        learner_logprobs: [N, T] log pi_learner_old of the sampled tokens (learner, sampling weights, no gradient).
        sampler_logprobs: [N, T] log pi_sampler, as reported by the generator.
        mask: [N, T] bool or float, true where a token counts. Masked slots may hold anything, NaN and inf included.
        cap: C, the upper bound.
        level: "token" (one ratio per token) or "sequence" (the product over the completion, on all its tokens).
        mode: "truncate" (clamp to [cap_min, cap]) or "mask" (weight 0 outside [cap_min, cap], rho inside).
        cap_min: lower bound, or None for none.

    Returns:
        weights: [N, T], detached, float32 (float64 for float64 input), 0 outside the mask.
    """
    mask = mask.bool()                                                        # [N, T]
    log_ratio = _log_ratio(learner_logprobs, sampler_logprobs, mask)          # [N, T], 0 where masked
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio)   # [N, T], log rho_i on each token
    elif level != "token":
        raise ValueError(f"level must be 'token' or 'sequence', not {level!r}")
    ratio = torch.exp(log_ratio)                                              # [N, T]
    low = 0.0 if cap_min is None else cap_min                                 # ratio >= 0: 0.0 is no lower bound
    if mode == "truncate":
        weights = ratio.clamp(low, cap)                                       # [N, T]
    elif mode == "mask":
        weights = torch.where((ratio >= low) & (ratio <= cap), ratio, 0.0)    # [N, T]
    else:
        raise ValueError(f"mode must be 'truncate' or 'mask', not {mode!r}")
    return torch.where(mask, weights, 0.0)


# ----------------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------------


def mismatch_metrics(
    learner_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    *,
    cap: float = 2.0,
) -> dict[str, float]:
    """How far the sampler's probabilities are from the learner's, over the masked tokens.

    Args:
        learner_logprobs: [N, T] log pi_learner_old, as for tis_weights.
        sampler_logprobs: [N, T] log pi_sampler.
        mask: [N, T] bool or float, true where a token counts. Masked slots may hold anything, NaN and inf included.
        cap: the cap at which to count truncated tokens (tis_weights' default).

    Returns:
        python floats, prefixed so they do not collide with the losses' metrics:
        mismatch_log_ratio_mean  mean of log pi_learner_old - log pi_sampler
        mismatch_kl_k3           k3 estimate of KL(pi_sampler || pi_learner_old): rho - 1 - log rho, >= 0
        mismatch_max_abs_diff    max |log pi_learner_old - log pi_sampler|
        mismatch_trunc_frac      fraction of tokens with rho > cap: truncated by TIS, zeroed by MIS (token level)
    """
    mask = mask.bool()                                                        # [N, T]
    log_ratio = _log_ratio(learner_logprobs, sampler_logprobs, mask)          # [N, T], 0 where masked
    abs_diff = torch.where(mask, log_ratio.abs(), 0.0)                        # [N, T]
    return {
        "mismatch_log_ratio_mean": _masked_mean(log_ratio, mask),
        "mismatch_kl_k3": _masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
        "mismatch_max_abs_diff": float(abs_diff.max()) if abs_diff.numel() else 0.0,
        "mismatch_trunc_frac": _masked_mean(torch.exp(log_ratio) > cap, mask),
    }


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------


def _log_ratio(learner_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log pi_learner_old - log pi_sampler: [N, T], detached, at least float32, exactly 0 where masked."""
    # Sanitise before any arithmetic: garbage in masked slots must reach neither exp() nor a sum over the sequence.
    # Work in at least float32: a sum of hundreds of bf16 log-ratios is meaningless.
    dtype = torch.promote_types(torch.promote_types(learner_logprobs.dtype, sampler_logprobs.dtype), torch.float32)
    learner = torch.where(mask, learner_logprobs.detach().to(dtype), 0.0)     # [N, T]
    sampler = torch.where(mask, sampler_logprobs.detach().to(dtype), 0.0)     # [N, T]
    return learner - sampler


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    """Mean of x over the true entries of mask (0.0 when there are none), as a python float for logging."""
    x = torch.where(mask, x.detach().float(), 0.0)
    return float(x.sum() / mask.sum().clamp(min=1))
