"""harness/memory_plan.py: what one learner rank will hold in GPU memory, estimated from the model's config alone, so
that a layout that cannot fit is refused before anything starts, with the flags that would make it fit, instead of
running out of memory after vLLM has started and the model has loaded.

A runtime module of the learner: a reader of the recipe may skip it. train.py's flag checks ask it at start-up on
a GPU (harness/flags.py: `learner_memory_plan`, `memory_problems`), and `python train.py plan` prints a plan without a
GPU. It holds:
  - SHAPES and `shape_config`: the configs of a few real models, written here so that neither the plan nor a
    benchmark's random-weight model needs a download;
  - `parameter_counts`: a dense decoder's parameters from its config, without building the model;
  - `kv_cache_bytes_per_token` and `sequence_kv_cache_bytes`: what vLLM's KV cache holds per token and for one
    sequence (harness/vllm_replica.py sizes a CPU replica's cache by it, harness/flags.py checks a GPU's share);
  - `activation_bytes_per_token_layer`: what backward keeps of one decoder layer, per token;
  - `Layout` (the flags and the machine the plan depends on), `estimate` and `plan_memory` -> `MemoryPlan`, whose
    `problems()` say, when it does not fit, which flags would make it fit, in order of cost.

The estimate counts what stays allocated, and rounds up where PyTorch's behaviour varies; short-lived buffers
(the gradient of the hidden state between layers, NCCL's staging, cuBLAS workspaces) and the caching allocator's
fragmentation are covered by a margin (MARGIN_BYTES + MARGIN_FRACTION of the GPU). It assumes attention that keeps
no [tokens, tokens] matrix (flash attention, the learner's choice on a GPU with --packing); sdpa over a dense mask
needs more.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 1 << 30
MARGIN_BYTES = 2 * GIB  # a rank's CUDA context, NCCL's communicators and cuBLAS's workspaces: about 1-2 GiB
MARGIN_FRACTION = 0.05  # the caching allocator's fragmentation under tensors of changing sizes (micro-batches vary)
VLLM_CONTEXT_BYTES = GIB  # the CUDA context of vLLM's worker on a GPU it shares, outside gpu_memory_utilization

# Dense decoders whose configs the plan and the benchmarks use without a download (values from each model's
# config.json on the Hugging Face hub). Qwen3-8B alone keeps its LM head apart from the input embedding.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936,
                       tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936,
                     tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                     tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                         tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=1e5, rms_norm_eps=1e-5),
}


def shape_config(name: str) -> Any:
    """The transformers config of SHAPES[name] (a Qwen3Config or LlamaConfig), e.g. for a random-weight model:
    `AutoModelForCausalLM.from_config(shape_config("qwen3-8b"))`."""
    from transformers import AutoConfig  # here, not at the top: a plain plan should not wait for transformers

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}: one of {', '.join(SHAPES)}")
    values = dict(SHAPES[name])
    return AutoConfig.for_model(values.pop("model_type"), **values)


# ----------------------------------------------------------------------------------------------------------------
# The model: parameters and activations from the config
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParameterCounts:
    """A dense decoder's parameters by FSDP2 unit: the input embedding, one decoder layer (of `layers`), the final
    norm, and the LM head's own weight (0 when it is tied to the input embedding)."""

    embedding: int
    layer: int
    layers: int
    final_norm: int
    head: int

    @property
    def total(self) -> int:
        return self.embedding + self.layers * self.layer + self.final_norm + self.head

    @property
    def head_weight(self) -> int:
        """The parameters of the weight the LM head multiplies by (the embedding's, when tied)."""
        return self.head or self.embedding


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def parameter_counts(config: Any) -> ParameterCounts:
    """Parameters of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2) from its config, equal to
    `sum(p.numel() for p in model.parameters())` of the model built from it. Raises ValueError for a model this
    does not describe (mixture-of-experts, another layer layout)."""
    if getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0):
        raise ValueError(f"{config.model_type}: a mixture of experts, which the memory plan does not describe")
    if config.model_type not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"{config.model_type}: not a decoder the memory plan describes (llama, mistral, qwen2, qwen3)")
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * _head_dim(config), config.num_key_value_heads * _head_dim(config)
    attention = h * q + 2 * h * kv + q * h
    if config.model_type == "qwen2":  # biases on q, k and v, none on o
        attention += q + 2 * kv
    elif getattr(config, "attention_bias", False):
        attention += q + 2 * kv + h
    if config.model_type == "qwen3":  # RMSNorm of each query and key head
        attention += 2 * _head_dim(config)
    mlp = 3 * h * i + ((2 * i + h) if getattr(config, "mlp_bias", False) else 0)
    layer = attention + mlp + 2 * h  # two RMSNorms: before attention and before the MLP
    return ParameterCounts(embedding=v * h, layer=layer, layers=config.num_hidden_layers, final_norm=h,
                           head=0 if config.tie_word_embeddings else v * h)


def kv_cache_bytes_per_token(config: Any, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """Bytes of vLLM's KV cache per token of a sequence, on each GPU of `tensor_parallel_size`: a key and a value of
    head_dim for every KV head of every layer, the heads split over the GPUs (no finer than one a GPU: vLLM
    replicates them). A decoder whose layers all attend to the whole context holds this; one with sliding-window or
    other layers holds less, so it bounds them."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * max(1, kv_heads // tensor_parallel_size) * _head_dim(config) * dtype_bytes


def sequence_kv_cache_bytes(config: Any, dtype_bytes: int, tokens: int, tensor_parallel_size: int = 1) -> int:
    """The KV cache vLLM needs to hold one sequence of `tokens` (its max_model_len), on each GPU: the tokens and two
    of its blocks of up to 256, the last one filled in part and the one it holds back. vLLM refuses to start an
    engine whose cache cannot hold this ("To serve at least one request ...")."""
    return kv_cache_bytes_per_token(config, dtype_bytes, tensor_parallel_size) * (tokens + 2 * 256)


def activation_bytes_per_token_layer(config: Any, dtype_bytes: int) -> int:
    """Bytes one decoder layer keeps per token for its backward, in a compute dtype of `dtype_bytes` (2: bfloat16,
    4: float32). Projections keep their inputs, which are other tensors' outputs and counted once:
      - each RMSNorm (two per layer) keeps the float32 copy of its input (for the variance's gradient) and its
        output before the weight (for the weight's gradient): 4 + dtype bytes per hidden unit;
      - Qwen3's per-head RMSNorms of the queries and keys keep the same per query and key unit;
      - attention keeps the queries, keys and values after RoPE (RoPE itself keeps only cos and sin, shared), its
        output (o_proj's input) and a float32 log-sum-exp per head; flash attention keeps no [tokens, tokens] matrix;
      - the MLP keeps gate_proj's output (SiLU's input), SiLU's output, up_proj's output and their product
        (down_proj's input): four [tokens, intermediate] tensors."""
    b, h, i = dtype_bytes, config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * _head_dim(config), config.num_key_value_heads * _head_dim(config)
    norms = 2 * (4 + b) * h
    head_norms = (4 + b) * (q + kv) if config.model_type == "qwen3" else 0
    attention = b * (2 * q + 2 * kv) + 4 * config.num_attention_heads
    mlp = 4 * b * i
    return norms + head_norms + attention + mlp


# ----------------------------------------------------------------------------------------------------------------
# The layout and the plan
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Everything the plan depends on besides the model: the batch, the flags, the machine."""

    learner_ranks: int  # FSDP2 shards parameters, gradients and AdamW state over all of them
    gpu_memory: int  # bytes of one learner GPU
    micro_batch_tokens: int  # --micro-batch-tokens
    sequence_tokens: int  # the longest prompt + completion (vLLM's context)
    group_size: int
    prompts_per_step: int
    dtype_bytes: int  # of the compute dtype: 2 with --dtype bfloat16, 4 with float32
    fp32_lm_head: bool = True
    logits_chunk_tokens: int = 1
    split_bf16_head: bool = False  # --lm-head-gemm split-bf16 (its auto choice on a GPU with bf16 and the FP32 head)
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    fsdp_reshard: str = "always"  # --fsdp-reshard: auto, always or never (reshard_layers resolves it)
    reference_model: bool = False  # --kl-coef's frozen copy of the policy
    generator_share: float = 0.0  # vLLM's fraction of the learner's GPU, where the two share it
    push_gpu: bool = False  # by vLLM's nccl or ipc engine: rank 0 holds the gathered weights on its GPU during a push

    @property
    def rank_batch_tokens(self) -> int:
        """This rank's share of the batch, every sequence at its longest."""
        return math.ceil(self.prompts_per_step / self.learner_ranks) * self.group_size * self.sequence_tokens

    @property
    def reshard_layers(self) -> bool:
        """Whether FSDP2 frees each decoder layer's gathered weights after its forward (reshard_after_forward)."""
        return reshard_layers(self.fsdp_reshard, self.learner_ranks, self.cpu_offload)

    @property
    def tokens(self) -> int:
        """Tokens of the largest micro-batch: the budget, but never less than one sequence (a completion over the
        budget is a micro-batch of its own: packing.micro_batches), nor more than this rank's share of the batch."""
        return min(max(self.micro_batch_tokens, self.sequence_tokens), self.rank_batch_tokens)


def reshard_layers(fsdp_reshard: str, learner_ranks: int, cpu_offload: bool) -> bool:
    """--fsdp-reshard resolved: auto keeps every layer gathered (False) on a single learner rank without
    --cpu-offload, where a gather copies the rank's own whole weights, and frees them (True) otherwise."""
    if fsdp_reshard != "auto":
        return fsdp_reshard == "always"
    return learner_ranks > 1 or cpu_offload


PART_NAMES = {
    "weights": "weights: float32 shards",
    "gradients": "gradients: float32 shards (0 for a step of one micro-batch: it peaks before they exist)",
    "optimizer": "AdamW state: 2 float32 per parameter, sharded",
    "reference": "--kl-coef's reference model: float32 shards",
    "gathered": "gathered units: the root, two decoder layers (all of them under --fsdp-reshard never), one unit's "
                "gradient",
    "lm_head": "LM head: float32 weight, its gradient, logits chunks",
    "activations": "activations of the largest micro-batch",
    "vllm": "vLLM's share of the GPU (--gen-memory-fraction)",
    "vllm_outside": "vLLM outside its share: its CUDA context, the largest layer a weight reload materialises",
    "push": "rank 0's weight push: the gathered weights in the generator's dtype on the GPU, beyond the activations "
            "and gathered units, freed by then",
}


@dataclass
class MemoryPlan:
    """Bytes per learner rank: `gpu` on its GPU and `host` in host memory (--cpu-offload), keyed as PART_NAMES;
    `margin` is kept free on the GPU for what the parts leave out. It fits when `total` <= `gpu_memory`."""

    config: Any = field(repr=False)
    layout: Layout
    gpu: dict[str, int]
    host: dict[str, int]
    margin: int
    push_host: int = 0  # rank 0's host memory during a weight push (not on the GPU, not in `total`)
    checkpoint_host: int = 0  # each rank's host memory during a checkpoint's save (not on the GPU, not in `total`)

    @property
    def gpu_memory(self) -> int:
        return self.layout.gpu_memory

    @property
    def learner_bytes(self) -> int:
        """What the learner itself allocates on its GPU (no vLLM, no margin): compare with a measured
        torch.cuda.max_memory_allocated()."""
        return sum(v for k, v in self.gpu.items() if k not in ("vllm", "vllm_outside"))

    @property
    def total(self) -> int:
        return sum(self.gpu.values()) + self.margin

    def fits(self) -> bool:
        return self.total <= self.gpu_memory

    def summary(self) -> str:
        """One line: the layout and the verdict."""
        flags = [f for f, on in (("--activation-checkpointing", self.layout.activation_checkpointing),
                                 ("--cpu-offload", self.layout.cpu_offload)) if on]
        return (f"{self.layout.learner_ranks} learner rank(s), micro-batch {self.layout.tokens:,} tokens"
                f"{', ' + ' '.join(flags) if flags else ''}: {gib(self.total)} of {gib(self.gpu_memory)} GiB per "
                f"GPU: {'fits' if self.fits() else 'does not fit'}")

    def describe(self) -> str:
        """The summary, then every part in GiB."""
        lines = [self.summary()]
        lines += [f"  {gib(v):>7} GiB  {PART_NAMES[k]}" for k, v in self.gpu.items()]
        lines.append(f"  {gib(self.margin):>7} GiB  margin: CUDA context, communication buffers, fragmentation")
        lines += [f"  {gib(v):>7} GiB  {PART_NAMES[k]} (host memory, --cpu-offload)" for k, v in self.host.items()]
        if self.push_host:
            lines.append(f"  {gib(self.push_host):>7} GiB  rank 0's host memory during a weight push: the weights in "
                         "the generator's dtype")
        lines.append(f"  {gib(self.checkpoint_host):>7} GiB  each rank's host memory during a checkpoint's save: "
                     "a file of its shard of the float32 weights and AdamW's moments, twice (harness/checkpoints.py)")
        return "\n".join(lines)

    def problems(self) -> list[str]:
        """[] when the plan fits; else one message: the parts in GiB, and the flags that would make it fit."""
        if self.fits():
            return []
        parts = ", ".join(f"{k} {gib(v)}" for k, v in self.gpu.items())
        message = (f"the learner does not fit its GPU: {gib(self.total)} GiB needed per rank of "
                   f"{gib(self.gpu_memory)} GiB (GiB: {parts}, margin {gib(self.margin)}; "
                   "plan: harness/memory_plan.py)")
        layout = self.layout
        fixes = remedies(self.config, layout)
        if fixes:
            return [f"{message}. It would fit with, in order of cost: {'; or '.join(fixes)}"]
        smallest = min(layout.sequence_tokens, layout.tokens)
        least = estimate(self.config, dataclasses.replace(layout, activation_checkpointing=True, cpu_offload=True),
                         tokens=smallest)
        return [f"{message}. No smaller --micro-batch-tokens, --activation-checkpointing, --cpu-offload or more "
                f"learner ranks makes it fit: with both flags, the smallest micro-batch ({smallest:,} tokens) still "
                f"needs {gib(least.total)} GiB, {gib(least.gpu['activations'])} of them activations; only fewer "
                f"tokens per sequence (--max-tokens) or a larger GPU can make it fit"]


def host_memory_available(cgroup: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")) -> int:
    """Bytes of host memory this process's processes may still take: the system's available memory (psutil), or
    less under a control group's limit (a container's `--memory`, a job scheduler's), which the kernel enforces with
    its out-of-memory killer whatever the machine has free: the limit less what the group uses, its inactive page
    cache counted free as the kernel reclaims it. Reads cgroup v2's memory.max and v1's memory.limit_in_bytes, in
    this process's own group (`own`, /proc/self/cgroup, names it) or, inside a container, at the root."""
    import psutil  # here, not at the top: vLLM's dependency, asked only by the CPU check

    memory = psutil.virtual_memory()
    try:  # "0::/PATH" (v2), "N:memory:/PATH" (v1)
        paths = {kind: path.lstrip("/") for _, kind, path in (line.split(":", 2) for line in
                                                             own.read_text().splitlines() if line.count(":") >= 2)}
    except OSError:
        paths = {}
    available = memory.available
    for base, kind, limit_name, usage_name, cache_key in (
            (cgroup, "", "memory.max", "memory.current", "inactive_file"),
            (cgroup / "memory", "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")):
        group = next((d for d in (base / paths.get(kind, ""), base) if (d / limit_name).is_file()), None)
        try:
            limit = (group / limit_name).read_text().strip() if group is not None else "max"
            if limit == "max" or int(limit) >= memory.total:
                continue
            stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines()
                        if len(line.split()) == 2)
            usage = int((group / usage_name).read_text()) - int(stat.get(cache_key, 0))
            available = min(available, max(0, int(limit) - usage))
        except (OSError, ValueError):
            continue
    return available


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def estimate(config: Any, layout: Layout, tokens: int | None = None, micro_batches: int | None = None) -> MemoryPlan:
    """The plan of `config` under `layout`; `tokens` replaces the largest micro-batch's (layout.tokens), and
    `micro_batches` the number a step has (default: this rank's share of the batch over the largest micro-batch).
    A step of one micro-batch peaks at the end of its forward, before any gradient exists (zero_grad frees them,
    and backward frees activations as it makes gradients): its gradients count 0 on the GPU. Measured on one H100:
    a one-micro-batch step of 8,117 tokens peaked at 53.1 GiB where weights, gradients, AdamW and the rest add up
    to 59 GiB (docs/memory.md)."""
    counts = parameter_counts(config)
    tokens = layout.tokens if tokens is None else tokens
    if micro_batches is None:
        micro_batches = math.ceil(layout.rank_batch_tokens / tokens)
    shard = math.ceil(counts.total / layout.learner_ranks)
    sharded = {"weights": 4 * shard, "gradients": 4 * shard, "optimizer": 8 * shard}
    if layout.reference_model:
        sharded["reference"] = 4 * shard  # weights only: it never has gradients or optimizer state
    gpu = {} if layout.cpu_offload else {**sharded, "gradients": 4 * shard if micro_batches > 1 else 0}
    gpu["gathered"] = gathered_unit_bytes(counts, layout)
    gpu["lm_head"] = lm_head_bytes(config, counts, layout, tokens)
    gpu["activations"] = activation_bytes(config, layout, tokens)
    if layout.generator_share:
        gpu["vllm"] = int(layout.generator_share * layout.gpu_memory)
        # beside gpu_memory_utilization's budget: a second process's CUDA context, and the new tensors of the layer
        # (or embedding) a layerwise reload builds before it copies them in
        gpu["vllm_outside"] = VLLM_CONTEXT_BYTES + layout.dtype_bytes * max(counts.layer, counts.embedding, counts.head)
    # a push gathers the weights one tensor at a time and casts each on the GPU (runtime.push_state_dict): rank 0
    # keeps them there for vLLM's nccl or ipc engine, or copies them to the host
    if layout.push_gpu:  # after the step: in the place of its activations and gathered units
        gpu["push"] = max(0, counts.total * layout.dtype_bytes - gpu["activations"] - gpu["gathered"])
    push_host = 0 if layout.push_gpu else counts.total * layout.dtype_bytes
    return MemoryPlan(config=config, layout=layout, gpu=gpu, host=dict(sharded) if layout.cpu_offload else {},
                      margin=MARGIN_BYTES + int(MARGIN_FRACTION * layout.gpu_memory), push_host=push_host,
                      checkpoint_host=checkpoint_host_bytes(counts, layout.learner_ranks))


SHARD_FILE_BYTES = 1 << 30  # harness/checkpoints.py's (this module imports no torch): a rank's shard files' size


def checkpoint_host_bytes(counts: ParameterCounts, learner_ranks: int) -> int:
    """A rank's host memory while it saves its shard of the float32 weights and AdamW's two moments (12 bytes a
    parameter over the ranks; harness/checkpoints.py): torch's distributed checkpoint writes it in files of
    SHARD_FILE_BYTES, one at a time, copying a file's tensors to the host and having safetensors build the file's
    bytes in memory before writing them: twice a file. Gathered to rank 0 (the format before), it was 12 bytes a
    parameter of the whole model, on rank 0."""
    shard = 12 * math.ceil(counts.total / learner_ranks)
    files = math.ceil(shard / SHARD_FILE_BYTES)
    return 2 * math.ceil(shard / files)


def gathered_unit_bytes(counts: ParameterCounts, layout: Layout) -> int:
    """FSDP2's unsharded copies in the compute dtype (bfloat16 under its MixedPrecisionPolicy): the root unit (the
    input embedding unless the FP32 head holds it, the final norm, and without --fp32-lm-head the head) stays
    gathered from forward to the end of backward (FSDP2 does not reshard the root after forward); a decoder layer
    is gathered while it computes, and the next one is prefetched, so two at a time. In backward a unit's gradient
    exists unsharded before its reduce-scatter, in the compute dtype and again as the float32 copy that is reduced
    (reduce_dtype float32); once when the compute dtype is float32. The largest such unit counts. Under
    --fsdp-reshard never no layer is freed after its forward: all of them are gathered at the end of the forward."""
    b = layout.dtype_bytes
    root = counts.final_norm + (counts.head if not layout.fp32_lm_head else 0)
    if not (layout.fp32_lm_head and counts.head == 0):  # a tied embedding joins the FP32 head's unit
        root += counts.embedding
    gradient_bytes = b if b == 4 else b + 4
    gathered_layers = 2 if layout.reshard_layers else counts.layers
    return b * (root + gathered_layers * counts.layer) + gradient_bytes * max(counts.layer, root)


def lm_head_bytes(config: Any, counts: ParameterCounts, layout: Layout, tokens: int) -> int:
    """The LM head's chunks (head_gemm.target_logprobs): three [chunk, vocab] float32 buffers, the logits, their
    log-softmax and, in backward, its gradient; with --fp32-lm-head its own unit's gathered float32 weight and
    unsharded float32 gradient (without it, the weight is in the root unit). Under split-bf16 the head keeps, from
    forward to backward, the logits' gradient of every position of the micro-batch in bf16 ([tokens, vocab] x 2
    bytes: it scores at most the micro-batch's tokens), and in forward its weight's three bf16 parts (6 bytes a
    weight) and two chunk buffers (the logits and one elementwise step), where in backward the weight's float32
    gradient (4 bytes a weight) takes the parts' place."""
    chunk = min(layout.logits_chunk_tokens, tokens) * config.vocab_size * 4
    weight = 4 * counts.head_weight if layout.fp32_lm_head else 0
    if layout.split_bf16_head:
        return 2 * chunk + 2 * tokens * config.vocab_size + weight + 6 * counts.head_weight
    return 3 * chunk + 2 * weight


def activation_bytes(config: Any, layout: Layout, tokens: int) -> int:
    """What backward keeps of a micro-batch of `tokens`. Without activation checkpointing, every layer's saved
    tensors (activation_bytes_per_token_layer); with it, each layer's input hidden state [tokens, hidden] and one
    layer's saved tensors while it is recomputed. Above the layers: the final norm's saved tensors and the head's
    float32 input with its copy of the scored positions (4 + 4 bytes per hidden unit)."""
    b, h = layout.dtype_bytes, config.hidden_size
    per_layer = activation_bytes_per_token_layer(config, b)
    if layout.activation_checkpointing:
        layers = config.num_hidden_layers * b * h + per_layer
    else:
        layers = config.num_hidden_layers * per_layer
    above = (4 + b) * h + 8 * h
    return tokens * (layers + above)


# ----------------------------------------------------------------------------------------------------------------
# What would make it fit
# ----------------------------------------------------------------------------------------------------------------


MAX_LEARNER_RANKS = 4096  # how far remedies looks for a number of learner ranks that fits


def remedies(config: Any, layout: Layout) -> list[str]:
    """The flags that would make `layout` fit, each checked, in order of cost: a smaller --micro-batch-tokens (more
    micro-batches, each less efficient), --activation-checkpointing (every layer's forward again in backward: about
    a third more learner compute), --cpu-offload (AdamW steps on the CPU, and every unit's shard crosses PCIe
    twice a step), more learner ranks (more GPUs). A combination of flags is named only when no part of it fits
    alone at the budget given."""
    fixes: list[str] = []
    fitting: list[set[str]] = []
    if not layout.reshard_layers and estimate(config, dataclasses.replace(layout, fsdp_reshard="always")).fits():
        fixes.append("--fsdp-reshard always")  # costs one gather of each layer in backward: cheapest of all
    flag_sets = ([], ["activation_checkpointing"], ["cpu_offload"], ["activation_checkpointing", "cpu_offload"])
    for flags in flag_sets:
        new = {f for f in flags if not getattr(layout, f)}
        if (flags and not new) or any(done <= new for done in fitting):
            continue  # on already, or a cheaper part of it fits
        variant = dataclasses.replace(layout, **{f: True for f in flags})
        named = " ".join(f"--{f.replace('_', '-')}" for f in sorted(new, key=flags.index))
        if flags and estimate(config, variant).fits():
            fixes.append(named)
            fitting.append(new)
            continue
        tokens = largest_fitting_tokens(config, variant)
        if tokens >= variant.sequence_tokens:
            budget = max(variant.sequence_tokens, tokens // 1024 * 1024)  # a round number that still fits
            fixes.append(f"{named} --micro-batch-tokens {budget}".strip())
    ranks = more_learner_ranks(config, layout)
    if ranks is not None:
        fixes.append(f"{ranks} learner ranks (GPUs)")
    elif not layout.activation_checkpointing and {"activation_checkpointing"} not in fitting:
        ranks = more_learner_ranks(config, dataclasses.replace(layout, activation_checkpointing=True))
        if ranks is not None:
            fixes.append(f"{ranks} learner ranks (GPUs) with --activation-checkpointing")
    return fixes


def largest_fitting_tokens(config: Any, layout: Layout) -> int:
    """The most tokens a micro-batch may hold for `layout` to fit (0: not even one): the plan grows with them."""
    low, high = 0, layout.tokens
    while low < high:
        middle = (low + high + 1) // 2
        if estimate(config, layout, tokens=middle).fits():
            low = middle
        else:
            high = middle - 1
    return low


def more_learner_ranks(config: Any, layout: Layout) -> int | None:
    """The fewest learner ranks above layout's that fit, or None: more ranks shrink only the sharded parts (and a
    rank's share of the batch), so the plan never grows with them and a bisection finds the fewest."""
    def fits(ranks: int) -> bool:
        return estimate(config, dataclasses.replace(layout, learner_ranks=ranks)).fits()

    low, high = layout.learner_ranks + 1, MAX_LEARNER_RANKS
    if low > high or not fits(high):
        return None
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return low


def plan_memory(config: Any, args: Any, learner_ranks: int, gpu_memory: int, *, dtype: str, sequence_tokens: int,
                generator_share: float, logits_chunk_bytes: int, split_bf16_head: bool = False,
                push_gpu: bool = False) -> MemoryPlan:
    """The plan of a run of train.py with these flags (its Args) on `learner_ranks` GPUs of `gpu_memory` bytes each.
    The values train.py resolves itself, where its defaults live, come as keywords: the compute `dtype`, the longest
    sequence (vLLM's context), vLLM's share of a learner GPU (0 where they do not share one) and the LM head's
    default chunk in bytes; `push_gpu`: the weights reach the replicas from rank 0's GPU (vLLM's nccl or ipc)."""
    from_chunk_bytes = max(1, logits_chunk_bytes // (4 * config.vocab_size))  # as head_gemm.install_head_logprobs
    layout = Layout(
        learner_ranks=learner_ranks, gpu_memory=gpu_memory, micro_batch_tokens=args.micro_batch_tokens,
        sequence_tokens=sequence_tokens, group_size=args.group_size, prompts_per_step=args.prompts_per_step,
        dtype_bytes=2 if dtype == "bfloat16" else 4, fp32_lm_head=args.fp32_lm_head,
        logits_chunk_tokens=args.logits_chunk_tokens or from_chunk_bytes,
        activation_checkpointing=args.activation_checkpointing, cpu_offload=args.cpu_offload,
        reference_model=bool(args.kl_coef),
        generator_share=generator_share, split_bf16_head=split_bf16_head, fsdp_reshard=args.fsdp_reshard,
        push_gpu=push_gpu)
    return estimate(config, layout)
