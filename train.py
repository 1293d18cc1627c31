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

How to read this file: `main` and the loop (`train`), then one function per step of the loop, in the order the loop
calls them (pull groups -> retire solved prompts -> filter zero-variance groups -> overlong penalty and filter -> old
logprobs -> advantages -> loss and backward -> optimizer step -> push weights -> evaluate -> log -> checkpoint), then
the learner itself (make_learner: the loss file, seeds, the FSDP2 policy with its FP32 head, AdamW and its warm-up),
and last the table of train.py's other commands (COMMANDS: export, evaluate, ...). What the loss sees and gives back
are records with named fields (LossInputs, LossOutputs): the loss files' compute_loss inputs and results, by name. The
runtime behind the recipe is in modules a reader of the recipe may skip: harness/flags.py (the flags, their checks, the
resume rules, args.json), harness/runtime.py (set-up: process groups, the output-directory lock, the generator's
start, signals, the collectives, the metrics log), harness/checkpoints.py (save, resume), harness/packing.py (rows and
micro-batches), harness/head_gemm.py (the FP32 LM head's log-probabilities in chunks, and its split-bf16 GEMM on a
GPU) and harness/commands.py (the other commands).

How this departs from the paper, deliberately:
  - The embedded default is a 0.86M-parameter model on 3-digit addition (harness/tasks.py, harness/base_model.py), so it runs on 2 CPU cores
    in minutes. Its generator is held to one batch ahead of the learner (--buffer-steps 1): with k = 8 alone, a
    fast generator made every batch 8 steps stale, and at lr 1e-4 that made runs swing (docs/results.md: the
    staleness experiment). Its settings (lr 1e-4, 32 prompts x 8 samples, no warm-up, 150 steps) are tuned for that
    model, as --help says; the paper's (lr 5e-7, AdamW eps 1e-15, weight decay 0.01, 100 warm-up steps, 48 x 16)
    apply to real models (--model).
  - compute_hours counts wall-clock hours x devices in use, where on CPU a "device" is a learner rank or the
    generator process. flops = 2N per generated token + 6N per trained token (N = parameters).
  - Old logprobs: pipeline mode uses the sampler's (ScaleRL: the denominator of rho is the generator's logprob).
    Sync mode, and any run with --tis, recompute them with the learner before the round's first update; --tis
    then multiplies in min(pi_learner_old / pi_sampler, cap).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import functools
import inspect
import math
import random
import re
import sys
import time
import types
import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from tqdm import tqdm

import cispo
import dapo  # whatever --loss is, the recipe's data side: filter_groups (zero-variance filtering, DAPO's dynamic
             # sampling) and overlong_penalty (--length-control overlong) live in dapo.py, its paper's file
import drgrpo
import grpo
import gspo
import pipeline_rl  # imports vLLM only inside the generator process, never in a learner rank
import scaling_fit
import tis  # --tis's importance weights, and the sampler/learner mismatch metrics
from harness import commands  # train.py's other commands: export, evaluate, migrate-checkpoint, plan, --help-markdown
from harness.checkpoints import TrainerState, save_checkpoint
from harness.flags import (LOSS_FLAGS, Args, adamw_fused, generator_values, lm_head_gemm, loss_problems, parse_args,
                           parse_literal, reshard_layers)
from harness.head_gemm import install_target_logprobs, model_logprobs
from harness.packing import Rows, micro_batch_groups, micro_batches, model_device, row_packing, to_rows
from harness.runtime import (PER_REPLICA_MISMATCH, Run, RunFileError, broadcast_from_rank0, collective_device,
                             completion_lengths, fleet_config, generator_position, idle_forward,
                             idle_forwards_needed, load_tasks, model_flops_utilisation, new_row, peak_flops_per_s,
                             push_state_dict, rank0_speaks, read_run_metrics, reduce_metrics, set_up, sum_over_ranks,
                             summary_line, this_ranks_share)
from harness.cli import note_error_lines  # under torchrun, a rank's error line for torchrun's summary
from harness.vllm_replica import WorkPace, exit_at_once, report_exit  # the debug slowdown; a rank's exit

# --loss NAME -> its loss file. The flags take their choices and each file's hyper-parameters from this table
# (parse_args reads the files' signatures), so the names and the defaults are written once.
LOSSES = {"grpo": grpo, "dapo": dapo, "drgrpo": drgrpo, "gspo": gspo, "cispo": cispo}


# ----------------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, set up (harness/runtime.py), run the loop, then fit ScaleRL's sigmoid to the evaluation rows.
    `train.py NAME ...` runs one of the other COMMANDS (end of this file) instead and prints what it returns."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in COMMANDS:
        print(COMMANDS[argv[0]](argv[1:]), end="")
        return
    args = parse_args(argv, generator_checks=pipeline_rl.config_problems, losses=LOSSES)  # the rule checked by the rule
    # A crash in native code (gloo, a kernel) kills a rank with no Python traceback: print every thread's stack.
    faulthandler.enable(all_threads=True)
    with rank0_speaks(Path(args.output_dir)), set_up(args) as setup:  # process groups, OUTPUT_DIR, data, model path
        learner = make_learner(args, setup.model_path, setup.device, setup.rank)
        state = setup.resume(learner)  # with --resume: the checkpoint's weights, optimizer and schedule
        generator = start_generator(args, setup, state)  # rank 0's, from the base weights (None on the others)
        if state.step > 0:  # give it the resumed weights before it samples anything
            push_resumed_weights(learner, generator, state.step)
        run = setup.begin(state)  # the metrics log and the progress bar
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
        if write_row(run, row):
            tqdm.write(f"step 0: val pass rate {row['val_pass_rate']:.3f} (the base model)")
    consecutive_bad = 0
    peak_flops = peak_flops_per_s(args.dtype, args.peak_tflops)  # one learner rank's; None: no mfu
    learner_pace = WorkPace(args.debug_learner_slowdown, on_cpu=model_device(learner.model).type == "cpu")
    while state.step < args.max_steps:
        # Pull groups, then the data-side steps on them (rank 0): retire solved prompts, filter zero-variance
        # groups, overlong penalty and filter. A round is one step's batch (pipeline mode) or k steps' (sync mode,
        # PPO-off-policy-k). Every rank receives the same round and trains on its share of each batch.
        round_ = broadcast_from_rank0(pull_round_or_error(args, run, state) if run.is_main else None)
        if round_.stop_reason:  # the generator (or vLLM's engine) died, the disk is full: keep what was learned
            stop_with_checkpoint(args, learner, run, state, resumable_stop(run, state, round_.stop_reason))
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
            stop_if_signalled(args, learner, run, state)
            step_start, version = time.time(), state.step
            learner_pace.start()
            rewards, my_advantages = compute_advantages(args, learner, batch, run)
            learner.optimizer.zero_grad(set_to_none=True)
            totals = loss_and_backward(args, learner, my_groups, my_advantages,
                                       Step(version, run.world, old_is_current))
            grad_norm, finite = optimizer_step(args, learner, totals.get("loss", 0.0), has_groups=bool(batch))
            metrics = reduce_metrics(totals, run.world)  # after the update is queued: it waits for the GPU
            if not finite:
                consecutive_bad += 1
                state.bad_steps_total += 1
            elif batch:
                consecutive_bad = 0
            learner_pace.pause()  # --debug-learner-slowdown X: a learner X times slower than this one
            state.step += 1
            state.consumed.update([grp.data_index for grp in batch] + round_.dropped)
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
                    **metrics, **round_.stats, **completion_lengths(batch),
                    # Lag of the tokens trained on at this step (in a sync round of k steps it grows 0..k-1).
                    **pipeline_rl.lag_stats(batch, version),
                }
                if (state.step % args.eval_every == 0 or state.step == args.max_steps) and not run.stop_reason:
                    with generator_errors_noted(run):
                        evaluate(args, run, row)
                log_row(args, run, row)
            if run.is_main and state.step == args.max_steps:  # the generator's work is done: it shuts down while
                run.generator.begin_close()  # the last checkpoint is written (set_up's exit waits for it)
            if consecutive_bad >= args.max_bad_steps:
                stop_with_checkpoint(args, learner, run, state, f"stopping: {consecutive_bad} consecutive steps had a "
                                     f"non-finite loss or gradient (last at step {state.step}); checkpoint saved in "
                                     f"{run.out / 'checkpoint'}. Lower --lr or check the data, then --resume.")
            if state.step % args.checkpoint_every == 0 or state.step == args.max_steps:
                checkpoint(learner, run, state)
    run.bar.close()
    redraw_dashboard_if_behind(args, run)  # a last step whose evaluation failed drew none
    if run.stop_reason:  # rank 0: the last step's row was not written (its checkpoint was, at --max-steps)
        raise SystemExit(f"stopping after step {state.step}: {run.stop_reason}; checkpoint saved in "
                         f"{run.out / 'checkpoint'}")


# ----------------------------------------------------------------------------------------------------------------
# What the loop works with: this rank's learner (the trainer state it saves is harness/checkpoints.py's TrainerState,
# the run around them harness/runtime.py's Run)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Loss:
    """The loss file --loss names, and what the run passes it beside the batch."""

    file: types.ModuleType  # one of LOSSES
    hyperparameters: dict[str, Any]  # compute_loss's keywords: flags over the file's paper defaults
    advantage_options: dict[str, Any]  # compute_advantages' keywords (--adv-norm)

    @property
    def aggregation(self) -> str:
        """The unit the loss averages over, "prompt", "sample" or "token": the file's AGGREGATION, or the one its
        `aggregation` keyword picks (cispo.py's, --aggregation)."""
        return self.hyperparameters.get("aggregation", self.file.AGGREGATION)


@dataclass
class Learner:
    """This rank's share of the policy and what trains it."""

    model: Any  # the policy, FSDP2-sharded (build_learner)
    optimizer: torch.optim.Optimizer  # AdamW
    scheduler: Any  # linear warm-up over --warmup-steps, then constant
    loss: Loss  # the loss file and its keywords
    pad_id: int
    n_params: int
    ref_model: Any = None  # --kl-coef: the frozen initial policy, sharded like the policy


@dataclass(frozen=True)
class Step:
    """What an optimizer step's loss is taken with, beside its groups and their advantages."""

    version: int  # the weights being trained (optimizer steps done): the sampler mismatch is measured against them
    world: int  # learner ranks; FSDP2 averages their gradients
    old_is_current: bool = False  # pi_old is the learner as it is now (a round of one batch in sync mode or with
                                  # --tis): the micro-batch's own logprobs, detached, not the completions' old_logprobs


# ----------------------------------------------------------------------------------------------------------------
# The steps, in the order the loop takes them. First the data side (rank 0, on the generator's groups)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Round:
    """The groups of one generation round, split into the batches of the optimizer steps that train on them, and
    the generator's statistics of the round (logged with each of its steps)."""

    batches: list[list[pipeline_rl.Group]]
    stats: dict[str, Any]
    stop_reason: str | None = None  # the generator died, a full disk: every rank checkpoints and stops instead
    # data indices of the groups pulled and dropped (zero variance): consumed with the round's steps, so that a
    # resume does not draw them again and a resumed sync run goes on as the run would have
    dropped: list[int] = field(default_factory=list)


def pull_round(args: Args, generator: Any, state: TrainerState) -> Round:
    """Rank 0: pull groups for one round (--prompts-per-step per optimizer step; k steps' worth in sync mode) and
    take them through the data-side steps of the recipe."""
    steps = pipeline_rl.steps_per_round(args.mode, args.max_off_policy)  # sync: k (PPO-off-policy-k); pipeline: 1
    want = args.prompts_per_step * steps
    stats: dict[str, Any] = {"overlong_filtered": 0} if args.overlong_filter else {}
    kept: list = []
    dropped: list[int] = []
    pulled = zero_variance = 0
    while len(kept) < want:
        groups = pull_groups(generator, want - len(kept), state.step, stats)
        pulled += len(groups)
        retire_solved_prompts(groups, state, args.retire_pass_rate, generator)
        has_signal = filter_zero_variance(groups, args.group_size)
        zero_variance += has_signal.count(False)
        keeps = [keep or args.zero_variance == "keep" for keep in has_signal]
        kept += [grp for grp, keep in zip(groups, keeps) if keep]
        dropped += [grp.data_index for grp, keep in zip(groups, keeps) if not keep]
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
    return Round(batches, stats, dropped=dropped)


def pull_groups(generator: Any, n: int, version: int, stats: dict[str, Any]) -> list:
    """Up to `n` finished groups from the generator for the learner at weights `version` (pipeline_rl.py bounds
    their staleness). Its statistics go into `stats`: per-call amounts add up; run totals, histograms and rates
    are the last call's."""
    groups, extra = generator.get_batch(n, version)
    for key, value in extra.items():
        if key in ("gen_tokens", "wait_s"):
            stats[key] = stats.get(key, 0) + value
        elif key.endswith("_by_replica"):  # {replica: amount}, summed; a replica's 0 stays (Counter's + drops it)
            stats[key] = {r: stats.get(key, {}).get(r, 0) + value.get(r, 0) for r in {**stats.get(key, {}), **value}}
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
    # FSDP2 leaves its root unit's parameters gathered after a forward, for the backward it expects; after forwards
    # without grad the next backward then reduced their gradient once more per such forward (measured: 2x the
    # gradient on the round's first step). Resharding every unit makes that step's backward start as any other's.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def compute_advantages(args: Args, learner: Learner, batch: list, run: Run) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss file's advantages over the whole batch (every rank computes the same: batch-level normalisation
    needs every group), then this rank's rows of them. Returns (the batch's rewards, this rank's advantages)."""
    g = args.group_size
    rewards = torch.tensor([r for grp in batch for r in grp.rewards], dtype=torch.float32)
    advantages = (learner.loss.file.compute_advantages(rewards, g, **learner.loss.advantage_options) if batch
                  else torch.zeros(0))
    mine = this_ranks_share(list(range(len(batch))), run)
    return rewards, (torch.cat([advantages[i * g: (i + 1) * g] for i in mine]) if mine else torch.zeros(0))


# What the loss file sees of one micro-batch, and what it gives back. N completions, one row each; T next-token
# positions, position t holding what concerns token t + 1 of the row (packing.Rows' layout, packed or not).


@dataclass
class LossInputs:
    """What the loss file sees for one micro-batch: its compute_loss's inputs, by their names there (the parameters
    before its `*`; the keyword-only ones after it are the run's hyper-parameters, Loss.hyperparameters)."""

    logprobs: torch.Tensor  # [N, T] the learner's log pi_theta(token), after temperature, with gradient
    old_logprobs: torch.Tensor  # [N, T] pi_old's: the sampler's (pipeline mode), else the learner's before the round
    advantages: torch.Tensor  # [N]
    mask: torch.Tensor  # [N, T] bool: the completion tokens that count (not prompt, padding or an injected phrase)
    group_size: int  # completions per group in these rows: --group-size, or 1 where the micro-batch splits a group
    is_weights: torch.Tensor | None  # [N, T] detached: --tis's weights against the sampler's logprobs, times each
                                     # token's share of its prompt where the micro-batch splits its group (Aggregation)
    denominator: float  # the whole batch's aggregation units (loss_denominator), summed over ranks
    ref_logprobs: torch.Tensor | None  # [N, T] the reference policy's (--kl-coef), else None


@dataclass
class LossOutputs:
    """What the loss file gives back for one micro-batch: its compute_loss's (loss, metrics)."""

    loss: torch.Tensor  # scalar: the micro-batch's share of the batch's loss (the whole batch's denominator)
    metrics: dict[str, float]  # the file's own: clip_frac, ratio_mean, kl_k3, num_tokens (masked tokens), ...


@dataclass
class Aggregation:
    """How a micro-batch's loss adds up to the whole batch's (loss_and_backward): every micro-batch divides by the
    whole batch's denominator; one that splits a group gives the loss file its completions as groups of one, and,
    where the unit is a prompt, weights each completion's tokens by its share of its prompt's tokens."""

    denominator: float  # the whole batch's aggregation units, summed over ranks
    group_size: int  # completions per group as the loss file sees the rows
    token_weights: torch.Tensor | None = None  # [N] each completion's share of its prompt's tokens, or None


def loss_and_backward(args: Args, learner: Learner, groups: list, advantages: Any, step: Step) -> dict[str, float]:
    """Loss and backward over this rank's groups, in micro-batches of completions within --micro-batch-tokens
    (micro_batches; a group may span several), packed (--packing) or padded: the loss file sees one row per
    completion either way (Rows); returns this rank's metric totals (reduce_metrics averages them over ranks).

    The micro-batch losses and gradients add up to the whole batch's, for any micro-batch size and world size:
    whatever normalises the loss is computed from the whole batch before it is split. Every micro-batch loss is
    divided by the WHOLE batch's denominator (prompts, completions or tokens: the loss's aggregation unit), summed
    over ranks. A micro-batch that holds part of a group goes to the loss file as groups of one completion each,
    which makes every completion a unit of its own; where the unit is a prompt (DAPO's and CISPO's prompt-level
    aggregation: a prompt's token sum over its group's tokens), its tokens are weighted by their share of their
    prompt's tokens (prompt_token_shares), so that each completion adds what it adds in its whole group."""
    g, model = args.group_size, learner.model
    device, pack = model_device(model), row_packing(args, model)
    masks = loss_masks(groups)                                                            # [N, T]
    hp = learner.loss.hyperparameters
    denominator = sum_over_ranks(learner.loss.file.loss_denominator(masks, g, **hp) if groups else 0.0)
    shares = prompt_token_shares(masks, g) if learner.loss.aggregation == "prompt" else None  # [N] or None
    batches = micro_batches(groups, args.micro_batch_tokens, args.packing)
    idle = idle_forwards_needed(len(batches))
    totals: dict[str, float] = defaultdict(float)
    for idx in batches:
        chosen, whole = micro_batch_groups(groups, idx)
        rows = to_rows(chosen, advantages[idx], g, learner.pad_id, device, pack)
        split_shares = None if whole or shares is None else shares[idx].to(device)
        aggregation = Aggregation(denominator, g if whole else 1, split_shares)
        for key, value in micro_batch_loss(args, learner, rows, step, aggregation).items():
            totals[key] += value
    for _ in range(idle):
        idle_forward(model, learner.pad_id, backward=True, ref_model=learner.ref_model)
    return dict(totals)


def loss_masks(groups: list) -> Any:
    """The loss masks of the groups' completions, right-padded: [N, T] bool, N completions in order."""
    masks = [c.loss_mask for g in groups for c in g.completions]
    lengths = torch.tensor([len(m) for m in masks], dtype=torch.long)                      # [N]
    filled = torch.arange(int(lengths.max()) if masks else 0) < lengths[:, None]          # [N, T]
    out = torch.zeros_like(filled)
    out[filled] = torch.tensor([x for m in masks for x in m], dtype=torch.bool)  # row-major: the lists' order
    return out


def prompt_token_shares(masks: Any, group_size: int) -> Any:
    """Each completion's share of its prompt's loss tokens, t_i / sum_{j in its group} t_j [N], for a loss whose
    aggregation unit is a prompt: a micro-batch that splits a group weights each completion's tokens by it (see
    loss_and_backward)."""
    tokens = masks.sum(dim=1).float().reshape(-1, group_size)                             # [P, G]
    return (tokens / tokens.sum(dim=1, keepdim=True).clamp(min=1)).flatten()              # [N]


def micro_batch_loss(args: Args, learner: Learner, rows: Rows, step: Step,
                     aggregation: Aggregation) -> dict[str, float]:
    """One micro-batch: what the loss sees (the policy's logprobs, --tis's importance weights, --kl-coef's reference
    logprobs), the loss file's loss, the metric totals (sums, token-weighted), backward."""
    logprobs, entropy = token_logprobs_and_entropy(learner.model, rows, args.temperature)  # [N, T] each
    old = logprobs.detach() if step.old_is_current else rows.old_logprobs                 # [N, T]
    tis_weights = importance_weights(args, rows, old)                                     # [N, T] or None
    inputs = LossInputs(
        logprobs=logprobs, old_logprobs=old, advantages=rows.advantages, mask=rows.loss_mask,
        group_size=aggregation.group_size, is_weights=weighted(tis_weights, aggregation.token_weights, rows.loss_mask),
        denominator=aggregation.denominator, ref_logprobs=reference_logprobs(learner.ref_model, rows, args.temperature))
    outputs = compute_loss(learner.loss, inputs)
    weight = outputs.metrics.get("num_tokens", 0.0)
    totals = {"loss": outputs.loss.item(), **{k: v * weight for k, v in outputs.metrics.items() if k != "num_tokens"},
              "num_tokens": weight, "entropy": float(entropy[rows.loss_mask].sum())}  # its token mean, reduced
    totals.update(mismatch_totals(rows, logprobs.detach(), step.version))
    if tis_weights is not None:
        totals["is_weight_mean"] = float(tis_weights[rows.loss_mask].sum())
        totals["is_weight_zero_frac"] = float((tis_weights[rows.loss_mask] == 0).sum())  # masked (MIS)
    # Backward after the metrics: each read waits for the GPU, so reads after it would leave the GPU idle while the
    # host queues what follows (the next micro-batch, clipping, AdamW). FSDP averages gradients over ranks; the loss
    # is already normalised by the global denominator.
    (outputs.loss * step.world).backward()
    return totals


def importance_weights(args: Args, rows: Rows, old_logprobs: Any) -> Any:
    """--tis: the truncated (or masked) importance weights of pi_old over the sampler, [N, T], detached; else None."""
    if not args.tis:
        return None
    return tis.tis_weights(old_logprobs, rows.sampler_logprobs, rows.loss_mask, cap=args.tis_cap, level=args.tis,
                           mode=args.tis_mode, cap_min=args.tis_cap_min)


def weighted(is_weights: Any, token_weights: Any, mask: Any) -> Any:
    """The per-token weights the loss multiplies in: the importance weights [N, T] (or None), times each
    completion's token weight [N] where a micro-batch splits a prompt's group (Aggregation)."""
    if token_weights is None:
        return is_weights
    return token_weights[:, None].expand_as(mask) * (1.0 if is_weights is None else is_weights)


def reference_logprobs(ref_model: Any, rows: Rows, temperature: float) -> Any:
    """--kl-coef: the frozen reference policy's logprobs of the rows' tokens [N, T], without gradient; else None."""
    if ref_model is None:
        return None
    with torch.no_grad():
        return token_logprobs(ref_model, rows, temperature)


def compute_loss(loss: Loss, inputs: LossInputs) -> LossOutputs:
    """The loss file's compute_loss on what it sees, each input by its name, with the run's hyper-parameters."""
    return LossOutputs(*loss.file.compute_loss(**vars(inputs), **loss.hyperparameters))


def mismatch_totals(rows: Rows, logprobs: Any, version: int) -> dict[str, float]:
    """The sampler/learner mismatch (tis.mismatch_metrics, token-weighted sums) on the completions sampled wholly by
    the weights being trained, `version` (lag 0), in all and per replica: a replica still serving old weights (an
    update that silently did nothing) shows here. A completion that straddles an update is left out: its later tokens
    were sampled over a KV cache computed by the older weights (PipelineRL's stale KV), which the learner does not
    reproduce, so it would show a mismatch (up to 0.6 in log-probability on the tiny model) that no engine causes.
    `logprobs` [N, T]: the learner's, detached."""
    whole = ((rows.versions == version) | (rows.versions < 0)).all(dim=1, keepdim=True)  # [N, 1]
    same_weights = rows.loss_mask & (rows.versions == version) & whole                   # [N, T]
    if not same_weights.any():
        return {}
    n_same = float(same_weights.sum())
    totals = {k: v * n_same for k, v in tis.mismatch_metrics(logprobs, rows.sampler_logprobs, same_weights).items()}
    totals["mismatch_tokens"] = n_same
    for r in rows.replicas[same_weights.any(dim=1)].unique().tolist():
        mine = same_weights & (rows.replicas == r)[:, None]
        n_mine = float(mine.sum())
        m = tis.mismatch_metrics(logprobs, rows.sampler_logprobs, mine)
        totals.update({f"mismatch_r{r}_{key}": m[f"mismatch_{key}"] * n_mine for key in PER_REPLICA_MISMATCH})
        totals[f"mismatch_r{r}_tokens"] = n_mine
    return totals


def optimizer_step(args: Args, learner: Learner, loss: float, has_groups: bool) -> tuple[float, bool]:
    """Clip the global gradient norm (--grad-clip) and step AdamW and the warm-up schedule. A non-finite gradient,
    or loss on any rank (`loss`: this rank's), skips the step on every rank (its gradients are dropped), and so does
    an empty batch. Returns (grad norm, finite). A fused AdamW (--adamw) is told of a skip on the device (found_inf,
    as torch.amp's GradScaler tells it), so the host queues the update while the GPU still runs the backward."""
    grad_norm = torch.nn.utils.clip_grad_norm_(learner.model.parameters(), args.grad_clip)
    skip = torch.full((), float(not math.isfinite(loss)), device=collective_device())  # filled there: no host copy
    dist.all_reduce(skip, op=dist.ReduceOp.MAX)
    grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).to(skip.device)
    skip = torch.maximum(skip, (~torch.isfinite(grad_norm)).float())
    fused = bool(learner.optimizer.defaults.get("fused"))
    if fused and has_groups:  # its kernel leaves the weights, moments and step count as they were where found_inf is 1
        learner.optimizer.found_inf = skip
        learner.optimizer.step()
        del learner.optimizer.found_inf
    grad_norm_value, finite = float(grad_norm), not skip.item()  # the step's one wait for the GPU
    if not (finite and has_groups):
        learner.optimizer.zero_grad(set_to_none=True)
    elif not fused:
        learner.optimizer.step()
    # A skipped step still counts in the schedule. When the run's first steps skip (every group dropped: the usual
    # start on a hard data set), torch warns that the scheduler stepped before the optimizer: no mistake of the run.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()` before"))
        learner.scheduler.step()
    return grad_norm_value, finite


def push_weights(learner: Learner, run: Run, version: int) -> tuple[float, float]:
    """Push the new weights to every generator replica as `version` (in pipeline mode applied between two decoding
    steps, in flight). Gathering them is a collective; rank 0 sends them. Returns the seconds rank 0 spent in all
    and, of those, in the transfer itself (vLLM's weight-transfer engines: Generator.update_weights)."""
    weights = push_state_dict(learner.model, run.generator)  # rank 0's, in the generator's dtype
    if not run.is_main or run.stop_reason:
        return 0.0, 0.0
    with generator_errors_noted(run):
        seconds = run.generator.update_weights(weights, version)
        return seconds, run.generator.last_broadcast_s
    return 0.0, 0.0


@contextlib.contextmanager
def generator_errors_noted(run: Run) -> Iterator[None]:
    """Rank 0: a GeneratorError is noted in run.stop_reason rather than raised, so that the next round tells
    every rank to checkpoint and stop together (an exception on rank 0 alone would leave the others waiting)."""
    try:
        yield
    except pipeline_rl.GeneratorError as e:
        run.stop_reason = str(e)
        print(f"[generator] {e}", file=sys.stderr, flush=True)


def pull_round_or_error(args: Args, run: Run, state: TrainerState) -> Round:
    """Rank 0: `pull_round`, or a Round that carries the generator's failure to every rank."""
    if not run.stop_reason:
        with generator_errors_noted(run), run.stopper.interrupting():  # a Ctrl-C ends the wait at once
            return pull_round(args, run.generator, state)
    return Round([], {}, stop_reason=run.stop_reason)


def evaluate(args: Args, run: Run, row: dict) -> None:
    """Rank 0: the mean@k pass rate on the held-out validation prompts (and on --test-dataset), added to `row`
    with k (--eval-samples; --final-eval-samples at the last step, when given) and the asymptote of the sigmoid
    fitted to the evaluations so far."""
    t0 = time.time()
    k = args.final_eval_samples if args.final_eval_samples and row["step"] == args.max_steps else args.eval_samples
    val = pass_rates(run.generator, run.val_problems, k, args.temperature)
    row.update(val_pass_rate=val["pass_rate"], val_reward=val["reward"], val_samples=k)
    if run.test_problems:
        test = pass_rates(run.generator, run.test_problems, k, args.temperature)
        row.update(test_pass_rate=test["pass_rate"], test_reward=test["reward"])
    row["eval_s"] = time.time() - t0  # both sets; later rows' rl_compute_hours leave it out
    run.eval_hours += row["eval_s"] / 3600.0
    run.eval_rows.append(row)
    asymptote = current_asymptote(run.eval_rows)
    if asymptote is not None:
        row["fit_asymptote"] = asymptote


def current_asymptote(rows: list[dict]) -> float | None:
    """The sigmoid fit's predicted asymptote A over the evaluation rows so far (None until it can be fitted)."""
    points = [(r["compute_hours"], r["val_pass_rate"]) for r in rows]
    if len(points) < 5:
        return None
    try:
        return scaling_fit.fit_sigmoid(*zip(*points)).A
    except ValueError:
        return None


def write_row(run: Run, row: dict) -> bool:
    """Rank 0: append `row` to metrics.jsonl; False if it could not be (a full disk: MetricsLog cut the file back to
    its last complete row, and writes no row after it). The first failure is noted in run.stop_reason, so that every
    rank checkpoints and stops together before the next step, as after a generator error."""
    try:
        run.metrics.write(row)
        return True
    except RunFileError as e:
        if str(e) not in (run.stop_reason or ""):  # its first failure
            run.stop_reason = "; ".join(filter(None, [run.stop_reason, f"{e}; metrics.jsonl has no row from step "
                                                                        f"{row['step']} on"]))
            print(f"[metrics] {e}", file=sys.stderr, flush=True)
        return False


def log_row(args: Args, run: Run, row: dict) -> None:
    """Rank 0: append the step's row to metrics.jsonl, move the progress bar, print a summary line every
    --log-every steps and at every evaluation."""
    write_row(run, row)
    run.recent.append(row)
    run.bar.update(1)
    run.bar.set_postfix(reward=f"{row['reward']:+.2f}", val=f"{run.eval_rows[-1]['val_pass_rate']:.2f}")
    if row["step"] % args.log_every == 0 or "val_pass_rate" in row:
        tqdm.write(summary_line(row, run.recent))
    if "val_pass_rate" in row and dashboard_due(run.dashboard_drawn, time.time(), last=row["step"] == args.max_steps):
        draw_dashboard(args, run)


DASHBOARD_EVERY_S = 60.0  # a drawing costs rank 0 about 1 CPU-second (2 cores), which the other rank waits out


def dashboard_due(last_drawn: float | None, now: float, last: bool) -> bool:
    """Whether this evaluation redraws dashboard.png: the first, the run's last, and any other at least
    DASHBOARD_EVERY_S after the previous drawing. At every evaluation (then every 5 steps) the drawings took a tenth
    of make run's time on 2 cores; once a minute they take about 2%, and the picture is never a minute old."""
    return last or last_drawn is None or now - last_drawn >= DASHBOARD_EVERY_S


def draw_dashboard(args: Args, run: Run) -> None:
    """Rank 0, at an evaluation that dashboard_due picks, and as the run ends (redraw_dashboard_if_behind):
    OUTPUT_DIR/dashboard.png redrawn from metrics.jsonl, the run at a glance (scaling_fit.plot_dashboard: pass rate
    and its fit, reward, entropy, lengths, KL, clipping, lag, speed)."""
    lines = run.metrics.lines
    try:
        scaling_fit.plot_dashboard([(f"{args.loss} ({args.mode})", read_run_metrics(run.metrics.path))],
                                   run.out / "dashboard.png")
    except Exception as error:  # a picture is not worth the run: say so, and train on
        tqdm.write(f"[dashboard] not drawn: {type(error).__name__}: {error}")
    run.dashboard_drawn, run.dashboard_lines = time.time(), lines


def redraw_dashboard_if_behind(args: Args, run: Run) -> None:
    """Rank 0, as the run ends cleanly (at --max-steps, or stopped with a checkpoint): dashboard.png drawn once more
    if metrics.jsonl has rows that its last drawing did not, since it is drawn at most once a minute; a run stopped
    early (Ctrl-C, SIGTERM, a dead generator, non-finite steps) would otherwise leave a picture up to a minute old."""
    if run.is_main and run.metrics.lines > run.dashboard_lines:
        draw_dashboard(args, run)


def checkpoint(learner: Learner, run: Run, state: TrainerState) -> None:
    """Save the model, the optimizer, every rank's RNG and the trainer state (checkpoint files: harness/checkpoints.py).
    Rank 0's state is the one written: it alone keeps the metrics log and the prompts' pass-rate history."""
    state.elapsed_hours, state.eval_hours = run.hours(), run.eval_hours
    state.metrics_lines = run.metrics.lines if run.is_main else 0
    save_checkpoint(run.out, learner.model, learner.optimizer, state.to_json(), run.rank)


def stop_if_signalled(args: Args, learner: Learner, run: Run, state: TrainerState) -> None:
    """Ctrl-C or SIGTERM to any rank, or a failure rank 0 noted in the middle of a round (a full disk): stop here,
    at a step boundary, with a checkpoint (a --resume redoes nothing)."""
    if run.stopper.agreed(also=run.stop_reason is not None):
        why = run.stop_reason or f"stopped by {run.stopper.signal or 'a signal to another rank or rank 0'}"
        stop_with_checkpoint(args, learner, run, state, resumable_stop(run, state, why))


def resumable_stop(run: Run, state: TrainerState, why: str) -> str:
    """The line of a stop that --resume continues: after which step, why, where the checkpoint is."""
    return (f"stopping after step {state.step}: {why}; checkpoint saved in {run.out / 'checkpoint'}: continue with "
            f"--resume {run.out}")


def stop_with_checkpoint(args: Args, learner: Learner, run: Run, state: TrainerState, line: str) -> NoReturn:
    """Every stop before --max-steps that keeps what was learned (a signal, a dead generator, a full disk, non-finite
    steps): the checkpoint, dashboard.png brought up to date, then SystemExit with the `line` that says why."""
    checkpoint(learner, run, state)
    redraw_dashboard_if_behind(args, run)
    raise SystemExit(line)


# ----------------------------------------------------------------------------------------------------------------
# What the steps use: logprobs through the FP32 LM head (harness/head_gemm.py), pass rates, the sigmoid fit
# ----------------------------------------------------------------------------------------------------------------


def token_logprobs(model: Any, rows: Rows, temperature: float) -> Any:
    """log pi(token) [N, L-1]: token_logprobs_and_entropy's first half, for old and reference logprobs."""
    return token_logprobs_and_entropy(model, rows, temperature, entropy=False)[0]


def token_logprobs_and_entropy(model: Any, rows: Rows, temperature: float, entropy: bool = True) -> tuple[Any, Any]:
    """log pi(token) for every next-token position [N, L-1], after dividing the logits by the sampling temperature,
    and with `entropy` the policy's entropy at each position [N, L-1] (a metric, without gradient; else None).
    Packed rows go through the model as they are, and their logprobs are gathered back into Rows' layout (0 beyond
    each sequence's end, where the loss files mask anyway).

    A learner (build_learner) scores the tokens through its FP32 head in chunks (head_gemm.model_logprobs), so the
    micro-batch's [N, L-1, V] float32 logits never exist at once (for a 150k-token vocabulary and long completions
    they would be tens of GB), and only at the positions that predict a completion token (Rows.scored; 0 at the
    prompt's); any other model goes through its full logits."""
    if rows.packed is None:
        input_ids, layout = rows.input_ids, {"attention_mask": rows.attention.long()}          # [N, L]
        scored = rows.scored
    else:  # no attention mask: transformers then reads the sequences' boundaries from the position ids
        input_ids, layout = rows.packed.input_ids, {"position_ids": rows.packed.position_ids}  # [R, W]
        scored = rows.packed.scored
    logprobs, entropies = model_logprobs(model, input_ids, temperature, scored, entropy, **layout)
    if rows.packed is None:
        return logprobs, entropies                                                            # [N, L-1] each
    unpack = lambda x: torch.where(rows.attention[:, 1:], x.reshape(-1)[rows.packed.index], 0.0)  # noqa: E731
    return unpack(logprobs), None if entropies is None else unpack(entropies)                # [R, W-1] -> [N, L-1]


def pass_rates(generator: Any, problems: list, samples: int, temperature: float) -> dict[str, float]:
    """mean@k pass rate (the fraction of correct completions, per prompt, averaged) and mean reward."""
    groups = generator.evaluate(problems, samples, temperature)
    rewards = [r for g in groups for r in g.rewards]
    per_prompt = [sum(r > 0 for r in g.rewards) / len(g.rewards) for g in groups]
    return {"pass_rate": sum(per_prompt) / len(per_prompt), "reward": sum(rewards) / len(rewards)}


def fit_and_plot(metrics_file: Path, out_png: Path, label: str) -> Any:
    """The end of a run: ScaleRL's sigmoid fitted to the evaluation rows, drawn with them into `out_png`."""
    rows = [r for r in read_run_metrics(metrics_file) if "val_pass_rate" in r]
    compute = [r["compute_hours"] for r in rows]
    reward = [r["val_pass_rate"] for r in rows]
    fit = None
    try:
        fit = scaling_fit.fit_sigmoid(compute, reward)
    except ValueError as err:  # too few points, or a flat curve: plot the points anyway
        few = f"skipped: {len(rows)} evaluations, and the sigmoid needs {scaling_fit.MIN_POINTS} (more --max-steps, " \
              "or a lower --eval-every)"
        print(f"[scaling fit] {few if len(rows) < scaling_fit.MIN_POINTS else err}")
    try:
        scaling_fit.plot_fits([(label, compute, reward, fit, None)], out_png, x_label="compute_hours",
                              y_label="val_pass_rate")
    except OSError as err:  # a full disk at the very end: the run, its checkpoint and metrics.jsonl are whole
        print(f"[scaling fit] {out_png} not written: {err.strerror or err} (python scaling_fit.py draws it again)")
    return fit


# ----------------------------------------------------------------------------------------------------------------
# The generator rank 0 owns (pipeline_rl.py): its settings from the flags, its start where the data stream left
# off, and the resumed weights pushed to it before it samples anything
# ----------------------------------------------------------------------------------------------------------------


def generator_config(args: Args, model_path: str) -> pipeline_rl.GeneratorConfig:
    """The generator's settings for this run: the rule's and the sampling's flags, and the fleet's (where and how
    the replicas run: runtime.fleet_config). Its seed is the run's own, resumed or not: each completion's sampler
    seed holds the weights' version as well (sampling_seed), so a resume draws what the run would have drawn."""
    round_steps = pipeline_rl.steps_per_round(args.mode, args.max_off_policy)
    return pipeline_rl.GeneratorConfig(
        model=model_path, **generator_values(args), seed=args.seed, data_seed=args.seed,
        groups_per_batch=args.prompts_per_step * round_steps,  # a round's groups, in one request
        fleet=fleet_config(args))


def start_generator(args: Args, setup: Any, state: TrainerState) -> pipeline_rl.Generator | None:
    """Rank 0: the generator and its vLLM replicas, started from the base weights where the data stream left off
    (runtime.generator_position: the prompts the run consumed skipped, its retired ones never sampled); None on the
    other ranks. set_up closes it, however the run ends."""
    if setup.rank != 0:
        return None
    config = generator_config(args, setup.model_path)
    setup.check_generator(config.max_tokens, config.fleet.max_model_len)  # the layout, the evaluation prompts
    setup.generator = pipeline_rl.Generator(config, setup.task, **generator_position(state))
    try:
        setup.generator.start()
    except pipeline_rl.GeneratorError as e:  # e.g. a remote replica that never joined: its line, no traceback
        raise SystemExit(f"train.py: error: {e}") from None
    if setup.device.type != "cuda":  # a GPU run printed it with the layout
        print(setup.generator.transport_line, flush=True)
    return setup.generator


def push_resumed_weights(learner: Learner, generator: pipeline_rl.Generator | None, step: int) -> None:
    """A resumed run's weights to the generator, which started from the base weights: gathered on every rank (a
    collective), sent by rank 0 as version `step`. A failure is one line: nothing has been trained yet."""
    weights = push_state_dict(learner.model, generator)
    if generator is not None:
        try:
            generator.update_weights(weights, step)
        except pipeline_rl.GeneratorError as e:  # a replica whose update failed, the last: one line
            raise SystemExit(f"train.py: error: {e}") from None


# ----------------------------------------------------------------------------------------------------------------
# The learner a rank trains: its loss file, its seeds, the policy as FSDP2 with ScaleRL's FP32 LM head, AdamW and
# its warm-up (main builds it once set_up knows the data and the model directory, and resumes it with Setup.resume)
# ----------------------------------------------------------------------------------------------------------------


def make_learner(args: Args, model_path: str, device: Any, rank: int) -> Learner:
    """The loss file --loss names (loss_file); the seeds (data order and sampling per rank, initialisation shared);
    the policy (build_learner) and, with --kl-coef, the frozen reference; AdamW and its linear warm-up over
    --warmup-steps. train.py builds it and hands it to the runtime (runtime.Setup.begin)."""
    loss = loss_file(args)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)
    model, n_params = build_learner(model_path, args, device)
    ref_model = build_reference(model_path, args, device) if args.kl_coef else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=args.adam_eps, weight_decay=args.weight_decay,
                                  fused=adamw_fused(args, device) or None)  # --adamw; None: PyTorch's default
    warmup = max(args.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)))
    return Learner(model=model, optimizer=optimizer, scheduler=scheduler, loss=loss, pad_id=pad_token_id(model_path),
                   n_params=n_params, ref_model=ref_model)


def loss_file(args: Args) -> Loss:
    """The loss file --loss names (LOSSES), with the run's keywords for its compute_loss (loss_hyperparameters) and
    its compute_advantages (--adv-norm, where it takes a normalization)."""
    return Loss(file=LOSSES[args.loss], hyperparameters=loss_hyperparameters(args),
                advantage_options=flag_keywords(args, LOSSES[args.loss].compute_advantages))


def loss_hyperparameters(args: Args) -> dict[str, Any]:
    """Keyword overrides for the loss file's compute_loss: the run's flags that its signature takes (flags.LOSS_FLAGS:
    Dr. GRPO's max_tokens is the generation budget, CISPO's aggregation --aggregation, every file's kl_coef
    --kl-coef, with ref_logprobs from the reference model), then --loss-arg's; everything not named keeps the
    file's paper default."""
    problems = loss_problems(args, LOSSES[args.loss])  # parse_args refused these before the start; a caller may not
    if problems:
        raise SystemExit("; ".join(problems))
    hp = flag_keywords(args, LOSSES[args.loss].compute_loss)
    for item in args.loss_arg or []:
        key, value = item.split("=", 1)
        hp[key] = parse_literal(value)
    return hp


def flag_keywords(args: Args, function: Any) -> dict[str, Any]:
    """The flags of LOSS_FLAGS that are set and that the loss file's `function` takes, as its keywords."""
    keywords = inspect.signature(function).parameters
    return {keyword: getattr(args, name) for keyword, name in LOSS_FLAGS[function.__name__].items()
            if keyword in keywords and getattr(args, name)}


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
            model.lm_head.register_forward_pre_hook(lambda module, inputs: (inputs[0].float(), *inputs[1:]))
        tied = model.lm_head.weight is model.get_input_embeddings().weight
        head = [model.get_input_embeddings(), model.lm_head] if tied else model.lm_head
        fully_shard(head, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, cast_forward_inputs=cast),
                    **offload)
    reshard = reshard_layers(args, dist.get_world_size())  # --fsdp-reshard
    for layer in model.model.layers:
        fully_shard(layer, **({"mp_policy": mp} if mp else {}), **offload, reshard_after_forward=reshard)
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
    install_target_logprobs(model, args.logits_chunk_tokens, gemm)
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


# ----------------------------------------------------------------------------------------------------------------
# train.py's other commands: `train.py NAME ARGS...` (main) prints what COMMANDS[NAME](ARGS) returns; each is an
# entry into harness/commands.py, handed what only the recipe has: the loss table, the generator it builds
# ----------------------------------------------------------------------------------------------------------------


def evaluation_generator(args: Args, model_dir: str, task: Any) -> pipeline_rl.Generator:
    """`train.py evaluate`'s generator: the run's, in sync mode, serving the model directory `model_dir`."""
    return pipeline_rl.Generator(dataclasses.replace(generator_config(args, model_path=model_dir), mode="sync"), task)


RULE_CHECKS = {"generator_checks": pipeline_rl.config_problems}  # the rule's settings, checked by the rule
COMMANDS = {
    "export": commands.export_command,  # RUN_DIR OUT_DIR: a run's policy as a Hugging Face model directory
    "evaluate": functools.partial(commands.evaluate_command, losses=LOSSES, **RULE_CHECKS,
                                  generator=evaluation_generator),  # pass@k
    "migrate-checkpoint": commands.migrate_command,  # RUN_DIR: an older run's checkpoints, converted
    "plan": functools.partial(commands.plan_command, losses=LOSSES, **RULE_CHECKS),  # memory per rank, no GPU needed
    "--help-markdown": functools.partial(commands.help_markdown, losses=LOSSES),  # the flags as docs/flags.md has them
}


if __name__ == "__main__":  # vLLM on CPU spawns its workers: the entry point must be guarded
    note_error_lines()  # under torchrun: the error line a rank prints is handed to torchrun's failure summary too
    try:
        main()
    except (SystemExit, Exception) as stop:  # a run that stops on an error skips the teardown as well: a gloo
        exit_at_once(report_exit(stop))      # thread racing it would turn the error's exit into a crash
    exit_at_once()  # all is written and closed: skip the interpreter's teardown of torch (1.3 s a rank, each run)
