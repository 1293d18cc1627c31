"""harness/runtime.py: the learner's runtime, what makes the recipe survive real machines. A reader of the recipe may
skip it. It never calls back into train.py: train.py builds its learner and its generator and hands them in.

It holds:
  - `set_up`: everything before the first step, on every rank, around the learner and the generator train.py builds
    (process groups, the OUTPUT_DIR lock, data; `Setup.resume`, `Setup.check_generator` and the generator's
    settings from the flags (`fleet_config`, `generator_position`); then `Setup.begin`: the metrics log), and `Run`,
    the run around the learner that the loop works with;
  - the collectives that keep the learner ranks in step (`broadcast_from_rank0`, `reduce_metrics`, the idle
    forwards of a rank with no micro-batch left, `full_state_dict`, `push_state_dict`);
  - signals (`GracefulStop`), the output-directory lock, the metrics file (`MetricsLog`) and a metrics row's
    bookkeeping (`new_row`, `summary_line`, model FLOPs utilisation);
  - --report-to: the rows sent to TensorBoard, W&B or trackio as well (`Reporter`, `report_scalars`).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from tqdm import tqdm

from harness import base_model, cli, fleet, tasks
from harness.cli import RankStop, quiet_rank_exit
from harness import vllm_replica  # the replica runtime: the secret file, the parent-death signal
from harness.checkpoints import (CHECKPOINT_DIRS, LinkRefusedError, TrainerState, load_checkpoint, make_run_dir,
                                 newest_checkpoint_step, newest_trainer_state, open_no_follow, read_no_follow,
                                 refuse_unless_regular, write_atomically, write_failure)
from harness.flags import (Args, fleet_values, generator_memory_fraction, generator_node, layout_lines,
                           learner_gpus, local_replicas, node_learner_ranks, resolve_defaults, secret_file_here,
                           step_ranges, trackio_dir, trackio_dir_problem, write_args_json)
from harness.packing import model_device


# ----------------------------------------------------------------------------------------------------------------
# The run around the learner, and what a metrics row counts beside the loss (model FLOPs utilisation, the fit)
# ----------------------------------------------------------------------------------------------------------------


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
    eval_hours: float = 0.0  # wall-clock hours spent evaluating so far, across resumes (train.evaluate adds)
    generator: Any = None  # pipeline_rl.Generator (train.py's start_generator)
    metrics: MetricsLog | None = None  # metrics.jsonl
    bar: Any = None  # tqdm progress bar (disabled off rank 0)
    recent: deque = field(default_factory=deque)  # the last --log-every rows, for the summary line
    eval_rows: list[dict] = field(default_factory=list)  # the evaluation rows so far, for the running sigmoid fit
    dashboard_drawn: float | None = None  # time.time() of the last dashboard.png drawn (train.dashboard_due)
    dashboard_lines: int = 0  # metrics.jsonl's lines at that drawing (train.redraw_dashboard_if_behind)
    data_skipped: dict[str, Any] = field(default_factory=dict)  # a fresh run's first row: bad data rows skipped
    lock: Any = None  # the open OUTPUT_DIR/.lock (rank 0), held as long as this object lives
    stop_reason: str | None = None  # rank 0: why the run must stop (the generator failed, a full disk), once noted

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def hours(self) -> float:
        return (time.time() - self.started) / 3600.0


def completion_lengths(groups: list) -> dict[str, float]:
    """The lengths of a batch's completions in generated tokens, the second thing RL practitioners watch after the
    reward: their mean, 90th percentile and longest; the mean of the correct and of the incorrect ones (a length
    that grows on wrong answers only is rambling, not reasoning); and the fractions interrupted and cut off."""
    completions = [c for grp in groups for c in grp.completions]
    if not completions:
        return {}
    lengths = sorted(len(c.token_ids) for c in completions)
    mean = lambda values: sum(values) / len(values) if values else None  # noqa: E731 (None: no such completion)
    return {"length_mean": mean(lengths), "length_p90": float(lengths[math.ceil(0.9 * len(lengths)) - 1]),
            "length_max": float(lengths[-1]),
            "length_mean_correct": mean([len(c.token_ids) for c in completions if c.reward > 0]),
            "length_mean_incorrect": mean([len(c.token_ids) for c in completions if not c.reward > 0]),
            "frac_interrupted": mean([float(c.interrupted) for c in completions]),
            "frac_truncated": mean([float(c.truncated) for c in completions])}


def new_row(run: Run, state: TrainerState) -> dict[str, Any]:
    """The start of a metrics.jsonl row: where the run stands in steps and compute. rl_compute_hours is
    compute_hours without the evaluations' time: the RL run's own compute, which ScaleRL's x axis counts, and which
    does not grow with --eval-every (on CPU evaluations can take a third of the wall time). In pipeline mode the
    generator goes on sampling training groups during an evaluation: that share is left out with it."""
    hours = run.hours()
    return {"step": state.step, "compute_hours": hours * run.devices_in_use,
            "rl_compute_hours": (hours - run.eval_hours) * run.devices_in_use, "flops": state.flops,
            "tokens": state.gen_tokens}


def summary_line(row: dict, recent: deque) -> str:
    mean = lambda key: sum(r.get(key, 0.0) for r in recent) / max(len(recent), 1)  # noqa: E731
    parts = [f"step {row['step']:4d}", f"reward {mean('reward'):+.3f}", f"train pass {mean('train_pass_rate'):.3f}"]
    if "val_pass_rate" in row:
        parts.append(f"VAL PASS {row['val_pass_rate']:.3f}")
    if "fit_asymptote" in row:
        parts.append(f"fit A {row['fit_asymptote']:.3f}")
    parts += [f"clip {mean('clip_frac'):.3f}", f"kl {mean('kl_k3'):.2e}", f"0-var {mean('frac_zero_variance'):.2f}",
              f"lag {mean('lag_mean'):.2f}", f"len {mean('length_mean'):.1f}", f"ent {mean('entropy'):.3f}",
              f"wait {mean('wait_s'):.2f}s",
              f"step {mean('step_s'):.2f}s", f"{row['compute_hours'] * 3600:.0f} dev-s"]
    return " | ".join(parts)


# ----------------------------------------------------------------------------------------------------------------
# Setup: from the flags to the learner, the generator and the trainer state the loop starts from
# ----------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def set_up(args: Args) -> Iterator[Setup]:
    """Everything before the first step, on every rank, around the learner and the generator that train.py builds:
    here the process group, the OUTPUT_DIR lock, the data and the model's path, with the defaults they decide (a
    Setup); then Setup.resume(learner), train.py's generator, and Setup.begin: the metrics log. On exit the generator
    is closed; a run that fails
    before its first metrics row leaves OUTPUT_DIR as it found it (with --overwrite, the old run is deleted only
    once all of that has started)."""
    tasks.set_vllm_cpu_env()  # vLLM's CPU settings (offline hub, no dynamo); nothing on a machine with CUDA
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun starts each rank in a session of its own, so a `kill -9` of torchrun would leave the ranks
        # training on, and a --resume would then race them for OUTPUT_DIR: die with the launcher instead.
        vllm_replica.set_parent_death_signal(signal.SIGKILL)
    rank, world, device = init_distributed(args.gen_devices, args.cpu_offload, process_group_timeout(args))
    is_main = rank == 0
    stopper = GracefulStop(announce=is_main, at_once=True)  # until the first step: nothing to checkpoint
    out = Path(args.output_dir)
    fresh_dir = not out.exists()  # a start that fails removes what it made, and only that
    found = {name for name in FAILED_START_FILES if os.path.lexists(out / name)}
    lock = claim_output_dir(out, is_main)
    # --overwrite deletes the old run last, once all checks pass
    setup = Setup(args, rank, world, device, stopper, out, lock, old_run_kept=args.overwrite and not fresh_dir,
                  found=found)
    try:  # until the first metrics row, a failure leaves the output directory as it was found
        refuse_unshared_output_dir(out, rank, world)
        # Data and model (without --model: the base model shipped with the repository).
        setup.task, setup.test_task = _data(args, is_main)
        setup.data_digest = tasks.data_digest(setup.task, setup.test_task)
        if args.resume and (newest := newest_trainer_state(out)) is not None:  # before the learner is built
            _refuse_changed_data(args, out, newest, setup.data_digest, rank)
        setup.model_path = _model_path(args, is_main)
        resolve_defaults(args, args.model is None, device.type == "cuda")
        yield setup
    except BaseException:
        stopper.at_once = False  # the cleanup below runs to its end unless signalled twice
        if is_main and not args.resume and not setup.old_run_kept and (setup.log is None or setup.log.lines == 0):
            _remove_failed_start(out, fresh_dir, setup.found)  # the corrected command must not find a "run" here
        raise
    finally:
        if setup.generator is not None:
            setup.generator.close()
        if setup.log is not None and setup.log.reporter is not None:
            setup.log.reporter.close()


@dataclass
class Setup:
    """A run between set_up's two halves: what train.py builds its learner and its generator with (this rank, its
    device, the model's path, the data), `resume` into that learner, `check_generator` before the generator starts,
    then `begin`, which opens the rest. set_up closes the generator and what begin opens."""

    args: Args
    rank: int
    world: int
    device: Any
    stopper: GracefulStop
    out: Path  # --output-dir
    lock: Any  # the open OUTPUT_DIR/.lock (rank 0)
    old_run_kept: bool  # --overwrite: the old run stays until everything has started
    found: set[str] = field(default_factory=set)  # FAILED_START_FILES that were there before this start
    model_path: str = ""  # --model, or the embedded base model
    task: Any = None
    test_task: Any = None
    data_digest: str = ""  # tasks.data_digest of task and test_task, kept in the run's checkpoints
    generator: Any = None  # rank 0, once train.py has started it (set_up closes it, however the run ends)
    problems: tuple[list, list] | None = None  # evaluation_problems', once asked for
    log: MetricsLog | None = None  # rank 0, once begin has opened metrics.jsonl

    def resume(self, learner: Any) -> TrainerState:
        """The TrainerState the loop starts from: a fresh one, or with --resume the checkpoint's, its weights and
        optimizer loaded into `learner` and the warm-up schedule stepped to where it was."""
        return _resumed_state(self.args, self.out, learner, self.rank, self.data_digest)

    def check_generator(self, max_tokens: int, max_model_len: int) -> None:
        """Rank 0, before the generator starts (train.py's start_generator): on a GPU, where everything goes and how
        weights travel (`train.py plan --gpus N` prints the same); an evaluation prompt too long for the context
        refused in one line; the remote replicas awaited, with the command that starts them."""
        args = self.args
        if self.device.type == "cuda":
            print("\n".join(layout_lines(args, torch.cuda.device_count(), node_learner_ranks())), flush=True)
        val_problems, test_problems = self.evaluation_problems()
        check_eval_prompts(self.model_path, max_tokens, max_model_len, val_problems + test_problems)
        if args.gen_remote_replicas:
            print(f"[generator] waiting up to {args.gen_join_timeout:.0f} s for {args.gen_remote_replicas} "
                  f"remote replica(s): on each generator node run `python pipeline_rl.py replica --connect "
                  f"{args.gen_listen} --secret-file FILE`", file=sys.stderr, flush=True)

    def evaluation_problems(self) -> tuple[list, list]:
        """(the validation problems, --test-dataset's), as every evaluation of the run takes them."""
        if self.problems is None:
            test = self.test_task.validation(None) if self.test_task else []
            self.problems = self.task.validation(self.args.eval_prompts), test
        return self.problems

    def begin(self, state: TrainerState) -> Run:
        """Once the learner is resumed and rank 0's generator started (train.py): open the metrics log, and give the
        Run the loop talks to."""
        args, is_main, out, task = self.args, self.rank == 0, self.out, self.task
        data_skipped = {}
        if not args.resume and is_main:
            data_skipped = {"data_skipped_rows": getattr(task, "skipped_rows", 0),
                            "data_skipped_reasons": getattr(task, "skipped_reasons", {})}
        val_problems, test_problems = self.evaluation_problems()
        devices_in_use = _devices_in_use(args, self.world, fleet_config(args), node_learner_ranks())
        eval_rows: list[dict] = []
        if is_main:  # the run's files appear only once it has started
            if args.overwrite:  # data, model and generator have all started: only now is the old run deleted
                remove_previous_run(out)
                self.old_run_kept = False
                self.found.discard("metrics.jsonl")  # the old run's are gone: those written from now are this run's
                self.found.discard("args.json")
            self.log = MetricsLog(out / "metrics.jsonl", state.metrics_lines if args.resume else 0,
                                  covers_step=state.step if args.resume else None)
            self.log.reporter = Reporter(args.report_to, out, vars(args),
                                         first_step=state.step + 1 if args.resume else 0,
                                         reported_through=self.log.cut_through)
            eval_rows = _record_start(args, out, state, self.log)
        bar = tqdm(total=args.max_steps, initial=state.step, desc=f"{args.loss}/{args.mode}", disable=not is_main,
                   dynamic_ncols=True)
        run = Run(rank=self.rank, world=self.world, out=out, stopper=self.stopper, devices_in_use=devices_in_use,
                  started=time.time() - state.elapsed_hours * 3600.0, eval_hours=state.eval_hours,
                  val_problems=val_problems, test_problems=test_problems, generator=self.generator,
                  metrics=self.log, bar=bar, recent=deque(maxlen=args.log_every), eval_rows=eval_rows,
                  data_skipped=data_skipped, lock=self.lock)
        self.stopper.at_once = False  # from the first step on, a signal stops at a step boundary, with a checkpoint
        return run


def generator_position(state: TrainerState) -> dict[str, Any]:
    """Where the generator's data stream starts (pipeline_rl.Generator's keywords): the prompts the run has consumed
    skipped, its retired prompts never sampled."""
    consumed = state.consumed
    data_start = min(set(range(max(consumed, default=-1) + 2)) - consumed)
    return {"data_start": data_start, "skip_indices": {i for i in consumed if i >= data_start},
            "retired_ids": state.retired}


def _data(args: Args, is_main: bool) -> tuple[tasks.Task, tasks.Task | None]:
    """load_tasks, a bad row named in a message rather than a traceback; what was skipped said once (rank 0)."""
    try:
        task, test_task = load_tasks(args)
    except (tasks.BadRowError, FileNotFoundError) as e:  # every bad row is named: a message, not a traceback
        _stop_every_rank(f"train.py: error: {e}", is_main)
    for t in (task, test_task):
        if is_main and getattr(t, "skipped_summary", ""):
            print(f"[data] {t.name_or_path}: {t.skipped_summary}", file=sys.stderr)
    for evaluated, what, metrics in ((task, "validation", "val_*"), (test_task, "--test-dataset", "test_*")):
        if is_main and (trained := tasks.trained_eval_problems(task, evaluated)):
            print(f"train.py: warning: {trained} of the {len(evaluated.validation(None))} {what} problems are also "
                  f"training problems of --dataset: the {metrics} metrics measure problems the run trains on, not "
                  "held out ones", file=sys.stderr, flush=True)
    return task, test_task


def _stop_every_rank(line: str, is_main: bool) -> NoReturn:
    """Status 2 on every rank for an error each rank met itself: rank 0 prints `line`, another keeps it (cli.RankStop)
    for the node where torchrun does not end it."""
    if is_main:
        print(line, file=sys.stderr, flush=True)
    raise RankStop(2, line) from None


def _model_path(args: Args, is_main: bool) -> str:
    """--model, or the embedded base model shipped with the repository, its checksum checked (a damaged copy is a
    message naming how to restore it, not a traceback)."""
    if args.model is not None:
        return args.model
    try:
        return str(base_model.embedded_base_model())
    except base_model.BaseModelDamagedError as e:
        _stop_every_rank(f"train.py: error: {e}", is_main)


# A share of unknown tokens in the evaluation prompts past which the model cannot read the data set: GSM8K's prompts
# through the embedded tiny model's word-level tokenizer (which knows only its task's symbols) were 40% <|unk|>; a
# byte-level BPE model has no unknown token, and a word-level one meets an unknown word now and then.
UNKNOWN_TOKENS_NOTED = 0.1


def check_eval_prompts(model_path: str, max_tokens: int, max_model_len: int, problems: list[tasks.Problem],
                       command: str = "train.py") -> None:
    """Rank 0, before the generator starts: a validation or test prompt too long for the context is one line naming
    it and the limit (the first evaluation would fail on it); a training prompt that is too long is skipped. Prompts
    whose tokens are more than UNKNOWN_TOKENS_NOTED unknown to the model's tokenizer get a warning: a run on them
    (GSM8K on the tiny model) trains on <|unk|> and scores about 0, which said nothing of why. A warning, not an
    error: the math tasks' plumbing is tried on the tiny model so (the tests do)."""
    if not problems:
        return
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    unknown_id, tokens, unknown, example = getattr(tokenizer, "unk_token_id", None), 0, 0, None
    for problem in problems:
        ids = tasks.chat_prompt_ids(tokenizer, problem.prompt)
        if why := tasks.prompt_overflow(problem, len(ids), max_tokens, max_model_len):
            raise SystemExit(f"{command}: error: evaluation {why}; raise --max-model-len or lower --max-tokens")
        tokens, unknown = tokens + len(ids), unknown + (ids.count(unknown_id) if unknown_id is not None else 0)
        example = example or (problem if unknown_id in ids else None)
    if example is not None and unknown > UNKNOWN_TOKENS_NOTED * tokens:
        print(f"{command}: warning: {unknown / tokens:.0%} of the evaluation prompts' tokens are unknown to the "
              f"tokenizer of {model_path} ({tokenizer.unk_token}; prompt {example.id}: {example.prompt[:60]!r}): the "
              "model cannot read this data set, and its pass rate will stay near 0; give --model one whose tokenizer "
              "covers it (docs/real-models.md)", file=sys.stderr, flush=True)


def _resumed_state(args: Args, out: Path, learner: Any, rank: int, data_digest: str) -> TrainerState:
    """A fresh TrainerState, or with --resume the checkpoint's, its weights and optimizer loaded into `learner`
    and the learning-rate schedule stepped to where it was. A resume whose data sets give other problems than the
    run started with (`data_digest`: a file edited, rows added, a hub set updated) is refused in one line: the
    checkpoint's data position and prompt history would point at other problems, and its validation curve would
    change mid-run. A checkpoint from before the digest was kept takes today's."""
    state = TrainerState(data_digest=data_digest)
    if args.resume:
        saved, ckpt = load_checkpoint(out, learner.model, learner.optimizer, rank)
        _refuse_changed_data(args, out, saved, data_digest, rank)  # set_up asked the newest; this one may be older
        state = TrainerState.from_json(saved)
        state.data_digest = data_digest
        if rank == 0:
            print(f"[resume] {ckpt}: step {state.step}", file=sys.stderr)
        for _ in range(state.step):
            learner.scheduler.step()
    return state


def _refuse_changed_data(args: Args, out: Path, saved_state: dict, data_digest: str, rank: int) -> None:
    """A resume whose data sets give other problems than the checkpoint's run started with is one line (rank 0)
    and SystemExit(2) on every rank. A checkpoint from before the digest was kept (none saved) passes."""
    if saved_state.get("data_digest", "") in ("", data_digest):
        return
    data = " and ".join(f"--{flag.replace('_', '-')} {getattr(args, flag)}"
                        for flag in ("dataset", "test_dataset") if getattr(args, flag))
    line = (f"train.py: error: --resume {out}: the run's data changed since it started ({data}): its checkpoint's "
            "data position and its validation would point at other problems; restore the data as it was, or start "
            "a new run (another --output-dir)")
    _stop_every_rank(line, rank == 0)


def _devices_in_use(args: Args, world: int, gen_config: fleet.FleetConfig, local_ranks: int) -> int:
    """learner ranks + the replicas (on CPU a replica counts as a device); on GPU: the GPUs either of them uses, a
    GPU rank 0's node shares between a learner rank and a replica (one of its `local_ranks`) counted once. The
    learner ranks of other nodes count too: taking only rank 0's node's, a run over two 8-GPU nodes was counted 8
    GPUs where it held 16, and its compute_hours (the scaling fit's x axis) with them."""
    devices_in_use = world + gen_config.replicas + gen_config.remote_replicas
    if args.gen_devices:
        learner_ids, gen_ids = vllm_replica.split_devices(args.gen_devices, torch.cuda.device_count())
        shared = len(set(gen_ids) & set(learner_ids[:local_ranks]))
        devices_in_use = world + len(gen_ids) - shared + gen_config.remote_replicas * args.tensor_parallel_size
    return devices_in_use


def _record_start(args: Args, out: Path, state: TrainerState, log: MetricsLog) -> list[dict]:
    """Rank 0, once the run has started: args.json written (with this resume in its history), a metrics file cut
    short behind the run's back said, and the evaluation rows the sigmoid fit has so far."""
    try:
        write_args_json(out, args, state.step, log.missing_steps)
    except OSError as e:  # a full disk: one line (an old args.json stays whole: it is replaced by a rename)
        size = len(json.dumps(vars(args), default=str))
        raise SystemExit(f"train.py: error: {write_failure(out / 'args.json', e, size, 'args.json')}") from None
    if log.missing_steps:  # a metrics file cut short behind the run's back: say so, and keep it on record
        gaps = ", ".join(f"{a}..{b}" if a < b else str(a) for a, b in step_ranges(log.missing_steps))
        print(f"[resume] {log.path} holds {log.lines} rows but the checkpoint covers {state.metrics_lines}: "
              f"no rows for steps {gaps} (recorded in args.json's resumes)", file=sys.stderr)
    if log.lines:
        return [r for r in read_run_metrics(log.path) if "val_pass_rate" in r]
    return []


SLOWEST_DECODE_TOKENS_PER_S = 10  # one completion's decoding speed process_group_timeout allows for (a GPU: 30-100+)


def process_group_timeout(args: Args) -> timedelta:
    """How long a learner rank may wait in a collective while rank 0 works alone: starting vLLM (--gen-join-timeout
    and the minute Generator.start adds to it), then the step-0 evaluation and a batch, each allowed at least
    torch's gloo default of 30 minutes, or one --max-tokens completion decoded at SLOWEST_DECODE_TOKENS_PER_S. Later
    steps wait for less (an evaluation and a batch, vLLM already up). NCCL's own default, 10 minutes, would have its
    watchdog kill the waiting ranks during a long vLLM start."""
    each = max(1800.0, args.max_tokens / SLOWEST_DECODE_TOKENS_PER_S)
    return timedelta(seconds=args.gen_join_timeout + 60 + 2 * each)


def init_distributed(gen_devices: str | None = None, cpu_offload: bool = False,
                     timeout: timedelta | None = None) -> tuple[int, int, Any]:
    """(rank, world size, this rank's device). On GPU the learner keeps off the generator's `gen_devices`;
    `cpu_offload` (--cpu-offload) adds gloo for the collectives over the parameters and gradients FSDP2 keeps on
    the host (the gradient norm's). `timeout`: of every NCCL collective (process_group_timeout; None: torch's
    default)."""
    # plain `python train.py`: a world of one, its store in this process. A TCP store needs a port, and one derived
    # from the pid (29500 + pid % 1000, as before) was taken now and then by another run or test on the machine.
    alone = {} if "RANK" in os.environ else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    if alone:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not alone:
        wait_for_every_rank(rank, world, timeout or timedelta(minutes=30))  # (torch's gloo default)
    if torch.cuda.is_available():
        learner_ids = learner_gpus(gen_devices, torch.cuda.device_count())
        device = torch.device("cuda", learner_ids[int(os.environ["LOCAL_RANK"]) % len(learner_ids)])
        torch.cuda.set_device(device)
        dist.init_process_group("cuda:nccl,cpu:gloo" if cpu_offload else "nccl", device_id=device, timeout=timeout,
                                **alone)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **alone)  # gloo's own 30 minutes: a CPU run's dead peer is not waited longer
        # The cores this process may use are shared by this node's learner ranks and, on rank 0's node, the
        # generator: oversubscribing threads only slows all down. (Counting every node's ranks, and the machine's
        # cores rather than those a job scheduler gave it, left a rank a thread where it had several.)
        sharing = node_learner_ranks() + generator_node()
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // sharing))
    return rank, world, device


JOIN_POLL_S = 0.2  # how often a rank waiting for the others to join looks at the start store


def wait_for_every_rank(rank: int, world: int, timeout: timedelta) -> None:
    """Before the process group: count this rank in the start store (cli.start_store), then wait until all `world`
    ranks are in, or one has stopped before joining (cli.tell_the_other_ranks). Rank 0 then stops with that
    rank's line, its rank and host; the others stop quietly, rank 0 speaking for them. torch's own set-up would have
    waited out its timeout for a rank that will never come (a flag check that failed on one node only). A rank that
    never arrives nor says why (killed before) is one line of rank 0 at `timeout`. Outside torchrun: no wait."""
    store = cli.start_store()
    if store is None or world < 2:
        return
    try:
        store.set(f"process/{rank}", json.dumps([socket.gethostname(), os.getpid()]))  # (set before it counts in)
        store.add("joined", 1)
        deadline = time.monotonic() + timeout.total_seconds()
        while (joined := store.add("joined", 0)) < world:
            if store.check(["stopped"]):
                stopped = json.loads(store.get("stopped"))
                if rank != 0:
                    raise SystemExit(1)
                line = re.sub(r" \[rank \d+ on .*\]$", "", stopped["line"].removeprefix("train.py: error: "))
                raise SystemExit(f"train.py: error: learner rank {stopped['rank']} on {stopped['host']} stopped "
                                 f"before the ranks could join (its torchrun's summary there says so too): {line}")
            if time.monotonic() > deadline:
                raise SystemExit(1 if rank else f"train.py: error: {joined} of {world} learner ranks joined within "
                                 f"{timeout.total_seconds():g} s; the others never came: their nodes' torchrun "
                                 "output says why")
            time.sleep(JOIN_POLL_S)
    except RuntimeError as error:  # (torch's DistNetworkError): node 0's torchrun, which holds the store, is gone,
        # and rank 0 with it; each node's first rank says so, where torch's traceback said "Failed to recv"
        address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        line = (f"train.py: error: torchrun's store at {address} went away while the learner ranks were joining "
                f"({str(error).splitlines()[0]}): the torchrun of node 0 there stopped, and its output says why")
        if rank == 0:
            raise SystemExit(line) from None
        if os.environ.get("LOCAL_RANK", "0") == "0":  # here, not through rank0_speaks: no rank 0 is left to say it
            print(line, file=sys.stderr, flush=True)
        raise Rank0Gone(1) from None


class Rank0Gone(SystemExit):
    """A rank's stop with no rank 0 left to speak for it (node 0's torchrun gone): it has said why itself, and
    rank0_speaks lets it exit without the wait for the signal that rank 0's exit would have brought."""


def rank0_killed(wait_s: float = 1.0) -> bool:
    """On rank 0's node: whether learner rank 0's process (noted in the start store as it joined) has ended (gone, or
    a zombie not yet reaped, looked at for up to `wait_s`: its sockets close as it exits, a moment before it is a
    zombie) without saying why. A rank 0 that stops with a line or a traceback marks the start store first
    (cli.torchrun_error_file), before its process ends. False where it is not known."""
    store = cli.start_store()
    try:
        if store is None or not store.check(["process/0"]):
            return False
        host, pid = json.loads(store.get("process/0"))
        return host == socket.gethostname() and _process_ended(pid, wait_s) and not store.check(["rank0-stopped"])
    except RuntimeError:  # torchrun's store is gone too
        return False


def _process_ended(pid: int, wait_s: float) -> bool:
    """Whether process `pid` (of this host) is gone or a zombie, looked at for up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                ended = stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            ended = True
        if ended or time.monotonic() > deadline:
            return ended
        time.sleep(0.01)


def claim_output_dir(out: Path, is_main: bool) -> Any:
    """One run per OUTPUT_DIR at a time: rank 0 takes the lock, and every rank stops if it is taken. The lock
    dies with its process, so a killed run never blocks its own --resume. Returns the open lock file (rank 0)."""
    lock, error = None, [None]
    if is_main:
        try:
            lock = lock_output_dir(out)
            refuse_planted_links(out)
        except (OutputDirBusyError, LinkRefusedError) as e:
            error = [str(e)]
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        dist.destroy_process_group()
        raise SystemExit(error[0])
    return lock


SHARED_DIR_WAIT_S = 60.0  # NFS's longest attribute cache by default (acdirmax): a new file may take that long to show


def refuse_unshared_output_dir(out: Path, rank: int, world: int, wait_s: float = SHARED_DIR_WAIT_S) -> None:
    """On several ranks, OUTPUT_DIR must be one directory for all of them: each writes its own shard of every
    checkpoint there, and rank 0 reads them all back before rotating the checkpoint in. Nodes that each have a
    directory of their own (a local disk at the same path) trained until the first checkpoint, --checkpoint-every
    steps in, to fail on rank 0's "shard-00002-... is missing". Asked at the start instead: rank 0 writes a file of a
    fresh name there and each other rank must read it within `wait_s` (a shared file system's client may cache the
    directory's old listing that long). A rank that does not is one line on every rank, naming it and its host."""
    if world < 2:
        return
    name = [f".shared-{secrets.token_hex(8)}" if rank == 0 else None]
    if rank == 0:
        os.close(open_no_follow(out / name[0], os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    dist.broadcast_object_list(name, src=0)
    deadline = time.monotonic() + wait_s
    while not (seen := rank == 0 or os.path.lexists(out / name[0])) and time.monotonic() < deadline:
        time.sleep(0.2)
    views: list[Any] = [None] * world
    dist.all_gather_object(views, (seen, socket.gethostname()))
    if rank == 0:
        (out / name[0]).unlink()
    blind = [f"rank {r} (on {host})" for r, (saw, host) in enumerate(views) if not saw]
    if blind:
        raise SystemExit(f"train.py: error: --output-dir {out} is not one directory for every rank: {', '.join(blind)} "
                         f"did not see the file rank 0 (on {views[0][1]}) wrote there within {wait_s:g} s. Each rank "
                         "writes its own shard of every checkpoint into it: on several nodes it must be on a file "
                         "system they share (NFS, Lustre, a cloud file store), at the same path on each")


def remove_previous_run(out: Path) -> None:
    """--overwrite, once the new run has passed every check and started: the old run's checkpoints, metrics (with
    --report-to's) and plot go (its args.json is rewritten next)."""
    for name in ("checkpoint", "checkpoint.old", "checkpoint.tmp"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("metrics.jsonl", "scaling.png", "dashboard.png"):
        (out / name).unlink(missing_ok=True)
    for name in REPORT_DIRS:  # --report-to's copies of the old rows: a new run must not be drawn over them
        shutil.rmtree(out / name, ignore_errors=True)


FAILED_START_FILES = ("metrics.jsonl", "args.json", ".lock")  # what a start writes before its first metrics row


def _remove_failed_start(out: Path, fresh_dir: bool, found: set[str] = frozenset()) -> None:
    """Leave the output directory as a failed start found it: of FAILED_START_FILES, those it wrote go, and those
    that were there before it (`found`: a file it did not write, a .lock left by a killed run) stay."""
    for name in FAILED_START_FILES:
        if name not in found:
            (out / name).unlink(missing_ok=True)
    if fresh_dir:
        try:
            out.rmdir()
        except OSError:  # something else is in it now: keep it
            pass


def load_tasks(args: Args) -> tuple[tasks.Task, tasks.Task | None]:
    """The training task behind --dataset (with --dataset-config for a hub data set) and the optional test task.
    A data set found nowhere is named with its flag: "--dataset NAME: not a local file and not found on the hub"."""
    try:
        task = tasks.load_task(args.dataset, **{k: v for k, v in (("question_field", args.question_field),
                                                                    ("answer_field", args.answer_field),
                                                                    ("skip_bad_rows", args.skip_bad_rows),
                                                                    ("dataset_config", args.dataset_config)) if v})
    except tasks.DataNotFoundError as e:
        raise tasks.DataNotFoundError(f"--dataset {e}{tasks.config_hint(e, '--dataset-config')}") from None
    if isinstance(task, tasks.MathDataset) and not task.val_problems:  # the first evaluation would divide by 0
        raise tasks.DataFileError(f"--dataset {args.dataset}: its {len(task.problems)} problems leave none to hold "
                                  "out for validation (a fifth is): give at least 5")
    try:
        # A test set is evaluated whole: a file's every row, a directory's test* files, a hub set's test split
        # (in --test-dataset-config's configuration, else --dataset-config's when it is --dataset's set)
        test_config = args.test_dataset_config or (args.dataset_config if args.test_dataset == args.dataset else None)
        test_task = tasks.load_task(args.test_dataset, question_field=args.question_field,
                                    answer_field=args.answer_field, skip_bad_rows=args.skip_bad_rows, split="test",
                                    test_set=True, dataset_config=test_config) if args.test_dataset else None
    except tasks.DataNotFoundError as e:
        raise tasks.DataNotFoundError(f"--test-dataset {e}{tasks.config_hint(e, '--test-dataset-config')}") from None
    return task, test_task


def fleet_config(args: Args) -> fleet.FleetConfig:
    """Where and how this run's replicas run (train.py's generator_config puts it into the GeneratorConfig): the
    fleet's flags, and what the machine decides (the replicas by --gen-devices, vLLM's memory share, the engine's
    threads, the secret read from --gen-secret-file on the generator's node: rank 0 proves it, other nodes never read
    it)."""
    return fleet.FleetConfig(
        **fleet_values(args),
        gpu_memory_utilization=generator_memory_fraction(args, generator_shares_a_gpu(args)),
        replicas=local_replicas(args, torch.cuda.device_count() if torch.cuda.is_available() else 0),
        secret=vllm_replica.read_secret(secret_file) if (secret_file := secret_file_here(args)) else None,
        num_threads=generator_threads(args),
    )


def generator_threads(args: Args) -> int | None:
    """Torch threads of each local replica on CPU (None: the process's default, one under torchrun). In sync mode
    the learner ranks wait while the replicas generate, so the replicas may take every core between them: every
    core this process may use (its affinity, which a job scheduler narrows), not the machine's."""
    if torch.cuda.is_available():
        return None
    if args.gen_threads is not None:
        return args.gen_threads
    if args.mode == "sync":
        return max(1, len(os.sched_getaffinity(0)) // max(1, local_replicas(args, 0)))
    return None


def generator_shares_a_gpu(args: Args) -> bool:
    """True when the learner shares the generator's GPUs: --gen-devices takes every GPU of the machine, and
    vllm_replica.split_devices then gives the learner ranks the same ones (gpu_layout_problems allows one rank each)."""
    if not (args.gen_devices and torch.cuda.is_available()):
        return False
    learner_ids, gen_ids = vllm_replica.split_devices(args.gen_devices, torch.cuda.device_count())
    return bool(set(learner_ids) & set(gen_ids))


# ----------------------------------------------------------------------------------------------------------------
# Keeping the ranks in step: collectives every rank calls at the same point
# ----------------------------------------------------------------------------------------------------------------


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (pickled; e.g. a round of groups)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def full_state_dict(model: Any) -> dict:
    """HF-named full weights gathered on rank 0 (empty elsewhere); a collective: every rank calls it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def push_state_dict(model: Any, generator: Any) -> dict:
    """The full weights of a push, gathered one tensor at a time (a collective: every rank calls it; `generator` is
    rank 0's, None on the others, which keep nothing) and on rank 0 cast to the generator's dtype as each arrives,
    on the device it arrives on. Rank 0 keeps them on its GPU where vLLM's nccl or ipc engine sends them (no host
    round trip); for the gloo engine they go to host memory (in the generator's dtype: half the bytes of float32
    where it is bf16)."""
    cfg = generator.config.fleet if generator is not None else None
    on_gpu = cfg is not None and cfg.weight_transport in ("nccl", "ipc")  # vLLM's GPU engines send from the GPU
    dtype = vllm_replica.DTYPES.get(cfg.dtype, torch.float32) if cfg is not None else None
    weights: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor | None] = {}  # a tied weight appears under two names: gather it once
    with torch.no_grad():
        for name, value in model.state_dict(keep_vars=True).items():  # the parameters themselves: ties share one
            if not isinstance(value, torch.Tensor):
                continue
            if id(value) not in gathered:
                full = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach()  # FSDP2: all-gather
                if cfg is not None and full.is_floating_point():
                    full = full.to(dtype)
                gathered[id(value)] = None if cfg is None else full if on_gpu else full.to("cpu")
            if cfg is not None:
                weights[name] = gathered[id(value)]
    return weights


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
# Signals, the output-directory lock, the metrics file
# ----------------------------------------------------------------------------------------------------------------


class GracefulStop:
    """SIGINT (Ctrl-C; torchrun passes it on to every rank) or SIGTERM: finish the current step, save a checkpoint
    and exit, so that a --resume redoes nothing. A second signal stops at once, and so does the first while
    `at_once` (the start: nothing is trained yet, and the wait for remote replicas may last --gen-join-timeout)."""

    first_signal: str | None = None  # the first signal any instance received in this process (read by rank0_speaks)

    def __init__(self, announce: bool, at_once: bool = False):
        self.signal: str | None = None
        self.announce = announce
        self.at_once = at_once
        self.waiting = False  # inside `interrupting`: rank 0's wait for a batch
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
        GracefulStop.first_signal = GracefulStop.first_signal or name
        if self.at_once:
            raise SystemExit(f"{name} during the start: stopped before the first step, nothing was trained")
        if self.waiting:  # the wait may last long: it ends now, and the run stops as after a generator failure
            raise fleet.GeneratorError(f"stopped by {name} while waiting for the generator's groups")
        if self.announce:
            print(f"\n[{self.signal}] stopping after this step, with a checkpoint (again to stop at once)",
                  file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def interrupting(self) -> Iterator[None]:
        """Inside (rank 0 waiting for a batch, which lasts as long as generation does), a first signal ends the wait
        at once with GeneratorError: the run then stops with a checkpoint of the steps done, on every rank."""
        self.waiting = True
        try:
            yield
        finally:
            self.waiting = False

    def agreed(self, also: bool = False) -> bool:
        """True on every rank if any rank was signalled, or has `also` (rank 0: a noted failure). A collective:
        every rank calls it at the same point."""
        flag = torch.tensor([float(self.signal is not None or also)], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


# What gloo raises on a rank whose peer has gone (rank 0 stopped, and says why itself; or another rank died).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


@contextlib.contextmanager
def rank0_speaks(run_dir: Path | None = None) -> Iterator[None]:
    """A run that stops says why once, on rank 0. Another rank prints nothing for what rank 0 reports: a SystemExit
    that every rank raises together (a message: a refused output directory, a failed start, a stop; or a status: a
    bad data row), which it leaves through cli.`quiet_rank_exit` (status 1 for a message), or a collective that failed
    because rank 0 left (gloo's "Connection closed by peer"), status 1 at once. On rank 0 of several, a collective
    that failed because another rank died (the out-of-memory killer's SIGKILL leaves no line of its own) is one line
    that says so and where `run_dir` resumes (peer_gone_message), not gloo's traceback; rank 0 itself killed, its
    node's rank 1 says it instead (rank0_killed)."""
    if os.environ.get("RANK", "0") == "0":
        try:
            yield
        except RuntimeError as e:
            gone = _peer_gone(e)
            if gone is None or run_dir is None or int(os.environ.get("WORLD_SIZE", "1")) < 2:
                raise
            raise SystemExit(peer_gone_message(run_dir, gone, str(e))) from None
        return
    try:
        yield
    except SystemExit as e:
        if e.code in (None, 0):
            raise
        # after a signal torchrun is ending every rank itself: no need to wait for rank 0, nor where it is gone
        quiet_rank_exit(1 if isinstance(e.code, str) else e.code,
                        wait=GracefulStop.first_signal is None and not isinstance(e, Rank0Gone),
                        message=getattr(e, "message", None))  # (a line every rank raised is rank 0's to say)
    except RuntimeError as e:
        gone = _peer_gone(e)
        if gone is None:
            raise
        # Rank 0 itself killed (the out-of-memory killer's likeliest choice: it loads the model and feeds the
        # generator) says nothing, nor did any other rank: its node's rank 1 says it for it.
        if run_dir is not None and os.environ.get("RANK") == os.environ.get("LOCAL_RANK") == "1" and rank0_killed():
            print(peer_gone_message(run_dir, gone, str(e), who="learner rank 0's"), file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _peer_gone(error: RuntimeError) -> str | None:
    """Which of PEER_GONE gloo's `error` says, if any."""
    return next((text for text in PEER_GONE if text in str(error)), None)


def peer_gone_message(run_dir: Path, gone: str, error: str = "", who: str = "another learner rank's") -> str:
    """Rank 0's line when a collective failed because another rank's process ended (gloo's `gone`): which rank and
    how are in torchrun's summary, which follows; a SIGKILL there is most often the kernel's out-of-memory killer,
    which leaves no line of its own. Then where --resume starts (the newest complete checkpoint), if anywhere. A
    rank on another node (gloo's `error` names its address, not a loopback one) has its output and its torchrun's
    summary there: the line names the address."""
    step = newest_checkpoint_step(run_dir)
    resume = (f"the newest checkpoint is step {step}: continue with --resume {run_dir}" if step is not None else
              "no checkpoint was written yet: nothing to resume")
    peer = (re.search(r"\[([^\]]+)\]:\d+", error) or [None, ""])[1]
    try:
        local = not peer or ipaddress.ip_address(peer).is_loopback
    except ValueError:  # a host name
        local = False
    where = ("its own output above, or torchrun's summary below, says how" if local else
             f"its own output and its torchrun's summary on that node ({peer}) say how")
    return (f"stopping: {who} process ended in the middle of a collective (gloo: {gone}); {where}. "
            "\"Signal 9 (SIGKILL)\" there is most often the "
            "kernel's out-of-memory killer (dmesg names it): a lower --micro-batch-tokens or "
            f"--activation-checkpointing lowers a rank's memory (docs/memory.md); {resume}")


class OutputDirBusyError(RuntimeError):
    """Another live train.py holds the output directory."""


def lock_output_dir(out: Path) -> Any:
    """Take OUTPUT_DIR/.lock for the life of this process; raise OutputDirBusyError if a live run holds it, and
    LinkRefusedError (naming it) if .lock is a symbolic link or not a regular file. flock is released by the kernel
    when its holder dies, however it dies."""
    out.mkdir(parents=True, exist_ok=True)
    # never through a link: a planted .lock -> ~/file would have that file truncated to our pid
    handle = os.fdopen(open_no_follow(out / ".lock", os.O_RDWR | os.O_CREAT, 0o666), "r+")
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


def refuse_planted_links(out: Path) -> None:
    """LinkRefusedError, naming it, for a symbolic link (or a non-file) where the run keeps a file or a checkpoint
    directory: checked as the run claims OUTPUT_DIR, so every rank stops in one line before anything starts. Each
    file is opened without following links as well (a link planted later is refused there)."""
    for name in ("args.json", "metrics.jsonl", "scaling.png", "dashboard.png"):
        refuse_unless_regular(out / name)
    for name in (*CHECKPOINT_DIRS, "checkpoint.tmp", *REPORT_DIRS):  # another user's too: the run would remove
        refuse_unless_regular(out / name, directory=True, own=True)  # it, or write where links wait inside


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


class RunFileError(Exception):
    """A file of the run could not be written (a full disk); the message names it and, on a full disk, the free
    space."""


def read_run_metrics(path: Path) -> list[dict]:
    """The rows of a run's own metrics.jsonl, as MetricsLog writes them (a JSON object a line), never read through a
    link planted there since the run checked it (LinkRefusedError naming it): a link would draw another run's curve
    as this one's. A line that is not a JSON object raises ValueError naming it. (scaling_fit.read_metrics reads
    anyone's metrics files; the harness, beneath the recipe, reads only the run's own.)"""
    rows = []
    for number, line in enumerate(read_no_follow(path).decode().splitlines(), start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: malformed JSON: {err.msg}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


class MetricsLog:
    """metrics.jsonl (format: scaling_fit.py's docstring). On resume it is cut back to the checkpoint's line
    count, so steps re-done after a crash are neither lost nor duplicated; the cut goes through a temporary file
    renamed over the old one, so a kill at that moment leaves it whole. A file with fewer lines than the checkpoint
    covers (cut behind the run's back) cannot be made whole: `missing_steps` names the steps 0..`covers_step`
    that have no row."""

    def __init__(self, path: Path, keep_lines: int | None, covers_step: int | None = None):
        self.path = path
        self.failure: str | None = None  # why a write failed: no row is written after it
        lines: list[str] = []
        if refuse_unless_regular(path):  # a planted link would copy its target's text into the run directory
            with os.fdopen(open_no_follow(path, os.O_RDONLY)) as f:
                lines = f.read().splitlines(keepends=True)
        kept = lines if keep_lines is None else lines[:keep_lines]
        self.lines = len(kept)
        self.reporter: Reporter | None = None  # --report-to: each row written is sent there too
        self.cut_through: int | None = None  # the last step of the rows cut off: an earlier attempt reported them
        for line in lines[len(kept):]:
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                self.cut_through = max(self.cut_through or 0, int(json.loads(line).get("step")))
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
        """Append `row` as one line. A write that fails (a full disk) cuts the file back to its last complete row
        and raises RunFileError: no half-written row stays behind, and no later row leaves a gap after it."""
        if self.failure:
            raise RunFileError(self.failure)
        row, non_finite = _json_safe(row)
        if non_finite:  # strict JSON has no NaN or Infinity: write null and name the fields
            row["non_finite"] = non_finite
        data = (json.dumps(row, allow_nan=False) + "\n").encode()
        fd = open_no_follow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        with os.fdopen(fd, "ab", buffering=0) as f:
            end = f.seek(0, os.SEEK_END)  # the end of the last complete row
            try:
                written = 0
                while written < len(data):  # an unbuffered write may be short just before the disk is full
                    written += f.write(data[written:])
                os.fsync(f.fileno())
            except OSError as e:
                os.ftruncate(f.fileno(), end)  # frees, never needs, space
                self.failure = write_failure(self.path, e, len(data), "a row")
                raise RunFileError(self.failure) from None
        self.lines += 1
        if self.reporter is not None:  # after the row is safe in metrics.jsonl, the record
            self.reporter.report(row)


# ----------------------------------------------------------------------------------------------------------------
# --report-to: the rows sent to TensorBoard, W&B or trackio as well; metrics.jsonl stays the record
# ----------------------------------------------------------------------------------------------------------------


# Under OUTPUT_DIR, one per --report-to that writes locally (.wandb: where W&B would move its files if it found one).
REPORT_DIRS = ("tensorboard", "wandb", ".wandb", "trackio")
WANDB_ONLINE_MODES = ("online", "run", "shared")  # WANDB_MODE values that send to a server: asked for, never default
# The fields train.py's evaluate adds to a row: reported under eval/, as TRL reports its evaluation; the rest train/.
EVAL_FIELDS = frozenset({"val_pass_rate", "val_reward", "val_samples", "eval_s", "test_pass_rate", "test_reward",
                         "fit_asymptote"})


def report_scalars(row: dict) -> dict[str, float]:
    """A metrics row as --report-to's scalars, keyed as TRL keys its logs: eval/NAME for the evaluation's fields,
    train/NAME for every other number, train/NAME/KEY for the numbers of a dict field (lag_hist/0, the replicas').
    `step` is the x axis, not a scalar; strings, lists, booleans and the nulls of non-finite values are left out."""
    scalars: dict[str, float] = {}

    def add(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for sub, item in value.items():
                add(f"{key}/{sub}", item)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            scalars[key] = float(value)

    for name, value in row.items():
        if name != "step":
            add(f"{'eval' if name in EVAL_FIELDS else 'train'}/{name}", value)
    return scalars


class Reporter:
    """Rank 0, --report-to tensorboard|wandb|trackio: each row metrics.jsonl takes is sent there too, as
    report_scalars names it, at the row's step. The package is imported at the first row (harness/flags.py checked that
    it imports). A failure never stops the run, which metrics.jsonl records whole: the first is printed, the rest
    counted and their number printed at the end.

    On resume the steps after the checkpoint are trained again. TensorBoard drops what the earlier attempt wrote from
    `first_step` on (SummaryWriter's purge_step), so its curves hold the steps of metrics.jsonl, each once. W&B and
    trackio only append: rows up to `reported_through` (the last step the resume cut from metrics.jsonl, which the
    earlier attempt had reported) are not sent again, so no step appears twice, with its first attempt's values."""

    def __init__(self, kind: str, out: Path, config: dict[str, Any], first_step: int = 0,
                 reported_through: int | None = None):
        self.kind, self.out, self.config = kind, out, dict(config)
        self.first_step, self.reported_through = first_step, reported_through
        self.log: Callable[[dict[str, float], int], None] | None = None
        self.finish: Callable[[], None] | None = None
        self.failures = 0  # rows not reported
        self.broken = False  # its start failed: nothing more is tried

    def report(self, row: dict) -> None:
        step = row["step"]
        if self.kind == "none" or (self.kind != "tensorboard" and self.reported_through is not None
                                   and step <= self.reported_through):
            return
        try:
            if self.broken:
                raise RuntimeError("not started")
            if self.log is None:
                try:
                    self.log, self.finish = getattr(self, f"_start_{self.kind}")()
                except BaseException:
                    self.broken = True
                    raise
            self.log(report_scalars(row), step)
        except Exception as error:  # the run goes on: metrics.jsonl has the row
            self.failures += 1
            if self.failures == 1:
                print(f"[report-to] {self.kind}: step {step} not reported: {type(error).__name__}: {error}; training "
                      "goes on (metrics.jsonl has every row), later failures are counted", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.finish is not None:
            with contextlib.suppress(Exception):
                self.finish()
            self.finish = None
        if self.failures:
            print(f"[report-to] {self.kind}: {self.failures} rows not reported; metrics.jsonl has them all",
                  file=sys.stderr, flush=True)
            self.failures = 0

    def _start_tensorboard(self) -> tuple[Callable, Callable]:
        from torch.utils.tensorboard import SummaryWriter

        # The events file gets a random suffix: its name (time, host, pid) is guessable, and the writer opens it
        # following links, so a link planted under the name it will take could be written through.
        writer = SummaryWriter(str(make_run_dir(self.out / "tensorboard")), purge_step=self.first_step or None,
                               filename_suffix=f".{secrets.token_hex(8)}")

        def log(scalars: dict[str, float], step: int) -> None:
            for key, value in scalars.items():
                writer.add_scalar(key, value, step)
            writer.flush()  # a row a step: TensorBoard shows it now, and a kill -9 loses none

        return log, writer.close

    def _start_wandb(self) -> tuple[Callable, Callable]:
        import wandb

        # One W&B run per OUTPUT_DIR, resumed with it: its id is kept beside W&B's own files, read without links.
        id_file = make_run_dir(self.out / "wandb") / "run_id"
        run_id = ""
        if refuse_unless_regular(id_file, reading=True):
            run_id = read_no_follow(id_file, limit=64).decode(errors="replace").strip()
            if not re.fullmatch(r"[0-9a-f]{8}", run_id):
                raise RuntimeError(f"{id_file} does not hold a run id this run wrote: not used")
        if not run_id:
            run_id = uuid.uuid4().hex[:8]
            write_atomically(id_file, run_id + "\n")
        mode = os.environ.get("WANDB_MODE") or "offline"  # no network unless asked for
        if mode in WANDB_ONLINE_MODES and not wandb.login(prompt=False, verify=False):
            raise RuntimeError(f"WANDB_MODE={mode} needs a W&B key (WANDB_API_KEY or `wandb login`); W&B is "
                               "never left waiting at a login prompt")
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "scalerl"), name=self.out.name, id=run_id,
                         resume="allow", dir=str(self.out), config=self.config, mode=mode,
                         settings=wandb.Settings(use_dot_wandb=False))  # OUTPUT_DIR/wandb, whatever else is there
        return (lambda scalars, step: run.log(scalars, step=step)), run.finish

    def _start_trackio(self) -> tuple[Callable, Callable]:
        directory = make_run_dir(trackio_dir(self.out))
        os.environ["TRACKIO_DIR"] = str(directory)  # read as trackio is imported (flags.py set it before its import)
        import trackio

        if trackio_dir_problem(self.out):
            raise RuntimeError(trackio_dir_problem(self.out))
        # Named for the whole output directory: two runs whose directories share a last name stay two runs.
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", "scalerl"), name=str(self.out.absolute()),
                     config=self.config, resume="allow")
        return (lambda scalars, step: trackio.log(scalars, step=step)), trackio.finish
