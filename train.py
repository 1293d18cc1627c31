"""train.py: the ScaleRL recipe on a torchrun FSDP2 learner with a vLLM generator.

    torchrun --standalone --nproc_per_node 2 train.py --loss cispo        # the embedded default, on a laptop CPU
    torchrun --nproc_per_node 8 train.py --model Qwen/Qwen3-8B --dataset POLARIS-Project/Polaris-Dataset-53K

The recipe (ScaleRL, Khatri et al. 2025, arXiv 2510.13786), one flag per component so that each leave-one-out
ablation is one command:
  - PipelineRL-k (--mode pipeline --max-off-policy 8): a vLLM generator streams groups while the learner trains and
    receives new weights after every optimizer step, in flight (pipeline_rl.py). k is the hard bound; the buffer
    limit (--buffer-steps 1) keeps the generator one batch ahead while the learner is fed, so the lag stays near 1
    whether the generator is faster or slower than the learner. --mode sync is conventional RL
    (and PPO-off-policy-k with --max-off-policy k: one generation round, then k optimizer steps on it).
  - The CISPO loss (--loss cispo; grpo, dapo, drgrpo, gspo for comparison), each from its own file with that
    file's paper defaults, overridable with --loss-arg KEY=VALUE.
  - Prompt-level loss aggregation and batch-level advantage normalisation (--aggregation, --adv-norm; CISPO's).
  - Zero-variance filtering (--zero-variance drop; DAPO's dynamic sampling is `resample`).
  - No-Positive-Resampling (--retire-pass-rate 0.9): prompts whose pass-rate history reaches 0.9 are retired.
  - Interruption-based length control (--length-control interruptions; DAPO's soft overlong penalty: `overlong`).
  - FP32 LM head in generator and learner (--fp32-lm-head).
  - Optional truncated importance sampling (--tis token|sequence, --tis-cap) against the sampler's logprobs.

The loop, top to bottom: pull a batch of groups -> compute the advantages -> compute the loss in micro-batches
-> step -> push the weights to the generator -> evaluate -> log a row of metrics.jsonl -> checkpoint. At the end:
fit ScaleRL's sigmoid to the evaluation rows and draw OUTPUT_DIR/scaling.png.

How this departs from the paper, deliberately:
  - The embedded default is a 0.86M-parameter model on 3-digit addition (tasks.py), so it runs on 2 CPU cores
    in minutes. Its generator is held to one batch ahead of the learner (--buffer-steps 1): with k = 8 alone, a
    fast generator made every batch 8 steps stale, and at lr 1e-4 that made runs swing (README: the staleness
    experiment). Its optimiser settings (lr 1e-4, 32 prompts x 8 samples, no warm-up, 100 steps) are tuned for that
    model and marked as such in --help; the paper's (lr 5e-7, AdamW eps 1e-15, weight decay 0.01, 100 warm-up steps,
    48 x 16) apply to real models (--model).
  - compute_hours counts wall-clock hours x devices in use, where on CPU a "device" is a learner rank or the
    generator process. flops = 2N per generated token + 6N per trained token (N = parameters).
  - Old logprobs: pipeline mode uses the sampler's (ScaleRL: the denominator of rho is the generator's logprob).
    Sync mode, and any run with --tis, recompute them with the learner before the round's first update; --tis
    then multiplies in min(pi_learner_old / pi_sampler, cap).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tasks

LOSSES = ("grpo", "dapo", "drgrpo", "gspo", "cispo")
EMBEDDED_MAX_MODEL_LEN = 256  # the tiny model's max_position_embeddings; its prompts are ~10 tokens
PROMPT_ALLOWANCE = 512  # prompt tokens a real model's context keeps beside --max-tokens: a chat template (with its
                        # system prompt) around a GSM8K or Polaris problem fits with room to spare


# ----------------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------------


def _arg(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Args:
    # what to train
    loss: str = _arg("cispo", "the loss file: grpo, dapo, drgrpo, gspo or cispo (ScaleRL: cispo)", choices=LOSSES)
    loss_arg: list[str] = _arg(None, "override a hyper-parameter of the loss, KEY=VALUE (repeatable), e.g. "
                               "--loss-arg eps_max=8; defaults are the loss file's paper values", action="append")
    model: str | None = _arg(None, "HF model name or directory (default: the embedded tiny model, built and cached "
                             "on first use by tasks.build_base_model)")
    dataset: str | None = _arg(None, "HF data set name or local .json/.jsonl/.parquet (default: the embedded "
                               "3-digit addition task)")
    dataset_config: str | None = _arg(None, "configuration (subset) of a hub --dataset, passed on as "
                                      "datasets.load_dataset(NAME, CONFIG); e.g. main for openai/gsm8k")
    test_dataset: str | None = _arg(None, "optional test set (local file or HF name), evaluated with the validation")
    question_field: str | None = _arg(None, "question field of --dataset (default: question, problem or prompt)")
    answer_field: str | None = _arg(None, "answer field of --dataset (default: answer, solution or final_answer)")
    skip_bad_rows: bool = _arg(False, "skip and count malformed data rows instead of stopping with an error")
    # the recipe's components
    mode: str = _arg("pipeline", "pipeline: PipelineRL in-flight updates (ScaleRL); sync: generate, then train",
                     choices=("pipeline", "sync"))
    max_off_policy: int = _arg(8, "k: pipeline: a sample's oldest token is at most k optimizer steps old (ScaleRL: "
                               "8); sync: k optimizer steps per generation round (PPO-off-policy-k; 1 = on-policy)")
    buffer_steps: int = _arg(1, "pipeline: freshness bound under k: the generator admits at most this many "
                             "learner steps' worth of prompts ahead of the learner (1: it samples the next batch "
                             "while the learner trains on this one; the lag then stays near 1 however fast the "
                             "generator is); k + 1 or more: only k limits it, as in PipelineRL and ScaleRL")
    aggregation: str | None = _arg(None, "CISPO loss aggregation: prompt (ScaleRL), sample or token",
                                   choices=("prompt", "sample", "token"))
    adv_norm: str | None = _arg(None, "CISPO advantage normalisation: batch (ScaleRL) or group",
                                choices=("batch", "group"))
    zero_variance: str = _arg("drop", "groups whose rewards are all equal: drop (ScaleRL), resample (DAPO dynamic "
                              "sampling: pull more groups until the batch is full) or keep",
                              choices=("drop", "resample", "keep"))
    retire_pass_rate: float = _arg(0.9, "No-Positive-Resampling: retire a prompt once its pass-rate history reaches "
                                   "this (ScaleRL: 0.9); 0 disables")
    length_control: str = _arg("interruptions", "interruptions (ScaleRL) or overlong (DAPO's soft overlong penalty "
                               "added to the reward)", choices=("interruptions", "overlong"))
    overlong_cache: int = _arg(16, "DAPO L_cache for --length-control overlong, in tokens (paper: 4096 of 20480; "
                               "tiny-task default 16 of 48)")
    fp32_lm_head: bool = _arg(True, "compute the LM head in float32 in generator and learner (ScaleRL, MiniMax-M1); "
                              "a no-op for float32 weights", action=argparse.BooleanOptionalAction)
    tis: str | None = _arg(None, "truncated importance sampling against the sampler's logprobs: token or sequence "
                           "(default: off)", choices=("token", "sequence"))
    tis_cap: float = _arg(2.0, "TIS truncation cap C (Yao et al.: 2)")
    tis_mode: str = _arg("truncate", "truncate: w = min(rho, C) (TIS); mask: w = rho inside [--tis-cap-min, C], "
                         "else 0 (MIS; IcePop: --tis token --tis-mode mask --tis-cap-min 0.5 --tis-cap 5)",
                         choices=("truncate", "mask"))
    tis_cap_min: float | None = _arg(None, "lower bound of the importance weight (default: none)")
    overlong_filter: bool = _arg(False, "DAPO's overlong filtering: completions cut off by --max-tokens are masked "
                                 "from the loss (their rewards still count in the group's advantages); counted "
                                 "in overlong_filtered")
    kl_coef: float = _arg(0.0, "GRPO's KL penalty to the reference policy (a frozen copy of the initial model, "
                          "sharded like the policy): beta of its k3 estimate, logged as kl_ref (DeepSeekMath: "
                          "0.04; 0 = off, as in DAPO and ScaleRL); only losses whose compute_loss takes "
                          "ref_logprobs (grpo)")
    # batch and schedule
    max_steps: int = _arg(100, "optimizer steps (tiny-task default: the pass rate levels off near 0.95 by step "
                          "50-60)")
    prompts_per_step: int = _arg(32, "prompts per optimizer step (ScaleRL: 48; tiny-task default 32)")
    group_size: int = _arg(8, "completions per prompt (ScaleRL: 16; tiny-task default 8)")
    temperature: float = _arg(1.0, "sampling temperature; the learner divides its logits by the same value")
    think_budget: str = _arg("34,40", "interruption point drawn uniformly in MIN,MAX thinking tokens "
                             "(ScaleRL: 10240,12288; tiny task: 34,40, above its ~29-token scratchpad)")
    answer_budget: int = _arg(8, "tokens allowed after an interruption (ScaleRL: 2048; tiny task: 8)")
    max_tokens: int = _arg(48, "generation budget per completion (ScaleRL: 14336; tiny task: 48)")
    max_model_len: int | None = _arg(None, "vLLM's context per sequence, prompt + completion tokens (default: "
                                     f"{EMBEDDED_MAX_MODEL_LEN} for the embedded tiny model, its context length; "
                                     f"--max-tokens + {PROMPT_ALLOWANCE} with --model, room for a chat-templated "
                                     "prompt); a training prompt that does not fit is skipped and counted in "
                                     "skipped_long_prompts")
    # optimiser
    lr: float | None = _arg(None, "AdamW learning rate (default: 1e-4 for the tiny model, tuned here, where 2e-4 "
                            "diverged; the paper's 5e-7 for --model)")
    adam_eps: float | None = _arg(None, "AdamW eps (default: 1e-8 tiny model; paper 1e-15)")
    weight_decay: float | None = _arg(None, "AdamW weight decay (default: 0 tiny model; paper 0.01)")
    warmup_steps: int | None = _arg(None, "linear warm-up steps (default: 0 tiny model; paper 100)")
    grad_clip: float = _arg(1.0, "clip the global gradient norm to this (logged as grad_norm, grad_clipped)")
    micro_batch_tokens: int = _arg(8192, "token budget of a micro-batch (padded rows x length); whole groups only")
    max_bad_steps: int = _arg(3, "stop (with a checkpoint) after this many consecutive non-finite steps")
    # evaluation, logging, checkpoints
    eval_every: int = _arg(5, "evaluate every N steps (and at step 0 and the end); tiny task: 5, so the rise of "
                           "the curve has enough points for the sigmoid fit")
    eval_samples: int = _arg(4, "k of the mean@k validation pass rate (ScaleRL: 16)")
    eval_prompts: int = _arg(128, "held-out validation prompts (ScaleRL: 1000)")
    log_every: int = _arg(5, "print a one-line summary every N steps")
    checkpoint_every: int = _arg(10, "save a checkpoint every N steps (and at the end)")
    output_dir: str = _arg("runs/default", "where metrics.jsonl, checkpoint/, scaling.png go")
    resume: str | None = _arg(None, "continue the run in this directory from its last checkpoint, with the flags it "
                              "was started with (args.json); flags given now override those, e.g. --max-steps")
    overwrite: bool = _arg(False, "start afresh in an --output-dir that already holds a run, deleting its metrics "
                           "and checkpoint (without this flag such a directory is refused)")
    seed: int = _arg(0, "seed of data order, sampling and initialisation")
    gen_devices: str | None = _arg(None, "GPU only: comma-separated CUDA devices for the vLLM generator (the "
                                   "learner uses the others); ScaleRL split 64 generator / 16 trainer GPUs")
    tensor_parallel_size: int = _arg(1, "GPU only: vLLM tensor parallelism of the generator")
    dtype: str | None = _arg(None, "float32 or bfloat16 (default: bfloat16 on GPU, float32 on CPU)")
    # debugging: turn the generator/learner speed ratio on purpose
    debug_gen_slowdown: float = _arg(1.0, "debug: make the generator X times slower (it sleeps X-1 times each "
                                     "engine step's duration), to see how the recipe behaves on a machine "
                                     "whose generator is slower relative to its learner")
    debug_learner_slowdown: float = _arg(1.0, "debug: make the learner X times slower (each rank sleeps X-1 "
                                         "times each step's compute), to emulate a relatively faster generator")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="train.py", description="The ScaleRL recipe: vLLM generator + FSDP2 learner. Run under torchrun.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Args):
        meta = dict(f.metadata)
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"default": f.default, "help": meta.pop("help")}
        kwargs.update(meta)
        if f.type in ("bool",) and "action" not in kwargs:
            kwargs["action"] = "store_true"
        elif "action" not in kwargs:
            kwargs["type"] = {"int": int, "float": float}.get(f.type.split(" |")[0], str)
        parser.add_argument(flag, **kwargs)
    return parser


class _Unset:
    """Marks a flag the command line did not give."""


class _Parser(argparse.ArgumentParser):
    """Argument errors in one line, printed once: every torchrun rank parses the same flags, so only rank 0
    speaks and the others exit quietly with the same status."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if os.environ.get("RANK", "0") == "0":
            print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None = None) -> Args:
    parser = build_parser()
    values = vars(parser.parse_args(argv))
    if values["resume"]:
        values = resumed_values(parser, argv, values["resume"])
    args = Args(**values)
    problems = check_args(args)
    if problems:
        parser.error("; ".join(problems))
    return args


def resumed_values(parser: argparse.ArgumentParser, argv: list[str] | None, run_dir: str) -> dict[str, Any]:
    """The flags a resumed run continues with: those it was started with (its args.json), overridden by the ones
    given now (e.g. --max-steps 400 to extend it). Its output directory is `run_dir`, whatever --output-dir says."""
    # Parse again into a namespace that already holds every field, so argparse leaves out the defaults; append
    # actions need a list-like start, hence None for them.
    blank = {f.name: None if f.metadata.get("action") == "append" else _Unset for f in dataclasses.fields(Args)}
    given = {k: v for k, v in vars(parser.parse_args(argv, namespace=argparse.Namespace(**blank))).items()
             if v is not _Unset and not (v is None and blank[k] is None)}
    saved_file = Path(run_dir) / "args.json"
    saved = {}
    if saved_file.exists():
        saved = json.loads(saved_file.read_text())
    elif complete_checkpoints(Path(run_dir)):
        parser.error(f"--resume {run_dir}: no args.json there, so the flags of the run are unknown")
    values = {f.name: f.default for f in dataclasses.fields(Args)}
    values.update({k: v for k, v in saved.items() if k in values})
    values.update(resume=run_dir, overwrite=False)
    values.update(given)
    values["output_dir"] = run_dir
    return values


def check_args(args: Args) -> list[str]:
    """Incompatible flags, explained before anything starts."""
    problems = []
    if args.loss != "cispo" and (args.aggregation or args.adv_norm):
        problems.append(f"--aggregation and --adv-norm are CISPO's options; --loss {args.loss} fixes its own "
                        "(see its file's docstring)")
    if args.mode == "sync" and args.max_off_policy < 1:
        problems.append("--max-off-policy must be >= 1 in sync mode (1 = on-policy)")
    if args.mode == "pipeline" and args.max_off_policy < 0:
        problems.append("--max-off-policy must be >= 0")
    if args.buffer_steps < 0:
        problems.append("--buffer-steps must be >= 0")
    for flag in ("debug_gen_slowdown", "debug_learner_slowdown"):
        if not getattr(args, flag) >= 1:
            problems.append(f"--{flag.replace('_', '-')} must be >= 1 (1 = full speed)")
    if args.zero_variance == "drop" and args.group_size < 2:
        problems.append("--group-size 1 has no group variance: every group would be dropped")
    if args.tis is None and (args.tis_cap != 2.0 or args.tis_mode != "truncate" or args.tis_cap_min is not None):
        problems.append("--tis-cap, --tis-mode and --tis-cap-min have no effect without --tis token|sequence")
    if args.tis_cap_min is not None and not 0 <= args.tis_cap_min <= args.tis_cap:
        problems.append(f"--tis-cap-min must lie in [0, --tis-cap] (got {args.tis_cap_min})")
    if args.kl_coef < 0:
        problems.append(f"--kl-coef must be >= 0 (got {args.kl_coef})")
    elif args.kl_coef > 0 and args.loss in LOSSES and not _loss_takes(args.loss, "ref_logprobs"):
        problems.append(f"--kl-coef needs a loss with a reference-policy KL term (grpo); {args.loss}.py has none")
    if args.overlong_filter and args.length_control == "interruptions":
        problems.append("--overlong-filter masks completions cut off by --max-tokens: use it with "
                        "--length-control overlong (with interruptions, a long completion is interrupted instead)")
    try:
        low, high = _budget(args.think_budget)
        if not 1 <= low <= high:
            raise ValueError
        if args.length_control == "interruptions" and high >= args.max_tokens:
            problems.append("--think-budget must end below --max-tokens so that an answer fits")
    except ValueError:
        problems.append(f"--think-budget {args.think_budget!r}: expected MIN,MAX with 1 <= MIN <= MAX, e.g. 34,40")
    if not args.temperature > 0:
        problems.append(f"--temperature must be > 0 (got {args.temperature}): RL samples, and greedy decoding has no "
                        "usable logprobs")
    for flag in ("lr", "adam_eps"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            problems.append(f"--{flag.replace('_', '-')} must be > 0 (got {value})")
    for flag in ("weight_decay", "warmup_steps"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            problems.append(f"--{flag.replace('_', '-')} must be >= 0 (got {value})")
    for flag in ("group_size", "max_tokens", "answer_budget", "eval_samples", "eval_prompts", "checkpoint_every",
                 "log_every", "micro_batch_tokens", "max_bad_steps"):
        if getattr(args, flag) < 1:
            problems.append(f"--{flag.replace('_', '-')} must be >= 1 (got {getattr(args, flag)})")
    if not args.grad_clip > 0:
        problems.append(f"--grad-clip must be > 0 (got {args.grad_clip})")
    if args.model is not None and not Path(args.model).exists() and (
            args.model.startswith(("/", ".", "~")) or args.model.count("/") > 1):
        problems.append(f"--model {args.model}: no such directory (a hub model is named ORG/NAME)")
    if args.dataset and tasks.is_local_data_file(args.dataset) and not Path(args.dataset).is_file():
        problems.append(f"--dataset {args.dataset}: no such file")
    problems += _output_dir_problems(Path(args.output_dir))
    if model_context(args) <= args.max_tokens:
        problems.append(f"--max-model-len ({model_context(args)}) must exceed --max-tokens ({args.max_tokens}): it "
                        "holds the prompt and the completion")
    if args.resume and not complete_checkpoints(Path(args.resume)):
        problems.append(f"--resume {args.resume}: no complete checkpoint there (expected {args.resume}/checkpoint/ "
                        f"or checkpoint.old/ with trainer_state.json); a run killed before its first checkpoint "
                        f"cannot be continued: start it afresh with --output-dir {args.resume} --overwrite")
    existing = [name for name in ("metrics.jsonl", "checkpoint", "checkpoint.old")
                if (Path(args.output_dir) / name).exists()
                and not (name == "metrics.jsonl" and (Path(args.output_dir) / name).stat().st_size == 0)]
    if args.resume and args.overwrite:
        problems.append("--resume continues a run and --overwrite deletes it: choose one")
    elif not args.resume and existing and not args.overwrite:
        problems.append(f"--output-dir {args.output_dir} already holds a run ({', '.join(existing)}): continue it "
                        f"with --resume {args.output_dir}, start afresh with --overwrite, or pick another directory")
    if args.dataset_config and not (args.dataset and args.dataset != "arithmetic"
                                    and not tasks.is_local_data_file(args.dataset)):
        problems.append("--dataset-config names a configuration of a hub data set: give --dataset NAME too, not a "
                        "local file or the embedded task")
    for item in args.loss_arg or []:
        if "=" not in item:
            problems.append(f"--loss-arg {item!r}: expected KEY=VALUE")
    if args.eval_every < 1 or args.max_steps < 1 or args.prompts_per_step < 1:
        problems.append("--eval-every, --max-steps and --prompts-per-step must be >= 1")
    return problems


def _loss_takes(loss: str, name: str) -> bool:
    """Whether the loss file's compute_loss has the keyword `name`."""
    import inspect

    return name in inspect.signature(importlib.import_module(loss).compute_loss).parameters


def _output_dir_problems(out: Path) -> list[str]:
    """--output-dir must be a directory this process can write, or a path where one can be made."""
    if out.exists() and not out.is_dir():
        return [f"--output-dir {out} is a file, not a directory"]
    probe = out
    while not probe.exists():  # the nearest existing ancestor is where the directory would be made
        probe = probe.parent
    if not probe.is_dir():
        return [f"--output-dir {out}: {probe} is a file, not a directory"]
    try:  # a real write: permission bits say little to root, or on a read-only file system
        tempfile.TemporaryDirectory(dir=probe, prefix=".scalerl-probe-").cleanup()
    except OSError as e:
        return [f"--output-dir {out}: {probe} is not writable ({e.strerror})"]
    return []


def model_context(args: Args) -> int:
    """vLLM's max_model_len: --max-model-len, else the tiny model's context, else --max-tokens + a prompt allowance."""
    if args.max_model_len is not None:
        return args.max_model_len
    return EMBEDDED_MAX_MODEL_LEN if args.model is None else args.max_tokens + PROMPT_ALLOWANCE


def _budget(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


def _literal(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(value.lower(), value)


def loss_hyperparameters(args: Args, loss_module: Any) -> dict[str, Any]:
    """Keyword overrides for the loss file; everything not named keeps the file's paper default."""
    import inspect

    accepted = inspect.signature(loss_module.compute_loss).parameters
    hp: dict[str, Any] = {}
    if args.loss == "drgrpo":
        hp["max_tokens"] = args.max_tokens  # Dr. GRPO's constant normaliser: the generation budget
    if args.aggregation:
        hp["aggregation"] = args.aggregation
    if args.kl_coef:
        hp["kl_coef"] = args.kl_coef  # with ref_logprobs from the reference model, per micro-batch
    for item in args.loss_arg or []:
        key, value = item.split("=", 1)
        if key not in accepted or key in ("logprobs", "old_logprobs", "advantages", "mask", "group_size"):
            names = [n for n, p in accepted.items() if p.kind == p.KEYWORD_ONLY and n not in ("is_weights", "denominator")]
            raise SystemExit(f"--loss-arg {key}: {args.loss}.compute_loss has no such hyper-parameter; it has {names}")
        hp[key] = _literal(value)
    return hp


# ----------------------------------------------------------------------------------------------------------------
# Distributed setup and the FSDP2 learner
# ----------------------------------------------------------------------------------------------------------------


def init_distributed(gen_devices: str | None = None) -> tuple[int, int, Any]:
    """(rank, world size, this rank's device). On GPU the learner keeps off the generator's `gen_devices`."""
    import torch
    import torch.distributed as dist

    import pipeline_rl

    if "RANK" not in os.environ:  # plain `python train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        learner_ids, _ = pipeline_rl.split_devices(gen_devices, torch.cuda.device_count())
        device = torch.device("cuda", learner_ids[int(os.environ["LOCAL_RANK"]) % len(learner_ids)])
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        # Two cores are shared by the learner ranks and the generator: oversubscribing threads only slows all down.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (world + 1)))
    return rank, world, device


def build_learner(model_path: str, args: Args, device: Any) -> tuple[Any, Any]:
    """The policy as FSDP2: fully_shard on every decoder layer, then the root. Returns (model, param count)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    model.config.use_cache = False
    low_precision = args.dtype == "bfloat16"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if low_precision else None
    if args.fp32_lm_head:
        # FP32 LM head (ScaleRL, MiniMax-M1): its own FSDP unit kept in float32, fed float32 hidden states. A head
        # tied to the input embedding (SmolLM2 and other small models) is one parameter, which FSDP2 refuses in two
        # units: the embedding joins the head's unit (and is kept in float32 with it).
        model.lm_head.register_forward_pre_hook(lambda module, inputs: (inputs[0].float(),))
        tied = model.lm_head.weight is model.get_input_embeddings().weight
        head = [model.get_input_embeddings(), model.lm_head] if tied else model.lm_head
        fully_shard(head, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    for layer in model.model.layers:
        fully_shard(layer, **({"mp_policy": mp} if mp else {}))
    fully_shard(model, **({"mp_policy": mp} if mp else {}))
    if device.type == "cuda":
        model.to(device)
    model.train()
    return model, n_params


def full_state_dict(model: Any) -> dict:
    """HF-named full weights gathered on rank 0 (empty elsewhere); a collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ----------------------------------------------------------------------------------------------------------------
# Batches: groups -> padded tensors, micro-batches by token budget
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Rows:
    """One micro-batch of completions, each row = prompt + completion, right-padded. Per-token fields are aligned
    with the predicted token: position t holds the logprob of input_ids[:, t + 1]."""

    input_ids: Any  # [N, L]
    attention: Any  # [N, L] bool
    loss_mask: Any  # [N, L-1] bool: completion tokens the model chose (not prompt, padding, injected phrase)
    sampler_logprobs: Any  # [N, L-1]
    versions: Any  # [N, L-1] weight version that sampled each token (-1 outside completions)
    old_logprobs: Any  # [N, L-1] behaviour policy: learner-recomputed where attached, else the sampler's
    advantages: Any  # [N]


def to_rows(groups: list, advantages: Any, group_size: int, pad_id: int) -> Rows:
    """Pad the groups' completions (after their prompts) into one micro-batch of rows."""
    import torch

    seqs = [(g.prompt_ids, c) for g in groups for c in g.completions]
    length = max(len(p) + len(c.token_ids) for p, c in seqs)
    n = len(seqs)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros(n, length, dtype=torch.bool)
    loss_mask = torch.zeros(n, length - 1, dtype=torch.bool)
    sampler = torch.zeros(n, length - 1)
    versions = torch.full((n, length - 1), -1, dtype=torch.long)
    old = torch.zeros(n, length - 1)
    for row, (prompt, c) in enumerate(seqs):
        p, t = len(prompt), len(c.token_ids)
        input_ids[row, : p + t] = torch.tensor(prompt + c.token_ids)
        attention[row, : p + t] = True
        loss_mask[row, p - 1 : p - 1 + t] = torch.tensor(c.loss_mask, dtype=torch.bool)
        sampler[row, p - 1 : p - 1 + t] = torch.tensor(c.sampler_logprobs)
        versions[row, p - 1 : p - 1 + t] = torch.tensor(c.versions)
        behaviour = c.old_logprobs if c.old_logprobs is not None else c.sampler_logprobs
        old[row, p - 1 : p - 1 + t] = torch.tensor(behaviour)
    return Rows(input_ids, attention, loss_mask, sampler, versions, old, advantages)


def micro_batches(groups: list, token_budget: int, group_size: int) -> list[list[int]]:
    """Indices of groups per micro-batch: whole groups, padded size (rows x longest row) within the budget."""
    batches, current, longest = [], [], 0
    for i, g in enumerate(groups):
        g_len = len(g.prompt_ids) + max(len(c.token_ids) for c in g.completions)
        new_longest = max(longest, g_len)
        if current and (len(current) + 1) * group_size * new_longest > token_budget:
            batches.append(current)
            current, new_longest = [], g_len
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


def token_logprobs(model: Any, rows: Rows, temperature: float) -> Any:
    """log pi(token) for every next-token position, after dividing the logits by the sampling temperature."""
    import torch

    logits = model(input_ids=rows.input_ids, attention_mask=rows.attention.long()).logits[:, :-1]  # [N, L-1, V]
    logits = logits.float() / temperature
    targets = rows.input_ids[:, 1:].unsqueeze(-1)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1)  # [N, L-1]


# ----------------------------------------------------------------------------------------------------------------
# One optimizer step: the loss over micro-batches, whose sum equals the full-batch loss on any world size
# ----------------------------------------------------------------------------------------------------------------


def loss_and_backward(model: Any, loss_module: Any, hp: dict, groups: list, advantages: Any, args: Args,
                      pad_id: int, world: int, version: int, ref_model: Any = None) -> dict[str, float]:
    """Forward/backward over this rank's micro-batches. Denominators cover the whole batch across ranks.
    `ref_model`: the frozen reference policy of --kl-coef, whose logprobs go to the loss as ref_logprobs."""
    import torch
    import torch.distributed as dist

    import tis

    g = args.group_size
    rows_per_batch = []
    for idx in micro_batches(groups, args.micro_batch_tokens, g):
        rows_idx = [i * g + j for i in idx for j in range(g)]
        rows_per_batch.append(to_rows([groups[i] for i in idx], advantages[rows_idx], g, pad_id))
    # Whole-batch denominator (prompts, completions or tokens, per the loss's aggregation), summed over ranks.
    local = sum(loss_module.loss_denominator(r.loss_mask, g, **hp) for r in rows_per_batch)
    counts = torch.tensor([float(local), float(len(rows_per_batch))])
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    denominator = counts[0].item()
    n_micro = torch.tensor([len(rows_per_batch)])
    dist.all_reduce(n_micro, op=dist.ReduceOp.MAX)  # FSDP collectives: every rank runs as many forwards
    totals: dict[str, float] = defaultdict(float)
    for i in range(int(n_micro.item())):
        if i < len(rows_per_batch):
            rows = rows_per_batch[i]
            logprobs = token_logprobs(model, rows, args.temperature)
            old = rows.old_logprobs
            is_weights = None
            if args.tis:
                is_weights = tis.tis_weights(old, rows.sampler_logprobs, rows.loss_mask, cap=args.tis_cap,
                                             level=args.tis, mode=args.tis_mode, cap_min=args.tis_cap_min)
            extra = {}
            if ref_model is not None:
                with torch.no_grad():
                    extra["ref_logprobs"] = token_logprobs(ref_model, rows, args.temperature)
            loss, metrics = loss_module.compute_loss(logprobs, old, rows.advantages, rows.loss_mask, g,
                                                     is_weights=is_weights, denominator=denominator, **hp, **extra)
            # FSDP averages gradients over ranks; the loss is already normalised by the global denominator.
            (loss * world).backward()
            weight = metrics.get("num_tokens", 0.0)
            totals["loss"] += loss.item()
            for key, value in metrics.items():
                if key != "num_tokens":
                    totals[key] += value * weight
            totals["num_tokens"] += weight
            # Sampler/learner mismatch on tokens sampled by the weights being trained now (lag 0).
            same_weights = rows.loss_mask & (rows.versions == version)
            if same_weights.any():
                mm = tis.mismatch_metrics(logprobs.detach(), rows.sampler_logprobs, same_weights)
                n_same = float(same_weights.sum())
                for key, value in mm.items():
                    totals[key] += value * n_same
                totals["mismatch_tokens"] += n_same
            if is_weights is not None:
                totals["is_weight_mean"] += float(is_weights[rows.loss_mask].sum())
                totals["is_weight_zero_frac"] += float((is_weights[rows.loss_mask] == 0).sum())  # masked (MIS)
        else:  # an idle rank still joins the FSDP all-gathers, with a loss that contributes nothing
            dummy = torch.full((1, 2), pad_id, dtype=torch.long)
            (model(input_ids=dummy).logits.sum() * 0.0).backward()
            if ref_model is not None:
                with torch.no_grad():
                    ref_model(input_ids=dummy)
    return dict(totals)


def reduce_metrics(totals: dict[str, float], world: int) -> dict[str, float]:
    """Token-weighted means over all ranks (the loss is a sum of micro-batch terms, so it is summed)."""
    import torch.distributed as dist

    gathered: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, totals)
    summed: dict[str, float] = defaultdict(float)
    for part in gathered:
        for key, value in part.items():
            summed[key] += value
    out = {"loss": summed.pop("loss", 0.0), "num_tokens": summed.get("num_tokens", 0.0)}
    n_tok, n_same = summed.pop("num_tokens", 0.0), summed.pop("mismatch_tokens", 0.0)
    for key, value in summed.items():
        denom = n_same if key.startswith("mismatch_") else n_tok
        out[key] = value / denom if denom else 0.0
    return out


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints: model, optimizer, step, RNG, prompt history, data position, metrics position
# ----------------------------------------------------------------------------------------------------------------


def save_checkpoint(out: Path, model: Any, optimizer: Any, state: dict, rank: int) -> None:
    """OUTPUT_DIR/checkpoint/ (the previous one kept as checkpoint.old/ until the next save completes). Each rank's
    RNG states go into rng-RANK.pt; trainer_state.json is written last, so a directory that has it is complete."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                   cpu_offload=True))
    tmp, final, old = out / "checkpoint.tmp", out / "checkpoint", out / "checkpoint.old"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        torch.save({"model": model_sd, "optimizer": optim_sd}, tmp / "weights.pt")
    dist.barrier()  # tmp exists before the other ranks write their RNG states into it
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(rng, tmp / f"rng-{rank}.pt")
    dist.barrier()
    if rank != 0:
        return
    (tmp / "trainer_state.json").write_text(json.dumps(state))
    # At every moment one complete checkpoint exists: a crash between these renames leaves checkpoint.old.
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)


def complete_checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints of a run directory, newest first (checkpoint/, then checkpoint.old/)."""
    return [d for d in (out / "checkpoint", out / "checkpoint.old") if (d / "trainer_state.json").is_file()]


def load_checkpoint(out: Path, model: Any, optimizer: Any, rank: int) -> tuple[dict, Path]:
    """Restore the newest complete checkpoint that loads; a corrupt one is named and the older one used instead."""
    import numpy as np
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    failures = []
    for ckpt in complete_checkpoints(out):
        try:
            state = json.loads((ckpt / "trainer_state.json").read_text())
            weights = torch.load(ckpt / "weights.pt", map_location="cpu", weights_only=False)
            rng_file = ckpt / f"rng-{rank}.pt"
            rng = torch.load(rng_file if rng_file.exists() else ckpt / "rng-0.pt", weights_only=False)
        except Exception as e:  # a file cut short or garbled: name it, try the older checkpoint
            failures.append(f"{ckpt} is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            if rank == 0:
                print(f"[resume] {failures[-1]}; trying the previous checkpoint", file=sys.stderr)
            continue
        set_state_dict(model, optimizer, model_state_dict=weights["model"], optim_state_dict=weights["optimizer"],
                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        return state, ckpt
    raise SystemExit(f"--resume {out}: no checkpoint could be read: " + "; ".join(failures))


class GracefulStop:
    """SIGINT (Ctrl-C; torchrun passes it on to every rank) or SIGTERM: finish the current step, save a checkpoint
    and exit, so that a --resume redoes nothing. A second signal stops at once."""

    def __init__(self, announce: bool, device: Any = "cpu"):
        self.signal: str | None = None
        self.announce, self.device = announce, device
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping at once")
        self.signal = signal.Signals(signum).name
        if self.announce:
            print(f"\n[{self.signal}] stopping after this step, with a checkpoint (again to stop at once)",
                  file=sys.stderr, flush=True)

    def agreed(self) -> bool:
        """True on every rank if any rank was signalled (a collective: every rank calls it at the same point)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([float(self.signal is not None)], device=self.device)  # NCCL reduces on the GPU
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class OutputDirBusyError(RuntimeError):
    """Another live train.py holds the output directory."""


def lock_output_dir(out: Path) -> Any:
    """Take OUTPUT_DIR/.lock for the life of this process; raise OutputDirBusyError if a live run holds it.
    flock is released by the kernel when its holder dies, however it dies."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    handle = (out / ".lock").open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise OutputDirBusyError(f"{out} is in use by another train.py (pid {holder}); stop it before starting or "
                                 "resuming a run there") from None
    handle.truncate(0)
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def _json_safe(value: Any, name: str = "") -> tuple[Any, list[str]]:
    """`value` with every non-finite float replaced by None, and the dotted names of the replaced fields."""
    if isinstance(value, float) and not math.isfinite(value):
        return None, [name]
    if isinstance(value, dict):
        out, bad = {}, []
        for key, item in value.items():
            out[key], found = _json_safe(item, f"{name}.{key}" if name else str(key))
            bad += found
        return out, bad
    if isinstance(value, (list, tuple)):
        pairs = [_json_safe(item, f"{name}[{i}]") for i, item in enumerate(value)]
        return [item for item, _ in pairs], [n for _, found in pairs for n in found]
    return value, []


class MetricsLog:
    """metrics.jsonl (format: scaling_fit.py's docstring). On resume it is cut back to the checkpoint's line
    count, so steps re-done after a crash are neither lost nor duplicated."""

    def __init__(self, path: Path, keep_lines: int | None):
        self.path = path
        lines = path.read_text().splitlines(keepends=True) if path.exists() else []
        if keep_lines is not None:
            lines = lines[:keep_lines]
        self.lines = len(lines)
        path.write_text("".join(lines))

    def write(self, row: dict) -> None:
        row, non_finite = _json_safe(row)
        if non_finite:  # strict JSON has no NaN or Infinity: write null and name the fields
            row["non_finite"] = non_finite
        with self.path.open("a") as f:
            f.write(json.dumps(row, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.lines += 1


# ----------------------------------------------------------------------------------------------------------------
# Evaluation and the end-of-run fit
# ----------------------------------------------------------------------------------------------------------------


def evaluate(generator: Any, problems: list, samples: int, temperature: float) -> dict[str, float]:
    groups = generator.evaluate(problems, samples, temperature)
    rewards = [r for g in groups for r in g.rewards]
    per_prompt = [sum(r > 0 for r in g.rewards) / len(g.rewards) for g in groups]
    return {"pass_rate": sum(per_prompt) / len(per_prompt), "reward": sum(rewards) / len(rewards)}


def fit_and_plot(metrics_file: Path, out_png: Path, label: str) -> Any:
    import scaling_fit

    rows = [r for r in scaling_fit.read_metrics(metrics_file) if "val_pass_rate" in r]
    compute = [r["compute_hours"] for r in rows]
    reward = [r["val_pass_rate"] for r in rows]
    fit = None
    try:
        fit = scaling_fit.fit_sigmoid(compute, reward)
    except ValueError as err:  # too few points, or a flat curve: plot the points anyway
        print(f"[scaling fit] {err}")
    scaling_fit.plot_fits([(label, compute, reward, fit, None)], out_png, x_label="compute_hours",
                          y_label="val_pass_rate")
    return fit


def current_asymptote(rows: list[dict]) -> float | None:
    """The sigmoid fit's predicted asymptote A over the evaluation rows so far (None until it can be fitted)."""
    import scaling_fit

    points = [(r["compute_hours"], r["val_pass_rate"]) for r in rows]
    if len(points) < 5:
        return None
    try:
        return scaling_fit.fit_sigmoid(*zip(*points)).A
    except ValueError:
        return None


# ----------------------------------------------------------------------------------------------------------------
# The recipe
# ----------------------------------------------------------------------------------------------------------------


def load_tasks(args: Args) -> tuple[tasks.Task, tasks.Task | None]:
    """The training task behind --dataset (with --dataset-config for a hub data set) and the optional test task."""
    task = tasks.load_task(args.dataset, **{k: v for k, v in (("question_field", args.question_field),
                                                                ("answer_field", args.answer_field),
                                                                ("skip_bad_rows", args.skip_bad_rows),
                                                                ("dataset_config", args.dataset_config)) if v})
    test_task = tasks.load_task(args.test_dataset, question_field=args.question_field,
                                answer_field=args.answer_field, skip_bad_rows=args.skip_bad_rows) \
        if args.test_dataset else None
    return task, test_task


def resolve_defaults(args: Args, embedded: bool, on_gpu: bool) -> None:
    """The tiny model's tuned optimiser defaults, or the paper's for real models."""
    tiny = {"lr": 1e-4, "adam_eps": 1e-8, "weight_decay": 0.0, "warmup_steps": 0}
    paper = {"lr": 5e-7, "adam_eps": 1e-15, "weight_decay": 0.01, "warmup_steps": 100}
    for key, value in (tiny if embedded else paper).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dtype is None:
        args.dtype = "bfloat16" if on_gpu else "float32"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import numpy as np
    import torch
    import torch.distributed as dist

    import pipeline_rl

    tasks.set_vllm_cpu_env()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun starts each rank in a session of its own, so a `kill -9` of torchrun would leave the ranks
        # training on, and a --resume would then race them for OUTPUT_DIR: die with the launcher instead.
        pipeline_rl.set_parent_death_signal(signal.SIGKILL)
    rank, world, device = init_distributed(args.gen_devices)
    is_main = rank == 0
    stopper = GracefulStop(announce=is_main, device=device)
    out = Path(args.output_dir)
    fresh_dir = not out.exists()  # a start that fails removes what it made
    # One run per OUTPUT_DIR at a time (the lock dies with its process, so a killed run never blocks its resume).
    output_lock, lock_error = None, [None]  # the open lock file: held until this function returns
    if is_main:
        try:
            output_lock = lock_output_dir(out)
        except OutputDirBusyError as e:
            lock_error = [str(e)]
    dist.broadcast_object_list(lock_error, src=0)
    if lock_error[0]:
        dist.destroy_process_group()
        raise SystemExit(lock_error[0])
    generator = None
    log: MetricsLog | None = None
    try:  # until the first metrics row, a failure leaves the output directory as it was found
        if is_main and args.overwrite:
            for name in ("checkpoint", "checkpoint.old", "checkpoint.tmp"):
                shutil.rmtree(out / name, ignore_errors=True)
            for name in ("metrics.jsonl", "scaling.png"):
                (out / name).unlink(missing_ok=True)
        loss_module = importlib.import_module(args.loss)
        hp = loss_hyperparameters(args, loss_module)
        adv_kwargs = {"normalization": args.adv_norm} if args.adv_norm else {}

        # Data and model. Rank 0 builds the embedded model once (cached); the others wait at the barrier.
        task, test_task = load_tasks(args)
        for t in (task, test_task):
            if is_main and getattr(t, "skipped_summary", ""):
                print(f"[data] {t.name_or_path}: {t.skipped_summary}", file=sys.stderr)
        embedded = args.model is None
        if embedded and is_main:
            tasks.build_base_model()
        dist.barrier()
        model_path = str(tasks.build_base_model()) if embedded else args.model
        resolve_defaults(args, embedded, device.type == "cuda")
        random.seed(args.seed + rank)
        np.random.seed(args.seed + rank)
        torch.manual_seed(args.seed)
        model, n_params = build_learner(model_path, args, device)
        ref_model = None
        if args.kl_coef:  # GRPO's reference policy: the initial model, frozen, sharded like the policy
            ref_model = build_learner(model_path, args, device)[0].eval().requires_grad_(False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=args.adam_eps, weight_decay=args.weight_decay)
        warmup = max(args.warmup_steps, 0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)))
        from transformers import AutoTokenizer

        pad_id = AutoTokenizer.from_pretrained(model_path).pad_token_id or 0

        # Trainer state (saved in every checkpoint).
        state: dict[str, Any] = {
            "step": 0, "metrics_lines": 0, "elapsed_hours": 0.0, "flops": 0.0, "gen_tokens": 0, "train_tokens": 0,
            "consumed": [], "history": {}, "retired": [], "bad_steps_total": 0, "reward_errors": 0,
        }
        if args.resume:
            state, ckpt = load_checkpoint(out, model, optimizer, rank)
            if is_main:
                print(f"[resume] {ckpt}: step {state['step']}", file=sys.stderr)
            for _ in range(state["step"]):
                scheduler.step()
        if not args.resume and is_main:
            state["data_skipped"] = {"rows": getattr(task, "skipped_rows", 0),
                                     "reasons": getattr(task, "skipped_reasons", {})}

        # The generator (rank 0 owns it; its process is vLLM's).
        consumed: set[int] = set(state["consumed"])
        history: dict[str, list[float]] = dict(state["history"])
        retired: set[str] = set(state["retired"])
        val_problems = task.validation(args.eval_prompts)
        test_problems = test_task.validation(None) if test_task else []
        devices_in_use = world + 1  # learner ranks + the generator (on GPU: its device count)
        if args.gen_devices:
            devices_in_use = world + len(args.gen_devices.split(","))
        if is_main:
            data_start = min(set(range(max(consumed, default=-1) + 2)) - consumed)
            config = generator_config(args, model_path, state)
            generator = pipeline_rl.Generator(config, task, data_start=data_start,
                                              skip_indices={i for i in consumed if i >= data_start},
                                              retired_ids=retired)
            generator.start()
        if state["step"] > 0:  # the generator starts from the base weights: give it the resumed ones
            sd = full_state_dict(model)
            if is_main:
                generator.update_weights(sd, state["step"])
        if is_main:  # the run's files appear only once it has started
            log = MetricsLog(out / "metrics.jsonl", state["metrics_lines"] if args.resume else 0)
            (out / "args.json").write_text(json.dumps(dataclasses.asdict(args), indent=1))
        run_loop(args, rank, world, model, optimizer, scheduler, loss_module, hp, adv_kwargs, generator, state,
                 consumed, history, retired, log, out, val_problems, test_problems, pad_id, n_params, devices_in_use,
                 stopper, ref_model)
    except BaseException:
        if is_main and not args.resume and (log is None or log.lines == 0):
            _remove_failed_start(out, fresh_dir)  # the corrected command must not find a "run" here
        raise
    finally:
        if generator is not None:
            generator.close()
    if is_main:
        fit = fit_and_plot(out / "metrics.jsonl", out / "scaling.png", f"{args.loss} ({args.mode})")
        if fit is not None:
            print(f"[scaling fit] A={fit.A:.3f} B={fit.B:.2f} C_mid={fit.C_mid:.4g} R0={fit.R0:.3f} "
                  f"R2={fit.r2:.3f} on {fit.n_points} points -> {out / 'scaling.png'}")
    dist.destroy_process_group()


def _remove_failed_start(out: Path, fresh_dir: bool) -> None:
    """Leave the output directory as a failed start found it."""
    for name in ("metrics.jsonl", "args.json", ".lock"):
        (out / name).unlink(missing_ok=True)
    if fresh_dir:
        try:
            out.rmdir()
        except OSError:  # something else is in it now: keep it
            pass


def generator_config(args: Args, model_path: str, state: dict) -> Any:
    """The vLLM generator's settings for this run; it restarts from step `state["step"]` after a resume."""
    import pipeline_rl

    return pipeline_rl.GeneratorConfig(
        model=model_path, group_size=args.group_size, temperature=args.temperature,
        interruptions=args.length_control == "interruptions", think_budget=_budget(args.think_budget),
        answer_budget=args.answer_budget, max_tokens=args.max_tokens, max_model_len=model_context(args),
        max_off_policy=args.max_off_policy, buffer_steps=args.buffer_steps, mode=args.mode,
        seed=args.seed + state["step"], data_seed=args.seed, dtype=args.dtype, fp32_lm_head=args.fp32_lm_head,
        debug_slowdown=args.debug_gen_slowdown,
        groups_per_batch=args.prompts_per_step * (args.max_off_policy if args.mode == "sync" else 1),
        gen_devices=args.gen_devices, tensor_parallel_size=args.tensor_parallel_size,
    )


def run_loop(args: Args, rank: int, world: int, model: Any, optimizer: Any, scheduler: Any, loss_module: Any,
             hp: dict, adv_kwargs: dict, generator: Any, state: dict, consumed: set, history: dict, retired: set,
             log: MetricsLog | None, out: Path, val_problems: list, test_problems: list, pad_id: int,
             n_params: int, devices_in_use: int, stopper: GracefulStop, ref_model: Any = None) -> None:
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    import pipeline_rl

    is_main = rank == 0
    g = args.group_size
    start_wall = time.time() - state["elapsed_hours"] * 3600.0
    eval_rows: list[dict] = []
    if is_main and log.lines:
        import scaling_fit

        eval_rows = [r for r in scaling_fit.read_metrics(log.path) if "val_pass_rate" in r]
    bar = tqdm(total=args.max_steps, initial=state["step"], desc=f"{args.loss}/{args.mode}", disable=not is_main,
               dynamic_ncols=True)
    consecutive_bad = 0
    recent: deque = deque(maxlen=args.log_every)

    def compute_row() -> dict:
        return {"step": state["step"], "compute_hours": (time.time() - start_wall) / 3600.0 * devices_in_use,
                "flops": state["flops"], "tokens": state["gen_tokens"]}

    def do_eval(row: dict) -> None:
        t0 = time.time()
        val = evaluate(generator, val_problems, args.eval_samples, args.temperature)
        row.update(val_pass_rate=val["pass_rate"], val_reward=val["reward"], eval_s=time.time() - t0)
        if test_problems:
            test = evaluate(generator, test_problems, args.eval_samples, args.temperature)
            row.update(test_pass_rate=test["pass_rate"], test_reward=test["reward"])
        eval_rows.append(row)
        asymptote = current_asymptote(eval_rows)
        if asymptote is not None:
            row["fit_asymptote"] = asymptote

    def checkpoint() -> None:
        state["elapsed_hours"] = (time.time() - start_wall) / 3600.0
        state["metrics_lines"] = log.lines if is_main else 0
        state.update(consumed=sorted(consumed), history=dict(history), retired=sorted(retired))
        box = [state]
        dist.broadcast_object_list(box, src=0)  # rank 0's bookkeeping is the one to save
        save_checkpoint(out, model, optimizer, box[0], rank)

    def stop_if_signalled() -> None:
        if stopper.agreed():
            checkpoint()
            raise SystemExit(f"stopped by {stopper.signal or 'a signal to another rank'} after step {state['step']}; "
                             f"checkpoint saved in {out / 'checkpoint'}: continue with --resume {out}")

    if state["step"] == 0 and is_main and log.lines == 0:  # (a run stopped at step 0 has its row already)
        row = compute_row()
        row.update({f"data_skipped_{k}": v for k, v in state.pop("data_skipped", {}).items()})
        do_eval(row)
        log.write(row)
        tqdm.write(f"step 0: val pass rate {row['val_pass_rate']:.3f} (the base model)")

    while state["step"] < args.max_steps:
        # 1. Rank 0 pulls a round of groups: one step's worth in pipeline mode, max_off_policy steps' worth in sync
        #    mode (PPO-off-policy-k), after zero-variance handling; every rank gets the same round.
        box = [next_round(args, generator, state["step"], history, retired) if is_main else None]
        dist.broadcast_object_list(box, src=0)
        round_batches, gen_stats = box[0]["batches"], box[0]["gen_stats"]
        my_batches = [[grp for i, grp in enumerate(batch) if i % world == rank] for batch in round_batches]

        # 2. Old logprobs: the sampler's (pipeline, ScaleRL), or the learner's before the round's first update
        #    (sync mode, and --tis, whose weights are min(pi_learner_old / pi_sampler, cap)).
        if args.mode == "sync" or args.tis:
            with torch.no_grad():
                attach_learner_logprobs(model, [grp for b in my_batches for grp in b], args, pad_id)

        for batch, my_groups in zip(round_batches, my_batches):
            if state["step"] >= args.max_steps:
                break
            stop_if_signalled()
            step_start = time.time()
            version = state["step"]
            # 3. Advantages over the whole batch (every rank computes the same), then this rank's rows.
            rewards = torch.tensor([r for grp in batch for r in grp.rewards], dtype=torch.float32)
            advantages = loss_module.compute_advantages(rewards, g, **adv_kwargs) if batch else torch.zeros(0)
            mine = [i for i in range(len(batch)) if i % world == rank]
            my_adv = torch.cat([advantages[i * g: (i + 1) * g] for i in mine]) if mine else torch.zeros(0)

            # 4. Loss and backward over micro-batches, clip, step; a non-finite loss or gradient skips the step.
            optimizer.zero_grad(set_to_none=True)
            totals = loss_and_backward(model, loss_module, hp, my_groups, my_adv, args, pad_id, world, version,
                                       ref_model)
            metrics = reduce_metrics(totals, world)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            finite = math.isfinite(grad_norm) and math.isfinite(metrics.get("loss", 0.0))
            if finite and batch:
                optimizer.step()
                consecutive_bad = 0
            else:
                optimizer.zero_grad(set_to_none=True)
                consecutive_bad += int(not finite)
                state["bad_steps_total"] += int(not finite)
            scheduler.step()
            if args.debug_learner_slowdown > 1:  # debug knob: a learner X times slower than this one
                time.sleep((args.debug_learner_slowdown - 1) * (time.time() - step_start))
            state["step"] += 1
            consumed.update(grp.data_index for grp in batch)

            # 5. Push the new weights to the generator (applied between decode steps in pipeline mode).
            weights = full_state_dict(model)
            sync_s = generator.update_weights(weights, state["step"]) if is_main else 0.0
            del weights

            # 6. Metrics row, evaluation, checkpoint.
            trained_tokens = sum(len(grp.prompt_ids) + len(c.token_ids) for grp in batch for c in grp.completions)
            gen_tokens = gen_stats.pop("gen_tokens", 0)  # a sync round's generation is counted at its first step
            state["train_tokens"] += trained_tokens
            state["gen_tokens"] += gen_tokens
            state["flops"] += 2 * n_params * gen_tokens + 6 * n_params * trained_tokens
            step_s = time.time() - step_start
            if is_main:
                batch_rewards = rewards.tolist()
                row = compute_row()
                row.update({
                    "reward": sum(batch_rewards) / max(len(batch_rewards), 1),
                    "train_pass_rate": sum(r > 0 for r in batch_rewards) / max(len(batch_rewards), 1),
                    "groups": len(batch), "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                    "grad_clipped": float(grad_norm > args.grad_clip), "skipped_step": float(not finite),
                    "bad_steps_total": state["bad_steps_total"], "weight_sync_s": sync_s, "step_s": step_s,
                    "train_tokens_per_s": trained_tokens / max(step_s, 1e-9), "retired_prompts": len(retired),
                    "gen_tokens": gen_tokens, **metrics, **gen_stats,
                    # Lag of the tokens trained on at this step (in a sync round of k steps it grows 0..k-1).
                    **pipeline_rl.lag_stats(batch, version),
                })
                if state["step"] % args.eval_every == 0 or state["step"] == args.max_steps:
                    do_eval(row)
                log.write(row)
                recent.append(row)
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward']:+.2f}", val=f"{eval_rows[-1]['val_pass_rate']:.2f}")
                if state["step"] % args.log_every == 0 or "val_pass_rate" in row:
                    tqdm.write(summary_line(row, recent))
            stop_bad = consecutive_bad >= args.max_bad_steps
            if state["step"] % args.checkpoint_every == 0 or state["step"] == args.max_steps or stop_bad:
                checkpoint()
            if stop_bad:
                raise SystemExit(f"stopping: {consecutive_bad} consecutive steps had a non-finite loss or gradient "
                                 f"(last at step {state['step']}); checkpoint saved in {out / 'checkpoint'}. Lower "
                                 "--lr or check the data, then --resume.")
    bar.close()


def attach_learner_logprobs(model: Any, groups: list, args: Args, pad_id: int) -> None:
    """Set `completion.old_logprobs` to the learner's logprobs of its tokens, with the current weights."""
    import torch
    import torch.distributed as dist

    batches = micro_batches(groups, args.micro_batch_tokens, args.group_size)
    n_micro = torch.tensor([len(batches)])
    dist.all_reduce(n_micro, op=dist.ReduceOp.MAX)  # FSDP collectives: every rank runs as many forwards
    for i in range(int(n_micro.item())):
        if i >= len(batches):
            model(input_ids=torch.full((1, 2), pad_id, dtype=torch.long))
            continue
        chosen = [groups[j] for j in batches[i]]
        rows = to_rows(chosen, None, args.group_size, pad_id)
        logprobs = token_logprobs(model, rows, args.temperature)
        completions = [(len(grp.prompt_ids), c) for grp in chosen for c in grp.completions]
        for row, (p, c) in enumerate(completions):
            c.old_logprobs = logprobs[row, p - 1: p - 1 + len(c.token_ids)].tolist()


def next_round(args: Args, generator: Any, version: int, history: dict, retired: set) -> dict:
    """Rank 0: the groups of one generation round, split into optimizer-step batches, after the zero-variance
    rule and the No-Positive-Resampling bookkeeping."""
    steps = args.max_off_policy if args.mode == "sync" else 1
    want = args.prompts_per_step * steps
    stats: dict[str, Any] = {"overlong_filtered": 0} if args.overlong_filter else {}
    kept: list = []
    zero_var = pulled = 0
    while len(kept) < want:
        batch, extra = generator.get_batch(want - len(kept), version)
        for key, value in extra.items():  # per-call amounts add up; run totals, histograms and rates: the last call's
            stats[key] = stats.get(key, 0) + value if key in ("gen_tokens", "wait_s") else value
        pulled += len(batch)
        for grp in batch:
            if args.length_control == "overlong":
                apply_overlong_penalty(grp, args)
            if args.overlong_filter:  # DAPO's overlong filtering: a cut-off completion teaches nothing
                for c in grp.completions:
                    if c.truncated:
                        c.loss_mask = [False] * len(c.loss_mask)
                        stats["overlong_filtered"] += 1
            pass_rate = sum(c.reward > 0 for c in grp.completions) / len(grp.completions)
            past = history.setdefault(grp.problem.id, [])
            past.append(pass_rate)
            if args.retire_pass_rate > 0 and sum(past) / len(past) >= args.retire_pass_rate:
                retired.add(grp.problem.id)
                generator.retire([grp.problem.id])
            constant = len(set(grp.rewards)) == 1
            zero_var += constant
            if not (constant and args.zero_variance != "keep"):
                kept.append(grp)
        # DAPO dynamic sampling keeps pulling until the batch is full; it gives up rather than spin forever on a
        # saturated task.
        if args.zero_variance != "resample" or pulled >= 8 * want:
            break
    stats["frac_zero_variance"] = zero_var / max(pulled, 1)
    stats["groups_pulled"] = pulled
    stats["reward_errors"] = sum(c.reward_error is not None for grp in kept for c in grp.completions)
    per_step = math.ceil(len(kept) / steps) if kept else 0
    batches = [kept[i * per_step: (i + 1) * per_step] for i in range(steps)] if per_step else [[] for _ in range(steps)]
    return {"batches": batches, "gen_stats": stats}


def apply_overlong_penalty(grp: Any, args: Args) -> list[float]:
    """DAPO's soft overlong punishment added to the correctness reward (in place on the completions)."""
    import torch

    dapo = importlib.import_module("dapo")
    lengths = torch.tensor([sum(c.loss_mask) for c in grp.completions])
    penalty = dapo.overlong_penalty(lengths, max_len=args.max_tokens, cache_len=args.overlong_cache)
    for c, p in zip(grp.completions, penalty.tolist()):
        c.reward = c.reward + p
    return grp.rewards


def summary_line(row: dict, recent: deque) -> str:
    mean = lambda key: sum(r.get(key, 0.0) for r in recent) / max(len(recent), 1)  # noqa: E731
    parts = [f"step {row['step']:4d}", f"reward {mean('reward'):+.3f}", f"train pass {mean('train_pass_rate'):.3f}"]
    if "val_pass_rate" in row:
        parts.append(f"VAL PASS {row['val_pass_rate']:.3f}")
    if "fit_asymptote" in row:
        parts.append(f"fit A {row['fit_asymptote']:.3f}")
    parts += [f"clip {mean('clip_frac'):.3f}", f"kl {mean('kl_k3'):.2e}", f"0-var {mean('frac_zero_variance'):.2f}",
              f"lag {mean('lag_mean'):.2f}", f"wait {mean('wait_s'):.2f}s", f"step {mean('step_s'):.2f}s",
              f"{row['compute_hours'] * 3600:.0f} dev-s"]
    return " | ".join(parts)


if __name__ == "__main__":  # vLLM on CPU spawns its workers: the entry point must be guarded
    main()
