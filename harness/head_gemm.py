"""harness/head_gemm.py: the learner's LM head as log-probabilities, and the split-bf16 GEMM of the FP32 head
(--lm-head-gemm split-bf16). A runtime module: a reader of the recipe may skip it.

`target_logprobs` turns hidden states into log pi(target) (and the policy's entropy, a metric) a chunk of rows at a
time, so that a micro-batch's [tokens, vocab] logits never exist at once: under --lm-head-gemm fp32 each chunk's
float32 logits are recomputed in backward; under split-bf16, `split_bf16_logprobs` computes the same logprobs, at
float32's accuracy, from bf16 tensor-core products (the float32 weight split into bf16 parts), with its own backward
(_SplitBf16Head): a faster way to the same head, not a different one. `install_target_logprobs` makes a learner's
model run it inside the head's own FSDP2 unit, where its weight is gathered, when asked with a `LogprobRequest`;
`model_logprobs` is how train.py asks. `logits_logprobs` and `logits_entropy` are the same two quantities from full
logits, for a model whose logits must exist whole (soft-capping) and for the tests."""

from __future__ import annotations

import functools
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch.distributed.fsdp import register_fsdp_forward_method


def target_logprobs(hidden: Any, targets: Any, weight: Any, bias: Any, temperature: float, chunk: int,
                    gemm: str = "fp32", entropy: bool = False) -> tuple[Any, Any]:
    """(log pi(targets) [M], with `entropy` the policy's entropy at each row [M], a metric without gradient, else
    None) of the LM head `weight` [V, H] (`bias` [V] or None) on hidden states [M, H], after dividing the logits by
    `temperature`, `chunk` rows of logits at a time. `gemm`: fp32, the head's linear layer on hidden states of its
    weight's dtype, each chunk's logits taken to float32 and recomputed in backward (activation checkpointing);
    split-bf16, bf16 hidden states as they are, float32's logprobs from bf16 products (split_bf16_logprobs)."""
    if gemm == "split-bf16":
        out = split_bf16_logprobs(hidden, targets, weight, bias, temperature, chunk, entropy=entropy)
        return out if entropy else (out, None)
    if targets.numel() <= chunk:  # one chunk: nothing to save by recomputing it
        logprobs, entropies = _head_chunk(hidden, targets, weight, bias, temperature, entropy)
    else:
        outputs = [torch.utils.checkpoint.checkpoint(
            _head_chunk, hidden[i: i + chunk], targets[i: i + chunk], weight, bias, temperature, entropy,
            use_reentrant=False) for i in range(0, targets.numel(), chunk)]
        logprobs, entropies = (torch.cat(parts) for parts in zip(*outputs))
    return logprobs, entropies if entropy else None


def _head_chunk(hidden: Any, targets: Any, weight: Any, bias: Any, temperature: float,
                entropy: bool = False) -> tuple[Any, Any]:
    """One chunk of the fp32 head: hidden [n, H] -> (log pi(targets) [n], with `entropy` the entropy at each row [n],
    without gradient, else 0s), both from the chunk's one [n, V] of logits."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logprobs, logits_entropy(logits) if entropy else logprobs.detach().new_zeros(logprobs.shape)


def logits_logprobs(logits: Any, targets: Any, temperature: float) -> Any:
    """log_softmax(logits / T) at the targets: logits [..., V], targets [...] -> [...] float32."""
    logits = logits.float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def logits_entropy(logits: Any) -> Any:
    """The entropy of softmax(logits) over the last axis, without gradient: logits [..., V] -> [...] float32."""
    with torch.no_grad():
        logp = torch.log_softmax(logits.float(), dim=-1)
        return -(logp.exp() * logp).sum(-1)


# ----------------------------------------------------------------------------------------------------------------
# The learner's LM head: a model whose head scores the rows' next tokens in chunks (install_target_logprobs), and
# its logprobs as train.py's steps ask for them (model_logprobs)
# ----------------------------------------------------------------------------------------------------------------


LOGITS_CHUNK_BYTES = 1 << 28  # default of --logits-chunk-tokens: 256 MiB of float32 logits held at once
SPLIT_CHUNK_BYTES = 1 << 30  # its default under split-bf16, whose chunks are not recomputed: a GEMM of more rows
                             # runs nearer the tensor cores' peak, and each chunk reads the whole weight again


@dataclass(frozen=True)
class LogprobRequest:
    """What a learner's LM head scores for model_logprobs, instead of returning logits."""

    targets: torch.Tensor  # [R, W-1] the token each position of the model's rows predicts
    temperature: float  # the sampler's: the logits are divided by it
    scored: torch.Tensor | None = None  # [M] positions of the flattened [R * (W-1)] to score (0 elsewhere); None: all
    entropy: bool = False  # the policy's entropy at each scored position too (a metric: no gradient)


def model_logprobs(model: Any, input_ids: Any, temperature: float, scored: Any = None, entropy: bool = False,
                   **layout: Any) -> tuple[Any, Any]:
    """log pi(token) [R, W-1] of each next token of input_ids [R, W] (with the attention mask or the packed position
    ids, `layout`), after dividing the logits by the sampling temperature, and with `entropy` the policy's entropy
    at each position [R, W-1] (a metric, without gradient; else None). A learner's model (install_target_logprobs)
    scores only the `scored` positions [M] of the flattened [R * (W-1)] (None: all; 0 elsewhere) through its head
    in chunks; any other model goes through its full logits."""
    targets = input_ids[:, 1:]
    if hasattr(model, "target_logprobs"):
        return model.target_logprobs(input_ids, LogprobRequest(targets, temperature, scored, entropy), **layout)
    logits = model(input_ids=input_ids, use_cache=False, **layout).logits[:, :-1]
    entropies = logits_entropy(logits.detach().float() / temperature) if entropy else None
    return logits_logprobs(logits, targets, temperature), entropies


def install_target_logprobs(model: Any, chunk_tokens: int | None = None, gemm: str = "fp32") -> None:
    """Give a learner's model `model.target_logprobs(input_ids, request, **layout)`: its body's hidden states
    [R, W, H], then its LM head on them with the LogprobRequest, which returns (log pi(target) [R, W-1], the entropy
    [R, W-1] or None) from target_logprobs rather than logits. Both run inside FSDP2's hooks: the model's
    method is registered as a forward of its root unit (register_fsdp_forward_method), and the head is called as a
    module, so its unit (the FP32 head's own, or the embedding's it is tied to) is gathered, cast and reduced as in
    any forward, and an idle rank's plain forward (runtime.idle_forward) makes the same collectives. Without a
    request the head is its plain linear layer. `chunk_tokens` (--logits-chunk-tokens) and `gemm` (--lm-head-gemm):
    see head_forward. Not for models that transform the logits after the head (Gemma's soft-capping): those keep
    the full logits."""
    if getattr(model.config, "final_logit_softcapping", None):
        return
    install_head_logprobs(model.get_output_embeddings(), chunk_tokens, gemm)
    model.target_logprobs = types.MethodType(policy_target_logprobs, model)
    register_fsdp_forward_method(model, "target_logprobs")  # a no-op on a model that is not FSDP2's


def policy_target_logprobs(model: Any, input_ids: Any, request: LogprobRequest, **layout: Any) -> tuple[Any, Any]:
    """A learner's model.target_logprobs: its body on input_ids [R, W] (with the attention mask or the packed
    position ids), then its LM head on the hidden states with `request`."""
    hidden = model.get_decoder()(input_ids=input_ids, use_cache=False, **layout).last_hidden_state  # [R, W, H]
    return model.get_output_embeddings()(hidden, request)


def install_head_logprobs(head: Any, chunk_tokens: int | None = None, gemm: str = "fp32") -> None:
    """Make the LM head `head` (a linear layer) take an optional LogprobRequest: head_forward, with these settings.
    Its own forward hooks (FSDP2's gathers, the FP32 head's cast) run as before: only its forward body changes."""
    vocab = head.weight.shape[0]
    if gemm == "split-bf16":
        chunk = chunk_tokens or max(128, SPLIT_CHUNK_BYTES // (4 * vocab) // 128 * 128)
    else:
        chunk = chunk_tokens or max(1, LOGITS_CHUNK_BYTES // (4 * vocab))  # positions per chunk
    head.forward = functools.partial(head_forward, head, chunk, gemm)


def head_forward(head: Any, chunk: int, gemm: str, hidden: Any, request: LogprobRequest | None = None) -> Any:
    """The learner's LM head on hidden states [R, W, H]: without a request, its linear layer (logits); with one,
    (log pi(target) [R, W-1], the entropy [R, W-1] or None) at the request's positions, from
    target_logprobs over chunks of `chunk` positions, so that only one chunk's logits exist at a time.
    `gemm` (--lm-head-gemm): fp32, the head's own linear layer, each chunk recomputed in backward (default chunk:
    as many positions as fit in LOGITS_CHUNK_BYTES of float32 logits); split-bf16, for bf16 hidden states,
    float32's logprobs from bf16 tensor-core products (default chunk: SPLIT_CHUNK_BYTES).

    The request's `scored` [M] (or None: all) names the positions of the flattened [R * (W-1)] to score; the others
    get 0 and cost nothing. Only completion tokens enter a loss, and a chat template's prompt can be most of a short
    completion's row: SmolLM2's system prompt and question (44 tokens) are about 60% of the small-arithmetic task's
    tokens, and its head (49k-token vocabulary, 576 hidden) a fifth of its FLOPs per token."""
    if request is None:  # logits, on hidden states of the weight's dtype (a bf16 trunk's, under split-bf16, too)
        return torch.nn.functional.linear(hidden.to(head.weight.dtype), head.weight, head.bias)
    # split-bf16 takes bf16 hidden states as they are (its products are exact on them); the rest is float32
    split = gemm == "split-bf16" and hidden.dtype == torch.bfloat16
    hidden = hidden if split else hidden.to(head.weight.dtype)
    n, length = request.targets.shape
    flat_hidden = hidden[:, :-1].reshape(n * length, -1)                     # [R*(W-1), H]: the last predicts nothing
    flat_targets = request.targets.reshape(-1)                               # [R*(W-1)]
    if request.scored is not None:
        flat_hidden, flat_targets = flat_hidden[request.scored], flat_targets[request.scored]   # [M, H], [M]
    logprobs, entropies = target_logprobs(flat_hidden, flat_targets, head.weight, head.bias, request.temperature,
                                          chunk, "split-bf16" if split else "fp32", request.entropy)  # [M] each
    if request.scored is not None:  # back to every position, 0 where nothing was scored
        logprobs = logprobs.new_zeros(n * length).index_copy(0, request.scored, logprobs)
        if entropies is not None:
            entropies = entropies.new_zeros(n * length).index_copy(0, request.scored, entropies)
    # [R, W-1], a tensor of its own rather than a view: FSDP2 hooks its backward onto the module's output
    return logprobs.view(n, length).clone(), None if entropies is None else entropies.view(n, length)


def split_bf16_logprobs(hidden: Any, targets: Any, weight: Any, bias: Any, temperature: float, chunk: int,
                        entropy: bool = False) -> Any:
    """log pi(targets) [M] of the head `weight` [V, H] (float32; `bias` [V] or None) on bf16 hidden states [M, H],
    at float32's accuracy from bf16 products (_SplitBf16Head), `chunk` rows of logits at a time; differentiable
    where autograd needs it, and without keeping anything for backward where it does not (old logprobs, the frozen
    reference). With `entropy`: (log pi(targets) [M], the policy's entropy at each row [M], a metric: no
    gradient), from the same chunks of logits."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        logprobs, entropies = _SplitBf16Head.apply(hidden, targets, weight, bias, temperature, chunk, entropy)
    else:
        logprobs, entropies = _split_bf16_forward(hidden, targets, weight, bias, temperature, chunk, None, entropy)
    return (logprobs, entropies) if entropy else logprobs


class _SplitBf16Head(torch.autograd.Function):
    """The FP32 LM head's log pi(target) on bf16 tensor cores, at float32's accuracy (--lm-head-gemm split-bf16).

    Forward. The hidden states are bf16 values (a bf16 trunk computed them), so only the float32 weight needs more
    bits than a bf16 product takes: W / T = hi + mid + lo, three bf16 parts, each the top 8 significant bits of
    what the parts before it left, hold all 24 bits of a float32 exactly. A bf16 x bf16 product is exact in
    float32 and the tensor cores sum in float32, so [h | h | h] @ [lo | mid | hi]^T, one bf16 GEMM of inner size
    3H, gives the logits / T to float32's accuracy (tests/test_head_gemm.py: within 1e-5 of a float32 head, and nearer
    float64 than it, where one bf16 product, h @ hi^T, is off by 1e-2). The log-softmax then runs on them in
    float32, a chunk of rows at a time.

    Backward, without recomputing the logits: the forward keeps D = softmax - onehot(target) [M, V] in bf16, the
    gradient of -log pi(target) with respect to the logits / T (M * V * 2 bytes, half of what the float32 logits
    would take: 2.5 GB for 8,192 tokens of a 152k vocabulary). The target's entry is p - 1 = expm1(log p), so that
    a confident token's small gradient keeps its digits. With s = -(dloss / dlog pi) / T [M], one bf16 product
    each, summed in float32 (the head's GEMMs: 3 x 2MVH FLOPs forward, 2 x 2MVH backward; the bias's is a GEMV):
      hidden:  s * (D @ bf16(W))    it goes back into the bf16 trunk, which rounds it to bf16 in any case
      weight:  D^T @ bf16(s * h)    bf16-grade, as every other weight's gradient in a bf16 learner; AdamW divides
                                    each entry by its running RMS, so a 2^-9 relative error moves a step by as much
      bias:    D^T @ bf16(s)"""

    @staticmethod
    def forward(ctx: Any, hidden: Any, targets: Any, weight: Any, bias: Any, temperature: float, chunk: int,
                entropy: bool) -> tuple:
        grad = hidden.new_empty(hidden.shape[0], weight.shape[0])            # [M, V] bf16: D, filled chunk by chunk
        logprobs, entropies = _split_bf16_forward(hidden, targets, weight, bias, temperature, chunk, grad, entropy)
        entropies = entropies if entropy else logprobs.new_zeros(0)          # an autograd output must be a tensor
        ctx.mark_non_differentiable(entropies)
        ctx.save_for_backward(hidden, weight, grad)
        ctx.temperature = temperature
        return logprobs, entropies

    @staticmethod
    def backward(ctx: Any, grad_logprobs: Any, grad_entropies: Any) -> tuple:
        hidden, weight, grad = ctx.saved_tensors                             # [M, H] bf16, [V, H] fp32, [M, V] bf16
        scale = -grad_logprobs.float() / ctx.temperature                     # [M]: dloss/d(logits / T) = -g D / T
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_hidden = (_mm_float32(grad, weight.to(torch.bfloat16)) * scale[:, None]).to(hidden.dtype)  # [M, H]
        if ctx.needs_input_grad[2]:
            grad_weight = _mm_float32(grad.t(), (hidden * scale[:, None]).to(torch.bfloat16))  # [V, H]
        if ctx.needs_input_grad[3]:
            grad_bias = _mm_float32(grad.t(), scale[:, None].to(torch.bfloat16)).squeeze(1)    # [V]
        return grad_hidden, None, grad_weight, grad_bias, None, None, None


def _split_bf16_forward(hidden: Any, targets: Any, weight: Any, bias: Any, temperature: float, chunk: int,
                        grad: Any, entropy: bool = False) -> tuple[Any, Any]:
    """_SplitBf16Head's forward: (log pi(targets) [M], the entropy at each row [M] if `entropy`, else None); where
    `grad` [M, V] (bf16) is given, D written into it."""
    parts = _split_bf16(weight, temperature)                                 # [V, 3H]: lo | mid | hi of W / T
    logprobs = torch.empty(targets.shape[0], device=hidden.device)          # [M]
    entropies = torch.empty(targets.shape[0], device=hidden.device) if entropy else None  # [M]
    for i in range(0, targets.shape[0], chunk):
        logits = _mm_float32(hidden[i: i + chunk].repeat(1, 3), parts.t())   # [n, V]: the logits / T
        if bias is not None:
            logits += bias / temperature
        chunk_logprobs, chunk_entropies = _logprobs_and_grad(logits, targets[i: i + chunk],
                                                             None if grad is None else grad[i: i + chunk], entropy)
        logprobs[i: i + chunk] = chunk_logprobs
        if entropy:
            entropies[i: i + chunk] = chunk_entropies
    return logprobs, entropies


def _mm_float32(a: Any, b: Any) -> Any:
    """a [n, k] @ b [k, m] of bf16 matrices, summed and returned in float32: on a GPU one tensor-core GEMM; on a CPU
    the same products (a bf16 x bf16 product is exact in float32) in a float32 GEMM."""
    if a.is_cuda and _MM_OUT_DTYPE:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError) as error:  # a torch without mm's out_dtype on this GPU: said once
            _MM_OUT_DTYPE.clear()
            print(f"torch.mm(..., out_dtype=float32) failed ({error}); the split-bf16 head runs float32 GEMMs: the "
                  "same values, slower", file=sys.stderr)
    return torch.mm(a.float(), b.float())


_MM_OUT_DTYPE = [True]  # cleared where torch.mm(bf16, bf16, out_dtype=float32) fails on a GPU


def _fused_on_gpu(fn: Any) -> Any:
    """fn compiled (torch.compile) where its first argument is on a GPU: its elementwise steps over [tokens, vocab]
    are bound by memory, and one kernel reads the logits once where eager torch reads them once a step. As it is
    elsewhere, and where compiling fails (said once: the same math, slower). `run.fused`: None until it ran on a
    GPU, then whether it runs compiled."""
    compiled: list = []  # torch.compile's wrapper, made at the first call on a GPU (it imports dynamo: seconds)

    def run(*args: Any) -> Any:
        if args[0].is_cuda and run.fused is not False:
            try:
                compiled[:] = compiled or [torch.compile(fn, dynamic=True)]
                result = compiled[0](*args)
                run.fused = True
                return result
            except Exception as error:  # e.g. no C compiler for Triton on this machine
                print(f"{fn.__name__}: torch.compile failed ({type(error).__name__}: {error}); running it unfused",
                      file=sys.stderr)
                run.fused = False
        return fn(*args)
    run.fused = None
    return run


@_fused_on_gpu
def _split_bf16(weight: Any, temperature: float) -> Any:
    """weight [V, H] float32 -> [V, 3H] bf16: lo | mid | hi, whose sum is weight / temperature exactly. Each part
    is the top 8 significant bits of what the parts before it left, cut by clearing the low 16 bits of the float32
    (a cast's rounding would do as well, but torch.compile may skip a bf16 round trip inside a fused kernel, and
    then mid and lo come out 0). The small parts come first, so that a GEMM adds their products while its running
    sum is small: after hi's, each would be rounded to the full sum's float32 ulp (hi | mid | lo was twice float32's
    error on a CPU; this is half)."""
    scaled = weight / temperature                                            # float32 (rounded once: float32's error)
    hi = _top_8_bits(scaled)
    mid = _top_8_bits(scaled - hi)                                           # exact differences: no bit is lost
    lo = scaled - hi - mid                                                   # at most 8 significant bits are left
    return torch.cat([lo, mid, hi], dim=1).to(torch.bfloat16)                # exact: each is a bf16 value


def _top_8_bits(x: Any) -> Any:
    """float32 x with its 16 low bits cleared: the bf16 value nearest x towards 0."""
    return (x.view(torch.int32) & -65536).view(torch.float32)


@_fused_on_gpu
def _logprobs_and_grad(logits: Any, targets: Any, grad: Any, entropy: bool = False) -> tuple[Any, Any]:
    """(log pi(targets) [n], with `entropy` the entropy at each row [n], else None) from float32 logits [n, V],
    already divided by the temperature; where `grad` [n, V] (bf16) is given, writes into it
    softmax - onehot(targets), the gradient of -log pi(targets) wrt the logits."""
    lse = torch.logsumexp(logits, dim=1)                                     # [n]
    logprobs = logits.gather(1, targets[:, None]).squeeze(1) - lse           # [n]
    entropies = None
    if grad is not None or entropy:
        probs = torch.exp(logits - lse[:, None])                             # [n, V] softmax, float32
        if entropy:  # H = -sum p log p = lse - sum p z
            entropies = lse - (probs * logits).sum(dim=1)
        if grad is not None:
            grad.copy_(probs)                                                # rounded to bf16
            # the target's p - 1 as expm1(log p): a confident token's 1 - p keeps its digits
            grad.scatter_(1, targets[:, None], torch.expm1(logprobs)[:, None].to(grad.dtype))
    return logprobs, entropies
