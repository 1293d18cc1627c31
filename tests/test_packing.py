"""harness/packing.py: completions into micro-batches by token budget, and into rows, padded or packed."""

import random

import pytest
import torch

from harness import packing
from harness.tasks import Problem
from helpers import make_group
from pipeline_rl import Completion, Group


def test_micro_batches_hold_completions_within_the_budget_and_may_split_groups():
    groups = [make_group(i, [2 + i, 3], [1.0, -1.0]) for i in range(6)]
    lengths = [3 + len(c.token_ids) for g in groups for c in g.completions]
    batches = packing.micro_batches(groups, token_budget=20)
    assert [n for b in batches for n in b] == list(range(12))  # every completion once, in order
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[n] for n in b) <= 20  # padded: rows x longest row
    assert any(b[0] % 2 == 1 for b in batches[1:])  # some micro-batch starts inside a group
    assert len(packing.micro_batches(groups, token_budget=10**6)) == 1


def test_micro_batch_groups_cut_each_group_to_the_completions_it_holds():
    groups = [make_group(i, [2, 3, 4], [1.0, -1.0, 1.0]) for i in range(3)]
    parts, whole = packing.micro_batch_groups(groups, [0, 1, 2, 3])
    assert not whole and [p.data_index for p in parts] == [0, 1]
    assert [len(c.token_ids) for p in parts for c in p.completions] == [2, 3, 4, 2]
    assert parts[1].prompt_ids == groups[1].prompt_ids and len(groups[1].completions) == 3  # the batch is untouched
    parts, whole = packing.micro_batch_groups(groups, [3, 4, 5])
    assert whole and [p.data_index for p in parts] == [1]


def test_rows_align_each_token_with_the_position_that_predicts_it():
    grp = make_group(0, [4, 2], [1.0, -1.0], prompt_len=3)
    rows = packing.to_rows([grp], torch.tensor([1.0, -1.0]), 2, pad_id=0)
    assert rows.input_ids.tolist() == [[1, 2, 3, 10, 11, 12, 13], [1, 2, 3, 10, 11, 0, 0]]
    # Position t predicts input_ids[t + 1]: completion token 0 is predicted at position len(prompt) - 1.
    assert rows.loss_mask.tolist() == [[False, False, True, True, True, False],
                                       [False, False, True, False, False, False]]
    assert rows.attention.sum(1).tolist() == [7, 5]
    assert rows.versions[1].tolist() == [-1, -1, 0, 0, -1, -1]
    grp.completions[0].old_logprobs = [-1.0, -2.0, -3.0, -4.0]  # learner-recomputed old logprobs win when present
    rows = packing.to_rows([grp], torch.tensor([1.0, -1.0]), 2, pad_id=0)
    assert rows.old_logprobs[0, 2:6].tolist() == [-1.0, -2.0, -3.0, -4.0]
    assert rows.old_logprobs[1, 2:4].tolist() == [-0.5, -0.5]


def test_rows_built_in_one_operation_per_field_equal_a_row_by_row_build():
    """to_rows fills each field with one boolean-mask assignment; a row-by-row loop is the reference. Random prompt
    and completion lengths (an empty completion too), versions, and learner old logprobs on some completions."""
    rng = random.Random(0)
    for trial in range(20):
        group_size = rng.randint(1, 4)
        groups = []
        for i in range(rng.randint(1, 5)):
            completions = []
            for _ in range(group_size):
                n = rng.randint(0 if trial % 4 == 0 else 1, 9)
                c = Completion(token_ids=[rng.randrange(3, 99) for _ in range(n)],
                               sampler_logprobs=[-rng.random() for _ in range(n)],
                               versions=[rng.randint(0, 3) for _ in range(n)],
                               loss_mask=[rng.random() < 0.8 for _ in range(n)], text="", finish_reason="stop",
                               reward=1.0)
                c.old_logprobs = [-rng.random() for _ in range(n)] if rng.random() < 0.5 else None
                completions.append(c)
            groups.append(Group(Problem(f"p{i}", "", ""), i, [rng.randrange(3, 99) for _ in range(rng.randint(1, 6))],
                                completions))
        rows = packing.to_rows(groups, None, group_size, pad_id=1)
        seqs = [(g.prompt_ids, c) for g in groups for c in g.completions]
        length = max(len(p) + len(c.token_ids) for p, c in seqs)
        assert rows.input_ids.shape == (len(seqs), length)
        for r, (prompt, c) in enumerate(seqs):
            p, t = len(prompt), len(c.token_ids)
            assert rows.input_ids[r].tolist() == prompt + c.token_ids + [1] * (length - p - t)
            assert rows.attention[r].tolist() == [True] * (p + t) + [False] * (length - p - t)
            span = slice(p - 1, p - 1 + t)  # position p - 1 + k predicts completion token k
            assert rows.loss_mask[r, span].tolist() == c.loss_mask and rows.loss_mask[r].sum() == sum(c.loss_mask)
            assert rows.versions[r, span].tolist() == c.versions and (rows.versions[r] >= 0).sum() == t
            assert rows.sampler_logprobs[r, span].tolist() == pytest.approx(c.sampler_logprobs)
            behaviour = c.old_logprobs if c.old_logprobs is not None else c.sampler_logprobs
            assert rows.old_logprobs[r, span].tolist() == pytest.approx(behaviour)
            assert rows.old_logprobs[r].abs().sum() == pytest.approx(sum(-x for x in behaviour))


def test_rows_go_to_the_models_device():
    """On a GPU the micro-batch must be where the model is; the "meta" device stands in for it on a CPU machine."""
    grp = make_group(0, [4, 2], [1.0, -1.0], prompt_len=3)
    rows = packing.to_rows([grp], torch.tensor([1.0, -1.0]), 2, pad_id=0, device="meta")
    fields = [rows.input_ids, rows.attention, rows.loss_mask, rows.sampler_logprobs, rows.versions,
              rows.old_logprobs, rows.advantages]
    assert all(x.device.type == "meta" for x in fields)
    assert packing.to_rows([grp], None, 2, pad_id=0, device="meta").advantages is None
    assert packing.model_device(torch.nn.Linear(2, 2, device="meta")).type == "meta"


def test_micro_batches_count_real_tokens_when_packing():
    """Packed, a micro-batch's budget counts real tokens (every completion with its prompt), not rows x longest."""
    groups = [make_group(i, [2, 12], [1.0, -1.0]) for i in range(4)]  # 3 + 2 and 3 + 12: 20 real tokens, 30 padded
    assert [len(b) for b in packing.micro_batches(groups, 40, packing=True)] == [4, 4]
    assert [len(b) for b in packing.micro_batches(groups, 40, packing=False)] == [2, 2, 2, 2]
    assert packing.micro_batches(groups, 5, packing=True) == [[n] for n in range(8)]  # over the budget: alone
