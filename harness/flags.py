"""harness/flags.py: the learner's flags and their checks. A runtime module: a reader of the recipe may skip it.

train.py's flags are the fields of `Args`, one per flag, grouped in --help by the step of the loop each one
configures (docs/flags.md is generated from them: `python train.py --help-markdown`). This file holds:
  - `Args`, its --help groups and `build_parser`/`parse_args`, and `flags_markdown`;
  - the checks run before anything starts (`check_args`, `range_problems`, `loss_problems`, `replica_problems`,
    `report_to_problems`, `gpu_layout_problems`, `memory_problems` with the learner's memory plan, which `python
    train.py plan` prints); the argparse types of the flags' values are harness.cli's (`text_value`, `path_text`,
    `number`);
  - the resume rules: which flags a --resume may change (CHANGEABLE_ON_RESUME), the run's saved flags
    (`resumed_values`), and OUTPUT_DIR/args.json with its history of resumes (`read_args_json`, `write_args_json`);
  - what the flags resolve to once the machine and the model are known (`resolve_defaults`, `compute_dtype`,
    `model_context`, `lm_head_gemm`, `generator_memory_fraction`),
    and REPORT_TO, the packages --report-to may import;
  - the loss files' part (`LossFiles`, `LOSS_FLAGS`, `loss_problems`): train.py imports the loss files and hands
    their table to `parse_args`; this file never imports one, and reads what it needs from their signatures.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import math
import os
import sys
import tempfile
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from harness import memory_plan  # the learner's memory per rank, checked before a GPU run starts (train.py plan)
from harness import base_model, fleet, tasks  # fleet: the replicas' settings, their defaults and checks
from harness import vllm_replica  # the replica runtime: the address and secret checks
from harness.checkpoints import (LinkRefusedError, complete_checkpoints, newest_checkpoint_step, read_no_follow,
                                 write_atomically)
from harness.cli import OneLineParser, int_at_least, number  # one error line (rank 0 only); argparse types
from harness.cli import path_text, text_value  # a path flag's ~ is the home directory, even in --flag=~/x
from harness.cli import DefaultsHelpFormatter  # --help with each default, where there is one to give
from harness.head_gemm import LOGITS_CHUNK_BYTES, SPLIT_CHUNK_BYTES  # --logits-chunk-tokens' defaults


# --report-to NAME -> (the module the reporter imports, the pip package that provides it); "none" needs nothing.
# Imported only when asked for, so that a run without them never needs them installed.
REPORT_TO = {"none": None, "tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
             "trackio": ("trackio", "trackio")}
# --loss NAME -> its loss file: train.py's table (LOSSES there), handed to build_parser and parse_args. The names are
# --loss's choices; each file's signatures say which hyper-parameters and loss flags it takes (loss_problems).
LossFiles = Mapping[str, types.ModuleType]
# The flags that reach a loss file's function as a keyword of the same meaning, where its signature has that keyword:
# {function: {keyword: Args field}}. The file decides which it takes, never its name: every compute_loss takes
# --kl-coef, cispo.py's --aggregation and its compute_advantages --adv-norm. Set for a file without the keyword, the
# flag is refused (loss_problems). The generation budget is the run's own setting, which a compute_loss takes where
# it has max_tokens (Dr. GRPO's constant normaliser: "the trainer should pass its own"), and never refused.
LOSS_FLAGS = {"compute_loss": {"max_tokens": "max_tokens", "aggregation": "aggregation", "kl_coef": "kl_coef"},
              "compute_advantages": {"normalization": "adv_norm"}}
RUN_SETTINGS = frozenset({"max_tokens"})  # LOSS_FLAGS' fields that every run sets: passed where taken, never refused
EMBEDDED_MAX_MODEL_LEN = 256  # the tiny model's max_position_embeddings; its prompts are ~10 tokens
PROMPT_ALLOWANCE = 512  # prompt tokens a real model's context keeps beside --max-tokens: a chat template (with its
                        # system prompt) around a GSM8K or Polaris problem fits with room to spare


# The flags the learner shares with the generator. The fleet's (harness/fleet.py's FleetConfig: replicas, devices,
# vLLM's engine settings) take their defaults from it and are checked by its fleet_problems. The rule's and the
# sampling's are pipeline_rl.GeneratorConfig's, the recipe above this package, which it never imports: their defaults
# are written in RULE_DEFAULTS as well (tests/test_flags.py holds the two equal), and their checks,
# pipeline_rl.config_problems, are handed to parse_args and plan by train.py (`generator_checks`).
RULE_DEFAULTS = {"mode": "pipeline", "max_off_policy": 8, "buffer_steps": 1, "group_size": 8, "temperature": 1.0,
                 "think_budget": (34, 40), "answer_budget": 8, "max_tokens": 48, "seed": 0, "reward_timeout": 10.0,
                 "batch_timeout": 3600.0}
MODES = ("pipeline", "sync")  # pipeline_rl.MODES: --mode's choices
# What checks the rule's and the sampling's settings: pipeline_rl.config_problems(values, name) -> its problems
GeneratorChecks = Callable[[Mapping[str, Any], Callable[[str], str]], list[str]]
# a field's flag where the names differ
GENERATOR_FLAGS = {"replicas": "gen_replicas", "remote_replicas": "gen_remote_replicas", "listen": "gen_listen",
                   "secret": "gen_secret_file", "join_timeout": "gen_join_timeout",
                   "debug_slowdown": "debug_gen_slowdown"}


def generator_flag(field_name: str) -> str:
    """The command-line flag of a GeneratorConfig or FleetConfig field: --max-off-policy for max_off_policy,
    --gen-listen for listen."""
    return "--" + GENERATOR_FLAGS.get(field_name, field_name).replace("_", "-")


def generator_default(field_name: str) -> Any:
    """The default of a field the flags share with the generator: the rule's (RULE_DEFAULTS), else FleetConfig's."""
    if field_name in RULE_DEFAULTS:
        return RULE_DEFAULTS[field_name]
    return fleet.FleetConfig.__dataclass_fields__[field_name].default


TINY_THINK_BUDGET = ",".join(str(n) for n in generator_default("think_budget"))  # --think-budget's default, as typed


# ----------------------------------------------------------------------------------------------------------------
# Arguments: one dataclass field per flag, grouped in --help by the step of the loop each one configures
# ----------------------------------------------------------------------------------------------------------------


class HelpGroup:
    """The groups of `train.py --help`, in the order of the loop's steps."""

    WHAT = "what to train"
    BATCH = "batch and schedule"
    GENERATION = "generation (pipeline)"
    ZERO_VARIANCE = "zero-variance and No-Positive-Resampling"
    LENGTH = "length control"
    LOSS = "loss"
    IMPORTANCE = "importance sampling"
    OPTIMIZER = "optimizer"
    EVALUATION = "evaluation and logging"
    CHECKPOINTS = "checkpoints and resume"
    PRECISION = "precision"
    MEMORY = "memory"
    GPU = "GPU placement"
    REPLICAS = "generator replicas (this node and others)"
    DEBUG = "debug"


def _arg(group: str, default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"group": group, "help": help, **kw})


# The flags a --resume may change: how the run is watched, logged, checkpointed, placed and slowed down, never
# what it trains. Every other flag defines the run, and a resume that changes one is refused (resumed_values): a
# flag added later defines the run until it is named here. Each change is recorded in args.json with its step.
CHANGEABLE_ON_RESUME = frozenset({
    "max_steps",  # upwards only: below the run's step is refused
    "report_to",  # where the rows go besides metrics.jsonl, which stays whole either way
    "eval_every", "eval_samples", "final_eval_samples", "log_every", "checkpoint_every", "max_bad_steps",
    "peak_tflops",  # only the mfu metric: a run may move to another kind of GPU
    "micro_batch_tokens", "logits_chunk_tokens", "packing",  # memory and speed only: a step is the same (tested)
    "activation_checkpointing", "cpu_offload",  # likewise
    "gen_devices", "tensor_parallel_size", "gen_memory_fraction",  # placement: a run may move to another machine
    "gen_replicas", "gen_remote_replicas", "gen_listen", "gen_secret_file", "gen_join_timeout",  # replicas: the
    "weight_transport",  # scheduler restarts from the checkpoint's data position whatever their number (tested)
    "weight_dir",  # placement
    "gen_threads",  # speed only
    "lm_head_gemm",  # speed: the logprobs are float32's either way, the gradients the same to bf16 rounding (tested)
    "adamw", "fsdp_reshard",  # speed: the same update to float32 rounding, the same step bit for bit (tested)
    "debug_gen_slowdown", "debug_learner_slowdown",
    "batch_timeout",  # how long the learner waits, not what it trains
    "output_dir", "resume", "overwrite",  # bookkeeping: a resumed run stays in its directory
})


# What a run leaves in its output directory (runtime.REPORT_DIRS last): a directory holding any of them holds a run, or
# part of one, that a new run neither mixes with nor deletes unless given --overwrite.
RUN_FILES = ("args.json", "metrics.jsonl", "checkpoint", "checkpoint.old", "checkpoint.tmp", "scaling.png",
             "dashboard.png", "tensorboard", "wandb", ".wandb", "trackio")


@dataclass
class Args:
    loss: str = _arg(HelpGroup.WHAT, "cispo", "the loss file: {} (ScaleRL: cispo)", losses=True)  # the table's names
    loss_arg: list[str] = _arg(HelpGroup.WHAT, None, "override a hyper-parameter of the loss, KEY=VALUE (repeatable), "
                               "e.g. --loss-arg eps_max=8; defaults are the loss file's paper values", action="append")
    model: str | None = _arg(HelpGroup.WHAT, None, "HF model name or directory (default: the embedded tiny model "
                             "shipped in models/tiny-arith, checked by its sha256 before use)", type=path_text)
    dataset: str | None = _arg(HelpGroup.WHAT, None, "HF data set name, or a local .json/.jsonl/.csv/.parquet file or "
                               "a directory of them (those datasets puts in the train split: train*, or all when none "
                               "is named so; default: the "
                               "embedded 3-digit addition task; arithmetic-verified: the same with its scratchpad "
                               "verified too, so a tight --think-budget is a hard ceiling; small-arithmetic and "
                               "mixed-arithmetic: tasks for a small real chat model, make run-real's; see "
                               "harness/tasks.py)", type=path_text)
    dataset_config: str | None = _arg(HelpGroup.WHAT, None, "configuration (subset) of a hub --dataset, passed on as "
                                      "datasets.load_dataset(NAME, CONFIG), or of a directory that clones one (as "
                                      "its README names them); e.g. main for openai/gsm8k")
    test_dataset: str | None = _arg(HelpGroup.WHAT, None, "optional test set, evaluated whole beside the "
                                    "validation (test_* metrics): a local file, a directory's test* files, or a hub "
                                    "data set's test split (in --test-dataset-config's configuration, by "
                                    "default --dataset-config's when it is --dataset's set)", type=path_text)
    test_dataset_config: str | None = _arg(HelpGroup.WHAT, None, "configuration (subset) of a hub --test-dataset, "
                                           "as --dataset-config is --dataset's")
    question_field: str | None = _arg(HelpGroup.WHAT, None, "question field of --dataset (default: question, problem "
                                      "or prompt)")
    answer_field: str | None = _arg(HelpGroup.WHAT, None, "answer field of --dataset (default: answer, solution or "
                                    "final_answer)")
    skip_bad_rows: bool = _arg(HelpGroup.WHAT, False, "skip and count malformed data rows instead of stopping with an "
                               "error")
    seed: int = _arg(HelpGroup.WHAT, generator_default("seed"), "seed of data order, sampling and initialisation")

    max_steps: int = _arg(HelpGroup.BATCH, 150, "optimizer steps (tiny-task default 150: the pass rate passes 0.94 "
                          "by step 140-150 and has levelled off near 0.95; 200 steps end near 0.96 for a third more "
                          "time)")
    prompts_per_step: int = _arg(HelpGroup.BATCH, 32, "prompts per optimizer step (ScaleRL: 48; tiny-task default 32)")
    group_size: int = _arg(HelpGroup.BATCH, generator_default("group_size"), "completions per prompt (ScaleRL: 16; "
                            f"tiny-task default {generator_default('group_size')})")

    mode: str = _arg(HelpGroup.GENERATION, generator_default("mode"),
                     "pipeline: PipelineRL in-flight updates (ScaleRL); sync: "
                     "generate, then train", choices=MODES)
    max_off_policy: int = _arg(HelpGroup.GENERATION, generator_default("max_off_policy"),
                               "k: pipeline: a sample's oldest token is at most k optimizer "
                               "steps old (ScaleRL: 8); sync: k optimizer steps per generation round "
                               "(PPO-off-policy-k; 1 = on-policy)")
    buffer_steps: int = _arg(HelpGroup.GENERATION, generator_default("buffer_steps"),
                             "pipeline: freshness bound under k: the generator admits at "
                             "most this many learner steps' worth of prompts ahead of the learner (1: it samples the "
                             "next batch while the learner trains on this one; the lag then stays near 1 however fast "
                             "the generator is); k + 1 or more: only k limits it, as in PipelineRL and ScaleRL")
    temperature: float = _arg(HelpGroup.GENERATION, generator_default("temperature"),
                              "sampling temperature; the learner divides its logits by the "
                              "same value")
    max_model_len: int | None = _arg(HelpGroup.GENERATION, None, "vLLM's context per sequence, prompt + completion "
                                     f"tokens (default: {EMBEDDED_MAX_MODEL_LEN} for the embedded tiny model, its "
                                     f"context length; --max-tokens + {PROMPT_ALLOWANCE} with --model, room for a "
                                     "chat-templated prompt); a training prompt that does not fit is skipped and "
                                     "counted in skipped_long_prompts")
    reward_timeout: float = _arg(HelpGroup.GENERATION, generator_default("reward_timeout"),
                                 "seconds one completion's reward may take; past it the completion scores as wrong "
                                 "(-1), is counted in reward_timeouts, and the run goes on")
    batch_timeout: float = _arg(HelpGroup.GENERATION, generator_default("batch_timeout"),
                                "seconds the learner waits for a batch of groups; past it the run stops with a "
                                "checkpoint and a line naming the request")

    zero_variance: str = _arg(HelpGroup.ZERO_VARIANCE, "drop", "groups whose rewards are all equal: drop (ScaleRL), "
                              "resample (DAPO dynamic sampling: pull more groups until the batch is full) or keep",
                              choices=("drop", "resample", "keep"))
    retire_pass_rate: float = _arg(HelpGroup.ZERO_VARIANCE, 0.9, "No-Positive-Resampling: retire a prompt once its "
                                   "pass-rate history reaches this (ScaleRL: 0.9); 0 disables")

    length_control: str = _arg(HelpGroup.LENGTH, "interruptions", "interruptions (ScaleRL) or overlong (DAPO's soft "
                               "overlong penalty added to the reward)", choices=("interruptions", "overlong"))
    think_budget: str = _arg(HelpGroup.LENGTH, TINY_THINK_BUDGET, "interruption point drawn uniformly in MIN,MAX "
                             f"thinking tokens (ScaleRL: 10240,12288; tiny task: {TINY_THINK_BUDGET}, above its "
                             "~29-token scratchpad)")
    answer_budget: int = _arg(HelpGroup.LENGTH, generator_default("answer_budget"), "tokens allowed after an "
                               f"interruption (ScaleRL: 2048; tiny task: {generator_default('answer_budget')})")
    max_tokens: int = _arg(HelpGroup.LENGTH, generator_default("max_tokens"), "generation budget per completion "
                            f"(ScaleRL: 14336; tiny task: {generator_default('max_tokens')})")
    overlong_cache: int = _arg(HelpGroup.LENGTH, 16, "DAPO L_cache for --length-control overlong, in tokens (paper: "
                               "4096 of 20480; tiny-task default 16 of 48)")
    overlong_filter: bool = _arg(HelpGroup.LENGTH, False, "DAPO's overlong filtering: completions cut off by "
                                 "--max-tokens are masked from the loss (their rewards still count in the group's "
                                 "advantages); counted in overlong_filtered")

    aggregation: str | None = _arg(HelpGroup.LOSS, None, "CISPO loss aggregation: prompt (ScaleRL), sample or token "
                                   "(default: the loss file's, prompt in cispo.py)",
                                   choices=("prompt", "sample", "token"))
    adv_norm: str | None = _arg(HelpGroup.LOSS, None, "CISPO advantage normalisation: batch (ScaleRL) or group "
                                "(default: the loss file's, batch in cispo.py)", choices=("batch", "group"))
    kl_coef: float = _arg(HelpGroup.LOSS, 0.0, "GRPO's KL penalty to the reference policy (a frozen copy of the "
                          "initial model, sharded like the policy): beta of its k3 estimate, logged as kl_ref "
                          "(DeepSeekMath: 0.04; 0 = off, as in DAPO and ScaleRL); every loss takes it")
    micro_batch_tokens: int = _arg(HelpGroup.LOSS, 8192, "token budget of a micro-batch: its real tokens with "
                                   "--packing, its padded rows x length without; a group may span micro-batches, a "
                                   "completion over the budget is one of its own. Sized for large "
                                   "models' memory: on a GPU with a small model, where each micro-batch costs fixed "
                                   "host time, a larger one is faster; on CPU a smaller one costs little time and "
                                   "lowers a rank's memory, which grows with it (docs/memory.md)")
    packing: bool = _arg(HelpGroup.LOSS, True, "pack the completions (with their prompts) end to end into a few "
                         "rows per micro-batch, position ids restarting with each, so that the learner computes on "
                         "real tokens, not padding; each sequence attends to itself only (their length: pack_rows). "
                         "--no-packing: one right-padded row per completion", action=argparse.BooleanOptionalAction)

    tis: str | None = _arg(HelpGroup.IMPORTANCE, None, "truncated importance sampling against the sampler's logprobs: "
                           "token or sequence (default: off)", choices=("token", "sequence"))
    tis_cap: float = _arg(HelpGroup.IMPORTANCE, 2.0, "TIS truncation cap C (Yao et al.: 2)")
    tis_mode: str = _arg(HelpGroup.IMPORTANCE, "truncate", "truncate: w = min(rho, C) (TIS); mask: w = rho inside "
                         "[--tis-cap-min, C], else 0 (MIS; IcePop: --tis token --tis-mode mask --tis-cap-min 0.5 "
                         "--tis-cap 5)", choices=("truncate", "mask"))
    tis_cap_min: float | None = _arg(HelpGroup.IMPORTANCE, None, "lower bound of the importance weight (default: "
                                     "none)")

    lr: float | None = _arg(HelpGroup.OPTIMIZER, None, "AdamW learning rate (default: 1e-4 for the tiny model, tuned "
                            "here, where 2e-4 diverged; the paper's 5e-7 for --model)")
    adam_eps: float | None = _arg(HelpGroup.OPTIMIZER, None, "AdamW eps (default: 1e-8 tiny model; paper 1e-15)")
    weight_decay: float | None = _arg(HelpGroup.OPTIMIZER, None, "AdamW weight decay (default: 0 tiny model; paper "
                                      "0.01)")
    warmup_steps: int | None = _arg(HelpGroup.OPTIMIZER, None, "linear warm-up steps (default: 0 tiny model; paper "
                                    "100)")
    adamw: str = _arg(HelpGroup.OPTIMIZER, "auto", "AdamW's implementation (the same update to float32 rounding): "
                      "default (PyTorch's choice: foreach kernels, a dozen passes over the weights and state, on a "
                      "GPU; a loop over the tensors on a CPU) or fused (one kernel that reads and writes each "
                      "parameter and its state once); auto: fused where the parameters live on a GPU (no "
                      "--cpu-offload), default elsewhere, so that CPU runs keep their results",
                      choices=("auto", "default", "fused"))
    grad_clip: float = _arg(HelpGroup.OPTIMIZER, 1.0, "clip the global gradient norm to this (logged as grad_norm, "
                            "grad_clipped)")
    max_bad_steps: int = _arg(HelpGroup.OPTIMIZER, 3, "stop (with a checkpoint) after this many consecutive "
                              "non-finite steps")

    eval_every: int = _arg(HelpGroup.EVALUATION, 10, "evaluate every N steps (and at step 0 and the end); tiny task: "
                           "10, which gives the sigmoid fit 5 points on the rise (steps 0-40) and costs a sixth of "
                           "the generator's tokens (every 5 steps: over a quarter)")
    eval_samples: int = _arg(HelpGroup.EVALUATION, 4, "k of the mean@k validation pass rate (ScaleRL: 16)")
    final_eval_samples: int | None = _arg(HelpGroup.EVALUATION, None, "k of the last evaluation only (default: "
                                          "--eval-samples): the run's final value measured more exactly for the cost "
                                          "of one evaluation, e.g. 16 when a fit's prediction is checked against it")
    eval_prompts: int = _arg(HelpGroup.EVALUATION, 128, "held-out validation prompts (ScaleRL: 1000)")
    log_every: int = _arg(HelpGroup.EVALUATION, 5, "print a one-line summary every N steps")
    report_to: str = _arg(HelpGroup.EVALUATION, "none", "also send every metrics row's numbers, as TRL names them "
                          "(train/reward, eval/val_pass_rate), to tensorboard (OUTPUT_DIR/tensorboard), wandb "
                          "(OUTPUT_DIR/wandb, offline unless WANDB_MODE=online, which needs a saved key: W&B never "
                          "prompts) or trackio (local: OUTPUT_DIR/trackio); "
                          "its package must be installed; metrics.jsonl is written either way and stays the record",
                          choices=tuple(REPORT_TO))
    peak_tflops: float | None = _arg(HelpGroup.EVALUATION, None, "dense peak TFLOP/s of one learner GPU in --dtype, "
                                     "for the metrics' mfu (model FLOPs utilisation); default: from a table of "
                                     "known GPUs by name (H100, H200, A100, L40S, ...); on CPU or an unknown GPU, "
                                     "none and no mfu")

    checkpoint_every: int = _arg(HelpGroup.CHECKPOINTS, 10, "save a checkpoint every N steps (and at the end)")
    output_dir: str = _arg(HelpGroup.CHECKPOINTS, "runs/default", "where metrics.jsonl, checkpoint/, scaling.png go",
                           type=path_text)
    resume: str | None = _arg(HelpGroup.CHECKPOINTS, None, "continue the run in this directory from its newest "
                              "checkpoint that every rank can read, with the flags it was started with (args.json). "
                              "Only these may change, each change recorded in args.json with its step: " + ", ".join(
                                  "--" + name.replace("_", "-") for name in sorted(CHANGEABLE_ON_RESUME)
                                  if name not in ("output_dir", "resume", "overwrite"))
                              + " (--max-steps upwards only); any other flag defines the run, and changing it is "
                              "refused", type=path_text)
    overwrite: bool = _arg(HelpGroup.CHECKPOINTS, False, "start afresh in an --output-dir that already holds a run "
                           "(any of its files: " + ", ".join(RUN_FILES) + "), deleting its metrics and checkpoints "
                           "once the new run has passed its checks and started (a failed start leaves the old run as "
                           "it was; without this flag such a directory is refused)")
    start_token: str | None = _arg(HelpGroup.CHECKPOINTS, None, "a word kept in args.json that says who started the "
                                   "run; it changes nothing in training, and a resume keeps it (and refuses another). "
                                   "python -m tools.experiments gives each run it starts its own (kept beside the "
                                   "run in RUN_DIR.command.json), and continues or restarts only a run that holds it")

    dtype: str | None = _arg(HelpGroup.PRECISION, None, "float32 or bfloat16 (default: bfloat16 on GPU, float32 on "
                             "CPU)")
    fp32_lm_head: bool = _arg(HelpGroup.PRECISION, generator_default("fp32_lm_head"),
                              "compute the LM head in float32 in generator and learner "
                              "(ScaleRL, MiniMax-M1); a no-op for float32 weights",
                              action=argparse.BooleanOptionalAction)
    logits_chunk_tokens: int | None = _arg(HelpGroup.PRECISION, None, "positions whose logits the learner's LM head "
                                           "computes at once, so that a micro-batch's full [tokens, vocab] float32 "
                                           "logits never exist: under --lm-head-gemm fp32 each chunk is recomputed "
                                           "in backward (default: as many as fit in 256 MiB); under split-bf16 the "
                                           "chunks keep their gradient, 2 bytes a logit, for backward (default: as "
                                           "many as fit in 1 GiB, in multiples of 128)")
    lm_head_gemm: str = _arg(HelpGroup.PRECISION, "auto", "how the learner's FP32 LM head multiplies: fp32 (float32 "
                             "GEMMs, no TF32, whose 10-bit products would miss float32's logprobs) or split-bf16 (the "
                             "float32 weight split into three bf16 parts whose sum is exact, so that bf16 tensor-core "
                             "products of the bf16 hidden states reach float32's logprobs; its gradients are "
                             "bf16-grade, as the rest of a bf16 learner's); auto: split-bf16 on a GPU with --dtype "
                             "bfloat16 and --fp32-lm-head, fp32 otherwise", choices=("auto", "fp32", "split-bf16"))
    activation_checkpointing: bool = _arg(HelpGroup.MEMORY, False, "keep only each decoder layer's input in the "
                                          "forward and recompute the layer in backward (torch's non-reentrant "
                                          "checkpoint, inside FSDP2's hooks): activation memory ~ layers x tokens x "
                                          "hidden instead of every layer's intermediates, for about a third more "
                                          "compute; what lets a 32k-token completion train (docs/memory.md)",
                                          action=argparse.BooleanOptionalAction)
    fsdp_reshard: str = _arg(HelpGroup.MEMORY, "auto", "whether FSDP2 frees each decoder layer's gathered "
                             "compute-dtype weights after its forward and gathers them again in backward: always "
                             "(FSDP2's default: about two layers gathered at a time) or never (every layer's kept "
                             "from forward to backward: 2 bytes a parameter more under bf16, one gather and cast of "
                             "each layer less); auto: never on a single learner rank without --cpu-offload, where a "
                             "gather copies the rank's own whole weights, always otherwise. The step is the same bit "
                             "for bit", choices=("auto", "always", "never"))
    cpu_offload: bool = _arg(HelpGroup.MEMORY, False, "keep the parameters, gradients and AdamW state in host memory "
                             "(FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU): a GPU trains a model its "
                             "memory cannot hold, at the cost of host-device copies every step",
                             action=argparse.BooleanOptionalAction)

    gen_devices: str | None = _arg(HelpGroup.GPU, None, "GPU only: comma-separated CUDA devices for the vLLM "
                                   "replicas of this node, taken in runs of --tensor-parallel-size (the learner uses "
                                   "the others); ScaleRL split 64 generator / 16 trainer GPUs")
    tensor_parallel_size: int = _arg(HelpGroup.GPU, generator_default("tensor_parallel_size"),
                                     "GPU only: vLLM tensor parallelism of each replica")
    gen_memory_fraction: float | None = _arg(HelpGroup.GPU, None, "GPU only: vLLM's share of each generator GPU's "
                                             "memory (default: 0.85 on GPUs of its own, 0.3 on GPUs it shares with "
                                             "the learner, when --gen-devices takes them all)")

    gen_replicas: int | None = _arg(HelpGroup.REPLICAS, None, "vLLM engines on this node, under one scheduler "
                                    "(default: on GPU, the --gen-devices / --tensor-parallel-size; on CPU, 1: they "
                                    "share the cores, and each takes its KV cache in host memory: "
                                    "VLLM_CPU_KVCACHE_SPACE GiB, 1 unless set, or one sequence's where that is more)")
    gen_threads: int | None = _arg(HelpGroup.REPLICAS, None, "CPU only: torch threads of each local replica "
                                   "(default: in sync mode the machine's cores shared among the replicas, since the "
                                   "learner ranks wait while they generate; in pipeline mode 1, beside the busy "
                                   "learner ranks, where two threads stall each other)")
    gen_remote_replicas: int = _arg(HelpGroup.REPLICAS, generator_default("remote_replicas"),
                                    "replicas on other nodes to wait for, each started there "
                                    "with `python pipeline_rl.py replica --connect HOST:PORT --secret-file FILE` "
                                    "(needs --gen-listen and --gen-secret-file)")
    gen_listen: str = _arg(HelpGroup.REPLICAS, generator_default("listen"),
                           "HOST:PORT the generator listens on for replicas "
                           "(port 0: a free one, for local replicas); with --gen-remote-replicas, an address of this "
                           "node the generator nodes reach, and a fixed port. Only this address is bound")
    gen_secret_file: str | None = _arg(HelpGroup.REPLICAS, None, "file with the secret every replica must prove "
                                       "(HMAC challenge), readable by its owner only; needed for remote replicas "
                                       "(default: a random one for the local replicas)", type=path_text)
    gen_join_timeout: float = _arg(HelpGroup.REPLICAS, generator_default("join_timeout"),
                                   "seconds to wait for every replica to connect and "
                                   "start its engine; then the start fails naming the missing ones")
    weight_transport: str = _arg(HelpGroup.REPLICAS, generator_default("weight_transport"),
                                 "the engine of vLLM's weight-transfer API that carries new weights to each "
                                 "replica: gloo (CPU; this project's, registered in vLLM's factory), nccl (separate "
                                 "GPUs) or ipc (a replica on learner rank 0's GPU: CUDA IPC, no copy); auto: the "
                                 "one for the layout (auto, gloo, nccl, ipc). broadcast, an earlier name, reads as "
                                 "auto; file is gone (refused in one line)")
    weight_dir: str | None = _arg(HelpGroup.REPLICAS, None, "gone with the weight file (weights travel through "
                                  "vLLM's weight-transfer engines, never a file): refused, in one line", type=path_text)

    # debugging: turn the generator/learner speed ratio on purpose
    debug_gen_slowdown: str = _arg(HelpGroup.DEBUG, f"{generator_default('debug_slowdown'):g}",
                                   "debug: make the generator X times slower (it sleeps X-1 times each engine "
                                   "step's work: on CPU the engine thread's CPU time, which a busy machine does not "
                                   "stretch), to see how the recipe behaves on a machine "
                                   "whose generator is slower relative to its learner; X,Y,...: one factor per "
                                   "replica (the last for the rest)")
    debug_learner_slowdown: float = _arg(HelpGroup.DEBUG, 1.0, "debug: make the learner X times slower (each rank "
                                         "sleeps X-1 times each step's compute: on CPU its thread's CPU time, which "
                                         "a busy machine does not stretch), to emulate a relatively faster "
                                         "generator")


def plan_model_problems(model: str) -> list[str]:
    """What keeps `train.py plan` from reading --model's config.json, the one file it needs, in words: a local path
    where nothing is, a file or a directory without it, or what the hub answers for a hub name."""
    if missing := base_model.missing_model_dir(model):
        return [missing]
    if Path(model).is_file():
        return [f"{model} is a file; expected a Hugging Face model directory (the plan reads its config.json)"]
    if Path(model).exists() and base_model.model_file(model, "config.json") is None:
        return [f"{model} has no config.json: not a Hugging Face model directory (the plan reads only that file)"]
    return base_model.hub_config_problems(model)


def check_args(args: Args, generator_checks: GeneratorChecks | None = None) -> list[str]:
    """Incompatible flags, explained before anything starts (the rule's and the sampling's settings by
    `generator_checks`, pipeline_rl.config_problems, where given)."""
    problems = gpu_layout_problems(args, torch.cuda.device_count(), node_learner_ranks())
    if args.gen_threads is not None and args.gen_threads < 1:
        problems.append(f"--gen-threads {args.gen_threads}: a replica needs at least one thread")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        problems.append(f"--peak-tflops must be > 0 (got {args.peak_tflops})")
    try:
        gen_slowdowns(args)  # its values are checked with the generator's settings, below
    except ValueError:
        problems.append(f"--debug-gen-slowdown {args.debug_gen_slowdown}: X or X,Y,... (one per replica), each "
                        "must be >= 1 (1 = full speed)")
    if not args.debug_learner_slowdown >= 1:
        problems.append("--debug-learner-slowdown must be >= 1 (1 = full speed)")
    problems += replica_problems(args)
    if args.weight_dir is not None:
        problems.append("--weight-dir: the weight file is gone (weights travel through vLLM's weight-transfer "
                        "engines, never a file): drop --weight-dir")
    problems += report_to_problems(args.report_to, args.output_dir)
    problems += generator_problems(args, generator_checks) + fleet.fleet_problems(  # the checks, written there
        {**fleet_values(args), "replicas": 1 if args.gen_replicas is None else args.gen_replicas,
         "secret": args.gen_secret_file}, generator_flag)
    problems += range_problems(args)
    if args.zero_variance == "drop" and args.group_size == 1:  # below 1 is refused with the generator's settings
        problems.append("--group-size 1 has no group variance: every group would be dropped")
    if args.tis is None and (args.tis_cap != 2.0 or args.tis_mode != "truncate" or args.tis_cap_min is not None):
        problems.append("--tis-cap, --tis-mode and --tis-cap-min have no effect without --tis token|sequence")
    if args.tis_cap_min is not None and not 0 <= args.tis_cap_min <= args.tis_cap:
        problems.append(f"--tis-cap-min must lie in [0, --tis-cap] (got {args.tis_cap_min})")
    if args.kl_coef < 0:
        problems.append(f"--kl-coef must be >= 0 (got {args.kl_coef})")
    if args.overlong_filter and args.length_control == "interruptions":
        problems.append("--overlong-filter masks completions cut off by --max-tokens: use it with "
                        "--length-control overlong (with interruptions, a long completion is interrupted instead)")
    try:
        low, high = int_range(args.think_budget)  # 1 <= low <= high is checked with the generator's settings
        if args.length_control == "interruptions" and 1 <= low <= high >= args.max_tokens:
            problems.append("--think-budget must end below --max-tokens so that an answer fits")
    except ValueError:
        problems.append(f"--think-budget {args.think_budget!r}: expected MIN,MAX with 1 <= MIN <= MAX, e.g. "
                        f"{TINY_THINK_BUDGET}")
    for flag in ("lr", "adam_eps"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            problems.append(f"--{flag.replace('_', '-')} must be > 0 (got {value})")
    for flag in ("weight_decay", "warmup_steps"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            problems.append(f"--{flag.replace('_', '-')} must be >= 0 (got {value})")
    if args.lm_head_gemm == "split-bf16" and (args.dtype == "float32" or not args.fp32_lm_head):
        problems.append("--lm-head-gemm split-bf16 multiplies bf16 hidden states by the FP32 head's weight: it needs "
                        "--fp32-lm-head and --dtype bfloat16")
    if args.logits_chunk_tokens is not None and args.logits_chunk_tokens < 1:
        problems.append(f"--logits-chunk-tokens must be >= 1 (got {args.logits_chunk_tokens})")
    if not args.grad_clip > 0:
        problems.append(f"--grad-clip must be > 0 (got {args.grad_clip})")
    if args.model is not None and (missing := base_model.missing_model_dir(args.model)):
        problems.append(f"--model {missing}")
    elif args.model is not None:  # a directory's config, weights, tokenizer; a hub name's config; a head size here
        problems += [f"--model {p}" for p in base_model.model_dir_problems(args.model, on_gpu=args.gen_devices is not None)]
        problems += context_problems(args)
    if args.dataset and tasks.is_local_data_file(args.dataset) and not Path(args.dataset).is_file():
        problems.append(f"--dataset {args.dataset}: no such file")
    for flag in ("dataset", "test_dataset"):  # an existing data.txt is a file of unknown kind, not a hub name
        if getattr(args, flag) and tasks.data_file_kind_problem(getattr(args, flag)):
            problems.append(f"--{flag.replace('_', '-')} {tasks.data_file_kind_problem(getattr(args, flag))}")
    problems += _output_dir_problems(Path(args.output_dir))
    problems += run_dir_problems(args)
    for flag in ("dataset", "test_dataset"):  # a hub set or a directory that clones one, not a file or a task
        if getattr(args, f"{flag}_config") and not (getattr(args, flag) and tasks.takes_config(getattr(args, flag))):
            problems.append(f"--{flag.replace('_', '-')}-config names a configuration of a hub data set (or of a "
                            f"directory that clones one): give --{flag.replace('_', '-')} NAME too, not a data file "
                            "or an embedded task")
    return problems


def report_to_problems(report_to: str, output_dir: str | None = None) -> list[str]:
    """--report-to's package, imported now: a missing one is a line naming what to install, before anything starts,
    rather than a failure at the first metrics row. trackio fixes its directory as it is imported, so TRACKIO_DIR is
    set to OUTPUT_DIR/trackio first (trackio_dir); a trackio imported earlier elsewhere is a line too."""
    if REPORT_TO.get(report_to) is None:
        return []
    module, package = REPORT_TO[report_to]
    if report_to == "trackio" and output_dir:
        os.environ["TRACKIO_DIR"] = str(trackio_dir(output_dir))
    try:
        importlib.import_module(module)
    except ImportError as e:
        why = " ".join(f"{type(e).__name__}: {e}".split())  # one line, whatever the error says
        return [f"--report-to {report_to} needs the {package} package: pip install {package} ({why})"]
    if report_to == "trackio" and output_dir and trackio_dir_problem(output_dir):
        return [f"--report-to trackio: {trackio_dir_problem(output_dir)}"]
    return []


def trackio_dir(output_dir: str | Path) -> Path:
    """Where --report-to trackio keeps its files: OUTPUT_DIR/trackio, the run's own (TRACKIO_DIR)."""
    return Path(output_dir).absolute() / "trackio"


def trackio_dir_problem(output_dir: str | Path) -> str | None:
    """Why trackio, as imported, would write outside OUTPUT_DIR/trackio (it read TRACKIO_DIR before the run set it),
    or None."""
    utils = sys.modules.get("trackio.utils")
    if utils is None or Path(utils.TRACKIO_DIR).absolute() == trackio_dir(output_dir):
        return None
    return (f"trackio was imported with its directory at {utils.TRACKIO_DIR}, not {trackio_dir(output_dir)}: its "
            "files would land outside the run directory")


SEED_LIMIT = 2**31  # numpy seeds each rank with --seed + rank, in 0..2**32 - 1: room for any number of ranks


def range_problems(args: Args) -> list[str]:
    """The documented ranges of the flags that check_args's other checks do not cover; they hold on any machine
    (train.py plan checks them too)."""
    problems = []
    for flag in ("eval_every", "max_steps", "prompts_per_step", "eval_samples", "eval_prompts", "checkpoint_every",
                 "log_every", "micro_batch_tokens", "max_bad_steps", "final_eval_samples"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            problems.append(f"--{flag.replace('_', '-')} must be >= 1 (got {getattr(args, flag)})")
    if not 0 <= args.seed < SEED_LIMIT:
        problems.append(f"--seed must lie in [0, 2**31) (got {args.seed}): each rank seeds numpy with --seed + rank")
    if not 0 <= args.retire_pass_rate <= 1:
        problems.append(f"--retire-pass-rate is a pass rate: it must lie in [0, 1] (got {args.retire_pass_rate}; 0 "
                        "disables)")
    if args.gen_memory_fraction is not None and not 0 < args.gen_memory_fraction <= 1:
        problems.append(f"--gen-memory-fraction is a share of a GPU's memory: it must lie in (0, 1] (got "
                        f"{args.gen_memory_fraction})")
    if args.overlong_cache < 1:
        problems.append(f"--overlong-cache must be >= 1 (got {args.overlong_cache})")
    elif args.length_control == "overlong" and args.overlong_cache > args.max_tokens:
        problems.append(f"--overlong-cache {args.overlong_cache} must not exceed --max-tokens {args.max_tokens}: the "
                        "penalty's ramp lies inside the generation budget")
    if args.model is None and args.max_model_len is not None and args.max_model_len > EMBEDDED_MAX_MODEL_LEN:
        problems.append(f"--max-model-len {args.max_model_len} exceeds the embedded tiny model's context "
                        f"({EMBEDDED_MAX_MODEL_LEN} positions)")
    return problems


def loss_problems(args: Args, loss_file: types.ModuleType) -> list[str]:
    """The flags that reach the loss file (`loss_file`, --loss's), checked against its signatures before anything
    starts, not at the first step: a loss flag it takes no keyword for (LOSS_FLAGS), and --loss-arg KEY=VALUE, whose
    KEY must be a hyper-parameter of its compute_loss (hyperparameter_defaults) and VALUE a number where its
    default is one."""
    problems = []
    for function, fields in LOSS_FLAGS.items():
        keywords = inspect.signature(getattr(loss_file, function)).parameters
        for keyword, name in fields.items():
            if getattr(args, name) and keyword not in keywords and name not in RUN_SETTINGS:
                problems.append(f"--{name.replace('_', '-')}: {loss_file.__name__}.{function} takes no {keyword}; "
                                f"--loss {args.loss} fixes its own (see its file's docstring)")
    defaults = hyperparameter_defaults(loss_file)
    names = list(defaults)
    for item in args.loss_arg or []:
        key, sep, value = item.partition("=")
        if not sep:
            problems.append(f"--loss-arg {item!r}: expected KEY=VALUE")
        elif key not in names:
            problems.append(f"--loss-arg {key}: {loss_file.__name__}.compute_loss has no such hyper-parameter; it has "
                            f"{names}")
        elif isinstance(defaults[key], (int, float)) and not isinstance(defaults[key], bool) and \
                not isinstance(parse_literal(value), (int, float)):
            problems.append(f"--loss-arg {item}: {key} is a number (default {defaults[key]})")
    return problems


def hyperparameter_defaults(loss_file: types.ModuleType) -> dict[str, Any]:
    """The hyper-parameters of a loss file's compute_loss, {name: default} in its order: its keyword-only parameters.
    The loss files' contract: the batch's inputs come first, the hyper-parameters after the `*`; each default stays
    written once, in its file, and is read here from the signature."""
    parameters = inspect.signature(loss_file.compute_loss).parameters.values()
    return {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY}


def run_files(out: Path) -> list[str]:
    """The RUN_FILES that `out` holds (a link there too): what a new run would mix with or replace. An empty
    metrics.jsonl holds no run."""
    return [name for name in RUN_FILES if os.path.lexists(out / name)
            and not (name == "metrics.jsonl" and not (out / name).is_symlink() and (out / name).stat().st_size == 0)]


def misplaced_run_dir(path: Path) -> str | None:
    """Where a run's directory is asked for (--resume, export's RUN_DIR): one of the run's checkpoints, or a file,
    named as such, with the run's directory to give instead; None otherwise."""
    if (path / "trainer_state.json").is_file() and (path.parent / "args.json").is_file():
        return f"{path} is a checkpoint of the run {path.parent}: give the run's directory"
    return f"{path} is a file: give the run's directory" if path.is_file() else None


def run_dir_problems(args: Args) -> list[str]:
    """--resume needs a complete checkpoint to continue from; a new run does not start over an old one (or any of
    its files: another run's args.json would be taken for this one's) unasked."""
    problems = []
    if args.resume and (misplaced := misplaced_run_dir(Path(args.resume))):  # the advice below would not fit it
        problems.append(f"--resume {misplaced}")
    elif args.resume and not complete_checkpoints(Path(args.resume)):
        problems.append(f"--resume {args.resume}: no complete checkpoint there (expected {args.resume}/checkpoint/ "
                        f"or checkpoint.old/ with trainer_state.json); a run killed before its first checkpoint "
                        f"cannot be continued: start it afresh with --output-dir {args.resume} --overwrite")
    existing = run_files(Path(args.output_dir))
    if args.resume and args.overwrite:
        problems.append("--resume continues a run and --overwrite deletes it: choose one")
    elif not args.resume and existing and not args.overwrite:
        problems.append(f"--output-dir {args.output_dir} already holds a run ({', '.join(existing)}): continue it "
                        f"with --resume {args.output_dir}, start afresh with --overwrite, or pick another directory")
    return problems


def replica_problems(args: Args) -> list[str]:
    """The replica flags' own checks, before anything starts (their number, address, secret and weight transport:
    fleet.fleet_problems; their GPU layout: gpu_layout_problems)."""
    problems = []
    try:  # a malformed address, a wildcard: fleet.fleet_problems, with the fleet's other settings
        _, port = vllm_replica.parse_address(args.gen_listen)
        if args.gen_remote_replicas and port == 0:
            problems.append(f"--gen-listen {args.gen_listen}: remote replicas need a fixed port to connect to")
    except ValueError:
        pass
    if secret_file := secret_file_here(args):
        try:
            vllm_replica.read_secret(secret_file)
        except ValueError as e:
            problems.append(f"--gen-secret-file: {e}")
    return problems


def generator_values(args: Args) -> dict[str, Any]:
    """The rule's and the sampling's settings this command line gives, by GeneratorConfig's field names: what
    check_args checks with pipeline_rl.config_problems and train.py's generator_config passes on. A --think-budget
    that does not parse is left out; check_args names it."""
    values = {"group_size": args.group_size, "temperature": args.temperature, "answer_budget": args.answer_budget,
              "interruptions": args.length_control == "interruptions", "max_tokens": args.max_tokens,
              "max_off_policy": args.max_off_policy, "mode": args.mode, "buffer_steps": args.buffer_steps,
              "reward_timeout": args.reward_timeout, "batch_timeout": args.batch_timeout}
    try:
        values["think_budget"] = int_range(args.think_budget)
    except ValueError:
        pass
    return values


def fleet_values(args: Args) -> dict[str, Any]:
    """The fleet's settings this command line gives, by FleetConfig's field names, but for those resolved at the
    start (the replicas, the secret, the engine's threads and memory share: runtime.fleet_config): what check_args
    checks with fleet.fleet_problems. A --debug-gen-slowdown that does not parse is left out; check_args names it."""
    values = {"max_model_len": model_context(args), "dtype": args.dtype, "fp32_lm_head": args.fp32_lm_head,
              "gen_devices": args.gen_devices, "tensor_parallel_size": args.tensor_parallel_size,
              "remote_replicas": args.gen_remote_replicas, "listen": args.gen_listen,
              "join_timeout": args.gen_join_timeout, "weight_transport": args.weight_transport}
    try:
        values["debug_slowdown"] = gen_slowdowns(args)
    except ValueError:
        pass
    return values


def generator_problems(args: Args, generator_checks: GeneratorChecks | None) -> list[str]:
    """What `generator_checks` (pipeline_rl.config_problems) finds wrong with the rule's and the sampling's flags,
    the context (--max-model-len) checked against --max-tokens with them; [] without it."""
    if generator_checks is None:
        return []
    return generator_checks({**generator_values(args), "max_model_len": model_context(args)}, generator_flag)


def gen_slowdowns(args: Args) -> tuple[float, ...]:
    """--debug-gen-slowdown: 'X' or 'X,Y,...' (one factor per replica), each finite."""
    factors = tuple(float(x) for x in str(args.debug_gen_slowdown).split(","))
    if not all(math.isfinite(x) for x in factors):
        raise ValueError(f"--debug-gen-slowdown {args.debug_gen_slowdown}: not a finite number")
    return factors


def local_replicas(args: Args, num_gpus: int) -> int:
    """How many replicas the generator's node (learner rank 0's: generator_node) runs, whichever node asks:
    --gen-replicas, else one per --tensor-parallel-size GPUs of --gen-devices on GPU, else 1. Every rank counts them
    among the run's devices (runtime._devices_in_use); only that node's memory holds them (host_memory_problems)."""
    if args.gen_replicas is not None:
        return args.gen_replicas
    if args.gen_devices and num_gpus:
        return max(1, len([d for d in args.gen_devices.split(",") if d.strip()]) // max(1, args.tensor_parallel_size))
    return 1


def generator_node() -> bool:
    """Whether this process is on the node of learner rank 0, which starts the generator (its local replicas and
    --gen-devices). torchrun numbers a node's ranks together, from 0 on rank 0's node: there, and only there, each
    rank's RANK is its LOCAL_RANK."""
    return os.environ.get("RANK", "0") == os.environ.get("LOCAL_RANK", "0")


def secret_file_here(args: Args) -> str | None:
    """--gen-secret-file where this process reads it: on the generator's node, where rank 0 proves the replicas'
    secret; None on a node of learner ranks only, which needs no copy of it."""
    return args.gen_secret_file if generator_node() else None


def node_learner_ranks() -> int:
    """This node's learner ranks: torchrun's LOCAL_WORLD_SIZE (1 outside torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def learner_gpus(gen_devices: str | None, num_gpus: int) -> list[int]:
    """The GPUs of this node's learner ranks, local rank r on the r-th: on the generator's node, those --gen-devices
    leaves it (vllm_replica.split_devices); on another node of a multi-node run, every GPU."""
    learner_ids, _ = vllm_replica.split_devices(gen_devices, num_gpus)
    return learner_ids if generator_node() else list(range(num_gpus))


def gpu_layout_problems(args: Args, num_gpus: int, learner_ranks: int) -> list[str]:
    """Where the generator and the learner ranks of this node go, refused before anything starts when it cannot
    work: on a GPU machine vLLM needs --gen-devices, and every learner rank a GPU of its own among the others (NCCL
    refuses two ranks on one GPU). When --gen-devices takes every GPU (a machine's one GPU, say), the learner ranks
    share the generator's GPUs, one rank per GPU, and vLLM gets a smaller share of their memory."""
    if num_gpus == 0:
        return [f"--gen-devices {args.gen_devices}: no CUDA GPU here (on CPU, vLLM runs beside the learner; drop the "
                "flag)"] if args.gen_devices else []
    if not args.gen_devices:
        return [f"--gen-devices is needed on a GPU machine: the CUDA devices of the vLLM generator, e.g. --gen-devices "
                f"{num_gpus - 1} (the learner ranks take the others; on a machine with one GPU, --gen-devices 0 "
                "shares it)"]
    try:
        learner_ids, gen_ids = vllm_replica.split_devices(args.gen_devices, num_gpus)
    except ValueError as e:
        return [f"--gen-devices {args.gen_devices}: {e}"]
    problems, here = [], learner_gpus(args.gen_devices, num_gpus)
    if learner_ranks > len(here):
        problems.append(f"--nproc_per_node {learner_ranks}: each learner rank needs a GPU of its own, and " + (
            f"{len(here)} of the {num_gpus} are left after --gen-devices {args.gen_devices}" if generator_node()
            else f"this node has {num_gpus} (the generator's --gen-devices are on rank 0's node)"))
    if args.tensor_parallel_size > len(gen_ids):
        problems.append(f"--tensor-parallel-size {args.tensor_parallel_size} needs as many --gen-devices (got "
                        f"{args.gen_devices})")
    elif len(gen_ids) % args.tensor_parallel_size:
        problems.append(f"--gen-devices {args.gen_devices}: {len(gen_ids)} devices do not split into replicas of "
                        f"--tensor-parallel-size {args.tensor_parallel_size}")
    elif args.gen_replicas is not None and args.gen_replicas != len(gen_ids) // args.tensor_parallel_size:
        problems.append(f"--gen-replicas {args.gen_replicas}: --gen-devices {args.gen_devices} with "
                        f"--tensor-parallel-size {args.tensor_parallel_size} makes "
                        f"{len(gen_ids) // args.tensor_parallel_size} replica(s); drop --gen-replicas or change them")
    else:
        try:
            layout_lines(args, num_gpus, learner_ranks)
        except ValueError as e:  # a --weight-transport that cannot work on this layout
            problems.append(f"--weight-transport {e}")
    return problems


def layout_lines(args: Args, num_gpus: int, learner_ranks: int) -> list[str]:
    """Where this node's learner ranks and replicas go and how weights travel between them: what `train.py plan
    --gpus N` prints and a GPU run prints at its start. The transport is vllm_replica.choose_weight_transport's, the
    chooser the generator applies when it starts (learner rank 0 is on learner_ids[0] in both). ValueError: a
    --weight-transport that cannot work here."""
    learner_ids, gen_ids = vllm_replica.split_devices(args.gen_devices, num_gpus)
    replica_gpus = vllm_replica.replica_devices(gen_ids, args.tensor_parallel_size)
    here = min(learner_ranks, len(learner_ids))
    shared = {g: i for i, gpus in enumerate(replica_gpus) for g in gpus}
    lines = [f"learner rank {r}: GPU {learner_ids[r]}"
             + (f" (shared with replica {shared[learner_ids[r]]})" if learner_ids[r] in shared else "")
             for r in range(here)]
    if learner_ranks > here:
        lines.append(f"learner ranks {here}..{learner_ranks - 1}: on other nodes, one GPU each")
    lines += [f"replica {i}: GPU{'s' * (len(gpus) > 1)} {','.join(map(str, gpus))}"
              for i, gpus in enumerate(replica_gpus)]
    if args.gen_remote_replicas:
        lines.append(f"replicas {len(replica_gpus)}..{len(replica_gpus) + args.gen_remote_replicas - 1}: on other "
                     "nodes (python pipeline_rl.py replica)")
    _, transport = vllm_replica.choose_weight_transport(args.weight_transport, learner_ids[0], replica_gpus,
                                                        len(replica_gpus), args.gen_remote_replicas, learner_ranks)
    return lines + [transport]


def memory_problems(args: Args, num_gpus: int, learner_ranks: int, world: int) -> list[str]:
    """On a GPU machine, a --model whose learner cannot fit its GPUs is refused before anything starts, with the
    flags that would make it fit (harness/memory_plan.py); only its config is read. `learner_ranks`: this node's, whose
    GPUs are checked; `world`: all of them, over which FSDP2 shards. Not on CPU: host memory is not what the plan is
    for. A model whose config cannot be read here (set_up will say why) or that the plan does not describe goes
    unchecked; the embedded tiny model always fits."""
    if num_gpus == 0 or args.model is None:
        return []
    from transformers import AutoConfig  # here, not at the top: see train.py's build_learner

    try:
        config = AutoConfig.from_pretrained(args.model)
        memory_plan.parameter_counts(config)
    except (OSError, ValueError):
        return []
    learner_ids, gen_ids = vllm_replica.split_devices(args.gen_devices, num_gpus)
    in_use = learner_ids[:learner_ranks]
    shares_gpu = bool(set(in_use) & set(gen_ids))
    plan = learner_memory_plan(args, config, world, min(learner_gpu_memory(i) for i in in_use), shares_gpu)
    gen_memory = min((learner_gpu_memory(i) for i in gen_ids), default=0)
    return plan.problems() + generator_gpu_problems(args, config, gen_ids, shares_gpu, gen_memory)


def generator_gpu_need(args: Args, config: Any) -> tuple[int, int]:
    """The least a replica holds on each of its GPUs: (its weights in the generator's dtype, the KV cache of one
    sequence of the run's context), each split over --tensor-parallel-size, in bytes."""
    tp, dtype_bytes = args.tensor_parallel_size, vllm_replica.DTYPES[compute_dtype(args, on_gpu=True)].itemsize
    weights = math.ceil(memory_plan.parameter_counts(config).total * dtype_bytes / tp)
    return weights, memory_plan.sequence_kv_cache_bytes(config, dtype_bytes, model_context(args), tp)


def generator_gpu_problems(args: Args, config: Any, gen_ids: list[int], shares_gpu: bool,
                           gpu_memory: int) -> list[str]:
    """vLLM's share of each generator GPU (--gen-memory-fraction of `gpu_memory` bytes) against the least a replica
    holds there (generator_gpu_need). vLLM refuses an engine whose share cannot hold it ("No available memory for
    the cache blocks" or "To serve at least one request ..."), advising its gpu_memory_utilization, once the learner
    has loaded; here it is one line with this project's flags. Its activations and CUDA graphs come on top: a
    floor, not a plan."""
    if not gen_ids:
        return []
    (weights, kv_cache), fraction = generator_gpu_need(args, config), generator_memory_fraction(args, shares_gpu)
    if weights + kv_cache <= fraction * gpu_memory:
        return []
    gib, tp = memory_plan.gib, args.tensor_parallel_size
    remedies = ["a larger --gen-memory-fraction"] + ["a larger --tensor-parallel-size"] * (len(gen_ids) > tp)
    remedies += ["generator GPUs the learner does not share (--gen-devices)"] * shares_gpu
    return [f"vLLM's share of each generator GPU ({fraction:g} of {gib(gpu_memory)} GiB: {gib(fraction * gpu_memory)} "
            f"GiB, --gen-memory-fraction) cannot hold {args.model}'s weights in {compute_dtype(args, on_gpu=True)} "
            f"({gib(weights)} GiB a GPU at --tensor-parallel-size {tp}) and one sequence's KV cache "
            f"({model_context(args)} tokens: {gib(kv_cache)} GiB): {', or '.join(remedies)}"]


def host_memory_problems(args: Args, num_gpus: int, learner_ranks: int, world: int) -> list[str]:
    """On CPU, what this node's processes hold at once at the least, against the host memory available now: the
    learner's float32 weights, gradients and AdamW moments at its optimizer step (16 bytes a parameter, sharded over
    the `world` ranks, `learner_ranks` of them here, none for `train.py evaluate`; 4 more for --kl-coef's reference
    model), and each replica's weights in the generator's dtype and its KV cache (vllm_replica.cpu_kv_cache_bytes;
    on learner rank 0's node, the only one with replicas), which vLLM takes whole as its engine starts, checking it
    against what is free at that moment only. Activations, the model's load on rank 0 and the weight push come on
    top: this refuses what cannot fit at all, in one line with its parts, before the kernel's out-of-memory killer
    ends a rank ("Signal 9" in torchrun's summary). A VLLM_CPU_KVCACHE_SPACE vLLM would not read is one line too.
    The parameters are read from the safetensors headers (none there, or unreadable ones, which the model checks
    name: only the caches)."""
    if num_gpus:
        return []
    from safetensors import SafetensorError  # here, not at the top: asked only on CPU

    model, context = args.model or str(base_model.BASE_MODEL_DIR), model_context(args)
    replicas = local_replicas(args, 0) if generator_node() else 0  # they run on learner rank 0's node only
    dtype = compute_dtype(args, on_gpu=False)
    try:
        kv_cache = vllm_replica.cpu_kv_cache_bytes(model, dtype, context)
        setting = vllm_replica.cpu_kv_cache_setting()
    except ValueError as e:
        return [str(e)]
    config = base_model.model_file(model, "config.json")
    try:
        params = base_model.count_parameters(config.parent) if config is not None else 0
    except (SafetensorError, OSError):  # a weight file cut short: base_model's checks name it
        params = 0
    learner = math.ceil(params * (20 if args.kl_coef > 0 else 16) / world) * learner_ranks
    weights = params * vllm_replica.DTYPES[dtype].itemsize
    needed, available = learner + replicas * (weights + kv_cache), memory_plan.host_memory_available()
    if needed <= available:
        return []
    gib = memory_plan.gib
    cache = (f"VLLM_CPU_KVCACHE_SPACE's {setting >> 30} GiB" if kv_cache == setting else
             f"one sequence of {context} tokens of {args.model or 'the tiny model'}")
    remedies = ["a smaller model"] * (learner + replicas * weights > needed / 2) + ["fewer --gen-replicas"] * (
        replicas > 1)  # then what sized the caches
    remedies += (["a smaller VLLM_CPU_KVCACHE_SPACE"] * (setting > 1 << 30) if kv_cache == setting else
                 ["a lower --max-tokens or --max-model-len"]) if replicas else []
    parts = [f"the learner's float32 weights, gradients and AdamW moments {gib(learner)} over {learner_ranks} rank(s) "
             "here"] * bool(learner_ranks)
    parts += [f"{replicas} replica(s) of {gib(weights)} of weights and {gib(kv_cache)} of KV cache each, holding "
              f"{cache}"] * bool(replicas)
    return [f"this node's processes need at least {gib(needed)} GiB of host memory, and this machine has "
            f"{gib(available)} GiB available (GiB: {'; '.join(parts)}): {' or '.join(remedies) or 'more memory'}"]


def learner_memory_plan(args: Args, config: Any, learner_ranks: int, gpu_memory: int,
                        shares_gpu: bool = False) -> memory_plan.MemoryPlan:
    """The memory plan of this run's learner on `learner_ranks` GPUs of `gpu_memory` bytes, `config` being the
    model's (transformers) config; `shares_gpu`: vLLM takes its share of each learner GPU too."""
    dtype = compute_dtype(args, on_gpu=True)
    split = lm_head_gemm(dataclasses.replace(args, dtype=dtype), "cuda") == "split-bf16"
    return memory_plan.plan_memory(
        config, args, learner_ranks, gpu_memory, dtype=dtype, sequence_tokens=model_context(args),
        logits_chunk_bytes=SPLIT_CHUNK_BYTES if split else LOGITS_CHUNK_BYTES, split_bf16_head=split,
        generator_share=generator_memory_fraction(args, shares_gpu) if shares_gpu else 0.0,
        push_gpu=bool(args.gen_devices))  # vLLM's nccl and ipc engines send from the GPU


def learner_gpu_memory(device_id: int) -> int:
    """Bytes of memory of CUDA device `device_id`."""
    return torch.cuda.get_device_properties(device_id).total_memory


# ----------------------------------------------------------------------------------------------------------------
# The command line: Args -> argparse, --resume's saved flags, loss-file options
# ----------------------------------------------------------------------------------------------------------------


def flags_markdown(losses: LossFiles) -> str:
    """Every flag of `Args` as a Markdown table per --help group, --loss's choices from the loss table `losses`:
    docs/flags.md, regenerated with `python train.py --help-markdown > docs/flags.md` (a test fails when the page
    and Args disagree)."""
    out = ["# train.py flags", "",
           "Generated from `Args` in harness/flags.py by `python train.py --help-markdown > docs/flags.md`: the same",
           "text as `python train.py --help`, grouped the same way. Do not edit by hand."]
    group = None
    for f in dataclasses.fields(Args):
        meta = flag_metadata(f, losses)
        if meta["group"] != group:
            group = meta["group"]
            out += ["", f"## {group}", "", "| flag | default | what it does |", "|---|---|---|"]
        flag = "--" + f.name.replace("_", "-")
        if meta.get("action") is argparse.BooleanOptionalAction:
            flag += f" / --no-{f.name.replace('_', '-')}"
        default = "" if f.default is None else f"`{f.default}`"
        text = meta["help"] + (f" (one of: {', '.join(meta['choices'])})" if "choices" in meta else "")
        out.append(f"| `{flag}` | {default} | {text.replace('|', '/')} |")
    return "\n".join(out) + "\n"


def flag_metadata(f: dataclasses.Field, losses: LossFiles | None) -> dict[str, Any]:
    """A field of Args as its flag's argparse settings; --loss (`losses=True`) takes its choices and the names in its
    help from the loss table, where one is given."""
    meta = dict(f.metadata)
    if meta.pop("losses", False) and losses is not None:
        names = list(losses)
        meta["help"] = meta["help"].format(", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0])
        meta["choices"] = names
    elif "{}" in meta["help"]:
        meta["help"] = meta["help"].format("one of train.py's loss table")
    return meta


def build_parser(losses: LossFiles | None = None) -> argparse.ArgumentParser:
    """train.py's parser, --loss choosing from the loss table `losses` (train.py's LOSSES). Without it, --loss takes
    any name and --loss-arg is unchecked: for a caller that only reads flags (a tool writing a command line for
    train.py), since train.py, which runs them, checks both."""
    parser = OneLineParser(
        prog="train.py", description="The ScaleRL recipe: vLLM generator + FSDP2 learner. Run under torchrun.",
        epilog="Other commands: `train.py plan --shape NAME | --model DIR [flags]` prints the learner's GPU memory "
        "per rank for a layout, no GPU needed, and what would make it fit (train.py plan --help); on a GPU, a run "
        "whose plan does not fit is refused before it starts. `train.py export RUN_DIR OUT_DIR`, `train.py evaluate "
        "[flags]`, `train.py migrate-checkpoint RUN_DIR`.", formatter_class=DefaultsHelpFormatter)
    groups: dict[str, Any] = {}  # title -> argparse argument group, in the order of Args
    for f in dataclasses.fields(Args):
        meta = flag_metadata(f, losses)
        group = meta.pop("group")
        if group not in groups:
            groups[group] = parser.add_argument_group(group)
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"default": f.default, "help": meta.pop("help")}
        kwargs.update(meta)
        if f.type in ("bool",) and "action" not in kwargs:
            kwargs["action"] = "store_true"
        elif "action" not in kwargs or kwargs["action"] == "append":
            kwargs.setdefault("type", {"int": int, "float": number()}.get(f.type.split(" |")[0], text_value))
        groups[group].add_argument(flag, **kwargs)
    return parser


class _Unset:
    """Marks a flag the command line did not give."""


def given_flags(parser: argparse.ArgumentParser, argv: list[str] | None) -> dict[str, Any]:
    """The fields of Args that `argv` gives, with their values, the defaults left out (build_parser's `parser`)."""
    # Parse into a namespace that already holds every field, so argparse leaves out the defaults; append actions
    # need a list-like start, hence None for them.
    blank = {f.name: None if f.metadata.get("action") == "append" else _Unset for f in dataclasses.fields(Args)}
    return {k: v for k, v in vars(parser.parse_args(argv, namespace=argparse.Namespace(**blank))).items()
            if v is not _Unset and not (v is None and blank[k] is None)}


def parse_args(argv: list[str] | None = None, evaluating: bool = False,
               generator_checks: GeneratorChecks | None = None, losses: LossFiles | None = None) -> Args:
    """The flags of a run, checked (check_args, with `generator_checks`: pipeline_rl.config_problems, which train.py
    hands in; and against --loss's file in `losses`, train.py's loss table: loss_problems), and on a GPU its learner's
    memory plan (memory_problems); with --resume, its own (resumed_values). `evaluating`: for `train.py evaluate
    --resume`, which trains nothing, so that any flag may differ from the run's (another data set, more samples).
    Without `losses`: see build_parser."""
    parser = build_parser(losses)
    values = vars(parser.parse_args(argv))
    if values["resume"]:
        values = resumed_values(parser, argv, values["resume"], evaluating)
    args = Args(**values)
    # The environment the run will have (on a machine without CUDA: vLLM's CPU settings, the hub offline unless
    # HF_HUB_OFFLINE is given), before a check of --model's reads the Hugging Face cache or the hub
    tasks.set_vllm_cpu_env()
    problems = check_args(args, generator_checks)
    problems += loss_problems(args, losses[args.loss]) if losses is not None else []
    if not problems:
        gpus, ranks = torch.cuda.device_count(), node_learner_ranks()
        world = int(os.environ.get("WORLD_SIZE", ranks))
        if evaluating:  # it trains nothing: no learner to fit, only the replicas
            problems = host_memory_problems(args, gpus, 0, world)
        else:
            problems = memory_problems(args, gpus, ranks, world) + host_memory_problems(args, gpus, ranks, world)
    if problems:
        parser.error("; ".join(problems))
    return args


def plan(argv: list[str], generator_checks: GeneratorChecks | None = None, losses: LossFiles | None = None) -> str:
    """`train.py plan`: the learner's memory plan per rank for a model (--shape, or --model's config) and a layout
    given as on the command line of a run, printed without a GPU and without checking the flags against this
    machine. Returns the plan's parts and, when it does not fit, the flags that would make it fit."""
    parser = OneLineParser(
        prog="train.py plan", description="The learner's GPU memory per rank (harness/memory_plan.py; docs/memory.md), "
        "for the model and layout of a run; any other flag is train.py's.", allow_abbrev=False)
    parser.add_argument("--shape", choices=sorted(memory_plan.SHAPES),
                        help="a model shape written in harness/memory_plan.py (else --model's config)")
    parser.add_argument("--learner-ranks", type=int_at_least(1), default=1,
                        help="learner ranks (GPUs) in all (default 1)")
    parser.add_argument("--gpu-memory-gib", type=number(), default=80.0, help="memory of one learner GPU (default "
                        "80)")
    parser.add_argument("--gpus", type=int_at_least(1), help="GPUs of the node: with --gen-devices, prints where the "
                        "learner ranks and replicas go and how weights travel (the lines a GPU run prints at its start), "
                        "and tells whether vLLM shares the learner's GPUs (default: it does not)")
    options, rest = parser.parse_known_args(argv)
    args = Args(**vars(build_parser(losses).parse_args(rest)))
    if options.shape:
        args.model = args.model or options.shape  # a real model: its context is --max-tokens + a prompt
    problems = (range_problems(args) + generator_problems(args, generator_checks)
                + fleet.fleet_problems(fleet_values(args), generator_flag))
    problems += loss_problems(args, losses[args.loss]) if losses is not None else []
    if args.model and not options.shape:  # the plan reads its config.json: a path or a hub name that has none
        problems += [f"--model {p}" for p in plan_model_problems(args.model)]
    problems += [] if options.shape else context_problems(args)  # a plan for a context vLLM would refuse is no plan
    if not options.gpu_memory_gib > 0:
        problems.append(f"--gpu-memory-gib must be > 0 (got {options.gpu_memory_gib:g})")
    if args.gen_devices and options.gpus:
        try:
            vllm_replica.split_devices(args.gen_devices, options.gpus)
        except ValueError as e:
            problems.append(f"--gen-devices {args.gen_devices}: {e}")
    if problems:  # what holds on any machine: the plan divides by these
        parser.error("; ".join(problems))
    layout, shares, gen_ids = [], False, []
    if args.gen_devices and options.gpus:
        try:
            layout = layout_lines(args, options.gpus, options.learner_ranks)
        except ValueError as e:
            parser.error(f"--weight-transport {e}")
        learner_ids, gen_ids = vllm_replica.split_devices(args.gen_devices, options.gpus)
        shares = bool(set(learner_ids) & set(gen_ids))
    if options.shape:
        config = memory_plan.shape_config(options.shape)
    elif args.model:
        from transformers import AutoConfig  # here, not at the top: see train.py's build_learner

        config = AutoConfig.from_pretrained(args.model)
    elif layout:  # the layout needs no model; the memory does
        return "\n".join([*layout, "memory: give --shape NAME or --model DIR for the learner's memory per rank"])
    else:
        raise SystemExit("train.py plan: give --shape NAME or --model DIR (a config.json is enough)")
    gpu_memory = int(options.gpu_memory_gib * memory_plan.GIB)
    memory = learner_memory_plan(args, config, options.learner_ranks, gpu_memory, shares_gpu=shares)
    generator = []
    if gen_ids:  # a GPU of the same memory: what vLLM's share must hold at the least
        (weights, kv_cache), fraction = generator_gpu_need(args, config), generator_memory_fraction(args, shares)
        generator = [f"vLLM, each generator GPU: {memory_plan.gib(weights)} GiB of weights and "
                     f"{memory_plan.gib(kv_cache)} GiB of one sequence's KV cache at the least, of its share "
                     f"{memory_plan.gib(fraction * gpu_memory)} GiB (--gen-memory-fraction {fraction:g})"]
    return "\n".join([*layout, memory.describe(), *generator, *memory.problems(),
                      *generator_gpu_problems(args, config, gen_ids, shares, gpu_memory)])


def resumed_values(parser: argparse.ArgumentParser, argv: list[str] | None, run_dir: str,
                   evaluating: bool = False) -> dict[str, Any]:
    """The flags a resumed run continues with: those it was started with (its args.json), where the flags of
    CHANGEABLE_ON_RESUME given now win (e.g. --max-steps 400 to extend it). Any other flag defines the run: giving it
    another value is refused, naming each with the run's value and the new one, and so is a --max-steps below the
    run's (upwards only) or below its step; a --max-steps equal to its step has nothing to do. Its output directory
    is `run_dir`, whatever --output-dir says. `evaluating` (evaluate --resume) skips these checks: it trains nothing."""
    given = given_flags(parser, argv)
    saved: dict[str, Any] = {}
    if os.path.lexists(Path(run_dir) / "args.json"):  # a dangling link too: refused by name, not taken for none
        try:
            saved = read_args_json(Path(run_dir))
        except ValueError as e:
            parser.error(f"--resume {run_dir}: {e}")
    elif complete_checkpoints(Path(run_dir)):
        parser.error(f"--resume {run_dir}: no args.json there, so the flags of the run are unknown")
    values = {f.name: f.default for f in dataclasses.fields(Args)}
    values.update({k: v for k, v in saved.items() if k in values})
    run_values = dict(values)
    values.update(resume=run_dir, overwrite=False)
    values.update(given)
    values["output_dir"] = run_dir
    if not saved or evaluating:
        return values
    changed = [f"--{name.replace('_', '-')} (the run's {_shown(run_values[name])}, now {_shown(value)})"
               for name, value in given.items() if name not in CHANGEABLE_ON_RESUME and value != run_values[name]]
    if changed:
        which = "these flags define" if len(changed) > 1 else "this flag defines"
        parser.error(f"--resume {run_dir}: {', '.join(changed)}: {which} the run and cannot change when it resumes; "
                     "start a new run (another --output-dir) to train with them")
    step = newest_checkpoint_step(Path(run_dir))
    if step is not None and values["max_steps"] < step:
        parser.error(f"--max-steps {values['max_steps']} is below step {step}, where the run {run_dir} is: a run "
                     f"cannot be shortened (its checkpoint is at step {step})")
    if "max_steps" in given and values["max_steps"] < run_values["max_steps"]:
        parser.error(f"--max-steps {values['max_steps']} is below the run's {run_values['max_steps']}: on --resume "
                     "--max-steps only goes upwards (a shorter run is a new run: another --output-dir)")
    if step is not None and values["max_steps"] == step:
        if os.environ.get("RANK", "0") == "0":
            print(f"[resume] {run_dir} is at step {step}, its --max-steps: nothing to do (give a higher --max-steps "
                  "to continue it)", file=sys.stderr)
        raise SystemExit(0)
    return values


def _shown(value: Any) -> str:
    """A flag's value as the command line writes it (--loss-arg's list as its items)."""
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


_JSON_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "list[str]": (list,)}


def upgraded_args(saved: dict[str, Any]) -> dict[str, Any]:
    """A run's args.json as today's flags spell its values: --debug-gen-slowdown, once one number (a JSON float),
    is text now ("X", or "X,Y,..." with one factor per replica). So a run made before reads as the run it was."""
    slowdown = saved.get("debug_gen_slowdown")
    if isinstance(slowdown, (int, float)) and not isinstance(slowdown, bool):
        saved = {**saved, "debug_gen_slowdown": f"{slowdown:g}"}
    return saved


def read_args_json(run_dir: Path) -> dict[str, Any]:
    """A run's args.json: its flags (and "resumes", the history of its resumes). ValueError, in one line, for a file
    that is not JSON, not an object, or holds a flag of the wrong type (a file edited by hand, or cut short), and for
    a symbolic link or non-file there, never read through: it could hand the run another run's flags."""
    path = run_dir / "args.json"
    try:
        saved = json.loads(read_no_follow(path).decode())
    except LinkRefusedError as e:
        raise ValueError(str(e)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is unreadable ({type(e).__name__}: {str(e)[:120]}): restore it, or start the run "
                         "afresh with --overwrite") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("resumes", []), list):
        raise ValueError(f"{path} holds {type(saved).__name__} {str(saved)[:40]!r}, not a run's flags")
    saved = upgraded_args(saved)
    for f in dataclasses.fields(Args):
        value = saved.get(f.name)
        if f.name not in saved or value is None and (f.default is None or "None" in f.type):
            continue
        types = _JSON_TYPES.get(f.type.split(" |")[0])
        if types and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            raise ValueError(f"{path}: {f.name} is {value!r}, not a {f.type}: restore the file, or start the run "
                             "afresh with --overwrite")
    return saved


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
    """vLLM's max_model_len: --max-model-len, else the tiny model's context, else --max-tokens + a prompt allowance,
    or a local model's whole context where that is shorter but still above --max-tokens (the prompts' share shrinks;
    an evaluation prompt that does not fit is refused in one line as the run starts)."""
    if args.max_model_len is not None:
        return args.max_model_len
    if args.model is None:
        return EMBEDDED_MAX_MODEL_LEN
    wanted, limit = args.max_tokens + PROMPT_ALLOWANCE, base_model.model_positions(args.model)
    return limit[0] if limit is not None and args.max_tokens < limit[0] < wanted else wanted


def context_problems(args: Args) -> list[str]:
    """vLLM's context (model_context) beyond the positions of --model, a local directory or a hub name in the Hugging
    Face cache (base_model.model_positions: its config.json's max_position_embeddings, as vLLM reads it): vLLM
    refuses it only as its engine starts, in a validation traceback; here it is one line naming the flag, its value
    and the model's limit. (The embedded tiny model's limit is range_problems'.) VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lets
    vLLM go beyond it, and this check too."""
    if args.model is None or os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").lower() in ("1", "true"):
        return []
    limit, context = base_model.model_positions(args.model), model_context(args)
    if limit is None or context <= limit[0]:
        return []
    positions, source = limit
    beyond = f"the {positions} positions of {args.model} ({source})"
    if args.max_model_len is not None:
        return [f"--max-model-len {context} exceeds {beyond}"]
    return [f"--max-tokens {args.max_tokens} leaves no room for a prompt within {beyond} (--max-model-len unset, "
            f"vLLM's context would be {context}): give a --max-tokens below {positions}"]


def int_range(text: str) -> tuple[int, int]:
    """'LOW,HIGH' -> (LOW, HIGH), as --think-budget (and tools/bench.py's --completion-tokens) write a range."""
    low, high = (int(x) for x in text.split(","))
    return low, high


def parse_literal(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(value.lower(), value)


def resolve_defaults(args: Args, embedded: bool, on_gpu: bool) -> None:
    """The tiny model's tuned optimiser defaults, or the paper's for real models."""
    tiny = {"lr": 1e-4, "adam_eps": 1e-8, "weight_decay": 0.0, "warmup_steps": 0}
    paper = {"lr": 5e-7, "adam_eps": 1e-15, "weight_decay": 0.01, "warmup_steps": 100}
    for key, value in (tiny if embedded else paper).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = compute_dtype(args, on_gpu)


def compute_dtype(args: Args, on_gpu: bool) -> str:
    """--dtype, else bfloat16 on GPU and float32 on CPU."""
    return args.dtype or ("bfloat16" if on_gpu else "float32")


def lm_head_gemm(args: Args, device: Any) -> str:
    """--lm-head-gemm as the learner runs it: auto is split-bf16 where an FP32 head takes bf16 hidden states on a
    GPU, fp32 elsewhere (a CPU learner, a float32 model: the tests and the tiny default run)."""
    if args.lm_head_gemm != "auto":
        return args.lm_head_gemm
    on_gpu = torch.device(device).type == "cuda"
    return "split-bf16" if on_gpu and args.dtype == "bfloat16" and args.fp32_lm_head else "fp32"


def adamw_fused(args: Args, device: Any) -> bool:
    """--adamw as the learner runs it: auto is fused where the parameters live on a GPU (one kernel instead of
    foreach's dozen passes over float32 weights and state: measured in docs/memory.md), PyTorch's default
    elsewhere."""
    if args.adamw != "auto":
        return args.adamw == "fused"
    return torch.device(device).type == "cuda" and not args.cpu_offload


def reshard_layers(args: Args, learner_ranks: int) -> bool:
    """--fsdp-reshard as the learner runs it: whether FSDP2 frees each decoder layer's gathered weights after its
    forward (memory_plan.reshard_layers: auto keeps them on a single learner rank without --cpu-offload)."""
    return memory_plan.reshard_layers(args.fsdp_reshard, learner_ranks, args.cpu_offload)


def generator_memory_fraction(args: Args, shares_gpu: bool) -> float:
    """vLLM's share of each of its GPUs: --gen-memory-fraction, else 0.3 of a GPU it shares with a learner rank and
    0.85 of one of its own."""
    return args.gen_memory_fraction or (0.3 if shares_gpu else 0.85)


def step_ranges(steps: list[int]) -> list[list[int]]:
    """[3, 4, 5, 8] -> [[3, 5], [8, 8]]: runs of consecutive steps."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return runs


def write_args_json(out: Path, args: Args, step: int, missing_steps: list[int]) -> None:
    """OUTPUT_DIR/args.json: the run's flags, and "resumes", the history of its resumes. Each resume appends the
    step it resumed from, the changeable flags it changed ({flag: [before, after]}) and the steps metrics.jsonl had
    lost; the history is never rewritten. Written through a temporary file renamed over the old one."""
    current = dataclasses.asdict(args)
    resumes = []
    if args.resume:
        saved = read_args_json(out) if os.path.lexists(out / "args.json") else {}
        defaults = {f.name: f.default for f in dataclasses.fields(Args)}
        before = {k: saved.get(k, defaults[k]) for k in current}
        resumes = list(saved.get("resumes") or [])
        entry: dict[str, Any] = {"step": step, "changed": {
            k: [before[k], current[k]] for k in sorted(CHANGEABLE_ON_RESUME - {"output_dir", "resume", "overwrite"})
            if before[k] != current[k]}}
        if missing_steps:
            entry["metrics_missing_steps"] = step_ranges(missing_steps)
        resumes.append(entry)
    write_atomically(out / "args.json", json.dumps({**current, "resumes": resumes}, indent=1))
