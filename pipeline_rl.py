"""pipeline_rl.py: the vLLM generator process, in-flight weight updates, bounded staleness, and a synchronous mode.

The learner (train.py) owns a `Generator`. `Generator.start()` spawns one child process that runs vLLM (which in turn
starts its own EngineCore and worker processes) and streams finished groups back. This module knows nothing of
losses: it moves prompts, completions, per-token logprobs, per-token weight versions, and weights.

    learner (torchrun rank 0)                       generator process (spawned child, own session)
    -------------------------                       ----------------------------------------------
    gen = Generator(cfg, ArithmeticTask)
    gen.start()              --- spawn --->         LLM(...)  (EngineCore + worker processes)
                             <-- "ready" ---        admit prompts (throttled) -> engine.step() -> groups
    groups, stats = gen.get_batch(B, V)  ------->   choose B finished groups (oldest deadline first)
    ... loss, backward, optimizer step: V -> V+1
    gen.update_weights(state_dict, V+1)  ------->   pause scheduler, reload weights, label version V+1, resume
                                                    (the sequences in flight keep going, with their old KV cache)

1. Per-token versions and in-flight updates (PipelineRL). Weights travel as a safetensors file in /dev/shm (shared
   memory; a temp dir when /dev/shm is too small). The generator applies an update between two engine steps:
   `pause_scheduler("keep")` (running sequences stay, no step runs), `collective_rpc` into `WeightSyncExtension`
   (`reload_weights` from the file), `set_weight_version(V)`, `resume_scheduler()`. vLLM labels each step's output
   with the weight version in force, so every token of a `Completion` carries the exact version that sampled it; a
   sequence that straddles an update holds tokens of two (or more) versions. Its KV cache is NOT recomputed (stale
   KV, as in PipelineRL). New prompts carry a `cache_salt` of the current version, so the prefix cache never serves
   KV computed by older weights to a new request (vLLM can only reset the prefix cache while nothing is running;
   we reset it when idle).

2. Bounded staleness, the exact rule. V = the learner version = the number of optimizer steps done; the learner
   calls `get_batch(num_groups, V)` before step V+1 and `update_weights(..., V+1)` after it. A token sampled with
   weights version v has lag V - v. Guarantee: `get_batch(n, V)` never returns a group that has a loss-masked
   token with lag > k (k = max_off_policy), i.e. it returns only groups with min_version >= V - k. To keep
   the learner from having to drop anything, the generator throttles admission and the batch is chosen
   earliest-deadline-first:
   - a group admitted while the generator holds version g gets the deadline D = g + k (its tokens are all >= g,
     so it is usable up to learner version D);
   - admission rule: with U groups admitted and not yet consumed, a new group is admitted only if
     U + 1 <= (g + k - V_next + 1) * B, where V_next is the learner version of the next get_batch call and B the
     groups consumed per learner step (learned from the get_batch calls; `groups_per_batch` gives it up front),
     and only while fewer than `max_concurrent_groups` groups are in flight;
   - admission starts with the learner's first get_batch or update_weights (a resumed learner pushes its weights
     first, so no group is generated with weights it has moved past);
   - batch choice: with n_j = #(unconsumed groups with D <= V + j), the batch must contain the
     r = max_j (n_j - j*B)^+ earliest-deadline groups (the learner waits for them if they are still being
     generated), and is filled with the ready groups of earliest deadline.
   The admission rule keeps n_j <= (j+1)*B, so r <= B and, by the usual earliest-deadline-first argument, every
   group is consumed by its deadline as long as the learner consumes B groups per step and does at most one step
   per get_batch call. The learner then WAITS (counted in `wait_s`) instead of dropping. If a group ever does arrive
   too stale (the learner consumed fewer groups per step than announced, or pushed no weights for k steps), it is
   dropped, counted in `stale_dropped`, and its prompt is generated again with fresh weights, so no data index is
   lost. Tests prove lag <= k and stale_dropped == 0 with a slow learner and with a slow generator.
   Freshness: the buffer limit (`buffer_steps`, b). k is a guarantee, not a target: a generator faster than the
   learner would fill the k steps of room the admission rule leaves, and every batch would be trained at lag ~k.
   So while the learner is fed, a new group is admitted only if U + 1 <= b * B as well (at most b learner steps'
   worth of groups admitted ahead of the learner's next request): with b = 1 the generator samples the next batch
   while the learner trains on this one, and the lag stays near 1 however fast the generator is. When the learner
   is starved (blocked in get_batch with fewer finished groups than it asked for), generation is the bottleneck
   and the limit is lifted: the generator fills its engine up to `max_concurrent_groups` and k, so a slow
   generator loses no throughput and the lag is what its latency requires. The metrics show both: `lag_mean` and
   `buffer_depth_steps` (finished groups waiting, in learner steps). How this relates to the papers' k: in
   PipelineRL and ScaleRL, k (ScaleRL: 8; PipelineRL's code counts it in samples) is the only limit, and the
   trainers wait when they get k steps ahead; at their scale generation dominates, so the realised lag is set by
   generation latency, far below k. On one CPU whose generator outruns its learner, k alone lets the lag reach k
   (8 steps at lr 1e-4 moved the tiny policy enough to make runs swing); the buffer restores the regime those
   papers ran in. `buffer_steps=None` (or >= k + 1) gives the k-only behaviour.
   Synchronous mode (`mode="sync"`): get_batch generates exactly num_groups fresh groups with the current weights
   (all lag 0), the conventional RL loop; PPO-off-policy-k is that with a k-times larger batch split by train.py.

3. Interruption-based length control (ScaleRL). Each completion draws a think budget b uniformly in `think_budget`.
   A vLLM logits processor (`InterruptionLogitsProcessor`, running inside the engine) watches the completion: if
   `</think>` has not appeared in its first b tokens, it forces the tokens of `task.interruption_phrase` (which ends
   in `</think>`) at positions b, b+1, ...; the model then writes its answer, with at most
   `answer_budget` tokens after the phrase (max_tokens = b + len(phrase) + answer_budget, capped by `max_tokens`).
   Forced tokens have loss_mask False and sampler logprob 0.0 (probability 1 after the processor); their version is
   the one in force. No request is aborted or re-submitted. With `interruptions=False`, plain max_tokens truncation.

4. Sampler logprobs are the probabilities the sampler used, after temperature: `logprobs_mode="processed_logprobs"`.
   A learner that divides its logits by the same temperature recomputes them (float32: to ~1e-6 here).

5. FP32 LM head. With float32 weights (CPU) it is automatic. With bf16/fp16 weights, `fp32_lm_head=True` passes
   vLLM's `hf_overrides={"head_dtype": "float32"}`: the last projection runs in float32 (bf16 hidden state and
   weight upcast, fp32 accumulation and logits). The learner must do the same: keep `lm_head` out of the bf16
   mixed-precision policy (FSDP2: `fully_shard(model.lm_head, mp_policy=MixedPrecisionPolicy(param_dtype=float32))`
   or compute `F.linear(hidden.float(), lm_head.weight.float())`), then divide by the temperature.

6. Placement. CPU (the tested path): the generator shares the machine with the learner. GPU: `gen_devices="6,7"`
   gives the generator those CUDA devices (CUDA_VISIBLE_DEVICES in the child) and `tensor_parallel_size` splits the
   model over them with vLLM's own TP; the learner's ranks use the other devices (`split_devices`). Weights take the
   same shared-memory file path (rank 0 gathers the full state dict, writes it, every TP worker reads it). See
   `tests/test_gpu.py` for the GPU smoke test; the NCCL-broadcast design is in the README.

7. Lifecycle. `start()` spawns the child (spawn context, its own session so that Ctrl-C reaches only the learner,
   which then closes it) and waits for "ready". The child exits when the learner closes it, when the pipe to the
   learner breaks, or when the learner dies (PR_SET_PDEATHSIG); `close()` also kills the vLLM processes if any
   survived. Any error in the child is sent to the learner, and a dead child raises `GeneratorError` in the learner
   within a fraction of a second, never a hang.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import logging
import math
import multiprocessing as mp
import os
import random
import shutil
import signal
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

import tasks
from tasks import Problem, Task

# --------------------------------------------------------------------------------------------------------------
# Public data types
# --------------------------------------------------------------------------------------------------------------


_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


@dataclass
class GeneratorConfig:
    """Settings of the generator (train.py maps its flags onto them in generator_config)."""

    # HF model directory or name that the generator starts from
    model: str
    # completions per prompt (G)
    group_size: int = 8
    # sampling temperature (the learner divides its logits by it)
    temperature: float = 1.0
    # ScaleRL interruption-based length control; off: plain max_tokens truncation (DAPO's overlong penalty)
    interruptions: bool = True
    # the interruption point is drawn uniformly in this range of completion tokens (train.py's tiny-task default,
    # above the task's ~29-token scratchpad; ScaleRL: 10240 to 12288)
    think_budget: tuple[int, int] = (34, 40)
    # tokens allowed after the interruption phrase (ScaleRL: 2048)
    answer_budget: int = 8
    # generation budget without interruptions, and the overall cap of a completion with them
    max_tokens: int = 48
    # k: the learner never trains on a token sampled more than k optimizer steps ago (ScaleRL: 8)
    max_off_policy: int = 8
    # freshness: admit at most this many learner steps' worth of groups ahead of the learner's next request (1:
    # generate the next batch while the learner trains on this one; None: only k limits it)
    buffer_steps: int | None = 1
    # pipeline: stream continuously with in-flight weight updates (PipelineRL-k); sync: generate a batch, train, sync
    mode: str = "pipeline"
    # seed of vLLM's sampler and the think budgets (and of the data stream unless data_seed is set)
    seed: int = 0
    # generator weights dtype (bfloat16 on GPU)
    dtype: str = "float32"
    # compute the LM head in float32 on the generator (automatic with float32 weights)
    fp32_lm_head: bool = True
    # GPU path: comma-separated CUDA device ids for the generator, e.g. '6,7' (None: CPU vLLM)
    gen_devices: str | None = None
    # vLLM tensor parallelism over gen_devices
    tensor_parallel_size: int = 1
    # prompt + completion tokens the engine reserves per sequence
    max_model_len: int = 256
    # cap on groups in flight in the generator (default: vLLM's max_num_seqs / group_size); the staleness rule adds
    # its own bound
    max_concurrent_groups: int | None = None
    # seed of the task's train stream (default: seed); keep it fixed across a resume, since data_start and
    # skip_indices are positions in this stream
    data_seed: int | None = None
    # groups the learner consumes per step, if known up front (else learned from get_batch)
    groups_per_batch: int | None = None
    # GPU path: vLLM's share of each generator GPU
    gpu_memory_utilization: float = 0.5
    # vLLM enforce_eager (default: True on CPU)
    enforce_eager: bool | None = None
    # vLLM max_num_seqs (default: vLLM's)
    max_num_seqs: int | None = None
    # run vLLM's engine core in processes of its own (vLLM's default) rather than inside the generator process; None:
    # own processes on GPU, inside on CPU, where the engine core's and the worker's busy-wait loops (vLLM spins up to
    # 1 s after every step) take cores the learner needs
    engine_process: bool | None = None
    # CPU: torch threads of the engine when it runs inside the generator process (None: torch's default, one per
    # core, or OMP_NUM_THREADS, which torchrun sets to 1 for train.py's ranks and so for their generator); fewer
    # leave cores to a learner that shares the machine (two threads beside a busy learner stall each other)
    num_threads: int | None = None
    # where weight files go (default: /dev/shm if it has room, else the temp dir)
    weight_dir: str | None = None
    # VLLM_LOGGING_LEVEL in the generator process
    vllm_log_level: str = "WARNING"
    # debug knob: vLLM's engine sleeps (x - 1) times the duration of every step (SlowdownLogitsProcessor), to emulate
    # a generator x times slower relative to its learner
    debug_slowdown: float = 1.0

    def __post_init__(self) -> None:
        self.think_budget = tuple(int(x) for x in self.think_budget)  # type: ignore[assignment]
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.mode not in ("pipeline", "sync"):
            raise ValueError(f"mode must be 'pipeline' or 'sync', got {self.mode!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.max_off_policy < 0:
            raise ValueError(f"max_off_policy must be >= 0, got {self.max_off_policy}")
        if self.buffer_steps is not None and self.buffer_steps < 0:
            raise ValueError(f"buffer_steps must be >= 0 or None, got {self.buffer_steps}")
        if not self.debug_slowdown >= 1:
            raise ValueError(f"debug_slowdown must be >= 1, got {self.debug_slowdown}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (sampling; greedy has no usable logprobs), got {self.temperature}")
        lo, hi = self.think_budget
        if not 1 <= lo <= hi:
            raise ValueError(f"think_budget must be (lo, hi) with 1 <= lo <= hi, got {self.think_budget}")
        if self.answer_budget < 1 or self.max_tokens < 1:
            raise ValueError("answer_budget and max_tokens must be >= 1")
        if self.max_tokens >= self.max_model_len:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be below max_model_len ({self.max_model_len})")


@dataclass
class Completion:
    """One sampled completion; the lists are per completion token (the prompt is not included)."""

    token_ids: list[int]
    sampler_logprobs: list[float]  # log-prob of each token under the sampler's distribution (after temperature)
    versions: list[int]  # weight version that sampled each token
    loss_mask: list[bool]  # False on tokens the model did not choose (the interruption phrase)
    text: str
    finish_reason: str  # "stop" | "length" | "interrupted"
    reward: float
    reward_error: str | None = None  # the reward function raised: reward is -1.0 and the error is here
    interrupted: bool = False  # the interruption phrase was inserted
    truncated: bool = False  # ran into max_tokens (also possible after an interruption)
    think_budget: int | None = None  # drawn interruption point (None without interruptions)
    # Filled in by the learner, never by the generator: its own log-probs of token_ids before the first update
    # of a round (sync mode, TIS); None means the sampler's log-probs stand for the old policy.
    old_logprobs: list[float] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Group:
    """The G completions of one prompt."""

    problem: Problem
    data_index: int  # index in the task's train stream; -1 for evaluation groups
    prompt_ids: list[int]
    completions: list[Completion]
    admitted_version: int = 0  # generator weights version when the prompt was admitted

    @property
    def rewards(self) -> list[float]:
        return [c.reward for c in self.completions]

    @property
    def min_version(self) -> int:
        """Oldest weight version over the loss-masked tokens (the admission version if there are none)."""
        versions = [v for c in self.completions for v, m in zip(c.versions, c.loss_mask) if m]
        return min(versions) if versions else self.admitted_version

    @property
    def max_version(self) -> int:
        versions = [v for c in self.completions for v in c.versions]
        return max(versions) if versions else self.admitted_version


class GeneratorError(RuntimeError):
    """The generator process failed to start, died, or reported an error."""


class GeneratorTimeout(GeneratorError, TimeoutError):
    """A call to the generator did not complete within its timeout (the generator is closed: start a new one)."""


class _RequestError(ValueError):
    """A request the generator refuses (reported to the learner as GeneratorError; the generator keeps running)."""


# --------------------------------------------------------------------------------------------------------------
# Pure logic: the staleness throttle, batch choice, lag histogram, interruption span (unit-tested without vLLM)
# --------------------------------------------------------------------------------------------------------------


def admission_allowed(unconsumed: int, gen_version: int, next_learner_version: int, k: int,
                      groups_per_step: int) -> bool:
    """May one more group be admitted? `unconsumed` groups are admitted and not yet consumed by the learner.

    The new group's tokens all have version >= gen_version, so its deadline is D = gen_version + k. It is admitted
    only if, counting it, the groups that must be consumed by D fit into the learner steps left before D:
    unconsumed + 1 <= (D - next_learner_version + 1) * groups_per_step.
    """
    steps_left = gen_version + k - next_learner_version + 1
    return unconsumed + 1 <= steps_left * max(1, groups_per_step)


def should_admit(*, unconsumed: int, in_flight: int, max_in_flight: int, gen_version: int,
                 next_learner_version: int, k: int, groups_per_step: int, waiting_for: int = 0,
                 buffer_steps: int | None = None, learner_starved: bool = False) -> bool:
    """The generator's admission decision: the concurrency cap, then the staleness rule (`admission_allowed`),
    then the buffer limit, which applies only while the learner is fed: a learner blocked in get_batch without
    enough finished groups (`learner_starved`) shows that generation is the bottleneck, and the generator then
    fills its engine up to the concurrency cap and k. A learner blocked for `waiting_for` groups is never left
    without them (no deadlock when the groups per step were under-estimated or the buffer is 0; plan_batch's
    hard check still holds)."""
    if in_flight >= max_in_flight:
        return False
    # the buffer limit: at most buffer_steps learner steps' worth of groups admitted ahead of the next request
    fresh = buffer_steps is None or learner_starved or unconsumed + 1 <= buffer_steps * max(1, groups_per_step)
    if fresh and admission_allowed(unconsumed, gen_version, next_learner_version, k, groups_per_step):
        return True
    return unconsumed < waiting_for


def mandatory_count(deadlines: Iterable[int], learner_version: int, groups_per_step: int) -> int:
    """r = max_j (n_j - j*B)^+ with n_j = #(deadline <= V + j): how many of the earliest-deadline groups the batch
    for learner version V must contain so that every other group still fits before its deadline."""
    B = max(1, groups_per_step)
    counts = collections.Counter(max(0, d - learner_version) for d in deadlines)
    r, n = 0, 0
    for j in sorted(counts):
        n += counts[j]
        r = max(r, n - j * B)
    return r


@dataclass
class _Entry:
    """What the batch planner needs to know about one unconsumed group."""

    gid: int
    deadline: int
    ready: bool
    min_version: int | None = None  # known once ready
    order: int = 0  # completion (or admission) order: earlier first among equals


def plan_batch(entries: list[_Entry], num_groups: int, learner_version: int, k: int,
               groups_per_step: int) -> tuple[list[int] | None, list[int]]:
    """Choose the groups for `get_batch(num_groups, learner_version)`.

    Returns (chosen gids, or None if the learner must wait; gids of ready groups too stale to use (lag > k)).
    Ready groups are judged by their real min_version; the earliest-deadline mandatory set is waited for.
    """
    stale = [e.gid for e in entries if e.ready and learner_version - e.min_version > k]
    live = [e for e in entries if not (e.ready and learner_version - e.min_version > k)]
    live.sort(key=lambda e: (e.deadline, not e.ready, e.order))
    r = min(num_groups, mandatory_count((e.deadline for e in live), learner_version, groups_per_step))
    mandatory = live[:r]
    if not all(e.ready for e in mandatory):
        return None, stale
    rest = [e for e in live[r:] if e.ready]
    if len(rest) < num_groups - r:
        return None, stale
    return [e.gid for e in mandatory] + [e.gid for e in rest[: num_groups - r]], stale


def lag_histogram(groups: Iterable[Group], learner_version: int) -> dict[int, int]:
    """{lag: number of loss-masked tokens} with lag = learner_version - token version."""
    hist: collections.Counter[int] = collections.Counter()
    for g in groups:
        for c in g.completions:
            for v, m in zip(c.versions, c.loss_mask):
                if m:
                    hist[learner_version - v] += 1
    return dict(sorted(hist.items()))


def lag_stats(groups: list[Group], learner_version: int) -> dict[str, Any]:
    hist = lag_histogram(groups, learner_version)
    total = sum(hist.values())
    return {
        "lag_hist": hist,
        "frac_tokens_by_lag": {lag: n / total for lag, n in hist.items()} if total else {},
        "lag_mean": sum(lag * n for lag, n in hist.items()) / total if total else 0.0,
        "lag_max": max(hist) if hist else 0,
    }


def find_subsequence_end(ids: list[int], pattern: list[int], start: int = 0, stop: int | None = None) -> int | None:
    """Index just past the first occurrence of `pattern` in ids[start:stop], or None."""
    stop = len(ids) if stop is None else min(stop, len(ids))
    n = len(pattern)
    for end in range(max(start, 0) + n, stop + 1):
        if ids[end - n : end] == pattern:
            return end
    return None


def interruption_start(token_ids: list[int], budget: int, close_ids: list[int]) -> int | None:
    """Where the interruption phrase was forced (== budget), or None: the same rule the logits processor applies.
    The phrase is forced iff the completion reached `budget` tokens without `</think>` in its first `budget`."""
    if len(token_ids) <= budget:
        return None
    if find_subsequence_end(token_ids, close_ids, 0, budget) is not None:
        return None
    return budget


def split_devices(gen_devices: str | None, num_devices: int) -> tuple[list[int], list[int]]:
    """(learner device ids, generator device ids) for a node with `num_devices` GPUs and `--gen-devices`.
    Learner rank r uses learner_ids[r % len(learner_ids)]; the generator child sees only gen ids."""
    gen = [int(x) for x in gen_devices.split(",") if x.strip()] if gen_devices else []
    bad = [d for d in gen if not 0 <= d < num_devices]
    if bad:
        raise ValueError(f"gen_devices {bad} out of range for {num_devices} devices")
    learner = [d for d in range(num_devices) if d not in gen]
    return (learner or list(range(num_devices))), gen


# --------------------------------------------------------------------------------------------------------------
# Code that runs inside vLLM's processes: the interruption logits processor and the weight-sync worker extension
# --------------------------------------------------------------------------------------------------------------

_INTERRUPT_KEY = "scalerl_interrupt"

class _ForcePhrase:
    """Per-request state: force `phrase` at position `budget` unless `close` appeared in the first `budget` tokens."""

    def __init__(self, budget: int, phrase: list[int], close: list[int]):
        self.budget, self.phrase, self.close = budget, phrase, close
        self.done = False
        self.scanned = 0  # output tokens already scanned for `close`

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if self.done:
            return logits
        n = len(output_ids)
        limit = min(n, self.budget)
        if self.scanned < limit:
            if find_subsequence_end(output_ids, self.close, self.scanned - len(self.close) + 1, limit) is not None:
                self.done = True  # the model closed its thinking itself
                return logits
            self.scanned = limit
        i = n - self.budget
        if i < 0:
            return logits
        if i >= len(self.phrase):
            self.done = True
            return logits
        forced = self.phrase[i]
        logits.fill_(float("-inf"))
        logits[forced] = 0.0
        return logits


def _interruption_processor_class() -> type:
    """Build the vLLM logits processor class on first use, so that importing this module (in every learner rank)
    does not import vLLM. vLLM loads it as "pipeline_rl:InterruptionLogitsProcessor" (module __getattr__ below)."""
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class InterruptionLogitsProcessor(AdapterLogitsProcessor):
        """vLLM v1 logits processor for ScaleRL's interruptions; active on requests whose SamplingParams.extra_args
        carry {"scalerl_interrupt": {"budget": b, "phrase": [...], "close": [...]}}."""

        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params: Any) -> Any:
            spec = (params.extra_args or {}).get(_INTERRUPT_KEY)
            if not spec:
                return None
            return _ForcePhrase(int(spec["budget"]), list(spec["phrase"]), list(spec["close"]))

    InterruptionLogitsProcessor.__module__ = __name__
    InterruptionLogitsProcessor.__qualname__ = "InterruptionLogitsProcessor"
    return InterruptionLogitsProcessor


_SLOWDOWN_ENV = "SCALERL_DEBUG_GEN_SLOWDOWN"  # GeneratorConfig.debug_slowdown, read inside vLLM's worker


def _slowdown_processor_class() -> type:
    """A vLLM logits processor that changes no logit and sleeps (x - 1) times the duration of each engine step,
    so that the engine itself (not just our reading of its outputs: vLLM's EngineCore runs in its own process)
    runs x times slower. The debug knob behind GeneratorConfig.debug_slowdown."""
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class SlowdownLogitsProcessor(LogitsProcessor):
        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool):
            self.factor = float(os.environ.get(_SLOWDOWN_ENV, "1"))
            self.last_step_end: float | None = None

        def is_argmax_invariant(self) -> bool:
            return False  # keep vLLM from skipping it

        def update_state(self, batch_update: Any) -> None:
            pass

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            now = time.perf_counter()
            # the time since the previous step ended is this step's work; a longer gap is an idle engine
            if self.last_step_end is not None and now - self.last_step_end < 1.0 and self.factor > 1:
                time.sleep((self.factor - 1) * (now - self.last_step_end))
            self.last_step_end = time.perf_counter()
            return logits

    SlowdownLogitsProcessor.__module__ = __name__
    SlowdownLogitsProcessor.__qualname__ = "SlowdownLogitsProcessor"
    return SlowdownLogitsProcessor


_LAZY_CLASSES = {"InterruptionLogitsProcessor": _interruption_processor_class,
                 "SlowdownLogitsProcessor": _slowdown_processor_class}


def __getattr__(name: str) -> Any:
    if name in _LAZY_CLASSES:
        cls = _LAZY_CLASSES[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _RotaryCacheFilter:
    """logging filter: drops vLLM's reload warning about RotaryEmbedding, whose buffer is not a checkpoint weight."""

    def filter(self, record: Any) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


def weight_tensors(state_dict: Mapping[str, Any], dtype: torch.dtype, tied: bool) -> dict[str, torch.Tensor]:
    """The tensors of a full HF-named state dict as the generator loads them: CPU, contiguous, floats in `dtype`,
    wrapper prefixes stripped. An untied model must include lm_head.weight (else vLLM keeps a stale head); a tied
    one leaves it out: it is the embedding itself, which vLLM loads (skipping the alias), and safetensors refuses
    two names for one storage, as a tied learner's state dict has them."""
    tensors: dict[str, torch.Tensor] = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue
        if hasattr(value, "full_tensor"):
            raise ValueError(f"{name} is a sharded DTensor: pass a full state dict (FSDP2: get_model_state_dict("
                             "model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))")
        for prefix in ("_orig_mod.", "module."):
            while name.startswith(prefix):
                name = name[len(prefix):]
        t = value.detach()
        if t.dtype.is_floating_point and t.dtype != dtype:
            t = t.to(dtype)
        tensors[name] = t.to("cpu").contiguous()
    if tied:
        tensors.pop("lm_head.weight", None)
    elif "lm_head.weight" not in tensors:
        raise ValueError("state dict has no lm_head.weight: vLLM would keep a stale LM head (send it always)")
    return tensors


class WeightSyncExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); reached through `LLM.collective_rpc`."""

    def scalerl_load_weights(self, path: str) -> int:
        """Reload all weights in place from a safetensors file (HF names, checkpoint format)."""
        from safetensors import safe_open

        # vLLM warns "RotaryEmbedding: Failed to load weights" at every reload: its cos/sin cache is computed, not
        # a checkpoint weight, and vLLM keeps it. Drop that one message (once per worker), keep every other.
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        if not any(isinstance(f, _RotaryCacheFilter) for f in reload_log.filters):
            reload_log.addFilter(_RotaryCacheFilter())

        def weights():
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

        self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return os.getpid()

    def scalerl_head_info(self) -> dict:
        model = self.model_runner.model  # type: ignore[attr-defined]
        head = getattr(model, "lm_head", None)
        lp = getattr(model, "logits_processor", None)
        return {"weight_dtype": str(getattr(getattr(head, "weight", None), "dtype", None)),
                "head_dtype": str(getattr(lp, "head_dtype", None))}

    def scalerl_param_checksum(self, name: str) -> float:
        params = dict(self.model_runner.model.named_parameters())  # type: ignore[attr-defined]
        return float(params[name].detach().double().sum())


# --------------------------------------------------------------------------------------------------------------
# The generator process
# --------------------------------------------------------------------------------------------------------------

_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME",
                  "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                  "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                  "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def vllm_engine_kwargs(cfg: GeneratorConfig) -> dict[str, Any]:
    """The arguments of the generator's `vllm.LLM`."""
    on_gpu = cfg.gen_devices is not None
    kwargs: dict[str, Any] = dict(
        model=cfg.model, dtype=cfg.dtype, seed=cfg.seed, max_model_len=cfg.max_model_len,
        enforce_eager=(not on_gpu) if cfg.enforce_eager is None else cfg.enforce_eager,
        logprobs_mode="processed_logprobs",  # logprobs after temperature: what the sampler really used
        worker_extension_cls=f"{__name__}.WeightSyncExtension",
        tensor_parallel_size=cfg.tensor_parallel_size, disable_log_stats=True, enable_prefix_caching=True,
    )
    if cfg.interruptions:
        kwargs["logits_processors"] = [f"{__name__}:InterruptionLogitsProcessor"]
    if cfg.debug_slowdown > 1:  # the factor reaches vLLM's worker through the environment (_generator_main)
        kwargs["logits_processors"] = kwargs.get("logits_processors", []) + [f"{__name__}:SlowdownLogitsProcessor"]
    if cfg.fp32_lm_head and _DTYPES.get(cfg.dtype, torch.float32) != torch.float32:
        kwargs["hf_overrides"] = {"head_dtype": "float32"}  # lm_head matmul and logits in float32
    if on_gpu:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if cfg.max_num_seqs:
        kwargs["max_num_seqs"] = cfg.max_num_seqs
    return kwargs


def _make_task(task_factory: Any) -> Task:
    if isinstance(task_factory, type) or not (hasattr(task_factory, "reward") and hasattr(task_factory, "train_stream")):
        return task_factory()
    return task_factory


@dataclass
class _GroupState:
    gid: int
    problem: Problem
    data_index: int
    prompt_ids: list[int]
    admitted_version: int
    deadline: int
    completions: list[Completion | None]
    budgets: list[int | None]
    admit_order: int
    done_order: int = -1
    min_version: int | None = None  # cached once ready

    @property
    def ready(self) -> bool:
        return all(c is not None for c in self.completions)

    def to_group(self) -> Group:
        return Group(self.problem, self.data_index, self.prompt_ids, list(self.completions),  # type: ignore[arg-type]
                     self.admitted_version)


class _GeneratorProcess:
    """Runs in the child process: owns the vLLM engine, the data stream, the throttle and the finished groups."""

    def __init__(self, conn: Any, config: GeneratorConfig, task_factory: Any, data_start: int,
                 skip_indices: list[int], retired_ids: list[str], version: int):
        self.conn, self.cfg = conn, config
        self.task = _make_task(task_factory)
        self.data_start, self.skip = data_start, set(skip_indices)
        self.retired = set(retired_ids)
        self.version = version
        self.rng = random.Random(config.seed * 7919 + 17)
        data_seed = config.seed if config.data_seed is None else config.data_seed
        self.stream = self.task.train_stream(data_seed, start=data_start)
        self.requeue: collections.deque[tuple[int, Problem]] = collections.deque()
        self.groups: dict[int, _GroupState] = {}  # unconsumed training groups (in flight or ready)
        self.eval_groups: dict[int, _GroupState] = {}
        self.next_gid = 0
        self.admit_counter = 0
        self.done_counter = 0
        self.pending: tuple | None = None  # the learner's outstanding request
        self.next_learner_version = version
        self.step_version: int | None = None  # learner version of the current step's get_batch calls
        self.consumed_this_step = 0
        self.groups_per_step = config.groups_per_batch or 0
        self.stale_dropped = 0
        self.skipped_long_prompts = 0
        self.reward_errors_total = 0
        self.tokens_since_reply = 0
        self.last_reply_time = time.perf_counter()
        self.engine_busy_s = 0.0
        self.closing = False
        self.dirty = False  # something changed since the last batch plan
        self.started = False  # admission starts with the learner's first get_batch or update_weights

    # ---- setup ------------------------------------------------------------------------------------------------
    def init_engine(self) -> dict:
        from transformers import AutoTokenizer
        from vllm import LLM

        cfg = self.cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.phrase_ids = list(self.tokenizer(self.task.interruption_phrase, add_special_tokens=False)["input_ids"])
        self.close_ids = list(self.tokenizer(tasks.THINK_CLOSE, add_special_tokens=False)["input_ids"])
        kwargs = vllm_engine_kwargs(cfg)
        self.llm = LLM(**kwargs)
        self.engine = self.llm.llm_engine
        self.engine.engine_core.set_weight_version(str(self.version))
        max_num_seqs = self.engine.vllm_config.scheduler_config.max_num_seqs
        self.max_groups = cfg.max_concurrent_groups or max(1, max_num_seqs // cfg.group_size)
        import psutil

        procs = psutil.Process().children(recursive=True)
        return {"pid": os.getpid(), "descendants": [(p.pid, p.create_time(), p.name()) for p in procs],
                "max_concurrent_groups": self.max_groups, "max_num_seqs": max_num_seqs,
                "phrase_ids": self.phrase_ids, "close_ids": self.close_ids,
                "head": self.llm.collective_rpc("scalerl_head_info")[0]}

    # ---- main loop --------------------------------------------------------------------------------------------
    def run(self) -> None:
        while not self.closing:
            busy = self.engine.has_unfinished_requests()
            self.handle_commands(timeout=0.0 if busy else 0.2)
            if self.closing:
                break
            self.admit()
            if self.engine.has_unfinished_requests():
                t0 = time.perf_counter()
                outputs = self.engine.step()
                self.engine_busy_s += time.perf_counter() - t0
                for out in outputs:
                    if out.finished:
                        self.on_finished(out)
            self.try_reply()

    def handle_commands(self, timeout: float) -> None:
        while self.conn.poll(timeout):
            timeout = 0.0
            try:
                msg = self.conn.recv()
            except EOFError:  # the learner is gone
                self.closing = True
                return
            kind = msg[0]
            if kind in ("get_batch", "update"):
                self.started = True
            if kind == "get_batch":
                _, num_groups, learner_version, t_sent = msg
                try:
                    self.start_batch(num_groups, learner_version)
                except _RequestError as e:  # the learner's mistake: tell it, keep running
                    self.conn.send(("fail", str(e)))
            elif kind == "update":
                _, path, version = msg
                seconds = self.apply_update(path, version)
                self.conn.send(("updated", version, seconds))
            elif kind == "evaluate":
                _, problems, samples, temperature = msg
                try:
                    self.start_eval(problems, samples, temperature)
                except _RequestError as e:
                    self.conn.send(("fail", str(e)))
            elif kind == "retire":
                self.retired.update(msg[1])
            elif kind == "debug":
                self.conn.send(("debug", self.debug(msg[1])))
            elif kind == "close":
                self.closing = True
                return
            else:
                raise ValueError(f"unknown command {kind!r}")

    # ---- prompts in -------------------------------------------------------------------------------------------
    def next_problem(self) -> tuple[int, Problem]:
        if self.requeue:
            return self.requeue.popleft()
        for _ in range(1_000_000):
            index, problem = next(self.stream)
            if index in self.skip or problem.id in self.retired:
                continue
            return index, problem
        raise RuntimeError("no admissible prompt in the last 1,000,000 of the stream (all retired?)")

    def sampling_params(self, temperature: float, budget: int | None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        cfg = self.cfg
        extra = None
        max_tokens = cfg.max_tokens
        if budget is not None:
            max_tokens = min(cfg.max_tokens, budget + len(self.phrase_ids) + cfg.answer_budget)
            extra = {_INTERRUPT_KEY: {"budget": budget, "phrase": self.phrase_ids, "close": self.close_ids}}
        return SamplingParams(temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_tokens, logprobs=0,
                              output_kind=RequestOutputKind.FINAL_ONLY, extra_args=extra)

    def submit(self, state: _GroupState, temperature: float, prefix: str) -> None:
        prompt = {"prompt_token_ids": state.prompt_ids, "cache_salt": f"v{self.version}"}
        for i in range(len(state.completions)):
            budget = self.rng.randint(*self.cfg.think_budget) if self.cfg.interruptions else None
            state.budgets[i] = budget
            self.engine.add_request(f"{prefix}{state.gid}.{i}", prompt, self.sampling_params(temperature, budget))

    def new_group(self, problem: Problem, data_index: int, samples: int) -> _GroupState:
        prompt_ids = tasks.chat_prompt_ids(self.tokenizer, problem.prompt)
        if len(prompt_ids) + self.cfg.max_tokens > self.cfg.max_model_len:
            raise _RequestError(f"prompt of {problem.id} has {len(prompt_ids)} tokens: with max_tokens "
                                f"{self.cfg.max_tokens} it exceeds max_model_len {self.cfg.max_model_len}")
        state = _GroupState(self.next_gid, problem, data_index, prompt_ids, self.version,
                            self.version + self.cfg.max_off_policy, [None] * samples, [None] * samples,
                            self.admit_counter)
        self.next_gid += 1
        self.admit_counter += 1
        return state

    def admit_one(self) -> None:
        while True:
            index, problem = self.next_problem()
            try:
                state = self.new_group(problem, index, self.cfg.group_size)
                break
            except _RequestError:  # a training prompt too long for max_model_len: skip it, count it
                self.skipped_long_prompts += 1
        self.groups[state.gid] = state
        self.submit(state, self.cfg.temperature, "t")

    def in_flight(self) -> int:
        return sum(not g.ready for g in self.groups.values())

    def admit(self) -> None:
        if self.cfg.mode != "pipeline" or not self.started:
            return
        need = self.pending[1] if self.pending and self.pending[0] == "batch" else 0
        starved = need > 0 and sum(g.ready for g in self.groups.values()) < need  # the learner waits on us
        while should_admit(unconsumed=len(self.groups), in_flight=self.in_flight(), max_in_flight=self.max_groups,
                           gen_version=self.version, next_learner_version=self.next_learner_version,
                           k=self.cfg.max_off_policy, groups_per_step=self.groups_per_step or 1, waiting_for=need,
                           buffer_steps=self.cfg.buffer_steps, learner_starved=starved):
            self.admit_one()

    # ---- completions out --------------------------------------------------------------------------------------
    def make_completion(self, state: _GroupState, index: int, out: Any) -> Completion:
        c = out.outputs[0]
        token_ids = list(c.token_ids)
        n = len(token_ids)
        logprobs = [0.0] * n
        lps = c.logprobs
        if lps is not None and hasattr(lps, "start_indices"):  # FlatLogprobs: the sampled token comes first
            for i, s in enumerate(lps.start_indices[:n]):
                if lps.token_ids[s] != token_ids[i]:
                    raise RuntimeError("logprobs out of step with the sampled tokens")
                logprobs[i] = float(lps.logprobs[s])
        elif lps is not None:
            for i, (tok, entry) in enumerate(zip(token_ids, lps)):
                logprobs[i] = float(entry[tok].logprob)
        versions = [self.version] * n
        spans = c.weight_versions
        if spans:
            for span in spans:
                v = int(span.version)
                for i in range(span.start, min(span.end, n)):
                    versions[i] = v
        mask = [True] * n
        budget = state.budgets[index]
        start = interruption_start(token_ids, budget, self.close_ids) if budget is not None else None
        interrupted = start is not None
        if interrupted:
            end = min(n, start + len(self.phrase_ids))
            if token_ids[start:end] != self.phrase_ids[: end - start]:
                raise RuntimeError(f"interruption phrase not found where forced: {token_ids[start:end]} vs "
                                   f"{self.phrase_ids}")
            for i in range(start, end):
                mask[i] = False
                logprobs[i] = 0.0
        reward, error = self.score(state.problem, c.text)
        truncated = c.finish_reason == "length"
        finish = "interrupted" if interrupted else str(c.finish_reason)
        return Completion(token_ids, logprobs, versions, mask, c.text, finish, reward, error, interrupted, truncated,
                          budget)

    def score(self, problem: Problem, text: str) -> tuple[float, str | None]:
        try:
            reward = float(self.task.reward(problem, text))
            if not math.isfinite(reward):
                raise ValueError(f"reward is {reward}")
            return reward, None
        except Exception as e:  # a broken verifier must not kill the run: count it, score the sample as failed
            self.reward_errors_total += 1
            return -1.0, f"{type(e).__name__}: {e}"

    def on_finished(self, out: Any) -> None:
        rid = out.request_id
        kind, rest = rid[0], rid[1:]
        gid_s, idx_s = rest.split(".")
        gid, idx = int(gid_s), int(idx_s)
        table = self.groups if kind == "t" else self.eval_groups
        state = table.get(gid)
        if state is None:
            return
        state.completions[idx] = self.make_completion(state, idx, out)
        self.tokens_since_reply += len(out.outputs[0].token_ids)
        if state.ready:
            state.done_order = self.done_counter
            self.done_counter += 1
            state.min_version = state.to_group().min_version
            self.dirty = True

    # ---- requests from the learner ----------------------------------------------------------------------------
    def start_batch(self, num_groups: int, learner_version: int) -> None:
        if self.cfg.mode == "pipeline" and learner_version - self.version > self.cfg.max_off_policy:
            raise _RequestError(
                f"learner version {learner_version} is more than k={self.cfg.max_off_policy} steps ahead of the "
                f"generator's weights (version {self.version}): call update_weights after every optimizer step")
        if learner_version != self.step_version:
            if self.step_version is not None and self.consumed_this_step > 0:
                self.groups_per_step = max(self.consumed_this_step, self.cfg.groups_per_batch or 0)
            self.step_version, self.consumed_this_step = learner_version, 0
        if not self.groups_per_step:
            self.groups_per_step = num_groups
        self.next_learner_version = learner_version
        self.pending = ("batch", num_groups, learner_version, time.perf_counter())
        self.dirty = True
        if self.cfg.mode == "sync":
            if self.groups:
                raise RuntimeError("sync mode: groups left over from a previous batch")
            for _ in range(num_groups):
                self.admit_one()

    def start_eval(self, problems: list[Problem], samples: int, temperature: float | None) -> None:
        temp = self.cfg.temperature if temperature is None else temperature
        states = [self.new_group(problem, -1, samples) for problem in problems]  # may refuse a too-long prompt
        gids = []
        for state in states:
            self.eval_groups[state.gid] = state
            self.submit(state, temp, "e")
            gids.append(state.gid)
        self.pending = ("eval", gids)
        self.dirty = True

    def try_reply(self) -> None:
        if self.pending is None or not self.dirty:
            return
        self.dirty = False
        if self.pending[0] == "eval":
            gids = self.pending[1]
            if all(self.eval_groups[g].ready for g in gids):
                groups = [self.eval_groups.pop(g).to_group() for g in gids]
                self.pending = None
                self.conn.send(("evaluated", groups))
            return
        _, num_groups, V, t0 = self.pending
        k = self.cfg.max_off_policy
        if self.cfg.mode == "sync":
            if not all(g.ready for g in self.groups.values()):
                return
            chosen = sorted(self.groups, key=lambda gid: self.groups[gid].done_order)
            stale: list[int] = []
        else:
            entries = [_Entry(g.gid, g.deadline, g.ready, g.min_version,
                              g.done_order if g.ready else 10**12 + g.admit_order)
                       for g in self.groups.values()]
            chosen, stale = plan_batch(entries, num_groups, V, k, self.groups_per_step or num_groups)
            for gid in stale:  # last resort: drop, count, and generate the prompt again with fresh weights
                state = self.groups.pop(gid)
                self.stale_dropped += 1
                self.requeue.append((state.data_index, state.problem))
            if chosen is None:
                return
        groups = [self.groups.pop(gid).to_group() for gid in chosen]
        self.consumed_this_step += len(groups)
        self.pending = None
        self.next_learner_version = V + 1
        now = time.perf_counter()
        interval = max(now - self.last_reply_time, 1e-9)
        stats: dict[str, Any] = {
            "gen_tokens": sum(c.num_tokens for g in groups for c in g.completions),
            "gen_tokens_per_s": self.tokens_since_reply / interval,
            "gen_busy_frac": min(1.0, self.engine_busy_s / interval),
            "reward_errors": sum(c.reward_error is not None for g in groups for c in g.completions),
            "reward_error_examples": [c.reward_error for g in groups for c in g.completions if c.reward_error][:3],
            "interrupted": sum(c.interrupted for g in groups for c in g.completions),
            "truncated": sum(c.truncated for g in groups for c in g.completions),
            "stale_dropped": self.stale_dropped,
            "reward_errors_total": self.reward_errors_total,
            "skipped_long_prompts": self.skipped_long_prompts,
            "groups_in_flight": self.in_flight(),
            "groups_ready": sum(g.ready for g in self.groups.values()),
            # buffer depth: learner steps' worth of groups already finished and waiting for the next requests
            "buffer_depth_steps": sum(g.ready for g in self.groups.values()) / max(1, self.groups_per_step),
            "generator_version": self.version,
            "groups_per_step": self.groups_per_step,
            "multi_version_completions": sum(len(set(c.versions)) > 1 for g in groups for c in g.completions),
        }
        stats |= lag_stats(groups, V)
        self.tokens_since_reply, self.engine_busy_s, self.last_reply_time = 0, 0.0, now
        self.conn.send(("batch", groups, stats))

    def apply_update(self, path: str, version: int) -> float:
        t0 = time.perf_counter()
        core = self.engine.engine_core
        # An engine core in its own process steps on its own: pause it so that no step runs until resume and the
        # version labels stay exact. In this process it steps only when run() calls engine.step(), not now.
        in_process = not hasattr(core, "call_utility")
        if not in_process:
            core.call_utility("pause_scheduler", "keep", False)
        try:
            self.llm.collective_rpc("scalerl_load_weights", args=(path,))
            if not self.engine.has_unfinished_requests():
                self.engine.reset_prefix_cache()  # only possible while nothing runs; else the cache salt protects
            core.set_weight_version(str(version))
            self.version = version
        finally:
            if not in_process:
                core.call_utility("resume_scheduler")
            try:
                os.unlink(path)
            except OSError:
                pass
        return time.perf_counter() - t0

    def debug(self, what: str) -> Any:
        if what == "state":
            return {"version": self.version, "groups": len(self.groups), "in_flight": self.in_flight(),
                    "eval_groups": len(self.eval_groups), "groups_per_step": self.groups_per_step,
                    "max_groups": self.max_groups, "stale_dropped": self.stale_dropped,
                    "unconsumed_indices": sorted([g.data_index for g in self.groups.values()]
                                                 + [i for i, _ in self.requeue]),
                    "admitted": self.admit_counter}
        if what.startswith("checksum:"):
            return self.llm.collective_rpc("scalerl_param_checksum", args=(what.split(":", 1)[1],))[0]
        raise ValueError(what)

    def shutdown(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown(timeout=1.0)  # SIGTERM, then kill after 1 s
            except Exception:
                pass


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (a no-op where prctl is missing)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(sig))  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _generator_main(conn: Any, config: GeneratorConfig, task_factory: Any, data_start: int, skip_indices: list[int],
                    retired_ids: list[str], version: int, parent_pid: int) -> None:
    """Entry point of the generator process."""
    try:
        os.setsid()  # Ctrl-C in the terminal goes to the learner, which closes us in order
    except OSError:
        pass
    set_parent_death_signal(signal.SIGTERM)  # the learner died: shut vLLM down in order
    if os.getppid() != parent_pid:  # the learner died before prctl took effect
        return

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    for var in _TORCHRUN_VARS:  # a vLLM started under torchrun must not see the learner's process group
        os.environ.pop(var, None)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", config.vllm_log_level)
    os.environ[_SLOWDOWN_ENV] = str(config.debug_slowdown)
    engine_process = config.gen_devices is not None if config.engine_process is None else config.engine_process
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if engine_process else "0"
    if config.gen_devices is not None:  # indices into the learner's visible devices (physical ids if unset)
        ids = [x.strip() for x in config.gen_devices.split(",") if x.strip()]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            visible_ids = [x.strip() for x in visible.split(",")]
            ids = [visible_ids[int(i)] for i in ids]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    else:
        tasks.set_vllm_cpu_env()
        if config.num_threads:  # before vLLM's CPU worker starts: it refuses set_num_threads afterwards
            torch.set_num_threads(config.num_threads)
    worker = None
    try:
        worker = _GeneratorProcess(conn, config, task_factory, data_start, skip_indices, retired_ids, version)
        info = worker.init_engine()
        conn.send(("ready", info))
        worker.run()
    except BaseException as e:  # report everything, including SystemExit from SIGTERM
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:
            pass
        if not isinstance(e, SystemExit):
            raise
    finally:
        if worker is not None:
            worker.shutdown()
        try:
            conn.send(("closed", None))
        except Exception:
            pass


# --------------------------------------------------------------------------------------------------------------
# The learner-side handle
# --------------------------------------------------------------------------------------------------------------


def _weight_dir(preferred: str | None, nbytes: int) -> Path:
    if preferred:
        return Path(preferred)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 * nbytes + (64 << 20):
        return shm
    return Path(tempfile.gettempdir())




def _remove_leaked_segments(since: float, shm: Path = Path("/dev/shm")) -> list[str]:
    """Unlink vLLM's shared-memory queues (psm_*) made since `since` that no live process maps or holds open any
    more: a killed engine core leaves them, and Python's resource tracker would remove them only when the learner
    exits. Segments of any other live vLLM are in use, hence kept."""
    if not shm.is_dir():
        return []
    candidates = {}
    for p in shm.glob("psm_*"):
        try:
            st = p.stat()
        except OSError:
            continue
        if st.st_uid == os.getuid() and st.st_mtime >= since - 1:
            candidates[str(p)] = p
    if not candidates:
        return []
    for proc in Path("/proc").iterdir():  # drop every segment that some process still maps or has open
        if not proc.name.isdigit():
            continue
        try:
            maps = (proc / "maps").read_text()
            fds = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:
            continue
        for name in list(candidates):
            if name in maps or name in fds:
                del candidates[name]
    removed = []
    for name, p in candidates.items():
        try:
            p.unlink()
            removed.append(p.name)
        except OSError:
            pass
    return removed


def _same_process(pid: int, created: float) -> Any:
    """The psutil process `pid` if it is still the one created at `created` (not gone, not a recycled pid)."""
    import psutil

    try:
        p = psutil.Process(pid)
        return p if abs(p.create_time() - created) < 1e-3 else None
    except psutil.Error:
        return None


def _alive(p: Any) -> bool:
    """psutil process still running (a zombie waiting to be reaped counts as dead)."""
    try:
        import psutil

        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False


class Generator:
    """Learner-side handle of the generator process. Use as a context manager, or call close()."""

    def __init__(self, config: GeneratorConfig, task_factory: Callable[[], Task] | Task, *, data_start: int = 0,
                 skip_indices: Iterable[int] = (), retired_ids: Iterable[str] = (), initial_version: int = 0):
        self.config = config
        self._task_factory = task_factory
        self._data_start = int(data_start)
        self._skip = sorted(int(i) for i in skip_indices)
        self._retired = sorted(str(i) for i in retired_ids)
        self._version = int(initial_version)
        self._proc: Any = None
        self._conn: Any = None
        self._info: dict = {}
        self._started_at = 0.0
        self._closed = False
        self._dead_reason: str | None = None
        self._tied = self._read_tie_flag(config.model)
        self.last_update_s = 0.0

    @staticmethod
    def _read_tie_flag(model: str) -> bool:
        try:
            from transformers import AutoConfig

            return bool(getattr(AutoConfig.from_pretrained(model), "tie_word_embeddings", False))
        except Exception:
            return False

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self, timeout: float = 600) -> None:
        if self._proc is not None:
            raise GeneratorError("generator already started")
        if self._closed:
            raise GeneratorError("generator is closed")
        self._started_at = time.time()  # vLLM's shared-memory segments are younger than this (close())
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=_generator_main, name="scalerl-generator",
            args=(child_conn, self.config, self._task_factory, self._data_start, self._skip, self._retired,
                  self._version, os.getpid()),
        )
        self._proc.start()
        child_conn.close()
        self._conn = parent_conn
        atexit.register(self.close)
        try:
            _, self._info = self._recv("ready", timeout, what="start")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Generator":
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def version(self) -> int:
        return self._version

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def info(self) -> dict:
        return dict(self._info)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the generator process and everything vLLM started; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
        proc, conn = self._proc, self._conn
        if proc is not None:
            if proc.is_alive() and conn is not None:
                try:
                    conn.send(("close",))
                except (OSError, EOFError, BrokenPipeError):
                    pass
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if conn is not None:
            conn.close()
        self._kill_descendants()
        if self._info.get("descendants"):
            _remove_leaked_segments(self._started_at)

    def _kill_descendants(self) -> None:
        """Kill vLLM processes of the generator that outlived it (e.g. after the generator was SIGKILLed)."""
        try:
            import psutil
        except ImportError:  # pragma: no cover
            return
        survivors = [p for pid, created, _ in self._info.get("descendants", [])
                     if (p := _same_process(pid, created)) is not None]
        for p in survivors:  # the generator is gone, so nothing can shut them down in order any more
            try:
                p.kill()
            except psutil.Error:
                pass
        deadline = time.monotonic() + 5
        while survivors and time.monotonic() < deadline:
            survivors = [p for p in survivors if _alive(p)]
            time.sleep(0.05)

    def _dead_engine_process(self) -> str | None:
        """'vLLM process NAME (pid P)' for each of the generator's vLLM processes (engine core, workers; only with
        engine_process) that has died, or None. Checked by the learner while it waits, so no vLLM call can hang it."""
        dead = [f"vLLM process {name} (pid {pid})" for pid, created, name in self._info.get("descendants", [])
                if (p := _same_process(pid, created)) is None or not _alive(p)]
        return ", ".join(dead) or None

    # ---- messaging --------------------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise GeneratorError("generator is closed" + (f": {self._dead_reason}" if self._dead_reason else ""))
        if self._proc is None:
            raise GeneratorError("generator not started: call start() first")

    def _send(self, msg: tuple) -> None:
        self._check_usable()
        try:
            self._conn.send(msg)
        except (OSError, EOFError, BrokenPipeError) as e:
            self._proc.join(1.0)  # a broken pipe usually means the process is gone: say so, as _recv does
            if self._proc.is_alive():
                self._die(f"lost the connection to the generator process while sending {msg[0]!r} ({e})")
            self._die(f"generator process died (noticed while sending {msg[0]!r}: {e})")

    def _die(self, reason: str) -> None:
        self._dead_reason = reason
        code = self._proc.exitcode if self._proc is not None else None
        self.close(timeout=2.0)
        raise GeneratorError(f"{reason} (exit code {code})")

    def _recv(self, expected: str, timeout: float | None, what: str) -> tuple:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            try:
                has = self._conn.poll(wait)
            except (OSError, EOFError):
                has = False
            if has:
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    self._proc.join(1.0)
                    self._die(f"generator process died during {what}")
                if msg[0] == "error":
                    # Name a dead vLLM process first: the generator may see its engine die (EngineDeadError)
                    # before this loop's watcher does, and the dead process is the cause a user must read.
                    dead = self._dead_engine_process()
                    self._proc.join(5.0)
                    cause = f"{dead} died during {what}; " if dead else ""
                    self._die(f"{cause}generator process failed during {what}: {msg[1]}")
                if msg[0] == "fail":
                    raise GeneratorError(msg[1])
                if msg[0] == "closed":
                    self._die(f"generator process exited during {what}")
                if msg[0] != expected:
                    raise GeneratorError(f"protocol error: expected {expected!r}, got {msg[0]!r}")
                return msg
            if not self._proc.is_alive():
                if self._conn.poll(0):  # a last message (its error) may still be in the pipe
                    continue
                self._die(f"generator process died during {what}")
            dead = self._dead_engine_process()
            if dead:  # vLLM's engine core or worker died: the generator would wait for its outputs forever
                self._die(f"{dead} died during {what}")
            if deadline is not None and time.monotonic() >= deadline:
                # the request is still pending in the generator: its late answer would be taken for the next one's
                self._dead_reason = f"no answer to {what} within {timeout} s"
                self.close(timeout=5.0)
                raise GeneratorTimeout(f"generator did not answer {what} within {timeout} s; it has been closed")

    # ---- the learner's API ------------------------------------------------------------------------------------
    def get_batch(self, num_groups: int, learner_version: int, timeout: float | None = None
                  ) -> tuple[list[Group], dict]:
        """`num_groups` finished groups whose loss-masked tokens all have lag learner_version - version <= k
        (pipeline), or exactly `num_groups` fresh groups generated with the current weights (sync).

        learner_version: optimizer steps done (push those weights with update_weights first). Blocks until the
        groups are there (`stats["wait_s"]`); `timeout` (None: forever, while the generator lives) is fatal:
        GeneratorTimeout, and the generator is closed. Stats of the returned groups: gen_tokens, lag_hist
        {lag: loss-masked tokens}, frac_tokens_by_lag, lag_mean, lag_max, reward_errors, interrupted, truncated,
        multi_version_completions; of the generator since the last call: gen_tokens_per_s, gen_busy_frac;
        run totals: stale_dropped, reward_errors_total, skipped_long_prompts; and its state: groups_in_flight,
        groups_ready, buffer_depth_steps, generator_version, groups_per_step."""
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        t0 = time.perf_counter()
        self._send(("get_batch", int(num_groups), int(learner_version), t0))
        _, groups, stats = self._recv("batch", timeout, what="get_batch")
        stats["wait_s"] = time.perf_counter() - t0
        return groups, stats

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int,
                       timeout: float | None = 600) -> float:
        """Push a full HF-named state dict (lm_head.weight included) as weights `version`. Returns the seconds the
        learner spent (writing the shared-memory file + the generator applying it between two decode steps)."""
        t0 = time.perf_counter()
        tensors = weight_tensors(state_dict, _DTYPES.get(self.config.dtype, torch.float32), self._tied)
        self._check_usable()
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        from safetensors.torch import save_file

        directory = _weight_dir(self.config.weight_dir, nbytes)
        path = directory / f"scalerl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}-v{version}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
        try:
            self._send(("update", str(path), int(version)))
            _, applied, _gen_seconds = self._recv("updated", timeout, what="update_weights")
        except BaseException:
            try:
                path.unlink()
            except OSError:
                pass
            raise
        self._version = int(applied)
        self.last_update_s = time.perf_counter() - t0
        return self.last_update_s

    def evaluate(self, problems: list[Problem], samples: int, temperature: float | None = None,
                 timeout: float | None = None) -> list[Group]:
        """`samples` completions of each problem with the current weights (data_index -1), in problem order."""
        if not problems:
            return []
        self._send(("evaluate", list(problems), int(samples), temperature))
        _, groups = self._recv("evaluated", timeout, what="evaluate")
        return groups

    def retire(self, problem_ids: Iterable[str]) -> None:
        """No-Positive-Resampling: never admit these prompts again (groups already in flight still arrive)."""
        ids = [str(i) for i in problem_ids]
        if ids:
            self._send(("retire", ids))

    def _debug(self, what: str, timeout: float = 60) -> Any:
        self._send(("debug", what))
        return self._recv("debug", timeout, what="debug")[1]


__all__ = ["GeneratorConfig", "Completion", "Group", "Generator", "GeneratorError", "GeneratorTimeout",
           "admission_allowed", "should_admit", "mandatory_count", "plan_batch", "lag_histogram", "lag_stats", "interruption_start",
           "split_devices", "set_parent_death_signal", "InterruptionLogitsProcessor", "WeightSyncExtension"]
