"""What several test files share: the repository root, torchrun's command, small groups and batches, a saved run
directory, and the check that two steps gave the same gradient."""

import dataclasses
import json
import random
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from harness import checkpoints, flags
from harness.tasks import Problem
from pipeline_rl import Completion, Group


REPO = Path(__file__).resolve().parent.parent


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def make_group(i: int, lengths: list[int], rewards: list[float], prompt_len: int = 3) -> Group:
    completions = [Completion(token_ids=list(range(10, 10 + n)), sampler_logprobs=[-0.5] * n, versions=[0] * n,
                              loss_mask=[True] * (n - 1) + [False], text="", finish_reason="stop", reward=r)
                   for n, r in zip(lengths, rewards)]
    return Group(Problem(f"p{i}", "", ""), i, list(range(1, 1 + prompt_len)), completions)


def random_groups(rng: random.Random, n_groups: int, group_size: int, vocab: int, longest: int = 20) -> list[Group]:
    """Groups of random prompts and completions (an empty completion now and then), for the packing tests."""
    groups = []
    for i in range(n_groups):
        completions = []
        for _ in range(group_size):
            n = rng.randint(0, longest)
            completions.append(Completion(token_ids=[rng.randrange(3, vocab) for _ in range(n)],
                                          sampler_logprobs=[-rng.random() for _ in range(n)], versions=[0] * n,
                                          loss_mask=[rng.random() < 0.8 for _ in range(n)], text="",
                                          finish_reason="stop", reward=1.0))
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))]
        groups.append(Group(Problem(f"p{i}", "", ""), i, prompt, completions))
    return groups


def assert_same_gradient(grads: list, reference_grads: list, where: object = None) -> None:
    """Float32 sums taken in another order (other micro-batches, ranks or head chunks) differ by up to some 5e-5 of
    the gradient's largest entry (measured on the default base model: GSPO's sequence ratios are the least exact), so
    the absolute tolerance is 1e-4 of it; an error of normalisation moves the entries it touches by tens of percent.
    A fixed tolerance would depend on the base model's weights: a base that fits its data better gives larger
    gradients on the synthetic groups, and larger rounding."""
    atol = 1e-4 * max(g.abs().max().item() for g in reference_grads)
    for grad, reference_grad in zip(grads, reference_grads):
        torch.testing.assert_close(grad, reference_grad, rtol=1e-4, atol=atol, msg=lambda m: f"{where}: {m}")


def head_weights(vocab: int, hidden: int, rows: int, logit_std: float, seed: int = 0) -> tuple:
    """A float32 LM head weight [V, H] whose logits have standard deviation `logit_std`, bf16-exact hidden states
    [M, H] (a bf16 trunk's), and targets [M] sampled from the head's own distribution, as a sampler's are."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen) * (logit_std / hidden ** 0.5)
    hidden_states = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    probs = torch.softmax(hidden_states.double() @ weight.double().T, -1)
    return weight, hidden_states, torch.multinomial(probs, 1, generator=gen).squeeze(1)


def saved_run(out: Path, steps: tuple[int, ...] = (1, 2), size: int = 4) -> tuple:
    """A run directory with a checkpoint per step of `steps` (a Linear layer and its AdamW state), its args.json and
    a metrics row per step. Returns (model, optimizer)."""
    model = torch.nn.Linear(size, size)
    optimizer = torch.optim.AdamW(model.parameters())
    out.mkdir(exist_ok=True)
    (out / "args.json").write_text(json.dumps(dataclasses.asdict(flags.Args(output_dir=str(out)))))
    for step in steps:
        model(torch.ones(1, size)).sum().backward()
        optimizer.step()
        checkpoints.save_checkpoint(out, model, optimizer, {"step": step, "metrics_lines": step + 1}, rank=0)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(max(steps) + 1)))
    return model, optimizer


def file_tree(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def metrics_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_where(where: str, fn: Callable[[], None]) -> None:
    """fn() in this, the main thread ("main") or in another one ("thread", joined within 60 s): rewards run in both."""
    if where == "thread":
        thread = threading.Thread(target=fn)
        thread.start()
        thread.join(60)
    else:
        fn()
