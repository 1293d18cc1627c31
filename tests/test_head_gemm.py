"""harness/head_gemm.py: the LM head's log-probabilities in chunks, and the split-bf16 GEMM of the FP32 head."""

import pytest
import torch

from harness import head_gemm
from helpers import U_BF16, assert_within, fp32_sum_error, head_weights


def test_split_bf16_head_gives_float32_logprobs_where_one_bf16_product_does_not():
    """--lm-head-gemm split-bf16: three bf16 products of the bf16 hidden states by the float32 weight's exact bf16
    parts, summed in float32, give log pi(target) within 1e-5 of a float32 head (train.py's, log_softmax included)
    and of float64, at a realistic scale: 8k vocabulary, 1024 hidden, logits up to ~17. There the float32 head
    itself is 4-5e-6 from float64, and split-bf16 closer (measured over 6 seeds: 2-2.6e-6 from float64, 3-5e-6
    from float32; at logits up to ~20, 2-3e-6 and 4-9e-6). Its shortcuts miss by far more: one bf16 product of the
    weight's top part summed in float32 (what tensor cores give a bf16 head) by ~1.5e-2, a bf16 GEMM with bf16
    logits by ~5e-2. On a CPU the products are the same (exact in float32), summed in a float32 GEMM."""
    weight, hidden, targets = head_weights(8192, 1024, 96, logit_std=3.5)
    logits = hidden.double() @ weight.double().T                                      # [M, V]
    assert logits.max() > 15
    float64 = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    float32 = head_gemm.logits_logprobs(hidden.float() @ weight.T, targets, 1.0).double()
    split = head_gemm.split_bf16_logprobs(hidden, targets, weight, None, 1.0, chunk=40).double()  # three chunks
    # z_t - logsumexp(z): a sum of 3H exact products (split) or H (float32), then one of V exps; either side is off
    # by 2 fp32_sum_error of that chain (about 3e-4 at |z| = 17), two of them by twice that
    bound = 2 * fp32_sum_error([3 * 1024, 8192], logits.abs().amax(-1))                       # [M] one side
    assert_within(split - float32, 2 * bound, "split-bf16 vs float32")
    assert_within(split - float64, bound, "split-bf16 vs float64")
    assert (split - float64).abs().max() < (float32 - float64).abs().max()
    one_product = head_gemm.logits_logprobs(hidden.float() @ weight.to(torch.bfloat16).float().T, targets, 1.0)
    bf16 = head_gemm.logits_logprobs(hidden @ weight.to(torch.bfloat16).T, targets, 1.0)
    assert ((one_product.double() - float64).abs() > bound).any() and ((bf16.double() - float64).abs() > bound).any()


@pytest.mark.parametrize("gemm", ["fp32", "split-bf16"])
def test_target_logprobs_are_the_full_logits_log_softmax_at_the_targets(gemm):
    """head_gemm.target_logprobs, the named function the learner's head runs, against log_softmax of the whole
    [M, V] logits gathered at the targets (temperature 0.7, a bias): the same logprobs, entropy and gradients, in
    chunks of 1, 7 or all rows, to float32 rounding (within 1e-5 of a logprob near -10, where a GEMM of one row
    and one of all rows already differ by 4e-6; split-bf16, on the bf16 hidden states it takes, its gradients
    bf16-grade by design: within 1% in relative norm). Rows added around them (padding, other sequences) change
    none of their values beyond that rounding."""
    weight, hidden, targets = head_weights(512, 64, 40, logit_std=2.5)
    bias = torch.randn(512, generator=torch.Generator().manual_seed(3)) * 0.5
    hidden = hidden if gemm == "split-bf16" else hidden.float()
    reference_hidden = hidden.detach().float().requires_grad_()
    reference_weight = weight.clone().requires_grad_()
    logits = torch.nn.functional.linear(reference_hidden, reference_weight, bias)               # [M, V]
    expected = head_gemm.logits_logprobs(logits, targets, 0.7)
    expected_entropy = head_gemm.logits_entropy(logits / 0.7)
    expected.sum().backward()
    # logprob: 2 fp32_sum_error of a (3H + 1)-term logit (split-bf16's; fp32's H + 1 is fewer) then V exps, a side;
    # entropy = lse - sum p z, with z and lse off by delta and each p by 2 delta: 2 delta (1 + max|z|) a side
    delta = fp32_sum_error([3 * 64 + 1, 512], logits.detach().abs().amax(-1) / 0.7)            # [M]
    bound, entropy_bound = 2 * 2 * delta, 2 * 2 * delta * (1 + logits.detach().abs().amax(-1) / 0.7)
    # gradients: D = softmax - onehot off by 2 delta of p, then sums of V (hidden) or M (weight) terms, a side;
    # split-bf16 rounds D and the other factor to bf16, so each product is off by up to 2 u_bf16
    grad_bound = 2 * (2 * delta.max().item() + fp32_sum_error([512, 40], 1.0))
    grad_bound += 2 * U_BF16 if gemm == "split-bf16" else 0
    for chunk in (1, 7, 40):
        leaf, w = hidden.detach().clone().requires_grad_(), weight.clone().requires_grad_()
        logprobs, entropy = head_gemm.target_logprobs(leaf, targets, w, bias, 0.7, chunk, gemm, entropy=True)
        assert_within(logprobs.detach() - expected.detach(), bound, ("logprobs", chunk))
        assert_within(entropy - expected_entropy, entropy_bound, ("entropy", chunk))
        assert not entropy.requires_grad
        logprobs.sum().backward()
        for grad, ref in ((leaf.grad.float(), reference_hidden.grad), (w.grad, reference_weight.grad)):
            assert_within((grad - ref).norm() / ref.norm(), grad_bound, ("gradient", chunk))
    assert head_gemm.target_logprobs(hidden, targets, weight, bias, 0.7, 7, gemm)[1] is None  # no entropy asked
    padded = torch.cat([torch.zeros_like(hidden[:5]), hidden, torch.ones_like(hidden[:3])])   # [5 + M + 3, H]
    padded_targets = torch.cat([torch.zeros_like(targets[:5]), targets, torch.ones_like(targets[:3])])
    logprobs, _ = head_gemm.target_logprobs(padded, padded_targets, weight, bias, 0.7, 7, gemm)
    unpadded, _ = head_gemm.target_logprobs(hidden, targets, weight, bias, 0.7, 7, gemm)
    assert_within(logprobs[5:-3] - unpadded, bound, "padded rows")  # two float32 heads of the same rows


def test_the_split_bf16_parts_sum_to_the_weight_over_t_exactly():
    weight = torch.randn(64, 48) * torch.logspace(-6, 2, 48)                         # [V, H], magnitudes 1e-6..1e2
    for temperature in (1.0, 0.7):
        parts = head_gemm._split_bf16(weight, temperature).double()                      # [V, 3H]: lo | mid | hi
        assert torch.equal(parts[:, :48] + parts[:, 48:96] + parts[:, 96:], (weight / temperature).double())
        assert (parts[:, :48].abs() <= 2.0 ** -15 * parts[:, 96:].abs()).all()       # lo holds the lowest bits


def test_the_learner_s_head_is_a_plain_linear_layer_without_a_request():
    """install_head_logprobs leaves the head's plain call its linear layer, so that any other forward of the model
    (generation, the idle forward of a rank with no micro-batch left) gets logits; with a LogprobRequest it gives
    (log pi(target), entropy) at the scored positions, 0 at the others, never logits."""
    head = torch.nn.Linear(16, 32)
    expected_logits = head(torch.ones(2, 5, 16)).detach()
    head_gemm.install_head_logprobs(head, chunk_tokens=3)
    hidden = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(head(torch.ones(2, 5, 16)), expected_logits)
    targets = torch.randint(0, 32, (2, 4), generator=torch.Generator().manual_seed(1))
    scored = torch.tensor([1, 2, 6])
    logprobs, entropy = head(hidden, head_gemm.LogprobRequest(targets, 1.0, scored))
    full = head_gemm.logits_logprobs(head(hidden)[:, :-1], targets, 1.0).reshape(-1)
    expected = torch.zeros(8).index_copy(0, scored, full[scored]).view(2, 4)
    # two float32 heads of 16-term logits and a 32-way softmax: 2 * 2 * fp32_sum_error([17, 32], 3) = 7e-6, within
    # torch's float32 default (1e-5 + 1.3e-6 |y|); measured 0.016 of it
    torch.testing.assert_close(logprobs, expected)
    assert entropy is None


def test_split_bf16_head_gradients_are_float32_autograd_s_to_bf16_rounding():
    """The learner's head under split-bf16, as train.py's token_logprobs drives it (a scored subset, temperature 0.7,
    chunks of 17 of its 70 positions, a bias): log pi(target) within 1e-5 of autograd through a float32 log_softmax, 0
    where nothing is scored, and the gradients of the hidden states, the weight and the bias within 1% in relative
    norm (bf16-grade by design: D = softmax - onehot and the other factor of each product are rounded to bf16,
    2^-9 = 0.2% each; measured 0.18-0.24%). Without grad it keeps nothing for backward and gives the same values."""
    n, length, temperature = 3, 40, 0.7
    weight, _, _ = head_weights(4096, 256, 1, logit_std=2.5)  # over T = 0.7: ~3.6, random targets at -10
    head = torch.nn.Linear(256, 4096)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.normal_(0, 0.5)
    head_gemm.install_head_logprobs(head, chunk_tokens=17, gemm="split-bf16")
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, length, 256, generator=gen).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 4096, (n, length - 1), generator=gen)
    scored = torch.randperm(n * (length - 1), generator=gen)[:70].sort().values
    loss_weights = torch.randn(n, length - 1, generator=gen)
    request = head_gemm.LogprobRequest(targets, temperature, scored, entropy=True)
    logprobs, entropy = head(hidden, request)
    (logprobs * loss_weights).sum().backward()

    reference = dict(hidden=hidden.detach().float().requires_grad_(), weight=weight.clone().requires_grad_(),
                     bias=head.bias.detach().clone().requires_grad_())
    logits = (reference["hidden"][:, :-1] @ reference["weight"].T + reference["bias"]) / temperature
    expected = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).reshape(-1)
    expected = torch.zeros(n * (length - 1)).index_copy(0, scored, expected[scored]).view(n, length - 1)
    (expected * loss_weights).sum().backward()
    # a side: a (3H + 1)-term logit (split-bf16's exact products; float32's H + 1 is fewer), then V exps (helpers)
    delta = fp32_sum_error([3 * 256 + 1, 4096], logits.detach().abs().amax(-1).reshape(-1)[scored])  # [70]
    assert_within(logprobs.detach().reshape(-1)[scored] - expected.detach().reshape(-1)[scored], 2 * 2 * delta)
    assert torch.count_nonzero(logprobs) == len(scored)
    with torch.no_grad():  # the policy's entropy at the scored positions, from the same chunks; 0 elsewhere
        logp = torch.log_softmax(logits.detach().double(), -1)
        expected_entropy = -(logp.exp() * logp).sum(-1).reshape(-1).float()
        expected_entropy = torch.zeros(n * (length - 1)).index_copy(0, scored, expected_entropy[scored])
    assert not entropy.requires_grad  # lse - sum p z: z and lse off by delta, each p by 2 delta, a side
    scale = logits.detach().abs().amax(-1).reshape(-1)[scored]
    assert_within(entropy.reshape(-1)[scored] - expected_entropy[scored], 2 * 2 * delta * (1 + scale), "entropy")
    assert expected_entropy[scored].min() > 0.1  # a test of something: far from 0 at every scored position
    # each product of bf16-rounded factors off by 2 u_bf16; D's float32 error (2 delta) and the sums' around it
    grad_bound = 2 * U_BF16 + 2 * (2 * delta.max().item() + fp32_sum_error([4096, 70], 1.0))
    for name, grad in [("hidden", hidden.grad.float()), ("weight", head.weight.grad), ("bias", head.bias.grad)]:
        ref = reference[name].grad
        assert_within((grad - ref).norm() / ref.norm(), grad_bound, name)
    with torch.no_grad():
        assert torch.equal(head(hidden, request)[0], logprobs)
