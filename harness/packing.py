"""harness/packing.py: the rows and micro-batches the learner feeds its model. A runtime module: a reader of the recipe
may skip it.

A batch's groups become `Rows` (`to_rows`: prompt + completion, right-padded, in the layout the loss files take),
split into micro-batches of at most --micro-batch-tokens (`micro_batches`, `micro_batch_groups`); under --packing
the same sequences are packed end to end into fewer, fuller rows (`PackedRows`, `pack_rows`, best-fit decreasing),
when the attention can keep them apart (`row_packing`). token_logprobs in train.py gathers the logprobs back, so
the loss files see the same tensors, packed or not.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from harness.flags import Args


# ----------------------------------------------------------------------------------------------------------------
# Rows and micro-batches: a batch's groups as the (packed or padded) rows the learner's model is fed
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Rows:
    """One micro-batch of completions in the layout the loss files take: one row per completion, prompt +
    completion, right-padded. Per-token fields are aligned with the predicted token: position t holds the logprob of
    input_ids[:, t + 1]. Under --packing the model is fed `packed` instead, the same sequences end to end in fewer,
    fuller rows, and token_logprobs gathers its logprobs back into this layout: the loss files, the importance
    weights and the metrics see the same [N, L-1] tensors, packed or not."""

    input_ids: Any  # [N, L]
    attention: Any  # [N, L] bool
    loss_mask: Any  # [N, L-1] bool: completion tokens the model chose (not prompt, padding, injected phrase)
    sampler_logprobs: Any  # [N, L-1]
    versions: Any  # [N, L-1] weight version that sampled each token (-1 outside completions)
    old_logprobs: Any  # [N, L-1] behaviour policy: learner-recomputed where attached, else the sampler's
    advantages: Any  # [N]
    replicas: Any = None  # [N] the generator replica that sampled each completion
    packed: PackedRows | None = None  # --packing: what the model is fed
    scored: Any = None  # [M] positions of the flattened [N * (L-1)] that predict a completion token: the LM head's


@dataclass
class PackedRows:
    """The model's input under --packing: a micro-batch's sequences (prompt + completion) end to end in R rows of W
    tokens (pack_rows), only the tail of a row padded. Position ids restart at 0 with each sequence, and with the
    tail padding: transformers reads the boundaries from them (attention_mask left None) and builds a block-diagonal
    causal mask (sdpa, eager), or hands the sequences to flash attention's varlen kernels, so no token attends to
    another sequence's."""

    input_ids: Any  # [R, W]
    position_ids: Any  # [R, W]
    index: Any  # [N, L-1]: where Rows' position t of completion n sits in the flattened packed logprobs [R * (W-1)]
    scored: Any = None  # [M] Rows.scored's positions in the flattened packed [R * (W-1)]


def to_rows(groups: list, advantages: Any, group_size: int, pad_id: int, device: Any = "cpu",
            pack: float | None = None) -> Rows:
    """Pad the groups' completions (after their prompts) into one micro-batch of rows, on `device` (the model's).
    `pack` (--packing: row_packing's answer for the model) also packs them for the model into Rows.packed: the
    attention's break-even row length (pack_rows), or math.inf for one row."""
    seqs = [(g.prompt_ids, c) for g in groups for c in g.completions]
    prompt_len = torch.tensor([len(p) for p, _ in seqs])                                  # [N]
    completion_len = torch.tensor([len(c.token_ids) for _, c in seqs])                    # [N]
    seq_len = prompt_len + completion_len                                                 # [N]
    length = int(seq_len.max())
    n = len(seqs)
    # One tensor per field for the whole micro-batch, not one per row: on a GPU the learner step is bound by the
    # host, and a per-row loop cost as much as the bare forward + backward of a small model (tools/bench.py train).
    # A boolean mask assigns its true slots in row-major order, the order of the flattened lists.
    positions = torch.arange(length)                                                      # [L]
    attention = positions < seq_len[:, None]                                              # [N, L]
    start = (prompt_len - 1)[:, None]                                                     # position predicting token 0
    in_completion = (positions[:-1] >= start) & (positions[:-1] < start + completion_len[:, None])  # [N, L-1]

    def flat(values: Any, dtype: torch.dtype) -> Any:
        return torch.tensor([x for v in values for x in v], dtype=dtype)

    tokens = flat((p + c.token_ids for p, c in seqs), torch.long)                          # [S]: every sequence
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    input_ids[attention] = tokens
    loss_mask = torch.zeros(n, length - 1, dtype=torch.bool)
    loss_mask[in_completion] = flat((c.loss_mask for _, c in seqs), torch.bool)
    sampler = torch.zeros(n, length - 1)
    sampler[in_completion] = flat((c.sampler_logprobs for _, c in seqs), torch.float32)
    versions = torch.full((n, length - 1), -1, dtype=torch.long)
    versions[in_completion] = flat((c.versions for _, c in seqs), torch.long)
    old = torch.zeros(n, length - 1)  # behaviour policy: learner-recomputed where attached, else the sampler's
    old[in_completion] = flat((c.sampler_logprobs if c.old_logprobs is None else c.old_logprobs for _, c in seqs),
                              torch.float32)
    replicas = torch.tensor([c.replica for _, c in seqs], dtype=torch.long)                # [N]
    fields = (input_ids, attention, loss_mask, sampler, versions, old, advantages, replicas)
    rows = Rows(*(None if x is None else x.to(device) for x in fields))  # built on the CPU, moved in one copy each
    # Found here on the host, not by the head on the device (a GPU learner step is bound by the host's work).
    rows.scored = in_completion.view(-1).nonzero().squeeze(1).to(device)                   # [M]
    if pack is not None:
        packed = _packed_rows(tokens, seq_len, attention, pack_rows(seq_len.tolist(), pack), pad_id)
        packed.scored = packed.index[in_completion]                                        # [M]
        rows.packed = PackedRows(*(x.to(device) for x in (packed.input_ids, packed.position_ids, packed.index,
                                                          packed.scored)))
    return rows


def _packed_rows(tokens: Any, seq_len: Any, attention: Any, bins: list[list[int]], pad_id: int) -> PackedRows:
    """The sequences whose tokens, end to end, are `tokens` [S] and whose lengths are `seq_len` [N], laid out in the
    rows `bins` (sequence indices per row, pack_rows); `attention` [N, L] marks their positions in the padded rows."""
    lengths, row_of, offset, used = seq_len.tolist(), [0] * len(seq_len), [0] * len(seq_len), []
    for r, members in enumerate(bins):
        filled = 0
        for i in members:
            row_of[i], offset[i] = r, filled
            filled += lengths[i]
        used.append(filled)
    width = max(used)
    row_of, offset = torch.tensor(row_of), torch.tensor(offset)                           # [N]
    first = seq_len.cumsum(0) - seq_len                                                   # [N] start in `tokens`
    in_seq = torch.arange(tokens.numel()) - torch.repeat_interleave(first, seq_len)      # [S] position in its sequence
    where = torch.repeat_interleave(row_of * width + offset, seq_len) + in_seq            # [S] slot in [R * W]
    input_ids = torch.full((len(bins), width), pad_id, dtype=torch.long)
    input_ids.view(-1)[where] = tokens
    # The tail padding counts 0, 1, ... too: a sequence of its own, which no real token attends to.
    position_ids = (torch.arange(width) - torch.tensor(used)[:, None]).clamp(min=0)       # [R, W]
    position_ids.view(-1)[where] = in_seq
    # The packed logprobs are [R, W-1], packed position j predicting token j + 1: completion n's position t (which
    # predicts its token t + 1) is position offset + t of its row. Beyond a sequence's end: slot 0, masked later.
    index = (row_of * (width - 1) + offset)[:, None] + torch.arange(attention.shape[1] - 1)  # [N, L-1]
    return PackedRows(input_ids, position_ids, torch.where(attention[:, 1:], index, 0))


def pack_rows(lengths: list[int], break_even: float) -> list[list[int]]:
    """The rows of a packed micro-batch: sequence indices per row, for sequences of `lengths`. With dense attention
    (sdpa's block-diagonal mask) a row of W tokens costs about W * (1 + W / break_even) token-layers: its linear
    layers, padding included, plus its attention over all W^2 positions, masked or not (break_even: the row length
    at which the two are equal, attention_break_even). Rows no narrower than the longest sequence (the [R, W] tensor
    is that wide anyway) and a few times wider are tried with best-fit decreasing, and the cheapest kept: rows about
    as long as the longest sequence when there are enough sequences to fill them, wider ones for a few. On the CPU
    this cost ranked the measured row lengths in their measured order (docs/benchmarks.md, "The learner step").
    break_even = math.inf (varlen attention, which costs what the sequences themselves do): one row."""
    longest, total = max(lengths), sum(lengths)
    if math.isinf(break_even):
        return [list(range(len(lengths)))]
    best, best_cost = [], math.inf
    for factor in (1, 1.25, 1.5, 2, 3, 4):
        rows = best_fit_decreasing(lengths, min(int(longest * factor), total))
        width = max(sum(lengths[i] for i in row) for row in rows)
        cost = len(rows) * width * (1 + width / break_even)
        if cost < best_cost:
            best, best_cost = rows, cost
    return best


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bin packing: each sequence, longest first, goes into the row with the least room that still holds it
    (lengths adding up to at most `capacity`), or opens a new row. Rows come out nearly full: padding is at most the
    tail of a row. A sorted list of the rows' room finds that row by bisection: pack_rows' six widths for 1,024
    sequences take 4 ms, where first-fit's scan of every row took 38 ms of host time (measured on the CPU)."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = bisect.bisect_left(room, (lengths[i], -1))
        if k == len(room):
            rows.append([])
            left, r = capacity, len(rows) - 1
        else:
            left, r = room.pop(k)
        rows[r].append(i)
        bisect.insort(room, (left - lengths[i], r))
    return rows


def model_device(model: Any) -> torch.device:
    """Where the model computes, so where its inputs must go: where its parameters (their local shards, under
    FSDP2) live, or, under --cpu-offload (shards on the host), the GPU FSDP2 gathers them on."""
    param = next(model.parameters())
    mesh = getattr(param, "device_mesh", None)
    if mesh is not None and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return param.device


def micro_batches(groups: list, token_budget: int, packing: bool = False) -> list[list[int]]:
    """The batch's completions per micro-batch, as indices n into them in order (group by group, n = g * G + j for
    groups of G): as many as fit the token budget, counted as real tokens (each completion with its prompt) when
    `packing`, else as the padded size (rows x longest row). A group may span micro-batches: one of ScaleRL's
    groups (16 completions of up to 14k tokens) is 230k tokens, which no budget that bounds memory holds. A
    completion over the budget is a micro-batch of its own."""
    batches, current, longest, real = [], [], 0, 0
    lengths = [len(g.prompt_ids) + len(c.token_ids) for g in groups for c in g.completions]
    for n, length in enumerate(lengths):
        new_longest, new_real = max(longest, length), real + length
        size = new_real if packing else (len(current) + 1) * new_longest
        if current and size > token_budget:
            batches.append(current)
            current, new_longest, new_real = [], length, length
        current.append(n)
        longest, real = new_longest, new_real
    if current:
        batches.append(current)
    return batches


def micro_batch_groups(groups: list, indices: list[int]) -> tuple[list, bool]:
    """The groups of a micro-batch's completions (`indices`, micro_batches'), each cut down to the completions the
    micro-batch holds, in order; and whether every one of them is whole."""
    first = np.cumsum([0] + [len(g.completions) for g in groups])          # index of each group's first completion
    held: dict[int, list] = {}
    for n in indices:
        i = int(np.searchsorted(first, n, side="right")) - 1
        held.setdefault(i, []).append(groups[i].completions[n - first[i]])
    parts = [dataclasses.replace(groups[i], completions=cs) for i, cs in held.items()]
    return parts, all(len(p.completions) == len(groups[i].completions) for i, p in zip(held, parts))


VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")  # attention that takes packed sequences as they are


def row_packing(args: Args, model: Any) -> float | None:
    """to_rows' `pack` for this model: None (--no-packing: padded rows); math.inf where its attention is varlen
    (flash attention attends within each sequence at the sequences' own cost, and needs one row); else the dense
    mask's break-even row length, from which pack_rows chooses the rows."""
    if not args.packing:
        return None
    if model.config._attn_implementation in VARLEN_ATTENTION:
        return math.inf
    return attention_break_even(model.config)


def attention_break_even(config: Any) -> float:
    """The row length at which a token's dense attention (4 x query width FLOPs per position of its row: the scores
    and the weighted sum) costs as much as its linear layers (2 FLOPs per weight), per decoder layer: about 830 for
    the tiny model, 3,070 for SmolLM2-135M. A config without these sizes: 2,048."""
    try:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        linear = 2 * config.hidden_size * (2 * q + 2 * kv + 3 * config.intermediate_size)
        return linear / (4 * q)
    except (AttributeError, TypeError):
        return 2048.0
