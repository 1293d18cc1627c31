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

How to read this file: the flags (Args), then `main` and the loop (`train`), then one function per step of the
loop, in the order the loop calls them:
  pull groups -> retire solved prompts (No-Positive-Resampling) -> filter zero-variance groups -> overlong penalty
  and overlong filter -> old logprobs -> advantages -> loss and backward -> optimizer step -> push weights
  -> evaluate -> log -> checkpoint; at the end, fit ScaleRL's sigmoid to the evaluation rows (OUTPUT_DIR/scaling.png).
Then the learner itself (make_learner: the loss file, seeds, the FSDP2 policy with its FP32 head, AdamW and its
warm-up), and `export` and `evaluate`. Below the PLUMBING banner: the command line, process groups, the
output-directory lock, resume, the generator's start, checkpoint files and signal handling, which a reader of the
recipe may skip.

How this departs from the paper, deliberately:
  - The embedded default is a 0.86M-parameter model on 3-digit addition (tasks.py), so it runs on 2 CPU cores
    in minutes. Its generator is held to one batch ahead of the learner (--buffer-steps 1): with k = 8 alone, a
    fast generator made every batch 8 steps stale, and at lr 1e-4 that made runs swing (docs/results.md: the
    staleness experiment). Its optimiser settings (lr 1e-4, 32 prompts x 8 samples, no warm-up, 100 steps) are tuned for that
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
import bisect
import collections
import contextlib
import dataclasses
import faulthandler
import functools
import fcntl
import inspect
import json
import math
import os
import pickle
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import zipfile
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tqdm import tqdm

import cispo  # the loss files, each one algorithm: --loss NAME picks one from LOSSES
import dapo  # ... and, whatever --loss is, the recipe's data side: filter_groups (zero-variance filtering, DAPO's
             # dynamic sampling) and overlong_penalty (--length-control overlong) live in dapo.py, its paper's file
import drgrpo
import grpo
import gspo
import memory_plan  # the learner's memory per rank, checked before anything starts on a GPU (train.py plan)
import pipeline_rl  # imports vLLM only inside the generator process, never in a learner rank
import scaling_fit
import tasks
import tis

LOSSES = {"grpo": grpo, "dapo": dapo, "drgrpo": drgrpo, "gspo": gspo, "cispo": cispo}  # --loss NAME -> its file
EMBEDDED_MAX_MODEL_LEN = 256  # the tiny model's max_position_embeddings; its prompts are ~10 tokens
PROMPT_ALLOWANCE = 512  # prompt tokens a real model's context keeps beside --max-tokens: a chat template (with its
                        # system prompt) around a GSM8K or Polaris problem fits with room to spare


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
    "eval_every", "eval_samples", "final_eval_samples", "log_every", "checkpoint_every", "max_bad_steps",
    "peak_tflops",  # only the mfu metric: a run may move to another kind of GPU
    "micro_batch_tokens", "logits_chunk_tokens", "packing",  # memory and speed only: a step is the same (tested)
    "activation_checkpointing", "cpu_offload",  # likewise
    "gen_devices", "tensor_parallel_size", "gen_memory_fraction",  # placement: a run may move to another machine
    "gen_replicas", "gen_remote_replicas", "gen_listen", "gen_secret_file", "gen_join_timeout",  # replicas: the
    "weight_transport",  # scheduler restarts from the checkpoint's data position whatever their number (tested)
    "gen_threads",  # speed only
    "lm_head_gemm",  # speed: the logprobs are float32's either way, the gradients the same to bf16 rounding (tested)
    "debug_gen_slowdown", "debug_learner_slowdown",
    "output_dir", "resume", "overwrite",  # bookkeeping: a resumed run stays in its directory
})


@dataclass
class Args:
    loss: str = _arg(HelpGroup.WHAT, "cispo", "the loss file: grpo, dapo, drgrpo, gspo or cispo (ScaleRL: cispo)",
                     choices=LOSSES)
    loss_arg: list[str] = _arg(HelpGroup.WHAT, None, "override a hyper-parameter of the loss, KEY=VALUE (repeatable), "
                               "e.g. --loss-arg eps_max=8; defaults are the loss file's paper values", action="append")
    model: str | None = _arg(HelpGroup.WHAT, None, "HF model name or directory (default: the embedded tiny model, "
                             "built and cached on first use by tasks.build_base_model)")
    dataset: str | None = _arg(HelpGroup.WHAT, None, "HF data set name or local .json/.jsonl/.parquet (default: the "
                               "embedded 3-digit addition task; arithmetic-verified: the same with its scratchpad "
                               "verified too, so a tight --think-budget is a hard ceiling, see tasks.py)")
    dataset_config: str | None = _arg(HelpGroup.WHAT, None, "configuration (subset) of a hub --dataset, passed on as "
                                      "datasets.load_dataset(NAME, CONFIG); e.g. main for openai/gsm8k")
    test_dataset: str | None = _arg(HelpGroup.WHAT, None, "optional test set (local file or HF name), evaluated with "
                                    "the validation")
    question_field: str | None = _arg(HelpGroup.WHAT, None, "question field of --dataset (default: question, problem "
                                      "or prompt)")
    answer_field: str | None = _arg(HelpGroup.WHAT, None, "answer field of --dataset (default: answer, solution or "
                                    "final_answer)")
    skip_bad_rows: bool = _arg(HelpGroup.WHAT, False, "skip and count malformed data rows instead of stopping with an "
                               "error")
    seed: int = _arg(HelpGroup.WHAT, 0, "seed of data order, sampling and initialisation")

    max_steps: int = _arg(HelpGroup.BATCH, 100, "optimizer steps (tiny-task default: the pass rate levels off near "
                          "0.95 by step 50-60)")
    prompts_per_step: int = _arg(HelpGroup.BATCH, 32, "prompts per optimizer step (ScaleRL: 48; tiny-task default 32)")
    group_size: int = _arg(HelpGroup.BATCH, 8, "completions per prompt (ScaleRL: 16; tiny-task default 8)")

    mode: str = _arg(HelpGroup.GENERATION, "pipeline", "pipeline: PipelineRL in-flight updates (ScaleRL); sync: "
                     "generate, then train", choices=("pipeline", "sync"))
    max_off_policy: int = _arg(HelpGroup.GENERATION, 8, "k: pipeline: a sample's oldest token is at most k optimizer "
                               "steps old (ScaleRL: 8); sync: k optimizer steps per generation round "
                               "(PPO-off-policy-k; 1 = on-policy)")
    buffer_steps: int = _arg(HelpGroup.GENERATION, 1, "pipeline: freshness bound under k: the generator admits at "
                             "most this many learner steps' worth of prompts ahead of the learner (1: it samples the "
                             "next batch while the learner trains on this one; the lag then stays near 1 however fast "
                             "the generator is); k + 1 or more: only k limits it, as in PipelineRL and ScaleRL")
    temperature: float = _arg(HelpGroup.GENERATION, 1.0, "sampling temperature; the learner divides its logits by the "
                              "same value")
    max_model_len: int | None = _arg(HelpGroup.GENERATION, None, "vLLM's context per sequence, prompt + completion "
                                     f"tokens (default: {EMBEDDED_MAX_MODEL_LEN} for the embedded tiny model, its "
                                     f"context length; --max-tokens + {PROMPT_ALLOWANCE} with --model, room for a "
                                     "chat-templated prompt); a training prompt that does not fit is skipped and "
                                     "counted in skipped_long_prompts")

    zero_variance: str = _arg(HelpGroup.ZERO_VARIANCE, "drop", "groups whose rewards are all equal: drop (ScaleRL), "
                              "resample (DAPO dynamic sampling: pull more groups until the batch is full) or keep",
                              choices=("drop", "resample", "keep"))
    retire_pass_rate: float = _arg(HelpGroup.ZERO_VARIANCE, 0.9, "No-Positive-Resampling: retire a prompt once its "
                                   "pass-rate history reaches this (ScaleRL: 0.9); 0 disables")

    length_control: str = _arg(HelpGroup.LENGTH, "interruptions", "interruptions (ScaleRL) or overlong (DAPO's soft "
                               "overlong penalty added to the reward)", choices=("interruptions", "overlong"))
    think_budget: str = _arg(HelpGroup.LENGTH, "34,40", "interruption point drawn uniformly in MIN,MAX thinking tokens "
                             "(ScaleRL: 10240,12288; tiny task: 34,40, above its ~29-token scratchpad)")
    answer_budget: int = _arg(HelpGroup.LENGTH, 8, "tokens allowed after an interruption (ScaleRL: 2048; tiny task: 8)")
    max_tokens: int = _arg(HelpGroup.LENGTH, 48, "generation budget per completion (ScaleRL: 14336; tiny task: 48)")
    overlong_cache: int = _arg(HelpGroup.LENGTH, 16, "DAPO L_cache for --length-control overlong, in tokens (paper: "
                               "4096 of 20480; tiny-task default 16 of 48)")
    overlong_filter: bool = _arg(HelpGroup.LENGTH, False, "DAPO's overlong filtering: completions cut off by "
                                 "--max-tokens are masked from the loss (their rewards still count in the group's "
                                 "advantages); counted in overlong_filtered")

    aggregation: str | None = _arg(HelpGroup.LOSS, None, "CISPO loss aggregation: prompt (ScaleRL), sample or token",
                                   choices=("prompt", "sample", "token"))
    adv_norm: str | None = _arg(HelpGroup.LOSS, None, "CISPO advantage normalisation: batch (ScaleRL) or group",
                                choices=("batch", "group"))
    kl_coef: float = _arg(HelpGroup.LOSS, 0.0, "GRPO's KL penalty to the reference policy (a frozen copy of the "
                          "initial model, sharded like the policy): beta of its k3 estimate, logged as kl_ref "
                          "(DeepSeekMath: 0.04; 0 = off, as in DAPO and ScaleRL); every loss takes it")
    micro_batch_tokens: int = _arg(HelpGroup.LOSS, 8192, "token budget of a micro-batch: its real tokens with "
                                   "--packing, its padded rows x length without; a group may span micro-batches, a "
                                   "completion over the budget is one of its own. Sized for large "
                                   "models' memory: on a GPU with a small model, where each micro-batch costs fixed "
                                   "host time, a larger one is faster")
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
    grad_clip: float = _arg(HelpGroup.OPTIMIZER, 1.0, "clip the global gradient norm to this (logged as grad_norm, "
                            "grad_clipped)")
    max_bad_steps: int = _arg(HelpGroup.OPTIMIZER, 3, "stop (with a checkpoint) after this many consecutive "
                              "non-finite steps")

    eval_every: int = _arg(HelpGroup.EVALUATION, 5, "evaluate every N steps (and at step 0 and the end); tiny task: "
                           "5, so the rise of the curve has enough points for the sigmoid fit")
    eval_samples: int = _arg(HelpGroup.EVALUATION, 4, "k of the mean@k validation pass rate (ScaleRL: 16)")
    final_eval_samples: int | None = _arg(HelpGroup.EVALUATION, None, "k of the last evaluation only (default: "
                                          "--eval-samples): the run's final value measured more exactly for the cost "
                                          "of one evaluation, e.g. 16 when a fit's prediction is checked against it")
    eval_prompts: int = _arg(HelpGroup.EVALUATION, 128, "held-out validation prompts (ScaleRL: 1000)")
    log_every: int = _arg(HelpGroup.EVALUATION, 5, "print a one-line summary every N steps")
    peak_tflops: float | None = _arg(HelpGroup.EVALUATION, None, "dense peak TFLOP/s of one learner GPU in --dtype, "
                                     "for the metrics' mfu (model FLOPs utilisation); default: from a table of "
                                     "known GPUs by name (H100, H200, A100, L40S, ...); on CPU or an unknown GPU, "
                                     "none and no mfu")

    checkpoint_every: int = _arg(HelpGroup.CHECKPOINTS, 10, "save a checkpoint every N steps (and at the end)")
    output_dir: str = _arg(HelpGroup.CHECKPOINTS, "runs/default", "where metrics.jsonl, checkpoint/, scaling.png go")
    resume: str | None = _arg(HelpGroup.CHECKPOINTS, None, "continue the run in this directory from its newest "
                              "checkpoint that every rank can read, with the flags it was started with (args.json). "
                              "Only these may change, each change recorded in args.json with its step: " + ", ".join(
                                  "--" + name.replace("_", "-") for name in sorted(CHANGEABLE_ON_RESUME)
                                  if name not in ("output_dir", "resume", "overwrite"))
                              + " (--max-steps upwards only); any other flag defines the run, and changing it is "
                              "refused")
    overwrite: bool = _arg(HelpGroup.CHECKPOINTS, False, "start afresh in an --output-dir that already holds a run, "
                           "deleting its metrics and checkpoints once the new run has passed its checks and started "
                           "(a failed start leaves the old run as it was; without this flag such a directory is "
                           "refused)")

    dtype: str | None = _arg(HelpGroup.PRECISION, None, "float32 or bfloat16 (default: bfloat16 on GPU, float32 on "
                             "CPU)")
    fp32_lm_head: bool = _arg(HelpGroup.PRECISION, True, "compute the LM head in float32 in generator and learner "
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
    cpu_offload: bool = _arg(HelpGroup.MEMORY, False, "keep the parameters, gradients and AdamW state in host memory "
                             "(FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU): a GPU trains a model its "
                             "memory cannot hold, at the cost of host-device copies every step",
                             action=argparse.BooleanOptionalAction)

    gen_devices: str | None = _arg(HelpGroup.GPU, None, "GPU only: comma-separated CUDA devices for the vLLM "
                                   "replicas of this node, taken in runs of --tensor-parallel-size (the learner uses "
                                   "the others); ScaleRL split 64 generator / 16 trainer GPUs")
    tensor_parallel_size: int = _arg(HelpGroup.GPU, 1, "GPU only: vLLM tensor parallelism of each replica")
    gen_memory_fraction: float | None = _arg(HelpGroup.GPU, None, "GPU only: vLLM's share of each generator GPU's "
                                             "memory (default: 0.85 on GPUs of its own, 0.3 on GPUs it shares with "
                                             "the learner, when --gen-devices takes them all)")

    gen_replicas: int | None = _arg(HelpGroup.REPLICAS, None, "vLLM engines on this node, under one scheduler "
                                    "(default: on GPU, the --gen-devices / --tensor-parallel-size; on CPU, 1: they "
                                    "share the cores)")
    gen_threads: int | None = _arg(HelpGroup.REPLICAS, None, "CPU only: torch threads of each local replica "
                                   "(default: in sync mode the machine's cores shared among the replicas, since the "
                                   "learner ranks wait while they generate; in pipeline mode 1, beside the busy "
                                   "learner ranks, where two threads stall each other)")
    gen_remote_replicas: int = _arg(HelpGroup.REPLICAS, 0, "replicas on other nodes to wait for, each started there "
                                    "with `python pipeline_rl.py replica --connect HOST:PORT --secret-file FILE` "
                                    "(needs --gen-listen and --gen-secret-file)")
    gen_listen: str = _arg(HelpGroup.REPLICAS, "127.0.0.1:0", "HOST:PORT the generator listens on for replicas "
                           "(port 0: a free one, for local replicas); with --gen-remote-replicas, an address of this "
                           "node the generator nodes reach, and a fixed port. Only this address is bound")
    gen_secret_file: str | None = _arg(HelpGroup.REPLICAS, None, "file with the secret every replica must prove "
                                       "(HMAC challenge), readable by its owner only; needed for remote replicas "
                                       "(default: a random one for the local replicas)")
    gen_join_timeout: float = _arg(HelpGroup.REPLICAS, 600.0, "seconds to wait for every replica to connect and "
                                   "start its engine; then the start fails naming the missing ones")
    weight_transport: str = _arg(HelpGroup.REPLICAS, "broadcast", "how new weights reach the replicas: broadcast "
                                 "(torch.distributed, gloo on CPU, NCCL on GPU, in buckets) or file (a safetensors "
                                 "file in /dev/shm; replicas on this node only)", choices=("broadcast", "file"))

    # debugging: turn the generator/learner speed ratio on purpose
    debug_gen_slowdown: str = _arg(HelpGroup.DEBUG, "1", "debug: make the generator X times slower (it sleeps X-1 "
                                   "times each engine step's duration), to see how the recipe behaves on a machine "
                                   "whose generator is slower relative to its learner; X,Y,...: one factor per "
                                   "replica (the last for the rest)")
    debug_learner_slowdown: float = _arg(HelpGroup.DEBUG, 1.0, "debug: make the learner X times slower (each rank "
                                         "sleeps X-1 times each step's compute), to emulate a relatively faster "
                                         "generator")


def check_args(args: Args) -> list[str]:
    """Incompatible flags, explained before anything starts."""
    problems = gpu_layout_problems(args, torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if args.gen_threads is not None and args.gen_threads < 1:
        problems.append(f"--gen-threads {args.gen_threads}: a replica needs at least one thread")
    if args.loss != "cispo" and (args.aggregation or args.adv_norm):
        problems.append(f"--aggregation and --adv-norm are CISPO's options; --loss {args.loss} fixes its own "
                        "(see its file's docstring)")
    if args.mode == "sync" and args.max_off_policy < 1:
        problems.append("--max-off-policy must be >= 1 in sync mode (1 = on-policy)")
    if args.mode == "pipeline" and args.max_off_policy < 0:
        problems.append("--max-off-policy must be >= 0")
    if args.buffer_steps < 0:
        problems.append("--buffer-steps must be >= 0")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        problems.append(f"--peak-tflops must be > 0 (got {args.peak_tflops})")
    try:
        if not all(x >= 1 for x in gen_slowdowns(args)):
            raise ValueError
    except ValueError:
        problems.append(f"--debug-gen-slowdown {args.debug_gen_slowdown}: X or X,Y,... (one per replica), each "
                        "must be >= 1 (1 = full speed)")
    if not args.debug_learner_slowdown >= 1:
        problems.append("--debug-learner-slowdown must be >= 1 (1 = full speed)")
    problems += replica_problems(args)
    if args.zero_variance == "drop" and args.group_size < 2:
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
        low, high = int_range(args.think_budget)
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
    if args.lm_head_gemm == "split-bf16" and (args.dtype == "float32" or not args.fp32_lm_head):
        problems.append("--lm-head-gemm split-bf16 multiplies bf16 hidden states by the FP32 head's weight: it needs "
                        "--fp32-lm-head and --dtype bfloat16")
    if args.logits_chunk_tokens is not None and args.logits_chunk_tokens < 1:
        problems.append(f"--logits-chunk-tokens must be >= 1 (got {args.logits_chunk_tokens})")
    for flag in ("group_size", "max_tokens", "answer_budget", "eval_samples", "eval_prompts", "checkpoint_every",
                 "log_every", "micro_batch_tokens", "max_bad_steps", "final_eval_samples"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            problems.append(f"--{flag.replace('_', '-')} must be >= 1 (got {getattr(args, flag)})")
    if not args.grad_clip > 0:
        problems.append(f"--grad-clip must be > 0 (got {args.grad_clip})")
    if args.model is not None and not Path(args.model).exists() and (
            args.model.startswith(("/", ".", "~")) or args.model.count("/") > 1):
        problems.append(f"--model {args.model}: no such directory (a hub model is named ORG/NAME)")
    elif args.model is not None:  # a local directory: config, weights, tokenizer, a head size vLLM supports here
        problems += [f"--model {p}" for p in tasks.model_dir_problems(args.model, on_gpu=args.gen_devices is not None)]
    if args.dataset and tasks.is_local_data_file(args.dataset) and not Path(args.dataset).is_file():
        problems.append(f"--dataset {args.dataset}: no such file")
    for flag in ("dataset", "test_dataset"):  # an existing data.txt is a file of unknown kind, not a hub name
        if getattr(args, flag) and tasks.data_file_kind_problem(getattr(args, flag)):
            problems.append(f"--{flag.replace('_', '-')} {tasks.data_file_kind_problem(getattr(args, flag))}")
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
    if args.dataset_config and not (args.dataset and args.dataset not in tasks.EMBEDDED_TASKS
                                    and not tasks.is_local_data_file(args.dataset)):
        problems.append("--dataset-config names a configuration of a hub data set: give --dataset NAME too, not a "
                        "local file or the embedded task")
    for item in args.loss_arg or []:
        if "=" not in item:
            problems.append(f"--loss-arg {item!r}: expected KEY=VALUE")
    if args.eval_every < 1 or args.max_steps < 1 or args.prompts_per_step < 1:
        problems.append("--eval-every, --max-steps and --prompts-per-step must be >= 1")
    return problems


def replica_problems(args: Args) -> list[str]:
    """The replica flags, checked before anything starts (their GPU layout: gpu_layout_problems)."""
    problems = []
    if (args.gen_replicas is not None and args.gen_replicas < 0) or args.gen_remote_replicas < 0:
        problems.append("--gen-replicas and --gen-remote-replicas must be >= 0")
    elif (args.gen_replicas if args.gen_replicas is not None else 1) + args.gen_remote_replicas < 1:
        problems.append("--gen-replicas 0 needs --gen-remote-replicas 1 or more: someone must generate")
    try:
        host, port = pipeline_rl.parse_address(args.gen_listen)
        if host in ("", "0.0.0.0", "::"):
            problems.append(f"--gen-listen {args.gen_listen}: name the address the replicas reach this node at, not "
                            "a wildcard (only that address is bound)")
        if args.gen_remote_replicas and port == 0:
            problems.append(f"--gen-listen {args.gen_listen}: remote replicas need a fixed port to connect to")
    except ValueError as e:
        problems.append(f"--gen-listen: {e}")
    if args.gen_remote_replicas and not args.gen_secret_file:
        problems.append("--gen-remote-replicas needs --gen-secret-file: replicas on other nodes must prove a shared "
                        "secret (e.g. `head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE`, copied to each node)")
    if args.gen_secret_file:
        try:
            pipeline_rl.read_secret(args.gen_secret_file)
        except ValueError as e:
            problems.append(f"--gen-secret-file: {e}")
    if args.weight_transport == "file" and args.gen_remote_replicas:
        problems.append("--weight-transport file reaches replicas on this node only: remote replicas need broadcast")
    return problems


def gen_slowdowns(args: Args) -> tuple[float, ...]:
    """--debug-gen-slowdown: 'X' or 'X,Y,...' (one factor per replica)."""
    return tuple(float(x) for x in str(args.debug_gen_slowdown).split(","))


def local_replicas(args: Args, num_gpus: int) -> int:
    """How many replicas this node runs: --gen-replicas, else one per --tensor-parallel-size GPUs of --gen-devices
    on GPU, else 1."""
    if args.gen_replicas is not None:
        return args.gen_replicas
    if args.gen_devices and num_gpus:
        return max(1, len([d for d in args.gen_devices.split(",") if d.strip()]) // max(1, args.tensor_parallel_size))
    return 1


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
        learner_ids, gen_ids = pipeline_rl.split_devices(args.gen_devices, num_gpus)
    except ValueError as e:
        return [f"--gen-devices {args.gen_devices}: {e}"]
    problems = []
    if learner_ranks > len(learner_ids):
        problems.append(f"--nproc_per_node {learner_ranks}: each learner rank needs a GPU of its own, and "
                        f"{len(learner_ids)} of the {num_gpus} are left after --gen-devices {args.gen_devices}")
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
    return problems


def memory_problems(args: Args, num_gpus: int, learner_ranks: int, world: int) -> list[str]:
    """On a GPU machine, a --model whose learner cannot fit its GPUs is refused before anything starts, with the
    flags that would make it fit (memory_plan.py); only its config is read. `learner_ranks`: this node's, whose
    GPUs are checked; `world`: all of them, over which FSDP2 shards. Not on CPU: host memory is not what the plan is
    for. A model whose config cannot be read here (set_up will say why) or that the plan does not describe goes
    unchecked; the embedded tiny model always fits."""
    if num_gpus == 0 or args.model is None:
        return []
    from transformers import AutoConfig  # here, not at the top: see build_learner

    try:
        config = AutoConfig.from_pretrained(args.model)
        memory_plan.parameter_counts(config)
    except (OSError, ValueError):
        return []
    learner_ids, gen_ids = pipeline_rl.split_devices(args.gen_devices, num_gpus)
    in_use = learner_ids[:learner_ranks]
    plan = learner_memory_plan(args, config, world, min(learner_gpu_memory(i) for i in in_use),
                               shares_gpu=bool(set(in_use) & set(gen_ids)))
    return plan.problems()


def learner_memory_plan(args: Args, config: Any, learner_ranks: int, gpu_memory: int,
                        shares_gpu: bool = False) -> memory_plan.MemoryPlan:
    """The memory plan of this run's learner on `learner_ranks` GPUs of `gpu_memory` bytes, `config` being the
    model's (transformers) config; `shares_gpu`: vLLM takes its share of each learner GPU too."""
    dtype = compute_dtype(args, on_gpu=True)
    split = lm_head_gemm(dataclasses.replace(args, dtype=dtype), "cuda") == "split-bf16"
    return memory_plan.plan_memory(
        config, args, learner_ranks, gpu_memory, dtype=dtype, sequence_tokens=model_context(args),
        logits_chunk_bytes=SPLIT_CHUNK_BYTES if split else LOGITS_CHUNK_BYTES, split_bf16_head=split,
        generator_share=generator_memory_fraction(args, shares_gpu) if shares_gpu else 0.0)


def learner_gpu_memory(device_id: int) -> int:
    """Bytes of memory of CUDA device `device_id`."""
    return torch.cuda.get_device_properties(device_id).total_memory


# ----------------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, set up (plumbing, below), run the loop, then fit ScaleRL's sigmoid to the evaluation rows.
    `train.py export RUN_DIR OUT_DIR` writes a run's policy as a Hugging Face model directory instead (`export`);
    `train.py evaluate [flags]` prints a model's or a run's pass@k as one JSON line (`evaluate_policy`);
    `train.py migrate-checkpoint RUN_DIR` converts an older run's pickled RNG files (`migrate_checkpoint`);
    `train.py plan --shape NAME | --model DIR [flags]` prints the learner's memory per rank, no GPU needed (`plan`);
    `train.py --help-markdown` prints the flags as docs/flags.md holds them (`flags_markdown`)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--help-markdown"]:
        print(flags_markdown(), end="")
        return
    if argv[:1] == ["export"]:
        if len(argv) != 3 or argv[1].startswith("-"):
            raise SystemExit("usage: train.py export RUN_DIR OUT_DIR")
        print(json.dumps(export(Path(argv[1]), Path(argv[2]))))
        return
    if argv[:1] == ["migrate-checkpoint"]:
        if len(argv) != 2 or argv[1].startswith("-"):
            raise SystemExit("usage: train.py migrate-checkpoint RUN_DIR")
        print(json.dumps(migrate_checkpoint(Path(argv[1]))))
        return
    if argv[:1] == ["plan"]:
        print(plan(argv[1:]))
        return
    if argv[:1] == ["evaluate"]:  # the training flags; nothing is written, so no output directory is claimed
        with tempfile.TemporaryDirectory(prefix="scalerl-evaluate-") as scratch:
            given = argv[1:] if "--resume" in argv else [*argv[1:], "--output-dir", str(Path(scratch) / "unused")]
            print(json.dumps(evaluate_policy(parse_args(given, evaluating=True), Path(scratch))))
        return
    args = parse_args(argv)
    # A crash in native code (gloo, a kernel) kills a rank with no Python traceback: print every thread's stack.
    faulthandler.enable(all_threads=True)
    with set_up(args) as (learner, run, state):
        train(args, learner, run, state)
    if run.is_main:  # the generator is closed by now: the fit has the CPU to itself
        fit = fit_and_plot(run.out / "metrics.jsonl", run.out / "scaling.png", f"{args.loss} ({args.mode})")
        if fit is not None:
            print(f"[scaling fit] A={fit.A:.3f} B={fit.B:.2f} C_mid={fit.C_mid:.4g} R0={fit.R0:.3f} "
                  f"R2={fit.r2:.3f} on {fit.n_points} points -> {run.out / 'scaling.png'}")
    dist.destroy_process_group()


def train(args: Args, learner: Learner, run: Run, state: TrainerState) -> None:
    """The ScaleRL loop, from `state` to --max-steps. Every learner rank runs it in step with the others (FSDP's
    collectives); rank 0 also drives the generator and writes metrics.jsonl."""
    if state.step == 0 and run.is_main and run.metrics.lines == 0:  # (a run stopped at step 0 has its row already)
        row = {**new_row(run, state), **run.data_skipped}
        evaluate(args, run, row)
        run.metrics.write(row)
        tqdm.write(f"step 0: val pass rate {row['val_pass_rate']:.3f} (the base model)")
    consecutive_bad = 0
    peak_flops = peak_flops_per_s(args.dtype, args.peak_tflops)  # one learner rank's; None: no mfu
    while state.step < args.max_steps:
        # Pull groups, then the data-side steps on them (rank 0): retire solved prompts, filter zero-variance
        # groups, overlong penalty and filter. A round is one step's batch (pipeline mode) or k steps' (sync mode,
        # PPO-off-policy-k). Every rank receives the same round and trains on its share of each batch.
        round_ = broadcast_from_rank0(pull_round_or_error(args, run, state) if run.is_main else None)
        if round_.generator_error:  # the generator (or vLLM's engine) died: keep what was learned, then stop
            checkpoint(learner, run, state)
            raise SystemExit(f"stopping after step {state.step}: {round_.generator_error}; checkpoint saved in "
                             f"{run.out / 'checkpoint'}: continue with --resume {run.out}")
        my_batches = [this_ranks_share(batch, run) for batch in round_.batches]
        # Old logprobs: the sampler's (pipeline mode, ScaleRL), or the learner's before the round's first update
        # (sync mode, and --tis, whose weights are min(pi_learner_old / pi_sampler, cap)). A round of one batch is
        # trained by the weights that would compute them: its old logprobs are the step's own, detached, and need
        # no forward of their own (sync mode with k = 1 saved a fifth of the learner's time on SmolLM2).
        learner_old = args.mode == "sync" or bool(args.tis)
        old_is_current = learner_old and len(round_.batches) == 1
        if learner_old and not old_is_current:
            with torch.no_grad():
                attach_learner_logprobs(learner.model, [grp for b in my_batches for grp in b], args, learner.pad_id)

        for batch, my_groups in zip(round_.batches, my_batches):
            if state.step >= args.max_steps:
                break
            stop_if_signalled(learner, run, state)
            step_start, version = time.time(), state.step
            rewards, my_advantages = compute_advantages(args, learner, batch, run)
            learner.optimizer.zero_grad(set_to_none=True)
            totals = loss_and_backward(learner.model, learner.loss_module, learner.hp, my_groups, my_advantages, args,
                                       learner.pad_id, run.world, version, learner.ref_model, old_is_current)
            metrics = reduce_metrics(totals, run.world)
            grad_norm, finite = optimizer_step(args, learner, metrics["loss"], has_groups=bool(batch))
            if not finite:
                consecutive_bad += 1
                state.bad_steps_total += 1
            elif batch:
                consecutive_bad = 0
            if args.debug_learner_slowdown > 1:  # debug knob: a learner X times slower than this one
                time.sleep((args.debug_learner_slowdown - 1) * (time.time() - step_start))
            state.step += 1
            state.consumed.update(grp.data_index for grp in batch)
            sync_s, broadcast_s = push_weights(learner, run, state.step)
            gen_tokens = round_.stats.pop("gen_tokens", 0)  # a sync round's generation counts at its first step
            trained_tokens = state.count_tokens(gen_tokens, batch, learner.n_params)
            step_s = time.time() - step_start

            if run.is_main:
                batch_rewards = rewards.tolist()
                mfu = model_flops_utilisation(learner.n_params, trained_tokens, step_s, run.world, peak_flops)
                row = {
                    **new_row(run, state),
                    "reward": sum(batch_rewards) / max(len(batch_rewards), 1),
                    "train_pass_rate": sum(r > 0 for r in batch_rewards) / max(len(batch_rewards), 1),
                    "groups": len(batch), "lr": learner.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                    "grad_clipped": float(grad_norm > args.grad_clip), "skipped_step": float(not finite),
                    "bad_steps_total": state.bad_steps_total, "weight_sync_s": sync_s,
                    "weight_broadcast_s": broadcast_s, "step_s": step_s,
                    "train_tokens_per_s": trained_tokens / max(step_s, 1e-9), "retired_prompts": len(state.retired),
                    "gen_tokens": gen_tokens, **({"mfu": mfu} if mfu is not None else {}),  # no peak known: none
                    **metrics, **round_.stats,
                    # Lag of the tokens trained on at this step (in a sync round of k steps it grows 0..k-1).
                    **pipeline_rl.lag_stats(batch, version),
                }
                if (state.step % args.eval_every == 0 or state.step == args.max_steps) and not run.generator_error:
                    with generator_errors_noted(run):
                        evaluate(args, run, row)
                log_row(args, run, row)
            stop_bad = consecutive_bad >= args.max_bad_steps
            if state.step % args.checkpoint_every == 0 or state.step == args.max_steps or stop_bad:
                checkpoint(learner, run, state)
            if stop_bad:
                raise SystemExit(f"stopping: {consecutive_bad} consecutive steps had a non-finite loss or gradient "
                                 f"(last at step {state.step}); checkpoint saved in {run.out / 'checkpoint'}. Lower "
                                 "--lr or check the data, then --resume.")
    run.bar.close()


# ----------------------------------------------------------------------------------------------------------------
# What the loop works with: the trainer state (saved in checkpoints), this rank's learner, the run around them
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class TrainerState:
    """Everything the loop carries from one step to the next; saved whole in every checkpoint
    (trainer_state.json) and restored whole by --resume."""

    step: int = 0  # optimizer steps done, which is also the version of the policy's weights
    metrics_lines: int = 0  # rows of metrics.jsonl this state covers (a resume cuts the file back to them)
    elapsed_hours: float = 0.0  # wall-clock hours of the run so far, across resumes
    flops: float = 0.0
    gen_tokens: int = 0
    train_tokens: int = 0
    consumed: set[int] = field(default_factory=set)  # data indices trained on: a resumed generator skips them
    history: dict[str, list[float]] = field(default_factory=dict)  # prompt id -> pass rate of each of its groups
    retired: set[str] = field(default_factory=set)  # prompt ids retired for good (No-Positive-Resampling)
    bad_steps_total: int = 0  # steps skipped for a non-finite loss or gradient

    def count_tokens(self, gen_tokens: int, batch: list, n_params: int) -> int:
        """Add a step's generated and trained tokens and their FLOPs (2N per generated, 6N per trained token);
        returns the trained tokens."""
        trained = sum(len(grp.prompt_ids) + len(c.token_ids) for grp in batch for c in grp.completions)
        self.train_tokens += trained
        self.gen_tokens += gen_tokens
        self.flops += 2 * n_params * gen_tokens + 6 * n_params * trained
        return trained

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "consumed": sorted(self.consumed), "retired": sorted(self.retired)}


    @classmethod
    def from_json(cls, saved: dict[str, Any]) -> TrainerState:
        """Also reads older checkpoints: unknown keys (e.g. their always-zero reward_errors) are ignored."""
        state = cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls) if f.name in saved})
        state.consumed, state.retired = set(state.consumed), set(state.retired)
        return state


# Dense peak TFLOP/s of one GPU (no 2:4 sparsity: NVIDIA's data sheets quote bfloat16 tensor cores with it, twice
# these), from the data sheets: H100 SXM/PCIe/NVL and H200 SXM/NVL (nvidia.com/en-us/data-center/h100 and /h200),
# A100 (A100 data sheet, SXM and PCIe alike), L40S, L40, A10, L4 (their product pages' data sheets). float32 is
# the CUDA cores' plain FP32, not TF32: the learner leaves TF32 matmuls off (PyTorch's default). Matched in order
# against torch.cuda.get_device_name(), case aside: the first substring found wins, so a variant precedes its
# family ("H100 PCIe" before "H100", "A100" before "A10", "L40S" and "L40" before "L4"). GH200 is an H200 here.
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (  # (name substring, bfloat16, float32)
    ("H100 PCIe", 756.0, 51.0),
    ("H100 NVL", 835.0, 60.0),
    ("H100", 989.4, 66.9),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H200 NVL", 835.0, 60.0),
    ("H200", 989.4, 66.9),
    ("A100", 312.0, 19.5),
    ("L40S", 362.05, 91.6),
    ("L40", 181.05, 90.5),
    ("A10", 125.0, 31.2),
    ("L4", 121.0, 30.3),
)


def known_peak_tflops(device_name: str, dtype: str) -> float | None:
    """PEAK_TFLOPS' dense peak of the GPU `device_name` in `dtype` (float32 or bfloat16); None if not listed."""
    for substring, bf16, fp32 in PEAK_TFLOPS:
        if substring.lower() in device_name.lower():
            return bf16 if dtype == "bfloat16" else fp32
    return None


def peak_flops_per_s(dtype: str | None, given_tflops: float | None = None) -> float | None:
    """One learner rank's peak FLOP/s: --peak-tflops if given, else the table's for this rank's GPU in `dtype`
    (bfloat16's under --fp32-lm-head too: the head is a small share of the step); None on a CPU or an unlisted GPU.
    The learner's GPU is the current CUDA device (init_distributed sets it)."""
    if given_tflops is not None:
        return given_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    tflops = known_peak_tflops(torch.cuda.get_device_name(), dtype or "bfloat16")
    return None if tflops is None else tflops * 1e12


def model_flops_utilisation(n_params: int, trained_tokens: int, step_s: float, ranks: int,
                            peak_flops: float | None) -> float | None:
    """MFU of a learner step: its model FLOPs, 6 x parameters x trained tokens (as TrainerState.count_tokens counts
    them: no attention FLOPs), over what `ranks` devices of `peak_flops` FLOP/s each could do in `step_s`. None
    without a known peak."""
    if peak_flops is None or step_s <= 0:
        return None
    return 6 * n_params * trained_tokens / (step_s * ranks * peak_flops)


@dataclass
class Learner:
    """This rank's share of the policy and what trains it."""

    model: Any  # the policy, FSDP2-sharded (build_learner)
    optimizer: torch.optim.Optimizer  # AdamW
    scheduler: Any  # linear warm-up over --warmup-steps, then constant
    loss_module: Any  # the loss file: grpo, dapo, drgrpo, gspo or cispo
    hp: dict[str, Any]  # its compute_loss keywords: flags over the file's paper defaults (loss_hyperparameters)
    adv_kwargs: dict[str, Any]  # its compute_advantages keywords (--adv-norm)
    pad_id: int
    n_params: int
    ref_model: Any = None  # --kl-coef: the frozen initial policy, sharded like the policy


@dataclass
class Run:
    """What the loop talks to besides the learner. Rank 0 alone holds the generator, the metrics log and the
    progress display (None or empty on the other ranks)."""

    rank: int
    world: int
    out: Path  # --output-dir
    stopper: GracefulStop  # Ctrl-C / SIGTERM: stop at the next step boundary, with a checkpoint
    devices_in_use: int  # learner ranks + the generator's devices: compute_hours = wall-clock hours x this
    started: float  # time.time() the run would have started at, had it never stopped (elapsed_hours earlier)
    val_problems: list
    test_problems: list
    generator: Any = None  # pipeline_rl.Generator
    metrics: MetricsLog | None = None  # metrics.jsonl
    bar: Any = None  # tqdm progress bar (disabled off rank 0)
    recent: deque = field(default_factory=deque)  # the last --log-every rows, for the summary line
    eval_rows: list[dict] = field(default_factory=list)  # the evaluation rows so far, for the running sigmoid fit
    data_skipped: dict[str, Any] = field(default_factory=dict)  # a fresh run's first row: bad data rows skipped
    lock: Any = None  # the open OUTPUT_DIR/.lock (rank 0), held as long as this object lives
    generator_error: str | None = None  # rank 0: why the generator failed (GeneratorError), once it has

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def hours(self) -> float:
        return (time.time() - self.started) / 3600.0


# ----------------------------------------------------------------------------------------------------------------
# The steps, in the order the loop takes them. First the data side (rank 0, on the generator's groups)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Round:
    """The groups of one generation round, split into the batches of the optimizer steps that train on them, and
    the generator's statistics of the round (logged with each of its steps)."""

    batches: list[list[pipeline_rl.Group]]
    stats: dict[str, Any]
    generator_error: str | None = None  # the generator died: every rank checkpoints and stops instead


def pull_round(args: Args, generator: Any, state: TrainerState) -> Round:
    """Rank 0: pull groups for one round (--prompts-per-step per optimizer step; k steps' worth in sync mode) and
    take them through the data-side steps of the recipe."""
    steps = args.max_off_policy if args.mode == "sync" else 1
    want = args.prompts_per_step * steps
    stats: dict[str, Any] = {"overlong_filtered": 0} if args.overlong_filter else {}
    kept: list = []
    pulled = zero_variance = 0
    while len(kept) < want:
        groups = pull_groups(generator, want - len(kept), state.step, stats)
        pulled += len(groups)
        retire_solved_prompts(groups, state, args.retire_pass_rate, generator)
        has_signal = filter_zero_variance(groups, args.group_size)
        zero_variance += has_signal.count(False)
        kept += [grp for grp, keep in zip(groups, has_signal) if keep or args.zero_variance == "keep"]
        # DAPO dynamic sampling (resample) pulls until the batch is full; it gives up rather than spin forever on a
        # saturated task.
        if args.zero_variance != "resample" or pulled >= 8 * want:
            break
    if args.length_control == "overlong":
        apply_overlong_penalty(kept, args.max_tokens, args.overlong_cache)
    if args.overlong_filter:
        stats["overlong_filtered"] += apply_overlong_filter(kept)
    stats["frac_zero_variance"] = zero_variance / max(pulled, 1)
    stats["groups_pulled"] = pulled
    stats["reward_errors"] = sum(c.reward_error is not None for grp in kept for c in grp.completions)
    per_step = math.ceil(len(kept) / steps) if kept else 0
    batches = [kept[i * per_step: (i + 1) * per_step] for i in range(steps)] if per_step else [[] for _ in range(steps)]
    return Round(batches, stats)


def pull_groups(generator: Any, n: int, version: int, stats: dict[str, Any]) -> list:
    """Up to `n` finished groups from the generator for the learner at weights `version` (pipeline_rl.py bounds
    their staleness). Its statistics go into `stats`: per-call amounts add up; run totals, histograms and rates
    are the last call's."""
    groups, extra = generator.get_batch(n, version)
    for key, value in extra.items():
        if key in ("gen_tokens", "wait_s"):
            stats[key] = stats.get(key, 0) + value
        elif key.endswith("_by_replica"):  # {replica: amount}
            stats[key] = dict(collections.Counter(stats.get(key, {})) + collections.Counter(value))
        elif key == "replica_deaths":  # a line for each replica that died
            stats[key] = stats.get(key, []) + value
        else:
            stats[key] = value
    return groups


def retire_solved_prompts(groups: list, state: TrainerState, threshold: float, generator: Any) -> None:
    """No-Positive-Resampling (ScaleRL): keep each prompt's pass-rate history (the fraction of correct completions
    of each of its groups) and retire the prompt for good once the history's mean reaches `threshold`; the
    generator never samples it again. 0 disables retiring (the history is still kept)."""
    for grp in groups:
        past = state.history.setdefault(grp.problem.id, [])
        past.append(sum(c.reward > 0 for c in grp.completions) / len(grp.completions))
        if threshold > 0 and sum(past) / len(past) >= threshold:
            state.retired.add(grp.problem.id)
            generator.retire([grp.problem.id])


def filter_zero_variance(groups: list, group_size: int) -> list[bool]:
    """Zero-variance filtering (ScaleRL) is DAPO's dynamic-sampling filter, dapo.filter_groups: True for a group
    whose rewards are not all equal. The others have zero advantage, hence no gradient; --zero-variance drop
    leaves them out of the batch, resample pulls more groups in their place, keep trains on them anyway.
    It looks at the correctness rewards, before any overlong penalty, as filter_groups asks (the paper filters
    on accuracy)."""
    rewards = torch.tensor([r for grp in groups for r in grp.rewards], dtype=torch.float64)
    return dapo.filter_groups(rewards, group_size).tolist()


def apply_overlong_penalty(groups: list, max_tokens: int, cache_len: int) -> None:
    """--length-control overlong: DAPO's soft overlong punishment (dapo.overlong_penalty, a ramp from 0 to -1 over
    the last `cache_len` tokens of the budget) added to each completion's reward, in place. It comes after the
    zero-variance filter, so it shapes the advantages inside a group but never decides which groups train."""
    for grp in groups:
        lengths = torch.tensor([sum(c.loss_mask) for c in grp.completions])
        penalty = dapo.overlong_penalty(lengths, max_len=max_tokens, cache_len=cache_len)
        for c, p in zip(grp.completions, penalty.tolist()):
            c.reward = c.reward + p


def apply_overlong_filter(groups: list) -> int:
    """--overlong-filter: DAPO's overlong filtering. A completion cut off by --max-tokens teaches nothing about its
    answer: it is masked from the loss (its reward still counts in its group's advantages). After the penalty,
    which measures lengths on the unmasked completions. Returns the number of completions masked."""
    masked = 0
    for grp in groups:
        for c in grp.completions:
            if c.truncated:
                c.loss_mask = [False] * len(c.loss_mask)
                masked += 1
    return masked


# ----------------------------------------------------------------------------------------------------------------
# The learner side: every rank, on its share of the batch
# ----------------------------------------------------------------------------------------------------------------


def attach_learner_logprobs(model: Any, groups: list, args: Args, pad_id: int) -> None:
    """Old logprobs from the learner: set `completion.old_logprobs` to the learner's logprobs of its tokens, with
    the current weights (call under torch.no_grad)."""
    batches = micro_batches(groups, args.micro_batch_tokens, args.packing)
    idle = idle_forwards_needed(len(batches))
    for idx in batches:
        chosen, _ = micro_batch_groups(groups, idx)
        rows = to_rows(chosen, None, args.group_size, pad_id, model_device(model), row_packing(args, model))
        logprobs = token_logprobs(model, rows, args.temperature)
        completions = [(len(grp.prompt_ids), c) for grp in chosen for c in grp.completions]
        for row, (p, c) in enumerate(completions):
            c.old_logprobs = logprobs[row, p - 1: p - 1 + len(c.token_ids)].tolist()
    for _ in range(idle):
        idle_forward(model, pad_id, backward=False)


def compute_advantages(args: Args, learner: Learner, batch: list, run: Run) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss file's advantages over the whole batch (every rank computes the same: batch-level normalisation
    needs every group), then this rank's rows of them. Returns (the batch's rewards, this rank's advantages)."""
    g = args.group_size
    rewards = torch.tensor([r for grp in batch for r in grp.rewards], dtype=torch.float32)
    advantages = learner.loss_module.compute_advantages(rewards, g, **learner.adv_kwargs) if batch else torch.zeros(0)
    mine = this_ranks_share(list(range(len(batch))), run)
    return rewards, (torch.cat([advantages[i * g: (i + 1) * g] for i in mine]) if mine else torch.zeros(0))


def loss_and_backward(model: Any, loss_module: Any, hp: dict, groups: list, advantages: Any, args: Args,
                      pad_id: int, world: int, version: int, ref_model: Any = None,
                      old_is_current: bool = False) -> dict[str, float]:
    """Loss and backward over this rank's groups, in micro-batches of completions within --micro-batch-tokens
    (micro_batches; a group may span several), packed (--packing) or padded: the loss file sees one row per
    completion either way (Rows); returns this rank's metric totals (reduce_metrics averages them over ranks).

    The micro-batch losses and gradients add up to the whole batch's, for any micro-batch size and world size:
    whatever normalises the loss is computed from the whole batch before it is split. Every micro-batch loss is
    divided by the WHOLE batch's denominator (prompts, completions or tokens, per the loss's aggregation), summed
    over ranks. A micro-batch that holds part of a group goes to the loss file as groups of one completion each,
    which makes every completion a unit of its own; for a loss whose unit is a prompt (DAPO's and CISPO's
    prompt-level aggregation: a prompt's token sum over its group's tokens), its tokens are weighted by their share
    of their prompt's tokens (prompt_token_shares), so that each completion adds what it adds in its whole group.

    `ref_model`: the frozen reference policy of --kl-coef, whose logprobs go to the loss as ref_logprobs.
    `old_is_current`: the behaviour policy is the learner as it is now (a round of one batch in sync mode or with
    --tis): its old logprobs are the micro-batch's own, detached, instead of the completions' old_logprobs."""
    g = args.group_size
    device, pack = model_device(model), row_packing(args, model)
    masks = loss_masks(groups)                                                            # [N, T]
    denominator = sum_over_ranks(loss_module.loss_denominator(masks, g, **hp) if groups else 0.0)
    shares = prompt_token_shares(loss_module, hp, masks, g)                               # [N] or None
    batches = micro_batches(groups, args.micro_batch_tokens, args.packing)
    idle = idle_forwards_needed(len(batches))
    totals: dict[str, float] = defaultdict(float)
    for idx in batches:
        chosen, whole = micro_batch_groups(groups, idx)
        rows = to_rows(chosen, advantages[idx], g, pad_id, device, pack)
        group_size, token_weights = (g, None) if whole else (1, None if shares is None else shares[idx].to(device))
        for key, value in micro_batch_loss(model, loss_module, hp, rows, args, denominator, world, version,
                                           ref_model, old_is_current, group_size, token_weights).items():
            totals[key] += value
    for _ in range(idle):
        idle_forward(model, pad_id, backward=True, ref_model=ref_model)
    return dict(totals)


def loss_masks(groups: list) -> Any:
    """The loss masks of the groups' completions, right-padded: [N, T] bool, N completions in order."""
    masks = [c.loss_mask for g in groups for c in g.completions]
    lengths = torch.tensor([len(m) for m in masks], dtype=torch.long)                      # [N]
    filled = torch.arange(int(lengths.max()) if masks else 0) < lengths[:, None]          # [N, T]
    out = torch.zeros_like(filled)
    out[filled] = torch.tensor([x for m in masks for x in m], dtype=torch.bool)  # row-major: the lists' order
    return out


def prompt_token_shares(loss_module: Any, hp: dict, masks: Any, group_size: int) -> Any:
    """For a loss whose aggregation unit is a prompt, each completion's share of its prompt's loss tokens, t_i /
    sum_{j in its group} t_j [N] (a micro-batch that splits a group weights each completion's tokens by it, see
    loss_and_backward); None for every other unit. The loss file says which unit it counts: its loss_denominator
    of two one-token completions in one group is 1 for prompts (2 for completions or tokens)."""
    if loss_module.loss_denominator(torch.ones(2, 1, dtype=torch.bool), 2, **hp) != 1.0:
        return None
    tokens = masks.sum(dim=1).float().reshape(-1, group_size)                             # [P, G]
    return (tokens / tokens.sum(dim=1, keepdim=True).clamp(min=1)).flatten()              # [N]


def micro_batch_loss(model: Any, loss_module: Any, hp: dict, rows: Rows, args: Args, denominator: float,
                     world: int, version: int, ref_model: Any, old_is_current: bool = False,
                     group_size: int | None = None, token_weights: Any = None) -> dict[str, float]:
    """One micro-batch: the policy's logprobs, the importance weights (--tis) and reference logprobs (--kl-coef)
    if asked for, the loss file's loss, backward. Returns its metric totals: sums, token-weighted.
    `group_size`: the rows' completions per group (default --group-size; 1 where the micro-batch splits a group),
    `token_weights` [N]: each completion's weight in the loss (loss_and_backward), multiplied into the importance
    weights."""
    logprobs = token_logprobs(model, rows, args.temperature)
    old = logprobs.detach() if old_is_current else rows.old_logprobs
    is_weights = None
    if args.tis:
        is_weights = tis.tis_weights(old, rows.sampler_logprobs, rows.loss_mask, cap=args.tis_cap, level=args.tis,
                                     mode=args.tis_mode, cap_min=args.tis_cap_min)
    loss_weights = is_weights
    if token_weights is not None:
        loss_weights = token_weights[:, None].expand_as(rows.loss_mask) * (1.0 if is_weights is None else is_weights)
    extra = {}
    if ref_model is not None:
        with torch.no_grad():
            extra["ref_logprobs"] = token_logprobs(ref_model, rows, args.temperature)
    loss, metrics = loss_module.compute_loss(logprobs, old, rows.advantages, rows.loss_mask,
                                             group_size or args.group_size, is_weights=loss_weights,
                                             denominator=denominator, **hp, **extra)
    # FSDP averages gradients over ranks; the loss is already normalised by the global denominator.
    (loss * world).backward()
    weight = metrics.get("num_tokens", 0.0)
    totals = {"loss": loss.item(), **{k: v * weight for k, v in metrics.items() if k != "num_tokens"},
              "num_tokens": weight}
    # Sampler/learner mismatch on completions sampled wholly by the weights being trained now (lag 0), in all and
    # per replica: a replica still serving old weights (an update that silently did nothing) shows here. A
    # completion that straddles an update is left out: its later tokens were sampled over a KV cache computed by
    # the older weights (PipelineRL's stale KV), which the learner does not reproduce, so it would show a mismatch
    # (up to 0.6 in log-probability on the tiny model) that no engine causes.
    whole = ((rows.versions == version) | (rows.versions < 0)).all(dim=1, keepdim=True)  # [N, 1]
    same_weights = rows.loss_mask & (rows.versions == version) & whole
    if same_weights.any():
        n_same = float(same_weights.sum())
        totals.update({k: v * n_same for k, v in tis.mismatch_metrics(logprobs.detach(), rows.sampler_logprobs,
                                                                     same_weights).items()})
        totals["mismatch_tokens"] = n_same
        for r in rows.replicas[same_weights.any(dim=1)].unique().tolist():
            mine = same_weights & (rows.replicas == r)[:, None]
            n_mine = float(mine.sum())
            m = tis.mismatch_metrics(logprobs.detach(), rows.sampler_logprobs, mine)
            totals.update({f"mismatch_r{r}_{key}": m[f"mismatch_{key}"] * n_mine for key in PER_REPLICA_MISMATCH})
            totals[f"mismatch_r{r}_tokens"] = n_mine
    if is_weights is not None:
        totals["is_weight_mean"] = float(is_weights[rows.loss_mask].sum())
        totals["is_weight_zero_frac"] = float((is_weights[rows.loss_mask] == 0).sum())  # masked (MIS)
    return totals


def optimizer_step(args: Args, learner: Learner, loss: float, has_groups: bool) -> tuple[float, bool]:
    """Clip the global gradient norm (--grad-clip) and step AdamW and the warm-up schedule. A non-finite loss or
    gradient skips the step (its gradients are dropped), and so does an empty batch. Returns (grad norm, finite)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(learner.model.parameters(), args.grad_clip)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    finite = math.isfinite(grad_norm) and math.isfinite(loss)
    if finite and has_groups:
        learner.optimizer.step()
    else:
        learner.optimizer.zero_grad(set_to_none=True)
    learner.scheduler.step()
    return grad_norm, finite


def push_weights(learner: Learner, run: Run, version: int) -> tuple[float, float]:
    """Push the new weights to every generator replica as `version` (in pipeline mode applied between two decoding
    steps, in flight). Gathering them is a collective; rank 0 sends them. Returns the seconds rank 0 spent in all
    and, of those, in the broadcast itself (pipeline_rl's WeightSender)."""
    weights = full_state_dict(learner.model)
    if not run.is_main or run.generator_error:
        return 0.0, 0.0
    with generator_errors_noted(run):
        seconds = run.generator.update_weights(weights, version)
        return seconds, run.generator.last_broadcast_s
    return 0.0, 0.0


@contextlib.contextmanager
def generator_errors_noted(run: Run) -> Iterator[None]:
    """Rank 0: a GeneratorError is noted in run.generator_error rather than raised, so that the next round tells
    every rank to checkpoint and stop together (an exception on rank 0 alone would leave the others waiting)."""
    try:
        yield
    except pipeline_rl.GeneratorError as e:
        run.generator_error = str(e)
        print(f"[generator] {e}", file=sys.stderr, flush=True)


def pull_round_or_error(args: Args, run: Run, state: TrainerState) -> Round:
    """Rank 0: `pull_round`, or a Round that carries the generator's failure to every rank."""
    if not run.generator_error:
        with generator_errors_noted(run):
            return pull_round(args, run.generator, state)
    return Round([], {}, generator_error=run.generator_error)


def evaluate(args: Args, run: Run, row: dict) -> None:
    """Rank 0: the mean@k pass rate on the held-out validation prompts (and on --test-dataset), added to `row`
    with k (--eval-samples; --final-eval-samples at the last step, when given) and the asymptote of the sigmoid
    fitted to the evaluations so far."""
    t0 = time.time()
    k = args.final_eval_samples if args.final_eval_samples and row["step"] == args.max_steps else args.eval_samples
    val = pass_rates(run.generator, run.val_problems, k, args.temperature)
    row.update(val_pass_rate=val["pass_rate"], val_reward=val["reward"], val_samples=k, eval_s=time.time() - t0)
    if run.test_problems:
        test = pass_rates(run.generator, run.test_problems, k, args.temperature)
        row.update(test_pass_rate=test["pass_rate"], test_reward=test["reward"])
    run.eval_rows.append(row)
    asymptote = current_asymptote(run.eval_rows)
    if asymptote is not None:
        row["fit_asymptote"] = asymptote


def log_row(args: Args, run: Run, row: dict) -> None:
    """Rank 0: append the step's row to metrics.jsonl, move the progress bar, print a summary line every
    --log-every steps and at every evaluation."""
    run.metrics.write(row)
    run.recent.append(row)
    run.bar.update(1)
    run.bar.set_postfix(reward=f"{row['reward']:+.2f}", val=f"{run.eval_rows[-1]['val_pass_rate']:.2f}")
    if row["step"] % args.log_every == 0 or "val_pass_rate" in row:
        tqdm.write(summary_line(row, run.recent))


def checkpoint(learner: Learner, run: Run, state: TrainerState) -> None:
    """Save the model, the optimizer, every rank's RNG and the trainer state (checkpoint files: plumbing, below).
    Rank 0's state is the one written: it alone keeps the metrics log and the prompts' pass-rate history."""
    state.elapsed_hours = run.hours()
    state.metrics_lines = run.metrics.lines if run.is_main else 0
    save_checkpoint(run.out, learner.model, learner.optimizer, state.to_json(), run.rank)


def stop_if_signalled(learner: Learner, run: Run, state: TrainerState) -> None:
    """Ctrl-C or SIGTERM to any rank: stop here, at a step boundary, with a checkpoint (a --resume redoes nothing)."""
    if run.stopper.agreed():
        checkpoint(learner, run, state)
        raise SystemExit(f"stopped by {run.stopper.signal or 'a signal to another rank'} after step {state.step}; "
                         f"checkpoint saved in {run.out / 'checkpoint'}: continue with --resume {run.out}")


# ----------------------------------------------------------------------------------------------------------------
# What the steps use: packed (or padded) rows of micro-batches, logprobs, evaluation, the sigmoid fit
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
    # host, and a per-row loop cost as much as the bare forward + backward of a small model (bench.py train).
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
    this cost ranked the measured row lengths in their measured order (README, "Benchmark: the learner step").
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


def token_logprobs(model: Any, rows: Rows, temperature: float) -> Any:
    """log pi(token) for every next-token position [N, L-1], after dividing the logits by the sampling temperature.
    Packed rows go through the model as they are, and their logprobs are gathered back into Rows' layout (0 beyond
    each sequence's end, where the loss files mask anyway).

    A learner's LM head (build_learner: install_target_logprob_head) returns only these, chunk by chunk, so the
    micro-batch's [N, L-1, V] float32 logits never exist at once (for a 150k-token vocabulary and long completions
    they would be tens of GB), and only at the positions that predict a completion token (Rows.scored; 0 at the
    prompt's); any other model goes through its full logits."""
    if rows.packed is None:
        input_ids, layout = rows.input_ids, {"attention_mask": rows.attention.long()}          # [N, L]
        scored = rows.scored
    else:  # no attention mask: transformers then reads the sequences' boundaries from the position ids
        input_ids, layout = rows.packed.input_ids, {"position_ids": rows.packed.position_ids}  # [R, W]
        scored = rows.packed.scored
    head = model.get_output_embeddings()
    targets = input_ids[:, 1:]
    if getattr(head, "scalerl_request", False) is None:  # an installed head, idle
        head.scalerl_request = (targets, temperature, scored)
        try:
            logprobs = model(input_ids=input_ids, use_cache=False, **layout).logits
        finally:
            head.scalerl_request = None
    else:
        logits = model(input_ids=input_ids, use_cache=False, **layout).logits[:, :-1]
        logprobs = _target_logprobs(logits, targets, temperature)
    if rows.packed is None:
        return logprobs                                                                       # [N, L-1]
    return torch.where(rows.attention[:, 1:], logprobs.reshape(-1)[rows.packed.index], 0.0)   # [R, W-1] -> [N, L-1]


def _target_logprobs(logits: Any, targets: Any, temperature: float) -> Any:
    """log_softmax(logits / T) at the targets: logits [..., V], targets [...] -> [...] float32."""
    logits = logits.float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


LOGITS_CHUNK_BYTES = 1 << 28  # default of --logits-chunk-tokens: 256 MiB of float32 logits held at once
SPLIT_CHUNK_BYTES = 1 << 30  # its default under split-bf16, whose chunks are not recomputed: a GEMM of more rows
                             # runs nearer the tensor cores' peak, and each chunk reads the whole weight again


def lm_head_gemm(args: Args, device: Any) -> str:
    """--lm-head-gemm as the learner runs it: auto is split-bf16 where an FP32 head takes bf16 hidden states on a
    GPU, fp32 elsewhere (a CPU learner, a float32 model: the tests and the tiny default run)."""
    if args.lm_head_gemm != "auto":
        return args.lm_head_gemm
    on_gpu = torch.device(device).type == "cuda"
    return "split-bf16" if on_gpu and args.dtype == "bfloat16" and args.fp32_lm_head else "fp32"


def install_target_logprob_head(model: Any, chunk_tokens: int | None = None, gemm: str = "fp32") -> None:
    """Make the model's LM head compute token_logprobs' answer itself. While token_logprobs has set
    `head.scalerl_request = (targets [N, L-1], temperature, scored)`, the head's forward takes the hidden states
    [N, L, H] and returns log pi(target) [N, L-1] instead of logits, over chunks of `chunk_tokens` positions, so
    that only one chunk's logits exist at a time. `gemm` (--lm-head-gemm) says how: fp32, the head's own
    linear layer, each chunk recomputed in backward (activation checkpointing; default chunk: as many positions as
    fit in LOGITS_CHUNK_BYTES of float32 logits); split-bf16, for bf16 hidden states, float32's logprobs from bf16
    tensor-core products (_SplitBf16Head; default chunk: SPLIT_CHUNK_BYTES). Otherwise (an idle forward, or any
    other caller) it is the plain linear layer. The head's own forward hooks (FSDP2's gathers, the FP32 head's
    cast) run as before: only its forward body changes. Not for models that transform the logits after the head
    (Gemma's soft-capping): those keep the full logits.

    The request's third element, `scored` [M] (or None: all), names the positions of the flattened [N * (L-1)] to
    score; the others get 0 and cost nothing. Only completion tokens enter a loss, and a chat template's prompt can
    be most of a short completion's row: SmolLM2's system prompt and question (44 tokens) are about 60% of the
    small-arithmetic task's tokens, and its head (49k-token vocabulary, 576 hidden) a fifth of its FLOPs per token."""
    if getattr(model.config, "final_logit_softcapping", None):
        return
    head = model.get_output_embeddings()
    head.scalerl_request = None

    def forward(hidden: Any) -> Any:
        request = head.scalerl_request
        # split-bf16 takes bf16 hidden states as they are (its products are exact on them); the rest is float32
        split = gemm == "split-bf16" and hidden.dtype == torch.bfloat16
        hidden = hidden if split else hidden.to(head.weight.dtype)
        if request is None:
            return torch.nn.functional.linear(hidden, head.weight, head.bias)
        targets, temperature, scored = request
        n, length = targets.shape
        flat_hidden = hidden[:, :-1].reshape(n * length, -1)                 # [N*(L-1), H]: the last predicts nothing
        flat_targets = targets.reshape(-1)                                   # [N*(L-1)]
        if scored is not None:
            flat_hidden, flat_targets = flat_hidden[scored], flat_targets[scored]    # [M, H], [M]
        if split:
            chunk = chunk_tokens or max(128, SPLIT_CHUNK_BYTES // (4 * head.weight.shape[0]) // 128 * 128)
            logprobs = split_bf16_logprobs(flat_hidden, flat_targets, head.weight, head.bias, temperature, chunk)
        else:
            chunk = chunk_tokens or max(1, LOGITS_CHUNK_BYTES // (4 * head.weight.shape[0]))  # positions per chunk
            if flat_targets.numel() <= chunk:  # one chunk: nothing to save by recomputing it
                logprobs = _head_chunk(flat_hidden, flat_targets, head.weight, head.bias, temperature)
            else:
                logprobs = torch.cat([torch.utils.checkpoint.checkpoint(
                    _head_chunk, flat_hidden[i: i + chunk], flat_targets[i: i + chunk], head.weight, head.bias,
                    temperature, use_reentrant=False) for i in range(0, flat_targets.numel(), chunk)])
        if scored is not None:  # back to every position, 0 where nothing was scored
            logprobs = logprobs.new_zeros(n * length).index_copy(0, scored, logprobs)
        # [N, L-1], a tensor of its own rather than a view: FSDP2 hooks its backward onto the module's output
        return logprobs.view(n, length).clone()

    head.forward = forward


def _head_chunk(hidden: Any, targets: Any, weight: Any, bias: Any, temperature: float) -> Any:
    """One chunk of the LM head: hidden [n, H] -> log pi(targets) [n]."""
    return _target_logprobs(torch.nn.functional.linear(hidden, weight, bias), targets, temperature)


def split_bf16_logprobs(hidden: Any, targets: Any, weight: Any, bias: Any, temperature: float, chunk: int) -> Any:
    """log pi(targets) [M] of the head `weight` [V, H] (float32; `bias` [V] or None) on bf16 hidden states [M, H],
    at float32's accuracy from bf16 products (_SplitBf16Head), `chunk` rows of logits at a time; differentiable
    where autograd needs it, and without keeping anything for backward where it does not (old logprobs, the frozen
    reference)."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _SplitBf16Head.apply(hidden, targets, weight, bias, temperature, chunk)
    return _split_bf16_forward(hidden, targets, weight, bias, temperature, chunk, None)


class _SplitBf16Head(torch.autograd.Function):
    """The FP32 LM head's log pi(target) on bf16 tensor cores, at float32's accuracy (--lm-head-gemm split-bf16).

    Forward. The hidden states are bf16 values (a bf16 trunk computed them), so only the float32 weight needs more
    bits than a bf16 product takes: W / T = hi + mid + lo, three bf16 parts, each the top 8 significant bits of
    what the parts before it left, hold all 24 bits of a float32 exactly. A bf16 x bf16 product is exact in
    float32 and the tensor cores sum in float32, so [h | h | h] @ [lo | mid | hi]^T, one bf16 GEMM of inner size
    3H, gives the logits / T to float32's accuracy (tests/test_train.py: within 1e-5 of a float32 head, and nearer
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
    def forward(ctx: Any, hidden: Any, targets: Any, weight: Any, bias: Any, temperature: float, chunk: int) -> Any:
        grad = hidden.new_empty(hidden.shape[0], weight.shape[0])            # [M, V] bf16: D, filled chunk by chunk
        logprobs = _split_bf16_forward(hidden, targets, weight, bias, temperature, chunk, grad)
        ctx.save_for_backward(hidden, weight, grad)
        ctx.temperature = temperature
        return logprobs

    @staticmethod
    def backward(ctx: Any, grad_logprobs: Any) -> tuple:
        hidden, weight, grad = ctx.saved_tensors                             # [M, H] bf16, [V, H] fp32, [M, V] bf16
        scale = -grad_logprobs.float() / ctx.temperature                     # [M]: dloss/d(logits / T) = -g D / T
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_hidden = (_mm_float32(grad, weight.to(torch.bfloat16)) * scale[:, None]).to(hidden.dtype)  # [M, H]
        if ctx.needs_input_grad[2]:
            grad_weight = _mm_float32(grad.t(), (hidden * scale[:, None]).to(torch.bfloat16))  # [V, H]
        if ctx.needs_input_grad[3]:
            grad_bias = _mm_float32(grad.t(), scale[:, None].to(torch.bfloat16)).squeeze(1)    # [V]
        return grad_hidden, None, grad_weight, grad_bias, None, None


def _split_bf16_forward(hidden: Any, targets: Any, weight: Any, bias: Any, temperature: float, chunk: int,
                        grad: Any) -> Any:
    """_SplitBf16Head's forward: log pi(targets) [M]; where `grad` [M, V] (bf16) is given, D written into it."""
    parts = _split_bf16(weight, temperature)                                 # [V, 3H]: lo | mid | hi of W / T
    logprobs = torch.empty(targets.shape[0], device=hidden.device)          # [M]
    for i in range(0, targets.shape[0], chunk):
        logits = _mm_float32(hidden[i: i + chunk].repeat(1, 3), parts.t())   # [n, V]: the logits / T
        if bias is not None:
            logits += bias / temperature
        logprobs[i: i + chunk] = _logprobs_and_grad(logits, targets[i: i + chunk],
                                                    None if grad is None else grad[i: i + chunk])
    return logprobs


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
def _logprobs_and_grad(logits: Any, targets: Any, grad: Any) -> Any:
    """log pi(targets) [n] from float32 logits [n, V], already divided by the temperature; where `grad` [n, V]
    (bf16) is given, writes into it softmax - onehot(targets), the gradient of -log pi(targets) wrt the logits."""
    lse = torch.logsumexp(logits, dim=1)                                     # [n]
    logprobs = logits.gather(1, targets[:, None]).squeeze(1) - lse           # [n]
    if grad is not None:
        grad.copy_(torch.exp(logits - lse[:, None]))                         # softmax, rounded to bf16
        # the target's p - 1 as expm1(log p): a confident token's 1 - p keeps its digits
        grad.scatter_(1, targets[:, None], torch.expm1(logprobs)[:, None].to(grad.dtype))
    return logprobs


def pass_rates(generator: Any, problems: list, samples: int, temperature: float) -> dict[str, float]:
    """mean@k pass rate (the fraction of correct completions, per prompt, averaged) and mean reward."""
    groups = generator.evaluate(problems, samples, temperature)
    rewards = [r for g in groups for r in g.rewards]
    per_prompt = [sum(r > 0 for r in g.rewards) / len(g.rewards) for g in groups]
    return {"pass_rate": sum(per_prompt) / len(per_prompt), "reward": sum(rewards) / len(rewards)}


def current_asymptote(rows: list[dict]) -> float | None:
    """The sigmoid fit's predicted asymptote A over the evaluation rows so far (None until it can be fitted)."""
    points = [(r["compute_hours"], r["val_pass_rate"]) for r in rows]
    if len(points) < 5:
        return None
    try:
        return scaling_fit.fit_sigmoid(*zip(*points)).A
    except ValueError:
        return None


def new_row(run: Run, state: TrainerState) -> dict[str, Any]:
    """The start of a metrics.jsonl row: where the run stands in steps and compute."""
    return {"step": state.step, "compute_hours": run.hours() * run.devices_in_use, "flops": state.flops,
            "tokens": state.gen_tokens}


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


def fit_and_plot(metrics_file: Path, out_png: Path, label: str) -> Any:
    """The end of a run: ScaleRL's sigmoid fitted to the evaluation rows, drawn with them into `out_png`."""
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


# ----------------------------------------------------------------------------------------------------------------
# The learner a rank trains: its loss file, its seeds, the policy as FSDP2 with ScaleRL's FP32 LM head, AdamW and
# its warm-up (set_up calls make_learner once the data and the model directory are known)
# ----------------------------------------------------------------------------------------------------------------


def make_learner(args: Args, model_path: str, device: Any, rank: int) -> Learner:
    """The loss file --loss names, with its hyper-parameters (flags over the file's paper defaults); the seeds (data
    order and sampling per rank, initialisation shared); the policy (build_learner) and, with --kl-coef, the frozen
    reference; AdamW and its linear warm-up over --warmup-steps."""
    loss_module = LOSSES[args.loss]
    hp = loss_hyperparameters(args, loss_module)
    adv_kwargs = {"normalization": args.adv_norm} if args.adv_norm else {}
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)
    model, n_params = build_learner(model_path, args, device)
    ref_model = build_reference(model_path, args, device) if args.kl_coef else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=args.adam_eps, weight_decay=args.weight_decay)
    warmup = max(args.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)))
    return Learner(model=model, optimizer=optimizer, scheduler=scheduler, loss_module=loss_module, hp=hp,
                   adv_kwargs=adv_kwargs, pad_id=pad_token_id(model_path), n_params=n_params, ref_model=ref_model)


def build_learner(model_path: str, args: Args, device: Any) -> tuple[Any, Any]:
    """The policy as FSDP2: fully_shard on every decoder layer, then the root. Returns (model, param count).

    No rank but rank 0 ever holds a full copy of the weights (FSDP2's documented way to load a large model): every
    rank builds the model on the meta device and shards it, then allocates its shards on `device`; rank 0 reads the
    checkpoint and broadcasts it, each rank keeping its shard. Buffers that are not in the checkpoint (the rotary
    frequencies) come from rank 0's copy too."""
    # transformers is imported here, not at the top: it takes longer to import than torch, and `--help`, the
    # flag checks and the tests that never build a model should not wait for it.
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch.float32,
                                                 attn_implementation=attention_implementation(args, device))
    n_params = sum(p.numel() for p in model.parameters())
    model.config.use_cache = False
    if args.activation_checkpointing:
        checkpoint_each_layer(model)
    low_precision = args.dtype == "bfloat16"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if low_precision else None
    # --cpu-offload: every unit's shards, gradients and so AdamW's state live on the host (pinned where a GPU can
    # copy from them), and FSDP2 copies a unit's shard to the GPU before gathering it.
    offload = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())} if args.cpu_offload else {}
    gemm = lm_head_gemm(args, device)
    if gemm == "split-bf16" and not (low_precision and args.fp32_lm_head):
        raise SystemExit("--lm-head-gemm split-bf16 needs --fp32-lm-head and --dtype bfloat16")
    if args.fp32_lm_head:
        # FP32 LM head (ScaleRL, MiniMax-M1): its own FSDP unit kept in float32, fed float32 hidden states (under
        # split-bf16, the bf16 ones as they are: its products take them exactly). A head tied to the input
        # embedding (SmolLM2 and other small models) is one parameter, which FSDP2 refuses in two units: the
        # embedding joins the head's unit (and is kept in float32 with it).
        cast = gemm == "fp32"
        if cast:
            model.lm_head.register_forward_pre_hook(lambda module, inputs: (inputs[0].float(),))
        tied = model.lm_head.weight is model.get_input_embeddings().weight
        head = [model.get_input_embeddings(), model.lm_head] if tied else model.lm_head
        fully_shard(head, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, cast_forward_inputs=cast),
                    **offload)
    for layer in model.model.layers:
        fully_shard(layer, **({"mp_policy": mp} if mp else {}), **offload)
    fully_shard(model, **({"mp_policy": mp} if mp else {}), **offload)
    model.to_empty(device="cpu" if args.cpu_offload else device)
    if args.cpu_offload:  # buffers (the rotary frequencies) are not FSDP2's to move: they go where it computes
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(device)
    loaded = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32) if dist.get_rank() == 0 else None
    set_model_state_dict(model, loaded.state_dict() if loaded is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    rank0_buffers = dict(loaded.named_buffers()) if loaded is not None else {}
    for name, buffer in model.named_buffers():
        if loaded is not None:
            buffer.copy_(rank0_buffers[name])
        dist.broadcast(buffer, src=0)
    del loaded, rank0_buffers
    install_target_logprob_head(model, args.logits_chunk_tokens, gemm)
    model.train()
    return model, n_params


def checkpoint_each_layer(model: Any) -> None:
    """--activation-checkpointing: each decoder layer's forward runs under torch's non-reentrant checkpoint, which
    keeps only its inputs and recomputes the layer in backward. Inside the module's call, so inside the hooks
    fully_shard adds (as torchtitan composes the two): the recompute takes the inputs FSDP2's mixed precision has
    already cast to bf16, and the parameters its pre-backward has gathered. (transformers' gradient checkpointing
    wraps the whole call instead; with transformers 5.17 on a GPU, its recompute got the float32 inputs of a tied
    FP32 embedding uncast, and attention failed on mixed dtypes.)"""
    for layer in model.model.layers:
        layer.forward = functools.partial(torch.utils.checkpoint.checkpoint, layer.forward, use_reentrant=False)


def attention_implementation(args: Args, device: Any) -> str:
    """The learner's attention: flash attention 2 where it can run (a GPU, bfloat16, flash-attn installed) under
    --packing, whose varlen kernels attend within each packed sequence at the sequences' own cost; else sdpa, which
    takes packed rows through a block-diagonal mask (pack_rows bounds its cost)."""
    if args.packing and torch.device(device).type == "cuda" and args.dtype == "bfloat16":
        from transformers.utils import is_flash_attn_2_available  # here, not at the top: see build_learner

        if is_flash_attn_2_available():
            return "flash_attention_2"
    return "sdpa"


def build_reference(model_path: str, args: Args, device: Any) -> Any:
    """--kl-coef's reference policy: the initial model, frozen, sharded like the policy."""
    return build_learner(model_path, args, device)[0].eval().requires_grad_(False)


def pad_token_id(model_path: str) -> int:
    from transformers import AutoTokenizer  # here, not at the top: see build_learner

    return AutoTokenizer.from_pretrained(model_path).pad_token_id or 0


def full_state_dict(model: Any) -> dict:
    """HF-named full weights gathered on rank 0 (empty elsewhere); a collective: every rank calls it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ----------------------------------------------------------------------------------------------------------------
# Export and evaluation: a run's policy as a Hugging Face model directory, and its pass@k (`train.py export`,
# `train.py evaluate`)
# ----------------------------------------------------------------------------------------------------------------


def export(run_dir: Path, out_dir: Path) -> dict[str, Any]:
    """The policy of a run's newest readable checkpoint as a Hugging Face model directory (config, weights,
    tokenizer, chat template) that transformers and vLLM load as they load the base model. Returns what it wrote."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # here, not at the top: see build_learner

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
    state, weights, _, ckpt = read_checkpoint(run_dir, None, "export")  # before the base model: it may be built
    base = saved.get("model") or str(tasks.build_base_model(progress=False))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.load_state_dict(weights["model"], strict=True)  # FSDP2's full state dict keeps the HF names
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(base).save_pretrained(out_dir)
    return {"model_dir": str(out_dir), "checkpoint": str(ckpt), "step": state["step"], "base_model": base}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 1.0


def evaluate_policy(args: Args, scratch: Path) -> dict[str, Any]:
    """`train.py evaluate [--model DIR | --resume RUN_DIR] [--dataset ...] --eval-samples N`: the policy's pass@k
    (k = 1, 2, 4 ... N) and mean reward on the data set's validation problems (--test-dataset's, if given), with the
    run's sampler settings, and three of its completions. Without --model or --resume: the embedded base model."""
    if args.resume:  # a run's checkpoint: export it, then evaluate it like any model directory
        model_dir = export(Path(args.resume), scratch / "policy")["model_dir"]
    else:
        model_dir = args.model or str(tasks.build_base_model(progress=False))
    resolve_defaults(args, embedded=args.model is None and not args.resume, on_gpu=args.gen_devices is not None)
    task, test_task = load_tasks(args)
    problems = (test_task or task).validation(args.eval_prompts)
    config = dataclasses.replace(generator_config(args, model_path=model_dir, step=0), mode="sync")
    with pipeline_rl.Generator(config, task) as generator:
        groups = generator.evaluate(problems, args.eval_samples, args.temperature)
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


# ================================================================================================================
# PLUMBING. A reader of the recipe may stop here: below are the command line, the setup (process groups, the
# output-directory lock, data and model directory, resume, the generator), the collectives that keep the ranks in
# step, checkpoint files, signal handling and the metrics file.
# ================================================================================================================


# ----------------------------------------------------------------------------------------------------------------
# The command line: Args -> argparse, --resume's saved flags, loss-file options
# ----------------------------------------------------------------------------------------------------------------


def flags_markdown() -> str:
    """Every flag of `Args` as a Markdown table per --help group: docs/flags.md, regenerated with
    `python train.py --help-markdown > docs/flags.md` (a test fails when the page and Args disagree)."""
    out = ["# train.py flags", "",
           "Generated from `train.py`'s `Args` by `python train.py --help-markdown > docs/flags.md`: the same text as",
           "`python train.py --help`, grouped the same way. Do not edit by hand."]
    group = None
    for f in dataclasses.fields(Args):
        if f.metadata["group"] != group:
            group = f.metadata["group"]
            out += ["", f"## {group}", "", "| flag | default | what it does |", "|---|---|---|"]
        flag = "--" + f.name.replace("_", "-")
        if f.metadata.get("action") is argparse.BooleanOptionalAction:
            flag += f" / --no-{f.name.replace('_', '-')}"
        default = "" if f.default is None else f"`{f.default}`"
        text = f.metadata["help"] + (f" (one of: {', '.join(f.metadata['choices'])})" if "choices" in f.metadata
                                     else "")
        out.append(f"| `{flag}` | {default} | {text.replace('|', '/')} |")
    return "\n".join(out) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="train.py", description="The ScaleRL recipe: vLLM generator + FSDP2 learner. Run under torchrun.",
        epilog="Other commands: `train.py plan --shape NAME | --model DIR [flags]` prints the learner's GPU memory "
        "per rank for a layout, no GPU needed, and what would make it fit (train.py plan --help); on a GPU, a run "
        "whose plan does not fit is refused before it starts. `train.py export RUN_DIR OUT_DIR`, `train.py evaluate "
        "[flags]`, `train.py migrate-checkpoint RUN_DIR`.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    groups: dict[str, Any] = {}  # title -> argparse argument group, in the order of Args
    for f in dataclasses.fields(Args):
        meta = dict(f.metadata)
        group = meta.pop("group")
        if group not in groups:
            groups[group] = parser.add_argument_group(group)
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"default": f.default, "help": meta.pop("help")}
        kwargs.update(meta)
        if f.type in ("bool",) and "action" not in kwargs:
            kwargs["action"] = "store_true"
        elif "action" not in kwargs:
            kwargs["type"] = {"int": int, "float": float}.get(f.type.split(" |")[0], str)
        groups[group].add_argument(flag, **kwargs)
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


def parse_args(argv: list[str] | None = None, evaluating: bool = False) -> Args:
    """The flags of a run, checked (check_args), and on a GPU its learner's memory plan (memory_problems); with
    --resume, its own (resumed_values). `evaluating`: for `train.py evaluate --resume`, which trains nothing, so that
    any flag may differ from the run's (another data set, more samples)."""
    parser = build_parser()
    values = vars(parser.parse_args(argv))
    if values["resume"]:
        values = resumed_values(parser, argv, values["resume"], evaluating)
    args = Args(**values)
    problems = check_args(args)
    if not problems and not evaluating:  # evaluating trains nothing: no learner to fit
        problems = memory_problems(args, torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                   int(os.environ.get("WORLD_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if problems:
        parser.error("; ".join(problems))
    return args


def plan(argv: list[str]) -> str:
    """`train.py plan`: the learner's memory plan per rank for a model (--shape, or --model's config) and a layout
    given as on the command line of a run, printed without a GPU and without checking the flags against this
    machine. Returns the plan's parts and, when it does not fit, the flags that would make it fit."""
    parser = argparse.ArgumentParser(
        prog="train.py plan", description="The learner's GPU memory per rank (memory_plan.py; docs/memory.md), for "
        "the model and layout of a run; any other flag is train.py's.", allow_abbrev=False)
    parser.add_argument("--shape", choices=sorted(memory_plan.SHAPES), help="a model shape written in memory_plan.py "
                        "(else --model's config)")
    parser.add_argument("--learner-ranks", type=int, default=1, help="learner ranks (GPUs) in all (default 1)")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one learner GPU (default 80)")
    parser.add_argument("--gpus", type=int, help="GPUs of the node, to tell whether vLLM shares the learner's GPUs "
                        "under --gen-devices (default: it does not)")
    options, rest = parser.parse_known_args(argv)
    args = Args(**vars(build_parser().parse_args(rest)))
    if options.shape:
        config = memory_plan.shape_config(options.shape)
        args.model = args.model or options.shape  # a real model: its context is --max-tokens + a prompt
    elif args.model:
        from transformers import AutoConfig  # here, not at the top: see build_learner

        config = AutoConfig.from_pretrained(args.model)
    else:
        raise SystemExit("train.py plan: give --shape NAME or --model DIR (a config.json is enough)")
    shares = False
    if args.gen_devices and options.gpus:
        learner_ids, gen_ids = pipeline_rl.split_devices(args.gen_devices, options.gpus)
        shares = bool(set(learner_ids) & set(gen_ids))
    memory = learner_memory_plan(args, config, options.learner_ranks, int(options.gpu_memory_gib * memory_plan.GIB),
                                 shares_gpu=shares)
    return "\n".join([memory.describe(), *memory.problems()])


def resumed_values(parser: argparse.ArgumentParser, argv: list[str] | None, run_dir: str,
                   evaluating: bool = False) -> dict[str, Any]:
    """The flags a resumed run continues with: those it was started with (its args.json), where the flags of
    CHANGEABLE_ON_RESUME given now win (e.g. --max-steps 400 to extend it). Any other flag defines the run: giving it
    another value is refused, naming each with the run's value and the new one, and so is a --max-steps below the
    run's step; a --max-steps equal to it has nothing to do. Its output directory is `run_dir`, whatever
    --output-dir says. `evaluating` (evaluate --resume) skips these checks: it trains nothing."""
    # Parse again into a namespace that already holds every field, so argparse leaves out the defaults; append
    # actions need a list-like start, hence None for them.
    blank = {f.name: None if f.metadata.get("action") == "append" else _Unset for f in dataclasses.fields(Args)}
    given = {k: v for k, v in vars(parser.parse_args(argv, namespace=argparse.Namespace(**blank))).items()
             if v is not _Unset and not (v is None and blank[k] is None)}
    saved: dict[str, Any] = {}
    if (Path(run_dir) / "args.json").exists():
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


def read_args_json(run_dir: Path) -> dict[str, Any]:
    """A run's args.json: its flags (and "resumes", the history of its resumes). ValueError, in one line, for a file
    that is not JSON, not an object, or holds a flag of the wrong type (a file edited by hand, or cut short)."""
    path = run_dir / "args.json"
    try:
        saved = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is unreadable ({type(e).__name__}: {str(e)[:120]}): restore it, or start the run "
                         "afresh with --overwrite") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("resumes", []), list):
        raise ValueError(f"{path} holds {type(saved).__name__} {str(saved)[:40]!r}, not a run's flags")
    for f in dataclasses.fields(Args):
        value = saved.get(f.name)
        if f.name not in saved or value is None and (f.default is None or "None" in f.type):
            continue
        types = _JSON_TYPES.get(f.type.split(" |")[0])
        if types and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            raise ValueError(f"{path}: {f.name} is {value!r}, not a {f.type}: restore the file, or start the run "
                             "afresh with --overwrite")
    return saved


def newest_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the newest complete checkpoint whose trainer_state.json reads (None if none does)."""
    for ckpt in complete_checkpoints(run_dir):
        try:
            step = json.loads((ckpt / "trainer_state.json").read_text()).get("step")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            continue
        if isinstance(step, int):
            return step
    return None


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


def int_range(text: str) -> tuple[int, int]:
    """'LOW,HIGH' -> (LOW, HIGH), as --think-budget (and bench.py's --completion-tokens) write a range."""
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


# ----------------------------------------------------------------------------------------------------------------
# Setup: from the flags to the learner, the generator and the trainer state the loop starts from
# ----------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def set_up(args: Args) -> Iterator[tuple[Learner, Run, TrainerState]]:
    """Everything before the first step, on every rank: process group, OUTPUT_DIR lock, data, model, optimizer,
    resume, generator, metrics log. On exit the generator is closed; a run that fails before its first metrics row
    leaves OUTPUT_DIR as it found it (with --overwrite, the old run is deleted only once all of that has started)."""
    tasks.set_vllm_cpu_env()  # vLLM's CPU settings (offline hub, no dynamo); nothing on a machine with CUDA
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun starts each rank in a session of its own, so a `kill -9` of torchrun would leave the ranks
        # training on, and a --resume would then race them for OUTPUT_DIR: die with the launcher instead.
        pipeline_rl.set_parent_death_signal(signal.SIGKILL)
    rank, world, device = init_distributed(args.gen_devices, args.cpu_offload)
    is_main = rank == 0
    stopper = GracefulStop(announce=is_main)
    out = Path(args.output_dir)
    fresh_dir = not out.exists()  # a start that fails removes what it made
    lock = claim_output_dir(out, is_main)
    generator = None
    log: MetricsLog | None = None
    old_run_kept = args.overwrite and not fresh_dir  # --overwrite deletes the old run last, once all checks pass
    try:  # until the first metrics row, a failure leaves the output directory as it was found
        # Data and model. Rank 0 builds the embedded model once (cached); the others wait at the barrier.
        try:
            task, test_task = load_tasks(args)
        except (tasks.BadRowError, FileNotFoundError) as e:  # every bad row is named: a message, not a traceback
            if is_main:
                print(f"train.py: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        for t in (task, test_task):
            if is_main and getattr(t, "skipped_summary", ""):
                print(f"[data] {t.name_or_path}: {t.skipped_summary}", file=sys.stderr)
        embedded = args.model is None
        if embedded and is_main:
            tasks.build_base_model()
        dist.barrier()
        model_path = str(tasks.build_base_model()) if embedded else args.model
        resolve_defaults(args, embedded, device.type == "cuda")
        learner = make_learner(args, model_path, device, rank)
        model, optimizer, scheduler = learner.model, learner.optimizer, learner.scheduler

        state = TrainerState()
        if args.resume:
            saved, ckpt = load_checkpoint(out, model, optimizer, rank)
            state = TrainerState.from_json(saved)
            if is_main:
                print(f"[resume] {ckpt}: step {state.step}", file=sys.stderr)
            for _ in range(state.step):
                scheduler.step()
        data_skipped = {}
        if not args.resume and is_main:
            data_skipped = {"data_skipped_rows": getattr(task, "skipped_rows", 0),
                            "data_skipped_reasons": getattr(task, "skipped_reasons", {})}

        # The generator (rank 0 owns it; its process is vLLM's).
        val_problems = task.validation(args.eval_prompts)
        test_problems = test_task.validation(None) if test_task else []
        # learner ranks + the replicas (on CPU a replica counts as a device); on GPU: the GPUs either of them uses
        gen_config = generator_config(args, model_path, state.step)
        devices_in_use = world + gen_config.replicas + gen_config.remote_replicas
        if args.gen_devices:
            learner_ids, gen_ids = pipeline_rl.split_devices(args.gen_devices, torch.cuda.device_count())
            devices_in_use = (len(set(gen_ids) | set(learner_ids[:world]))
                              + gen_config.remote_replicas * args.tensor_parallel_size)
        if is_main:
            consumed = state.consumed
            data_start = min(set(range(max(consumed, default=-1) + 2)) - consumed)
            if args.gen_remote_replicas:
                print(f"[generator] waiting up to {args.gen_join_timeout:.0f} s for {args.gen_remote_replicas} "
                      f"remote replica(s): on each generator node run `python pipeline_rl.py replica --connect "
                      f"{args.gen_listen} --secret-file FILE`", file=sys.stderr, flush=True)
            generator = pipeline_rl.Generator(gen_config, task,
                                              data_start=data_start,
                                              skip_indices={i for i in consumed if i >= data_start},
                                              retired_ids=state.retired)
            generator.start()
        if state.step > 0:  # the generator starts from the base weights: give it the resumed ones
            weights = full_state_dict(model)
            if is_main:
                generator.update_weights(weights, state.step)
        eval_rows: list[dict] = []
        if is_main:  # the run's files appear only once it has started
            if args.overwrite:  # data, model and generator have all started: only now is the old run deleted
                remove_previous_run(out)
                old_run_kept = False
            log = MetricsLog(out / "metrics.jsonl", state.metrics_lines if args.resume else 0,
                             covers_step=state.step if args.resume else None)
            write_args_json(out, args, state.step, log.missing_steps)
            if log.missing_steps:  # a metrics file cut short behind the run's back: say so, and keep it on record
                gaps = ", ".join(f"{a}..{b}" if a < b else str(a) for a, b in _ranges(log.missing_steps))
                print(f"[resume] {log.path} holds {log.lines} rows but the checkpoint covers {state.metrics_lines}: "
                      f"no rows for steps {gaps} (recorded in args.json's resumes)", file=sys.stderr)
            if log.lines:
                eval_rows = [r for r in scaling_fit.read_metrics(log.path) if "val_pass_rate" in r]
        bar = tqdm(total=args.max_steps, initial=state.step, desc=f"{args.loss}/{args.mode}", disable=not is_main,
                   dynamic_ncols=True)
        run = Run(rank=rank, world=world, out=out, stopper=stopper, devices_in_use=devices_in_use,
                  started=time.time() - state.elapsed_hours * 3600.0, val_problems=val_problems,
                  test_problems=test_problems, generator=generator, metrics=log, bar=bar,
                  recent=deque(maxlen=args.log_every), eval_rows=eval_rows, data_skipped=data_skipped, lock=lock)
        yield learner, run, state
    except BaseException:
        if is_main and not args.resume and not old_run_kept and (log is None or log.lines == 0):
            _remove_failed_start(out, fresh_dir)  # the corrected command must not find a "run" here
        raise
    finally:
        if generator is not None:
            generator.close()


def init_distributed(gen_devices: str | None = None, cpu_offload: bool = False) -> tuple[int, int, Any]:
    """(rank, world size, this rank's device). On GPU the learner keeps off the generator's `gen_devices`;
    `cpu_offload` (--cpu-offload) adds gloo for the collectives over the parameters and gradients FSDP2 keeps on
    the host (the gradient norm's)."""
    if "RANK" not in os.environ:  # plain `python train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        learner_ids, _ = pipeline_rl.split_devices(gen_devices, torch.cuda.device_count())
        device = torch.device("cuda", learner_ids[int(os.environ["LOCAL_RANK"]) % len(learner_ids)])
        torch.cuda.set_device(device)
        dist.init_process_group("cuda:nccl,cpu:gloo" if cpu_offload else "nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        # Two cores are shared by the learner ranks and the generator: oversubscribing threads only slows all down.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (world + 1)))
    return rank, world, device


def claim_output_dir(out: Path, is_main: bool) -> Any:
    """One run per OUTPUT_DIR at a time: rank 0 takes the lock, and every rank stops if it is taken. The lock
    dies with its process, so a killed run never blocks its own --resume. Returns the open lock file (rank 0)."""
    lock, error = None, [None]
    if is_main:
        try:
            lock = lock_output_dir(out)
        except OutputDirBusyError as e:
            error = [str(e)]
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        dist.destroy_process_group()
        raise SystemExit(error[0])
    return lock


def remove_previous_run(out: Path) -> None:
    """--overwrite, once the new run has passed every check and started: the old run's checkpoints, metrics and
    plot go (its args.json is rewritten next)."""
    for name in ("checkpoint", "checkpoint.old", "checkpoint.tmp"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("metrics.jsonl", "scaling.png"):
        (out / name).unlink(missing_ok=True)


def _remove_failed_start(out: Path, fresh_dir: bool) -> None:
    """Leave the output directory as a failed start found it."""
    for name in ("metrics.jsonl", "args.json", ".lock"):
        (out / name).unlink(missing_ok=True)
    if fresh_dir:
        try:
            out.rmdir()
        except OSError:  # something else is in it now: keep it
            pass


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


def generator_config(args: Args, model_path: str, step: int) -> pipeline_rl.GeneratorConfig:
    """The vLLM generator's settings for this run; it restarts from `step` after a resume."""
    return pipeline_rl.GeneratorConfig(
        model=model_path, group_size=args.group_size, temperature=args.temperature,
        interruptions=args.length_control == "interruptions", think_budget=int_range(args.think_budget),
        answer_budget=args.answer_budget, max_tokens=args.max_tokens, max_model_len=model_context(args),
        max_off_policy=args.max_off_policy, buffer_steps=args.buffer_steps, mode=args.mode,
        seed=args.seed + step, data_seed=args.seed, dtype=args.dtype, fp32_lm_head=args.fp32_lm_head,
        debug_slowdown=gen_slowdowns(args),
        groups_per_batch=args.prompts_per_step * (args.max_off_policy if args.mode == "sync" else 1),
        gen_devices=args.gen_devices, tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=generator_memory_fraction(args, generator_shares_a_gpu(args)),
        replicas=local_replicas(args, torch.cuda.device_count() if torch.cuda.is_available() else 0),
        remote_replicas=args.gen_remote_replicas, listen=args.gen_listen, join_timeout=args.gen_join_timeout,
        secret=pipeline_rl.read_secret(args.gen_secret_file) if args.gen_secret_file else None,
        weight_transport=args.weight_transport, num_threads=generator_threads(args),
    )


def generator_memory_fraction(args: Args, shares_gpu: bool) -> float:
    """vLLM's share of each of its GPUs: --gen-memory-fraction, else 0.3 of a GPU it shares with a learner rank and
    0.85 of one of its own."""
    return args.gen_memory_fraction or (0.3 if shares_gpu else 0.85)


def generator_threads(args: Args) -> int | None:
    """Torch threads of each local replica on CPU (None: the process's default, one under torchrun). In sync mode
    the learner ranks wait while the replicas generate, so the replicas may take every core between them."""
    if torch.cuda.is_available():
        return None
    if args.gen_threads is not None:
        return args.gen_threads
    if args.mode == "sync":
        return max(1, (os.cpu_count() or 1) // max(1, local_replicas(args, 0)))
    return None


def generator_shares_a_gpu(args: Args) -> bool:
    """True when the learner shares the generator's GPUs: --gen-devices takes every GPU of the machine, and
    pipeline_rl.split_devices then gives the learner ranks the same ones (gpu_layout_problems allows one rank each)."""
    if not (args.gen_devices and torch.cuda.is_available()):
        return False
    learner_ids, gen_ids = pipeline_rl.split_devices(args.gen_devices, torch.cuda.device_count())
    return bool(set(learner_ids) & set(gen_ids))


# ----------------------------------------------------------------------------------------------------------------
# Keeping the ranks in step: collectives every rank calls at the same point
# ----------------------------------------------------------------------------------------------------------------


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (pickled; e.g. a round of groups)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def this_ranks_share(items: list, run: Run) -> list:
    """Every world-th item, from this rank's: the groups of a batch are dealt out to the ranks like cards."""
    return [item for i, item in enumerate(items) if i % run.world == run.rank]


def collective_device() -> torch.device:
    """Where a collective's tensors must be: NCCL reduces on this rank's GPU only, gloo on the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in dist.get_backend() else torch.device("cpu")


def sum_over_ranks(value: float) -> float:
    total = torch.tensor([float(value)], device=collective_device())
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.item()


def idle_forwards_needed(n_micro_batches: int) -> int:
    """How many forwards this rank must add to its own micro-batches to run as many as the busiest rank: FSDP2's
    all-gathers are collectives, so a rank with no micro-batch left must still join them (idle_forward). A
    collective itself: call it before the first forward."""
    most = torch.tensor([n_micro_batches], device=collective_device())
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item()) - n_micro_batches


def idle_forward(model: Any, pad_id: int, backward: bool, ref_model: Any = None) -> None:
    """A forward (and backward) on a dummy row that contributes nothing, with the collectives of a real micro-batch
    in the same order: the policy's forward, the reference model's forward, the backward."""
    dummy = torch.full((1, 2), pad_id, dtype=torch.long, device=model_device(model))
    logits = model(input_ids=dummy).logits
    if ref_model is not None:
        with torch.no_grad():
            ref_model(input_ids=dummy)
    if backward:
        (logits.sum() * 0.0).backward()


PER_REPLICA_MISMATCH = ("kl_k3", "max_abs_diff")  # logged per replica as mismatch_<key>_by_replica {replica: value}


def reduce_metrics(totals: dict[str, float], world: int) -> dict[str, Any]:
    """Token-weighted means over all ranks (the loss is a sum of micro-batch terms, so it is summed); a replica's
    mismatch (mismatch_r<R>_<key>) over that replica's tokens, gathered into mismatch_<key>_by_replica."""
    gathered: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, totals)
    summed: dict[str, float] = defaultdict(float)
    for part in gathered:
        for key, value in part.items():
            summed[key] += value
    out: dict[str, Any] = {"loss": summed.pop("loss", 0.0), "num_tokens": summed.get("num_tokens", 0.0)}
    n_tok, n_same = summed.pop("num_tokens", 0.0), summed.pop("mismatch_tokens", 0.0)
    replica_tokens = {key: summed.pop(key) for key in list(summed) if re.fullmatch(r"mismatch_r\d+_tokens", key)}
    for key, value in summed.items():
        if per_replica := re.fullmatch(r"mismatch_r(\d+)_(.+)", key):
            replica, name = per_replica.groups()
            out.setdefault(f"mismatch_{name}_by_replica", {})[int(replica)] = \
                value / replica_tokens[f"mismatch_r{replica}_tokens"]
            continue
        denom = n_same if key.startswith("mismatch_") else n_tok
        out[key] = value / denom if denom else 0.0
    return out


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint files: model, optimizer, every rank's RNG, the trainer state. Nothing in a run directory is
# unpickled: the weights load with torch's weights_only loader (tensors and plain values, nothing else), the RNG
# states and the trainer state are JSON. People share run directories; a crafted file must not run code.
# ----------------------------------------------------------------------------------------------------------------

CHECKPOINT_DIRS = ("checkpoint", "checkpoint.old")  # newest first; checkpoint.tmp/ is a save in progress


class CheckpointError(Exception):
    """A checkpoint file that cannot be read (cut short, garbled, a pickle of objects); the message names it."""


def save_checkpoint(out: Path, model: Any, optimizer: Any, state: dict, rank: int) -> None:
    """OUTPUT_DIR/checkpoint/, the previous one kept as checkpoint.old/. A collective: every rank calls it.

    The new checkpoint is written beside the others as checkpoint.tmp/ and read back by the ranks that wrote it;
    only then does rank 0 rotate it in (checkpoint -> checkpoint.old, checkpoint.tmp -> checkpoint). The newest
    checkpoint that every rank can read (agree_on_checkpoint) is never removed or renamed over before that: what
    goes first, to make room, is every other checkpoint directory (an older checkpoint.old, a corrupt checkpoint
    after a fallback to checkpoint.old, a save cut short). So a save needs room for two checkpoints at its peak,
    and one that would not fit fails before writing anything, naming the file system, the size and the free
    space. Each rank writes its RNG states (rng-RANK.json); rank 0 the weights and trainer_state.json (`state`,
    rank 0's, with the world size). Directories are made 0700 and files 0600: readable by their owner only."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                   cpu_offload=True))
    tmp, final, old = out / "checkpoint.tmp", out / "checkpoint", out / "checkpoint.old"
    world = dist.get_world_size()
    keep, report, _ = agree_on_checkpoint(out, rank, load=False)  # stays until the new one is in place
    if report and rank == 0:
        print(f"[checkpoint] {report}; the others are removed to make room", file=sys.stderr)
    weights, state = {"model": model_sd, "optimizer": optim_sd}, {**state, "world_size": world}
    need, refused = 0, None
    if rank == 0:
        need = checkpoint_bytes(weights, state, world)
        doomed = [d for d in (tmp, final, old) if d.exists() and d != keep]
        reclaimed = sum(_tree_bytes(d) for d in doomed)
        free = shutil.disk_usage(out).free
        if free + reclaimed < need:
            refused = no_space_message(out, need, free, reclaimed) + f"; nothing was written: {_kept(keep)}"
        else:
            for d in doomed:
                shutil.rmtree(d)
            tmp.mkdir(mode=0o700)
            os.chmod(tmp, 0o700)  # whatever the umask: checkpoints are readable by their owner only
    refused = broadcast_from_rank0(refused)
    if refused:
        raise SystemExit(f"checkpoint at step {state.get('step')}: {refused}")
    error, writing = None, tmp
    try:
        if rank == 0:
            writing = tmp / "weights.pt"
            torch.save(weights, writing)
            os.chmod(writing, 0o600)
            writing = tmp / "trainer_state.json"
            write_atomically(writing, json.dumps(state), private=True)
            read_weights(tmp / "weights.pt", expect=weights)  # read back: a short write shows here, not at resume
            read_trainer_state(tmp)
        writing = tmp / f"rng-{rank}.json"
        write_atomically(writing, json.dumps(rng_states()), private=True)
        read_rng(tmp, rank, world)
    except Exception as e:  # an ENOSPC the estimate missed, an I/O error: torch's own message names neither
        error = f"could not write {writing} on rank {rank} ({_first_line(e)})"
        if rank == 0 and shutil.disk_usage(out).free < need:
            error += f": {no_space_message(out, need, shutil.disk_usage(out).free, 0)}"
    except BaseException:  # a second Ctrl-C: stop at once, leaving no partial directory behind
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    errors: list[str | None] = [None] * world
    dist.all_gather_object(errors, error)
    if any(errors):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"checkpoint at step {state.get('step')} failed: {'; '.join(e for e in errors if e)}; "
                         f"{_kept(keep)}")
    if rank == 0:
        if final.exists():  # the kept one (anything else there went before writing)
            final.rename(old)
        tmp.rename(final)
    dist.barrier()  # no rank reads the directory again before it is in place


def _kept(keep: Path | None) -> str:
    return f"the previous checkpoint {keep} is intact" if keep else "there was no earlier checkpoint to keep"


def checkpoint_bytes(weights: dict, state: dict, world: int) -> int:
    """What a checkpoint will take on disk, from its tensors' sizes: their bytes, torch.save's archive record and
    pickled name per tensor (about 500 bytes measured; 1 KiB counted), the JSON files, and 64 KiB to spare."""
    tensors: list[torch.Tensor] = []

    def collect(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item)

    collect(weights)
    tensor_bytes = sum(t.numel() * t.element_size() + 1024 for t in tensors)
    return tensor_bytes + len(json.dumps(state)) + world * RNG_FILE_BYTES + (64 << 10)


RNG_FILE_BYTES = 32 << 10  # rng-RANK.json: Python's 625 and numpy's 624 integers, torch's 5056 bytes in hex


def no_space_message(out: Path, need: int, free: int, reclaimed: int) -> str:
    mb = 1 << 20
    freed = f", {reclaimed / mb:.1f} MB of it in older checkpoints a save replaces" if reclaimed else ""
    return (f"no space left on {file_system(out)} for a checkpoint of {need / mb:.1f} MB (free "
            f"{(free + reclaimed) / mb:.1f} MB{freed})")


def file_system(path: Path) -> str:
    """The device a path is on, as /proc/mounts names it, with its mount point (the path itself if unknown)."""
    target, best = path.resolve(), None
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount = line.split()[:2]
            mount = mount.replace("\\040", " ")
            if (target == Path(mount) or Path(mount) in target.parents) and (best is None or len(mount) > len(best[1])):
                best = (device, mount)
    except (OSError, ValueError):
        pass
    return f"{best[0]} (mounted at {best[1]})" if best else str(path)


def _tree_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def complete_checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints of a run directory, newest first (checkpoint/, then checkpoint.old/)."""
    return [out / name for name in CHECKPOINT_DIRS if (out / name / "trainer_state.json").is_file()]


def read_trainer_state(ckpt: Path) -> dict:
    path = ckpt / "trainer_state.json"
    try:
        state = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({_first_line(e)})") from None
    if not (isinstance(state, dict) and isinstance(state.get("step"), int)):
        raise CheckpointError(f"{path} holds no trainer state (no step)")
    return state


def read_weights(path: Path, expect: dict | None = None) -> dict:
    """weights.pt ({"model", "optimizer"}) through torch's weights_only loader, memory-mapped (its tensors are
    read when used, so checking a checkpoint costs little). `expect`: what was just saved, to compare names and
    shapes with."""
    if not zipfile.is_zipfile(path):  # torch.save's archive: a file cut short loses its directory at the end
        raise CheckpointError(f"{path} is cut short or garbled (not a torch.save archive)")
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:  # torch's message goes on to suggest weights_only=False: never here
        raise CheckpointError(f"{path} holds objects other than tensors and plain values (a pickle that could run "
                              "code): refused unread") from None
    except Exception as e:
        raise CheckpointError(f"{path} is unreadable ({_first_line(e)})") from None
    if not (isinstance(weights, dict) and isinstance(weights.get("model"), dict) and "optimizer" in weights
            and all(isinstance(t, torch.Tensor) for t in weights["model"].values())):
        raise CheckpointError(f"{path} holds no model and optimizer state")
    if expect is not None and {k: t.shape for k, t in weights["model"].items()} != \
            {k: t.shape for k, t in expect["model"].items()}:
        raise CheckpointError(f"{path} does not read back as written")
    return weights


def rng_states() -> dict[str, Any]:
    """This process's RNG states as JSON values: Python's (version, 625 ints, gauss), numpy's (name, 624 ints,
    pos, has_gauss, cached), torch's CPU generator (bytes, in hex)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss], "numpy": [name, keys.tolist(), int(pos), int(has_gauss),
                                                                    float(cached)],
            "torch": torch.get_rng_state().numpy().tobytes().hex()}


def read_rng(ckpt: Path, rank: int, world: int | None) -> dict[str, Any] | None:
    """This rank's RNG states from rng-RANK.json, checked on scratch generators (a garbled file fails here, not
    when set). None for a rank the saving run did not have (its world size, `world`, was smaller): it keeps its
    fresh seeding. A checkpoint of an older train.py (pickled rng-RANK.pt) is refused with how to convert it."""
    path = ckpt / f"rng-{rank}.json"
    if not path.exists():
        if (ckpt / f"rng-{rank}.pt").exists() or (ckpt / "rng-0.pt").exists():
            raise CheckpointError(f"{ckpt} was written by an older train.py: its RNG states are pickles (rng-*.pt), "
                                  "which are never loaded; convert them once with `python train.py migrate-checkpoint "
                                  f"{ckpt.parent}`")
        if world is not None and rank >= world:
            return None
        raise CheckpointError(f"{path} is missing")
    try:
        saved = json.loads(path.read_bytes())
        version, internal, gauss = saved["python"]
        python = (version, tuple(internal), gauss)
        random.Random().setstate(python)
        name, keys, pos, has_gauss, cached = saved["numpy"]
        numpy_state = (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
        np.random.RandomState().set_state(numpy_state)
        torch_state = torch.frombuffer(bytearray.fromhex(saved["torch"]), dtype=torch.uint8).clone()
        torch.Generator().set_state(torch_state)
    except (OSError, ValueError, TypeError, KeyError, OverflowError, RuntimeError) as e:
        raise CheckpointError(f"{path} is unreadable ({_first_line(e)})") from None
    return {"python": python, "numpy": numpy_state, "torch": torch_state}


def read_checkpoint_files(ckpt: Path, rank: int | None) -> tuple[dict, dict, dict | None]:
    """The files of checkpoint directory `ckpt` that rank `rank` loads: (trainer state, weights, its RNG states);
    rank None (export) skips the RNG. CheckpointError names the first file that does not read."""
    state = read_trainer_state(ckpt)
    weights = read_weights(ckpt / "weights.pt")
    return state, weights, None if rank is None else read_rng(ckpt, rank, state.get("world_size"))


def agree_on_checkpoint(out: Path, rank: int, load: bool = True) -> tuple[Path | None, str, tuple | None]:
    """The newest checkpoint that every rank can read, the same on every rank. Each rank reads its own files of each
    complete checkpoint (trainer_state.json, weights.pt, its rng-RANK.json); one all_gather then gives every rank
    every rank's findings. No rank falls back on its own: ranks that loaded different checkpoints would train
    shards of two models, then deadlock. Returns (that checkpoint, or None; a report naming each unreadable file
    and each rank's own newest readable checkpoint, empty when all is well; what this rank read of it, when
    `load`). A collective: every rank calls it."""
    found: dict[str, str | None] = {}
    read: dict[str, tuple] = {}
    for ckpt in complete_checkpoints(out):
        try:
            read[ckpt.name] = read_checkpoint_files(ckpt, rank)
            found[ckpt.name] = None
        except CheckpointError as e:
            found[ckpt.name] = str(e)
    reports: list[dict[str, str | None]] = [{}] * dist.get_world_size()
    dist.all_gather_object(reports, found)
    names = [n for n in CHECKPOINT_DIRS if any(n in r for r in reports)]
    chosen = next((n for n in names if all(n in r and r[n] is None for r in reports)), None)
    problems: dict[str, list[int]] = {}  # each unreadable file, with the ranks that found it so
    for r, report in enumerate(reports):
        for n in names:
            reason = report[n] if n in report else f"{out / n} is incomplete on this rank's file system"
            if reason:
                problems.setdefault(reason, []).append(r)
    text = ""
    if problems:
        own = [f"rank {r}: {next((str(out / n) for n in names if n in rep and rep[n] is None), 'none')}"
               for r, rep in enumerate(reports)]
        text = ("unreadable: " + "; ".join(f"{reason} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                                           for reason, rs in problems.items())
                + f". Newest checkpoint each rank can read: {', '.join(own)}. "
                + (f"Every rank uses {out / chosen}" if chosen else "No checkpoint is readable by every rank"))
    return (out / chosen if chosen else None), text, (read[chosen] if chosen and load else None)


def read_checkpoint(out: Path, rank: int | None, purpose: str) -> tuple[dict, dict, dict | None, Path]:
    """The newest complete checkpoint of run directory `out` that this process reads, alone (export: no other rank
    to agree with): (its trainer state, its weights {"model", "optimizer"}, rank `rank`'s RNG states or None, its
    directory). A corrupt one is named and the older one read instead; none readable is a SystemExit naming each.
    `purpose` labels the messages ("export")."""
    failures = []
    for ckpt in complete_checkpoints(out):
        try:
            return (*read_checkpoint_files(ckpt, rank), ckpt)
        except CheckpointError as e:
            failures.append(str(e))
            print(f"[{purpose}] {failures[-1]}; trying the previous checkpoint", file=sys.stderr)
    raise SystemExit(f"{purpose} {out}: no checkpoint could be read: " + ("; ".join(failures) or "none is complete"))


def load_checkpoint(out: Path, model: Any, optimizer: Any, rank: int) -> tuple[dict, Path]:
    """Restore the newest checkpoint that every rank can read (agree_on_checkpoint); rank 0 prints the report of
    any unreadable file. Returns (its trainer_state.json, its directory). A collective."""
    chosen, report, loaded = agree_on_checkpoint(out, rank)
    if report and rank == 0:
        print(f"[resume] {report}", file=sys.stderr)
    if chosen is None:
        raise SystemExit(f"resume {out}: no checkpoint could be read by every rank" + (f": {report}" if report else
                                                                                       ": none is complete"))
    state, weights, rng = loaded
    set_state_dict(model, optimizer, model_state_dict=weights["model"], optim_state_dict=weights["optimizer"],
                   options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rng is not None:  # None: a rank the saving run did not have keeps its fresh seeding
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
    return state, chosen


def migrate_checkpoint(run_dir: Path) -> dict[str, Any]:
    """`train.py migrate-checkpoint RUN_DIR`: convert, once, the RNG files of a run's checkpoints written by an older
    train.py (rng-RANK.pt, pickles) into rng-RANK.json, deleting the pickles. They are read with torch's weights_only
    loader, allowed numpy's array and dtype besides tensors and plain values: a file that holds any other object is
    refused, never run. The weights (weights.pt) need no conversion. Returns the files written."""
    print(f"[migrate-checkpoint] reading the pickled RNG files of {run_dir} with torch.load(weights_only=True) "
          "(numpy arrays allowed); a file holding any other object is refused", file=sys.stderr)
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, (core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
               np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    written = []
    for ckpt in complete_checkpoints(run_dir):
        for pickled in sorted(ckpt.glob("rng-*.pt")):
            target = pickled.with_suffix(".json")
            try:
                with torch.serialization.safe_globals(allowed):
                    saved = torch.load(pickled, map_location="cpu", weights_only=True)
                version, internal, gauss = saved["python"]
                name, keys, pos, has_gauss, cached = saved["numpy"]
                states = {"python": [version, list(internal), gauss],
                          "numpy": [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
                          "torch": saved["torch"].numpy().tobytes().hex()}
            except Exception as e:
                raise SystemExit(f"migrate-checkpoint: {pickled} is refused ({_first_line(e)}): it is not an RNG "
                                 "file of train.py; nothing in it was run, and nothing was changed") from None
            write_atomically(target, json.dumps(states), private=True)
            read_rng(ckpt, int(pickled.stem.split("-")[1]), None)  # reads back as a resume will read it
            pickled.unlink()
            written.append(str(target))
    return {"run_dir": str(run_dir), "converted": written}


def write_atomically(path: Path, text: str, private: bool = False) -> None:
    """Write `text` to a temporary file beside `path`, flush it to disk, then rename it over `path`: a kill at any
    moment leaves the old file or the new one, never an empty or half-written one. `private`: mode 0600."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------------------------------------------
# Signals, the output-directory lock, the metrics file
# ----------------------------------------------------------------------------------------------------------------


class GracefulStop:
    """SIGINT (Ctrl-C; torchrun passes it on to every rank) or SIGTERM: finish the current step, save a checkpoint
    and exit, so that a --resume redoes nothing. A second signal stops at once."""

    def __init__(self, announce: bool):
        self.signal: str | None = None
        self.announce = announce
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:
            # torchrun passes a first Ctrl-C on to the ranks as SIGINT, and a second one as SIGTERM (its shutdown
            # after an interrupted shutdown): after a SIGINT, a SIGTERM is the second Ctrl-C, and is named so.
            label = "SIGINT" if self.signal == "SIGINT" and name == "SIGTERM" else name
            raise SystemExit(f"second {label}: stopping at once, without the checkpoint of this step (the previous "
                             "one is intact)")
        self.signal = name
        if self.announce:
            print(f"\n[{self.signal}] stopping after this step, with a checkpoint (again to stop at once)",
                  file=sys.stderr, flush=True)

    def agreed(self) -> bool:
        """True on every rank if any rank was signalled (a collective: every rank calls it at the same point)."""
        flag = torch.tensor([float(self.signal is not None)], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class OutputDirBusyError(RuntimeError):
    """Another live train.py holds the output directory."""


def lock_output_dir(out: Path) -> Any:
    """Take OUTPUT_DIR/.lock for the life of this process; raise OutputDirBusyError if a live run holds it.
    flock is released by the kernel when its holder dies, however it dies."""
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
    count, so steps re-done after a crash are neither lost nor duplicated; the cut goes through a temporary file
    renamed over the old one, so a kill at that moment leaves it whole. A file with fewer lines than the checkpoint
    covers (cut behind the run's back) cannot be made whole: `missing_steps` names the steps 0..`covers_step`
    that have no row."""

    def __init__(self, path: Path, keep_lines: int | None, covers_step: int | None = None):
        self.path = path
        lines = path.read_text().splitlines(keepends=True) if path.exists() else []
        kept = lines if keep_lines is None else lines[:keep_lines]
        self.lines = len(kept)
        if kept != lines or not path.exists():
            write_atomically(path, "".join(kept))
        self.missing_steps: list[int] = []
        if covers_step is not None and keep_lines is not None and len(lines) < keep_lines:
            present = set()
            for line in kept:
                with contextlib.suppress(ValueError, AttributeError):
                    present.add(json.loads(line).get("step"))
            self.missing_steps = [s for s in range(covers_step + 1) if s not in present]

    def write(self, row: dict) -> None:
        row, non_finite = _json_safe(row)
        if non_finite:  # strict JSON has no NaN or Infinity: write null and name the fields
            row["non_finite"] = non_finite
        with self.path.open("a") as f:
            f.write(json.dumps(row, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.lines += 1


def _ranges(steps: list[int]) -> list[list[int]]:
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
        saved = read_args_json(out) if (out / "args.json").exists() else {}
        defaults = {f.name: f.default for f in dataclasses.fields(Args)}
        before = {k: saved.get(k, defaults[k]) for k in current}
        resumes = list(saved.get("resumes") or [])
        entry: dict[str, Any] = {"step": step, "changed": {
            k: [before[k], current[k]] for k in sorted(CHANGEABLE_ON_RESUME - {"output_dir", "resume", "overwrite"})
            if before[k] != current[k]}}
        if missing_steps:
            entry["metrics_missing_steps"] = _ranges(missing_steps)
        resumes.append(entry)
    write_atomically(out / "args.json", json.dumps({**current, "resumes": resumes}, indent=1))


if __name__ == "__main__":  # vLLM on CPU spawns its workers: the entry point must be guarded
    main()
