"""harness/commands.py: train.py's commands beside training, each an entry that takes the command's arguments and
returns the text it prints: `train.py export`, `evaluate`, `migrate-checkpoint`, `plan` and `--help-markdown`. A
runtime module: a reader of the recipe may skip it.

train.py's `main` picks the entry from its COMMANDS table and hands in what only the recipe has: its loss table
(--loss's choices and checks) and, for `evaluate`, the generator it builds. Here: the entries (`export_command`,
`evaluate_command`, `migrate_command`, `plan_command`, `help_markdown`), then the work of the first two, `export`
(a run's policy as a Hugging Face model directory) and `evaluate_policy` (a model's or a run's pass@k).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from harness import base_model
from harness.checkpoints import load_model_weights, migrate_checkpoint, read_checkpoint
from harness.cli import positionals  # a subcommand's arguments, checked like flags: one error line
from harness.cli import OneLineParser, path_text  # export's: its arguments and --dtype, one error line each
from harness.fleet import GeneratorError
from harness.vllm_replica import DTYPES  # a dtype's name, as --dtype spells it, to torch's
from harness.flags import (Args, GeneratorChecks, LossFiles, flags_markdown, misplaced_run_dir, parse_args, plan,
                           read_args_json, resolve_defaults)
from harness.runtime import check_eval_prompts, load_tasks
from harness.tasks import BadRowError

# `train.py evaluate`'s generator, built by train.py: (the flags, the model directory, the task) -> a generator to
# start() and then use as a context manager, whose evaluate(problems, samples, temperature) returns the scored groups
MakeGenerator = Callable[[Args, str, Any], Any]


# ----------------------------------------------------------------------------------------------------------------
# The entries: `train.py NAME ARGS...` prints what ENTRY(ARGS) returns
# ----------------------------------------------------------------------------------------------------------------


def export_command(argv: list[str]) -> str:
    """`train.py export RUN_DIR OUT_DIR [--dtype D]`: export's result as one JSON line."""
    parser = OneLineParser(prog="train.py export", description=export.__doc__)
    parser.add_argument("run_dir", metavar="RUN_DIR", type=path_text, help="the run's output directory")
    parser.add_argument("out_dir", metavar="OUT_DIR", type=path_text, help="a new or empty directory")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="the exported weights' dtype: float32, the learner's master weights as trained "
                             "(default), or bfloat16 or float16, rounded from them to the nearest: half the bytes, "
                             "the dtype a GPU serves in")
    args = parser.parse_args(argv)
    return json.dumps(export(Path(args.run_dir), Path(args.out_dir), args.dtype)) + "\n"


def migrate_command(argv: list[str]) -> str:
    """`train.py migrate-checkpoint RUN_DIR`: converts an older run's checkpoints (checkpoints.migrate_checkpoint);
    what it did as one JSON line."""
    run_dir, = positionals("train.py migrate-checkpoint", ("RUN_DIR",), argv, migrate_checkpoint.__doc__)
    return json.dumps(migrate_checkpoint(Path(run_dir))) + "\n"


def plan_command(argv: list[str], losses: LossFiles, generator_checks: GeneratorChecks) -> str:
    """`train.py plan --shape NAME | --model DIR [flags]`: the learner's memory per rank, no GPU needed (flags.plan)."""
    return plan(argv, generator_checks, losses) + "\n"


def evaluate_command(argv: list[str], losses: LossFiles, generator_checks: GeneratorChecks,
                     generator: MakeGenerator) -> str:
    """`train.py evaluate [flags]`: evaluate_policy's result as one JSON line. It takes the training flags; nothing is
    written, so no output directory is claimed."""
    with tempfile.TemporaryDirectory(prefix="scalerl-evaluate-") as scratch:
        given = argv if "--resume" in argv else [*argv, "--output-dir", str(Path(scratch) / "unused")]
        args = parse_args(given, evaluating=True, generator_checks=generator_checks, losses=losses)
        return json.dumps(evaluate_policy(args, Path(scratch), generator)) + "\n"


def help_markdown(argv: list[str], losses: LossFiles) -> str:
    """`train.py --help-markdown`: the flags as docs/flags.md holds them (flags.flags_markdown)."""
    return flags_markdown(losses)


# ----------------------------------------------------------------------------------------------------------------
# Export and evaluation: a run's policy as a Hugging Face model directory, and its pass@k
# ----------------------------------------------------------------------------------------------------------------


def export(run_dir: Path, out_dir: Path, dtype: str = "float32") -> dict[str, Any]:
    """The policy of a run's newest readable checkpoint as a Hugging Face model directory (config, weights,
    tokenizer, chat template) that transformers and vLLM load as they load the base model, its weights in `dtype`
    (the float32 master weights, or rounded from them to bfloat16 or float16; its config.json says which). Returns
    what it wrote."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # here, not at the top: see train.py's build_learner

    if misplaced := misplaced_run_dir(run_dir):
        raise SystemExit(f"export: {misplaced}")
    if not (run_dir / "args.json").is_file():
        raise SystemExit(f"export: {run_dir} holds no run (no args.json)")
    if out_dir.exists() and not out_dir.is_dir():
        raise SystemExit(f"export: {out_dir} is a file; OUT_DIR must be a new or empty directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise SystemExit(f"export: {out_dir} is not empty")
    try:
        saved = read_args_json(run_dir)
    except ValueError as e:
        raise SystemExit(f"export: {e}") from None
    state, shards, _, ckpt = read_checkpoint(run_dir, None, "export")  # before the base model: it may be built
    base = saved.get("model") or str(base_model.embedded_base_model())
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # the model's tensors alone, each assembled from the ranks' shards (FSDP2 keeps the HF names): the optimizer's
    # are never read
    load_model_weights(ckpt, shards, model.state_dict())
    model.to(DTYPES[dtype]).save_pretrained(out_dir)  # float32 stays as it is; the config says the dtype
    AutoTokenizer.from_pretrained(base).save_pretrained(out_dir)
    return {"model_dir": str(out_dir), "checkpoint": str(ckpt), "step": state["step"], "base_model": base,
            "dtype": dtype}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 1.0


def evaluate_policy(args: Args, scratch: Path, generator: MakeGenerator) -> dict[str, Any]:
    """`train.py evaluate [--model DIR | --resume RUN_DIR] [--dataset ...] --eval-samples N`: the policy's pass@k
    (k = 1, 2, 4 ... N) and mean reward on the data set's validation problems (--test-dataset's, if given), with the
    run's sampler settings, and three of its completions. Without --model or --resume: the embedded base model.
    `generator(args, model_dir, task)`: the generator that samples them, as train.py builds it."""
    resolve_defaults(args, embedded=args.model is None and not args.resume, on_gpu=args.gen_devices is not None)
    try:  # first: a data set with bad rows, or none there, is one line before a checkpoint is exported
        task, test_task = load_tasks(args)
    except (BadRowError, FileNotFoundError) as e:  # as a run's start says it (runtime._data)
        raise SystemExit(f"train.py evaluate: error: {e}") from None
    if args.resume:  # a run's checkpoint: export it, then evaluate it like any model directory
        model_dir = export(Path(args.resume), scratch / "policy")["model_dir"]
    else:
        model_dir = args.model or str(base_model.embedded_base_model())
    problems = (test_task or task).validation(args.eval_prompts)
    sampler = generator(args, model_dir, task)
    # as a run's start checks them: a prompt too long for the context, a data set the model cannot read
    check_eval_prompts(model_dir, sampler.config.max_tokens, sampler.config.fleet.max_model_len, problems,
                       "train.py evaluate")
    try:
        sampler.start()
    except GeneratorError as e:  # e.g. a --reward-timeout refused: one line, as a run's start says it
        raise SystemExit(f"train.py evaluate: error: {e}") from None
    with sampler:
        groups = sampler.evaluate(problems, args.eval_samples, args.temperature)
    n = args.eval_samples
    correct = [sum(r > 0 for r in g.rewards) for g in groups]
    ks = [k for k in (2 ** i for i in range(n.bit_length())) if k <= n]
    scorer = test_task or task
    checks = {}  # a task's other checks of the same completions (small-arithmetic: a strict and a lenient format)
    if hasattr(scorer, "checks"):
        results = [scorer.checks(g.problem, c.text) for g in groups for c in g.completions]
        checks = {f"check_{name}": sum(r[name] for r in results) / len(results) for name in results[0]}
    return {
        "model": model_dir, "resume": args.resume, "dataset": args.test_dataset or args.dataset or "arithmetic",
        "problems": len(groups), "samples": n,
        **{f"pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / len(correct) for k in ks},
        "mean_reward": sum(r for g in groups for r in g.rewards) / (n * len(groups)), **checks,
        "temperature": args.temperature, "max_tokens": args.max_tokens, "length_control": args.length_control,
        "think_budget": args.think_budget,
        # what the policy writes: the first sample of the first three problems, as scored
        "examples": [{"prompt": g.problem.prompt, "answer": g.problem.answer, "completion": g.completions[0].text,
                      "reward": g.rewards[0]} for g in groups[:3]],
    }
