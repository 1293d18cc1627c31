"""Benchmarks of scalerl. Each prints what it measured, as a ratio against a baseline timed in the same run,
and ends with one line holding a JSON object of the results (the LAST line printed).

    python -m tools.bench fit         # ScaleRL's full-grid sigmoid fit vs exhaustive per-grid-point curve_fit
    python -m tools.bench pipeline    # our vLLM generator vs LLM.generate, weight-sync latency, pipeline vs sync
    python -m tools.bench train       # train.py's learner step, packed and padded, vs a bare packed training step
    python -m tools.bench head        # the FP32 LM head: float32, bf16, split-bf16 GEMMs, the learner's head, errors
    python -m tools.bench generator   # make run's generator: seconds and CPU-seconds a learner step's groups cost
    python -m tools.bench checkpoint  # a checkpoint's save and load, sharded per rank vs gathered to rank 0

A subcommand is a function ``bench_<name>(args)`` registered in ``BENCHMARKS`` with its argument setup. Experiments
made of whole train.py runs (staleness, study, report) are tools/experiments.py's.
Heavy imports live inside the functions so that one benchmark does not pay for another's.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from harness.cli import exit_with  # a closed stdout (`| head`) ends the command quietly
from harness.cli import run_subcommand, subcommand_parser  # one subcommand per benchmark, one error line for a bad flag
from harness.cli import int_at_least as _count  # the argparse type of a count (`none`: or the word none)
from harness.cli import int_list as _int_list, number as _number  # argparse types of a list of integers, a number
from harness.cli import path_text  # the argparse type of a path: not empty, its ~ the home directory
from harness.cli import output_file, write_output  # a file written after the work: checked before it
from harness import memory_plan  # SHAPES: model shapes in code (no hub); it imports neither torch nor transformers


def _pin_to_one_core() -> None:
    """The fit target is for one CPU core: pin the process and its BLAS threads before numpy loads."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})



def _add_fit_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--points", type=_count(1), default=75,
                        help="evaluation points in the synthetic curve (default 75)")
    parser.add_argument("--noise", type=_number(0.0), default=0.01, help="std of the Gaussian noise on the pass rate")
    parser.add_argument("--repeats", type=_count(1), default=5, help="timed repeats of our fit; the median is reported")
    parser.add_argument("--seed", type=_count(0), default=0, help="random seed of the synthetic noise")


def bench_fit(args: argparse.Namespace) -> dict:
    """Time fit_sigmoid on ScaleRL's grids (71 A x 100 C_mid) against a loop of curve_fit over the same grid."""
    _pin_to_one_core()
    import numpy as np
    from scipy.optimize import curve_fit

    import scaling_fit as sf

    # A synthetic run shaped like ScaleRL's 8B fit (Table 1: C_mid 2542, B 1.92, A 0.610), evaluated at
    # evenly spaced compute between the paper's 1.5k GPU-h cut-off and 16k GPU-h.
    truth = dict(A=0.610, B=1.92, C_mid=2542.0, R0=0.30)
    rng = np.random.default_rng(args.seed)
    compute = np.linspace(1500.0, 16000.0, args.points)
    reward = np.clip(sf.sigmoid(compute, **truth) + rng.normal(0.0, args.noise, args.points), 0.0, 1.0)
    r0 = truth["R0"]
    a_grid, c_mid_grid = sf.PAPER_A_GRID, sf.PAPER_C_MID_GRID

    ours_times, fit = [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        fit = sf.fit_sigmoid(compute, reward, r0=r0, a_grid=a_grid, c_mid_grid=c_mid_grid)
        ours_times.append(time.perf_counter() - start)
    ours_s = float(np.median(ours_times))

    default_times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        default_fit = sf.fit_sigmoid(compute, reward, r0=r0)
        default_times.append(time.perf_counter() - start)
    n_default_grid = len(sf.default_a_grid(reward, r0)) * sf.N_C_MID

    # The baseline: the paper's procedure written directly, one bounded curve_fit for B per grid point.
    start = time.perf_counter()
    baseline = (np.inf, 0.0, 0.0, 0.0)
    failures = 0
    for A in a_grid:
        for C_mid in c_mid_grid:
            model = lambda C, B: sf.sigmoid(C, A, B, C_mid, r0)  # noqa: E731
            try:
                (B,), _ = curve_fit(model, compute, reward, p0=[1.0], bounds=sf.B_BOUNDS)
            except (RuntimeError, ValueError):
                failures += 1
                continue
            sse = float(np.sum((reward - model(compute, B)) ** 2))
            if sse < baseline[0]:
                baseline = (sse, float(A), float(B), float(C_mid))
    baseline_s = time.perf_counter() - start
    base_sse, base_A, base_B, base_C_mid = baseline

    same_optimum = bool(
        abs(fit.A - base_A) < 1e-9
        and abs(fit.C_mid - base_C_mid) < 1e-6 * base_C_mid
        and abs(fit.B - base_B) < 1e-4 * base_B
        and abs(fit.sse - base_sse) <= 1e-7 * base_sse
    )
    grid_size = len(a_grid) * len(c_mid_grid)
    print(f"synthetic curve: {args.points} points, truth {truth}, noise std {args.noise}")
    print(f"grid: {len(a_grid)} A x {len(c_mid_grid)} C_mid = {grid_size} points (ScaleRL's), one CPU core")
    print(f"{'method':38}{'time (s)':>10}{'A':>8}{'B':>9}{'C_mid':>9}{'SSE':>12}")
    print(f"{'fit_sigmoid (median of ' + str(args.repeats) + ')':38}{ours_s:>10.3f}{fit.A:>8.3f}{fit.B:>9.4f}"
          f"{fit.C_mid:>9.1f}{fit.sse:>12.6g}")
    print(f"{'exhaustive curve_fit per grid point':38}{baseline_s:>10.3f}{base_A:>8.3f}{base_B:>9.4f}"
          f"{base_C_mid:>9.1f}{base_sse:>12.6g}")
    print(f"speed-up: {baseline_s / ours_s:.1f}x; same optimum: {same_optimum}; curve_fit failures: {failures}")
    print(f"fit_sigmoid on its default data-adaptive grid ({n_default_grid} points): "
          f"{float(np.median(default_times)):.3f} s, A={default_fit.A:.3f} B={default_fit.B:.3f} "
          f"C_mid={default_fit.C_mid:.1f}")
    return {
        "bench": "fit",
        "n_points": args.points,
        "grid_points": grid_size,
        "ours_s": round(ours_s, 4),
        "baseline_s": round(baseline_s, 3),
        "speedup": round(baseline_s / ours_s, 1),
        "same_optimum": same_optimum,
        "ours": {"A": fit.A, "B": fit.B, "C_mid": fit.C_mid, "sse": fit.sse},
        "baseline": {"A": base_A, "B": base_B, "C_mid": base_C_mid, "sse": base_sse},
        "default_grid_points": n_default_grid,
        "default_grid_s": round(float(np.median(default_times)), 4),
        "target_met": bool(ours_s <= 2.0 and same_optimum),
    }


def _add_pipeline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=_count(1), default=128,
                        help="prompts per timed repeat of the throughput comparison (default 128: on a machine whose "
                             "vLLM makes 15,000 tokens/s, 64 took a second a repeat and the ratio moved by 0.4)")
    parser.add_argument("--group-size", type=_count(1), default=8, help="completions per prompt (default 8)")
    parser.add_argument("--max-tokens", type=_count(1), default=48, help="generation budget of the throughput runs")
    parser.add_argument("--repeats", type=_count(1), default=9,
                        help="alternating timed repeats of each throughput run; the median and range are reported "
                             "(default 9)")
    parser.add_argument("--prompts-per-step", type=_count(1), default=16, help="groups per learner step (default 16)")
    parser.add_argument("--steps", type=_count(1), default=16,
                        help="learner steps per mode, timed from generator ready")
    parser.add_argument("--max-off-policy", type=_count(0), default=8,
                        help="k of the pipeline run (default 8, ScaleRL)")
    parser.add_argument("--buffer-steps", type=_count(0, none=True), default=1,
                        help="buffer limit of the pipeline run in learner steps (default 1, train.py's; none: only "
                             "k limits how far the generator runs ahead)")
    parser.add_argument("--gen-threads", type=_count(1), default=1,
                        help="torch threads of the generator's engine, both modes (default 1: what train.py's "
                             "generator gets, as torchrun sets OMP_NUM_THREADS=1 for the ranks it inherits from; "
                             "0: torch's default, one per core, whose threads stall beside a busy learner)")
    parser.add_argument("--learner-threads", type=_count(1), default=1,
                        help="torch threads of the simulated learner, both modes (default 1: one core each)")
    parser.add_argument("--train-batch", type=_count(1), nargs=2, default=(128, 50), metavar=("ROWS", "TOKENS"),
                        help="batch of the reference training step for weight_sync_frac (default 128 x 50: what "
                             "one of train.py's two learner ranks trains per step by default, 32 prompts x 8 / 2, "
                             "and this benchmark's own learner step, 16 prompts x 8)")
    parser.add_argument("--seed", type=_count(0), default=0, help="seed of the prompts and the sampler")
    parser.add_argument("--gen-replicas", type=_count(1), default=1,
                        help="vLLM replicas of the generator, under one scheduler (default 1); the weight updates "
                             "then go to each by broadcast and by file, alternately, and each is timed")
    parser.add_argument("--weight-updates", type=_count(1), default=8,
                        help="timed weight updates (default 8)")
    parser.add_argument("--only-weights", action="store_true",
                        help="time the weight updates alone (with --model, e.g. a real model), nothing else")
    parser.add_argument("--model", type=path_text, default=None,
                        help="model directory of --only-weights (default: the embedded tiny model)")


def _time_weight_transports(gen, state: dict, updates: int) -> dict:
    """Weight updates through vLLM's weight-transfer API (the engine the generator chose: gloo on CPU) to the same
    replicas: the learner's seconds (median and range), the transfer's own share, and each replica's seconds to
    apply one."""
    times, transfer_only, per_replica = [], [], collections.defaultdict(list)
    for _ in range(updates):
        times.append(gen.update_weights(state, gen.version + 1))
        transfer_only.append(gen.last_broadcast_s)
        for replica, seconds in gen.last_update_info["seconds"].items():
            per_replica[f"r{replica}"].append(seconds)
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    engine = gen.config.fleet.weight_transport
    out = {"weight_bytes": nbytes, "weight_updates": updates, "weight_engine": engine,
           "weight_update_s": round(statistics.median(times), 4),
           "weight_update_s_range": [round(min(times), 4), round(max(times), 4)],
           "weight_transfer_only_s": round(statistics.median(transfer_only), 4),
           "weight_apply_s_by_replica": {k: round(statistics.median(v), 4) for k, v in sorted(per_replica.items())}}
    print(f"weight update of {nbytes / 2**20:.1f} MB to {len(gen.info['replicas'])} replica(s) by vLLM's {engine} "
          f"engine, median of {updates}: {out['weight_update_s'] * 1000:.1f} ms (of which the transfer itself "
          f"{out['weight_transfer_only_s'] * 1000:.1f} ms)", flush=True)
    return out


WEIGHTS_CONTEXT = 1024  # --only-weights' vLLM context, or the model's own where shorter


def _weights_config(args: argparse.Namespace, model_dir: str) -> pl.GeneratorConfig:
    """--only-weights' generator settings. Its context is WEIGHTS_CONTEXT or the model's max_position_embeddings,
    whichever is shorter: vLLM refuses a max_model_len beyond the model's (the tiny model has 256 positions)."""
    from transformers import AutoConfig

    import pipeline_rl as pl

    positions = getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None) or WEIGHTS_CONTEXT
    fleet = pl.FleetConfig(replicas=args.gen_replicas, max_model_len=min(WEIGHTS_CONTEXT, positions),
                           num_threads=args.gen_threads)
    return pl.GeneratorConfig(model=model_dir, seed=args.seed, max_tokens=64, interruptions=False, fleet=fleet)


def bench_weights(args: argparse.Namespace) -> dict:
    """--only-weights: the generator on --model with --gen-replicas replicas, then only the timed weight updates."""
    from harness import base_model, tasks

    tasks.set_vllm_cpu_env()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    from transformers import AutoModelForCausalLM

    import pipeline_rl as pl

    model_dir = args.model or str(base_model.embedded_base_model())
    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    with pl.Generator(_weights_config(args, model_dir), tasks.ArithmeticTask()) as gen:
        results = _time_weight_transports(gen, state, args.weight_updates)
    return {"bench": "pipeline", "only_weights": True, "model_dir": model_dir, "gen_replicas": args.gen_replicas,
            "cpu_count": os.cpu_count(), **results}


def _train_step(model, optimizer, groups) -> None:
    """One real learner step on a batch of groups: REINFORCE with group-centred rewards, forward + backward +
    AdamW (the loss itself does not matter for timing; the shapes and the work do)."""
    import torch

    rows, advantages = [], []
    for g in groups:
        mean = sum(g.rewards) / len(g.rewards)
        for c in g.completions:
            rows.append((g.prompt_ids, c.token_ids, c.loss_mask))
            advantages.append(c.reward - mean)
    length = max(len(p) + len(t) for p, t, _ in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    attn = torch.zeros(len(rows), length, dtype=torch.bool)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for r, (p, t, m) in enumerate(rows):
        ids[r, : len(p) + len(t)] = torch.tensor(p + t)
        attn[r, : len(p) + len(t)] = True
        mask[r, len(p) : len(p) + len(t)] = torch.tensor(m, dtype=torch.bool)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    target_mask = mask[:, 1:]
    adv = torch.tensor(advantages)[:, None]
    loss = -(adv * logp * target_mask).sum() / target_mask.sum().clamp(min=1)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


QUIET_S = 1.5  # longer than the 1 s that vLLM's processes spin after their last step (shm_broadcast.SpinCondition)


def _cpu_seconds(generator_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the generator's process tree and by this process (the learner)."""
    import psutil

    def used(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system

    root = psutil.Process(generator_pid)
    generator = used(root)
    for child in root.children(recursive=True):
        try:
            generator += used(child)
        except psutil.Error:
            pass
    return {"generator": generator, "learner": used(psutil.Process())}


def bench_pipeline(args: argparse.Namespace) -> dict:
    """The generator against vLLM's own LLM.generate, the weight-sync latency against a training step, and
    end-to-end samples/s of pipeline mode against synchronous mode with a real (CPU) learner in this process.
    With --gen-replicas N, N replicas do the generating, and the weight updates are timed by broadcast and by file."""
    if args.only_weights:
        return bench_weights(args)
    bench = _pipeline_bench(args)
    sync = _sync_generator_runs(bench)  # 1-4: LLM.generate against ours, weight sync, sync mode, side by side
    train_step_s = _plain_train_step_s(bench)
    print(f"weight sync: {sync['weight_sync_s'] * 1000:.1f} ms (median of {args.weight_updates}); training step "
          f"{args.train_batch[0]}x{args.train_batch[1]} tokens ({args.learner_threads} thread): "
          f"{train_step_s * 1000:.1f} ms", flush=True)
    import pipeline_rl as pl

    # 5. end to end, pipeline mode, same settings
    with pl.Generator(bench.config("pipeline"), bench.task) as gen:
        pipe_sps, pipe_stats = _run_learner(bench, gen, args.steps)
    return _pipeline_results(bench, sync, train_step_s, pipe_sps, pipe_stats)


@dataclasses.dataclass
class _PipelineBench:
    """What every part of the pipeline bench shares: its flags, the tiny model (`state`: its weights, which the
    weight-sync timing sends), the task and the prompts, in the order of the task's stream."""
    args: argparse.Namespace
    model_dir: str
    task: Any
    model: Any
    problems: list
    prompt_ids: list[list[int]]
    warmup: int = 4  # warm-up prompts; repeat r then uses prompts W + r*N .. W + (r+1)*N - 1, in both runs

    def config(self, mode: str) -> pl.GeneratorConfig:
        """Equal settings everywhere: no interruptions, the max_tokens cap."""
        import pipeline_rl as pl

        a = self.args
        return pl.GeneratorConfig(model=self.model_dir, group_size=a.group_size, interruptions=False,
                                  max_tokens=a.max_tokens, temperature=1.0, mode=mode, seed=a.seed,
                                  max_off_policy=a.max_off_policy, groups_per_batch=a.prompts_per_step,
                                  buffer_steps=a.buffer_steps,
                                  fleet=pl.FleetConfig(num_threads=a.gen_threads, replicas=a.gen_replicas))


def _pipeline_bench(args: argparse.Namespace) -> _PipelineBench:
    """vLLM's CPU settings, the tiny model and the prompts of every run of the bench."""
    from harness import base_model, tasks

    # The baseline as docs/benchmarks.md measured it: vLLM's default LLM.generate, its engine in processes of its own
    # (set_vllm_cpu_env would put it in this process, as each replica has its own).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    tasks.set_vllm_cpu_env()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = str(base_model.embedded_base_model())
    task = tasks.ArithmeticTask()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    warmup = _PipelineBench.warmup
    problems = [p for _, (_, p) in zip(range(warmup + args.repeats * args.prompts), task.train_stream(args.seed))]
    prompt_ids = [tasks.chat_prompt_ids(tokenizer, p.prompt) for p in problems]
    torch.set_num_threads(args.learner_threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return _PipelineBench(args, model_dir, task, model, problems, prompt_ids)


def _run_learner(bench: _PipelineBench, gen: pl.Generator, steps: int) -> tuple[float, list[dict]]:
    """`steps` learner steps of get_batch -> forward/backward/AdamW -> update_weights, timed from the moment the
    generator is ready (so a pipeline gets no credit for groups generated before the clock started)."""
    import torch
    from transformers import AutoModelForCausalLM

    args = bench.args
    learner = AutoModelForCausalLM.from_pretrained(bench.model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(learner.parameters(), lr=1e-4)
    V, all_stats = gen.version, []
    cpu0 = _cpu_seconds(gen.pid)
    t0 = time.perf_counter()
    for _ in range(steps):
        groups, stats = gen.get_batch(args.prompts_per_step, V)
        _train_step(learner, optimizer, groups)
        V += 1
        stats["update_s"] = gen.update_weights(learner.state_dict(), V)
        all_stats.append(stats)
    elapsed = time.perf_counter() - t0
    cpu1 = _cpu_seconds(gen.pid)
    all_stats[0]["cpu_s"] = {side: cpu1[side] - cpu0[side] for side in cpu0}  # the run's CPU seconds by side
    return steps * args.prompts_per_step * args.group_size / elapsed, all_stats


def _co_run(bench: _PipelineBench, gen: pl.Generator, batches: int) -> dict[str, float]:
    """Seconds per batch of generation and per learner step when both run side by side on the same cores,
    neither waiting for the other: the generator makes `batches` sync-mode batches while a thread trains on
    a fixed batch without pause. A pipeline cannot beat max of the two (it adds the waits and the weight
    loads); unlike the times each side takes alone, these include what the sides take from each other."""
    import torch
    from transformers import AutoModelForCausalLM

    per_step = bench.args.prompts_per_step
    time.sleep(QUIET_S)
    groups, _ = gen.get_batch(per_step, gen.version)  # a batch for the learner to train on
    learner = AutoModelForCausalLM.from_pretrained(bench.model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(learner.parameters(), lr=1e-4)
    _train_step(learner, optimizer, groups)  # warm-up
    running, step_times = threading.Event(), []
    running.set()

    def train_without_pause() -> None:
        while running.is_set():
            t0 = time.perf_counter()
            _train_step(learner, optimizer, groups)
            step_times.append(time.perf_counter() - t0)

    trainer = threading.Thread(target=train_without_pause)
    trainer.start()
    try:
        time.sleep(0.5)  # the learner is in full swing before the generator's clock starts
        t0 = time.perf_counter()
        for _ in range(batches):
            gen.get_batch(per_step, gen.version)
        gen_s = (time.perf_counter() - t0) / batches
    finally:
        running.clear()
        trainer.join()
    return {"gen_s": gen_s, "learner_s": statistics.median(step_times)}


def _sync_generator_runs(bench: _PipelineBench) -> dict:
    """1-2. vLLM's own LLM.generate against our generator (sync mode: get_batch(N) admits the same N prompts, the
    stream in order), on the same prompts with the same sampling settings (processed logprobs of each token). The
    two engines live side by side and the runs alternate, so that load from other processes hits both alike. Then,
    on our generator: 3. the weight sync's latency, 4a. sync mode end to end, 4b. both sides side by side."""
    from vllm import LLM, SamplingParams

    import pipeline_rl as pl
    from harness import vllm_internals

    args, W, N = bench.args, bench.warmup, bench.args.prompts
    with vllm_internals.engine_start():
        llm = LLM(model=vllm_internals.loadable_model_path(bench.model_dir), dtype="float32", seed=args.seed,
                  max_model_len=256, enforce_eager=True, logprobs_mode="processed_logprobs", disable_log_stats=True)
    params = SamplingParams(n=args.group_size, temperature=1.0, max_tokens=args.max_tokens, logprobs=0)
    inputs = [{"prompt_token_ids": ids} for ids in bench.prompt_ids]
    llm.generate(inputs[:W], params, use_tqdm=False)  # warm-up
    base_rates, ours_rates = [], []
    gen = pl.Generator(bench.config("sync"), bench.task)
    gen.start()
    try:
        gen.get_batch(W, 0)  # warm-up on the same W prompts
        for r in range(args.repeats):
            # vLLM's worker (and engine core, when in a process of its own) busy-waits for 1 s after its last step:
            # a run that starts right after the other engine's would share the 2 cores with that spin
            time.sleep(QUIET_S)
            t0 = time.perf_counter()
            outs = llm.generate(inputs[W + r * N : W + (r + 1) * N], params, use_tqdm=False)
            base_rates.append(sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - t0))
            time.sleep(QUIET_S)
            t0 = time.perf_counter()
            groups, _ = gen.get_batch(N, 0)
            ours_rates.append(sum(c.num_tokens for g in groups for c in g.completions) / (time.perf_counter() - t0))
            expected = bench.problems[W + r * N : W + (r + 1) * N]
            assert sorted(g.problem.id for g in groups) == sorted(p.id for p in expected)
            print(f"repeat {r}: LLM.generate {base_rates[-1]:.0f} tokens/s, ours {ours_rates[-1]:.0f} tokens/s",
                  flush=True)
        vllm_internals.shutdown_engine_core(llm)
        del llm, outs
        gc.collect()
        transports = _time_weight_transports(gen, bench.model.state_dict(), args.weight_updates)
        sync_sps, sync_stats = _run_learner(bench, gen, args.steps)
        corun = _co_run(bench, gen, args.steps)
    finally:
        gen.close()
    ratios = sorted(o / b for o, b in zip(ours_rates, base_rates))
    print(f"gen throughput ratio per repeat: {', '.join(f'{x:.3f}' for x in ratios)} (median "
          f"{statistics.median(ratios):.3f}, range {ratios[0]:.3f}..{ratios[-1]:.3f})", flush=True)
    print(f"sync mode: {sync_sps:.1f} samples/s", flush=True)
    return {"base_rates": base_rates, "ours_rates": ours_rates, "ratios": ratios, "transports": transports,
            "weight_sync_s": transports["weight_update_s"], "sync_sps": sync_sps, "sync_stats": sync_stats,
            "corun": corun}


def _plain_train_step_s(bench: _PipelineBench) -> float:
    """The median of 5 timed AdamW steps (after one warm-up) of the tiny model on --train-batch random tokens."""
    import torch

    rows, cols = bench.args.train_batch
    model = bench.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(10, model.config.vocab_size, (rows, cols))
    step_times = []
    for _ in range(6):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step_times.append(time.perf_counter() - t0)
    return statistics.median(step_times[1:])


def _pipeline_bounds(bench: _PipelineBench, sync: dict, pipe_sps: float) -> dict:
    """The most pipelining can give on this machine: in sync mode the learner waits for generation (wait_s) and the
    generator idles while the learner trains, so with both overlapped perfectly a step would take
    max(generation, learning) instead of their sum. On 2 shared cores the overlap is partial: they compete.
    Two bounds: on separate devices, (generation + learning) / max of the two; on shared cores the two sides
    also cannot use more CPU seconds per second than there are cores, so a step takes at least
    (generator's CPU seconds + learner's CPU seconds) / cores, as measured in the sync run. A third, measured side
    by side (4b): a step of a perfect pipeline takes max(co-run generation, co-run learning)."""
    args, corun, sync_stats = bench.args, sync["corun"], sync["sync_stats"]
    sync_total_s = args.steps * args.prompts_per_step * args.group_size / sync["sync_sps"]
    sync_gen_s = sum(s["wait_s"] for s in sync_stats)
    overlap_bound = sync_total_s / max(sync_gen_s, sync_total_s - sync_gen_s)
    cpu_s = sync_stats[0]["cpu_s"]
    cores = len(os.sched_getaffinity(0))
    shared_bound = sync_total_s / max(sync_gen_s, sync_total_s - sync_gen_s,
                                      (cpu_s["generator"] + cpu_s["learner"]) / cores)
    co_run_bound = (sync_total_s / args.steps) / max(corun["gen_s"], corun["learner_s"])
    speedup = pipe_sps / sync["sync_sps"]
    print(f"pipeline / sync: {speedup:.3f}; bound (generation + learning) / max of the two, from the sync run: "
          f"{overlap_bound:.3f} (the pipeline reached {speedup / overlap_bound:.0%} of it); bound on {cores} shared "
          f"cores (sync run: generator {cpu_s['generator']:.1f} + learner {cpu_s['learner']:.1f} CPU-s in "
          f"{sync_total_s:.1f} s): {shared_bound:.3f} (reached {speedup / shared_bound:.0%}); side by side, not "
          f"waiting for each other, a batch took {corun['gen_s']:.3f} s to generate and a step {corun['learner_s']:.3f} "
          f"s to train (sync run: {sync_gen_s / args.steps:.3f} s and {(sync_total_s - sync_gen_s) / args.steps:.3f} "
          f"s): bound {co_run_bound:.3f} (reached {speedup / co_run_bound:.0%})", flush=True)
    return {
        "pipeline_vs_sync_speedup": round(speedup, 3),
        "pipeline_vs_sync_bound": round(overlap_bound, 3),
        "pipeline_frac_of_bound": round(speedup / overlap_bound, 3),
        "pipeline_vs_sync_shared_core_bound": round(shared_bound, 3),
        "pipeline_frac_of_shared_core_bound": round(speedup / shared_bound, 3),
        "co_run_gen_s": round(corun["gen_s"], 3), "co_run_learner_s": round(corun["learner_s"], 3),
        "sync_gen_s": round(sync_gen_s / args.steps, 3),
        "sync_learner_s": round((sync_total_s - sync_gen_s) / args.steps, 3),
        "pipeline_vs_sync_co_run_bound": round(co_run_bound, 3),
        "pipeline_frac_of_co_run_bound": round(speedup / co_run_bound, 3),
    }


def _pipeline_results(bench: _PipelineBench, sync: dict, train_step_s: float, pipe_sps: float,
                      pipe_stats: list[dict]) -> dict:
    """The pipeline run's lag and tokens per replica printed, its bounds, and every figure of the bench."""
    args = bench.args
    lag: collections.Counter[int] = collections.Counter()  # {lag: loss-masked tokens} over all steps
    tokens_by_replica: collections.Counter[int] = collections.Counter()
    for s in pipe_stats:
        lag.update(s["lag_hist"])
        tokens_by_replica.update(s["gen_tokens_by_replica"])
    pipe_s = args.steps * args.prompts_per_step * args.group_size / pipe_sps
    per_replica = {r: round(n / pipe_s, 1) for r, n in sorted(tokens_by_replica.items())}
    print(f"pipeline mode: generated tokens/s by replica {per_replica}", flush=True)
    print(f"pipeline mode (k={args.max_off_policy}): {pipe_sps:.1f} samples/s; lag histogram "
          f"{dict(sorted(lag.items()))}", flush=True)
    bounds = _pipeline_bounds(bench, sync, pipe_sps)
    ratio, weight_sync_s, sync_stats = statistics.median(sync["ratios"]), sync["weight_sync_s"], sync["sync_stats"]
    return {
        "bench": "pipeline", "model_dir": bench.model_dir, "cpu_count": os.cpu_count(), "prompts": args.prompts,
        "group_size": args.group_size, "max_tokens": args.max_tokens, "gen_replicas": args.gen_replicas,
        "llm_generate_tokens_per_s": round(statistics.median(sync["base_rates"]), 1),
        "ours_sync_tokens_per_s": round(statistics.median(sync["ours_rates"]), 1),
        "gen_throughput_ratio": round(ratio, 3),
        "gen_throughput_ratios": [round(x, 3) for x in sync["ratios"]],
        "weight_sync_s": round(weight_sync_s, 4),
        **sync["transports"],
        "pipeline_gen_tokens_per_s_by_replica": per_replica,
        "train_step_s": round(train_step_s, 4),
        "train_batch": list(args.train_batch),
        "weight_sync_frac": round(weight_sync_s / train_step_s, 3),
        "sync_samples_per_s": round(sync["sync_sps"], 2),
        "pipeline_samples_per_s": round(pipe_sps, 2),
        **bounds,
        "sync_cpu_s": {side: round(x, 2) for side, x in sync_stats[0]["cpu_s"].items()},
        "pipeline_cpu_s": {side: round(x, 2) for side, x in pipe_stats[0]["cpu_s"].items()},
        "pipeline_wait_s_mean": round(statistics.mean(s["wait_s"] for s in pipe_stats), 3),
        "sync_wait_s_mean": round(statistics.mean(s["wait_s"] for s in sync_stats), 3),
        "pipeline_lag_mean": round(sum(k * n for k, n in lag.items()) / max(1, sum(lag.values())), 3),
        "pipeline_lag_max": max(lag) if lag else 0,
        "stale_dropped": pipe_stats[-1]["stale_dropped"],
        "prompts_per_step": args.prompts_per_step, "steps": args.steps, "max_off_policy": args.max_off_policy,
        "buffer_steps": args.buffer_steps,
        "learner_threads": args.learner_threads, "gen_threads": args.gen_threads,
        # the issue's goals: generator >= 0.95 of raw vLLM, weight sync < 10% of a step, pipeline >= 80% of the bound
        "target_met": bool(ratio >= 0.95 and weight_sync_s / train_step_s < 0.10
                           and bounds["pipeline_frac_of_bound"] >= 0.8),
    }


def _add_train_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", type=_count(1), default=32,
                        help="groups in the batch (default 32, the tiny recipe's)")
    parser.add_argument("--group-size", type=_count(1), default=8, help="completions per group (default 8)")
    parser.add_argument("--repeats", type=_count(1), default=5,
                        help="timed steps per method in each of 2 interleaved rounds, after one warm-up (default 5)")
    parser.add_argument("--loss", default="cispo", help="loss file used by the learner (default cispo)")
    parser.add_argument("--micro-batch-tokens", type=_count(1), default=None,
                        help="the learner's micro-batch token budget (default: train.py's --micro-batch-tokens)")
    parser.add_argument("--model", type=path_text, default=None,
                        help="HF model name or directory to time (default: the embedded tiny model, built on "
                             "first use)")
    parser.add_argument("--shape", default=None,
                        help="time a model of this shape with random weights instead of --model: a name of "
                             "memory_plan.SHAPES (qwen3-1.7b, qwen3-4b, qwen3-8b, smollm2), its config written in "
                             "code, so no hub")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the learner's compute dtype, as train.py's --dtype (bfloat16 keeps its FP32 LM head); "
                             "the bare step runs its model in the same dtype (default float32)")
    parser.add_argument("--fp32-lm-head", action=argparse.BooleanOptionalAction, default=True,
                        help="the learner's LM head in float32 under bfloat16, as train.py's --fp32-lm-head "
                             "(default on)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="the learner's --activation-checkpointing; the bare step recomputes its decoder layers "
                             "in backward too (transformers' gradient checkpointing)")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="the learner's --cpu-offload; the bare step, a plain model, keeps everything on the GPU")
    parser.add_argument("--adamw", default="auto", choices=("auto", "default", "fused"),
                        help="the learner's --adamw (auto: fused on a GPU without --cpu-offload); the bare step "
                             "uses the same implementation, and where it is fused is also timed with PyTorch's "
                             "default, the limit as it was first measured")
    parser.add_argument("--fsdp-reshard", default="auto", choices=("auto", "always", "never"),
                        help="the learner's --fsdp-reshard (auto: never on one rank without --cpu-offload)")
    parser.add_argument("--completion-tokens", type=_int_list(1, pair=True), default="3,20",
                        help="MIN,MAX length of the synthetic completions, uniform (default 3,20)")
    parser.add_argument("--row-widths", type=_int_list(1), default=None,
                        help="W1,W2,...: also time the bare step on the batch packed (best-fit decreasing) into rows "
                             "of each width, at least the longest sequence's, and in padded rows: where the packed "
                             "rows' length should sit, against the one packing.pack_rows chooses")
    parser.add_argument("--packed-only", action="store_true",
                        help="time the learner in packed rows only, without the padded layout and the per-micro-batch "
                             "host times: for batches whose steps take seconds (one long sequence has no padding)")
    parser.add_argument("--peak-tflops", type=_number(0.0, above=True), default=None,
                        help="dense peak TFLOP/s of the GPU in --dtype, for MFU, as train.py's --peak-tflops "
                             "(default: harness/runtime.py's table of GPUs; none on CPU, and then no MFU)")
    parser.add_argument("--json", type=output_file, default=None, metavar="PATH",
                        help="also write the results (the JSON object of the last line printed) to PATH")
    parser.add_argument("--profile", type=output_file, default=None, metavar="PATH",
                        help="also profile one packed learner step after the timed ones (torch.profiler) and write "
                             "its operators, the most time-consuming first, to PATH: where the step's time goes")


def synthetic_groups(n_groups: int, group_size: int, vocab: int, seed: int = 0,
                     completion_tokens: tuple[int, int] = (3, 20)) -> list:
    """Groups of random prompts and completions with +-1 rewards and sampler logprobs near -3.7 (so that some
    ratios get clipped): a learner batch without a generator. tests/learner_probe.py uses it too."""
    import random

    from pipeline_rl import Completion, Group
    from harness.tasks import Problem

    rng = random.Random(seed)
    groups = []
    for i in range(n_groups):
        prompt = [rng.randrange(8, vocab) for _ in range(rng.randint(5, 9))]
        completions = []
        for _ in range(group_size):
            length = rng.randint(*completion_tokens)
            completions.append(Completion(
                token_ids=[rng.randrange(8, vocab) for _ in range(length)],
                sampler_logprobs=[-3.7 + rng.uniform(-0.5, 0.5) for _ in range(length)],  # some ratios get clipped
                versions=[0] * length, loss_mask=[rng.random() > 0.1 for _ in range(length)], text="",
                finish_reason="stop", reward=rng.choice([1.0, -1.0])))
        groups.append(Group(Problem(f"p{i}", "", ""), i, prompt, completions))
    return groups


def bench_train(args: argparse.Namespace) -> dict:
    """The learner's real (trained) tokens/s, train.py's FSDP2 step (micro-batches, loss file, clipping, AdamW) with
    packed rows and with padded ones (--no-packing), against the no-padding limit: a bare transformers forward +
    backward + AdamW over the same real tokens, packed as the learner packs them. In one process on one rank, with
    `python -m tools.bench train` (no torchrun). The learner and the bare model are built, timed and freed one after
    the other, so that a model the size of the GPU's memory can be timed at all (two copies of Qwen3-1.7B's weights,
    gradients and AdamW state with a step's activations did not fit in 80 GB). For each: the step's time, tokens/s, MFU
    where the GPU's peak is known, its peak GPU memory, and its LM head's share of the step. Also the padding fraction
    of either layout, over the micro-batches the learner runs, and the host time of one micro-batch of the learner,
    packed and padded."""
    import importlib
    import tempfile

    import torch
    import torch.distributed as dist

    from harness import flags, runtime
    from transformers import AutoConfig

    cli = _learner_cli(args)  # before anything starts: a flag this train.py lacks stops the bench here
    _, world, device = runtime.init_distributed()
    try:
        with tempfile.TemporaryDirectory(prefix="scalerl-bench-") as scratch:
            model_dir = _bench_model_dir(args, Path(scratch), device)
            _free_memory(device)
            loss_module = importlib.import_module(args.loss)
            config = AutoConfig.from_pretrained(model_dir)
            groups = synthetic_groups(args.groups, args.group_size, config.vocab_size,
                                      completion_tokens=flags.int_range(args.completion_tokens))
            rewards = torch.tensor([r for grp in groups for r in grp.rewards])
            advantages = loss_module.compute_advantages(rewards, args.group_size)
            learner = _time_learner(model_dir, cli, loss_module, groups, advantages, args, device, world)
            learner["planned_bytes"] = _planned_learner_bytes(config, cli, groups, world, device)
            _free_memory(device)  # the learner is gone (tested): the bare step gets the whole GPU
            learner["after_free_bytes"] = _allocated(device)
            learner["head_s"] = _learner_head_seconds(config, cli, learner.pop("rows"), args.repeats, device)
            _free_memory(device)
            learner["head_gemms_s"] = _head_gemms_seconds(config, cli, learner["scored_tokens"], args.repeats, device)
            _free_memory(device)
            bare = _time_bare(model_dir, cli, groups, advantages, args, device)
            _free_memory(device)
    finally:
        dist.destroy_process_group()
    results = _train_report(args, cli, groups, learner, bare, runtime.peak_flops_per_s(args.dtype, args.peak_tflops))
    if args.json:
        write_output(args.json, json.dumps(results) + "\n")
    return results


def _learner_cli(args: argparse.Namespace) -> Any:
    """The train.py flags of the learner the bench times (packed rows; the padded layout flips --packing)."""
    from harness import flags

    cli = flags.Args(loss=args.loss, group_size=args.group_size, dtype=args.dtype, fp32_lm_head=args.fp32_lm_head,
                     packing=True, activation_checkpointing=args.activation_checkpointing,
                     cpu_offload=args.cpu_offload, adamw=args.adamw, fsdp_reshard=args.fsdp_reshard)
    if args.micro_batch_tokens is not None:
        cli.micro_batch_tokens = args.micro_batch_tokens
    return cli


def _bench_model_dir(args: argparse.Namespace, scratch: Path, device: Any) -> str:
    """The model directory to time: --model, or --shape's random weights written under `scratch`, or the embedded
    tiny model."""
    if args.model and args.shape:
        raise SystemExit("--model or --shape, not both")
    if args.model:
        return args.model
    if args.shape:
        return write_random_model(args.shape, scratch / args.shape, device)
    from harness import base_model

    return str(base_model.embedded_base_model())


def write_random_model(shape: str, out_dir: Path, device: Any) -> str:
    """A model directory of `shape` (memory_plan.shape_config) with random weights: config.json and safetensors,
    no tokenizer (the bench pads with id 0 and reads none). Built on `device` (a GPU initialises billions of weights
    in seconds, a CPU in minutes) and stored in bfloat16 (half float32's disk and time; the learner loads it in
    float32 all the same)."""
    import torch
    from transformers import AutoModelForCausalLM


    with torch.device(device):
        model = AutoModelForCausalLM.from_config(memory_plan.shape_config(shape), dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    return str(out_dir)


def _allocated(device: Any) -> int | None:
    """Bytes of GPU memory allocated now; None off a GPU."""
    import torch

    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _free_memory(device: Any) -> None:
    """Collect what is no longer referenced (an FSDP2 model holds reference cycles: its hooks, the installed head)
    and hand the GPU's cached blocks back, so the next model starts from an empty GPU."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _host_memory(into: dict) -> Iterator[None]:
    """This process's resident memory (RSS) as the block starts, `into["host_start_bytes"]`, and its highest while
    it runs, `into["host_peak_bytes"]`: the kernel's high-water mark (VmHWM), reset to the resident size as the block
    starts (/proc/self/clear_refs), so no short-lived tensor is missed. The C allocator first hands back the memory
    freed since (glibc's malloc_trim), which it would otherwise keep in the process: a warm-up step's activations
    counted in the start, and the peak over it read as gibibytes less. Off a GPU, where there is no allocator's peak
    to read: what a train step or a checkpoint's save adds."""
    import ctypes

    def status(key: str) -> int:
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key))
        return int(line.split()[1]) * 1024

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # a C library without malloc_trim (not glibc): as it is
        ctypes.CDLL(None).malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the resident size now
    into["host_start_bytes"] = status("VmRSS:")
    try:
        yield
    finally:
        into["host_peak_bytes"] = status("VmHWM:")


def _time_methods(methods: dict[str, Callable[[], None]], repeats: int, device: Any) -> dict[str, dict]:
    """Each method's step time, the best of 2 interleaved rounds of `repeats` steps (fair to the noise of a shared
    machine), after one warm-up step; and the peak GPU memory of its first round's steps (max_memory_allocated since
    a reset after the warm-up: steps as a run has them, AdamW's state allocated by the step before), or off a GPU
    the process's resident memory before and at its highest during them (_host_memory):
    {"s": ..., "peak_bytes": ...} or {"s": ..., "host_start_bytes": ..., "host_peak_bytes": ...}. A method that runs
    out of GPU memory gets {"oom": the error's first line}, and the methods not yet run are left out ({}): a step cut
    short may leave an FSDP2 model half gathered."""
    import torch

    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # CUDA kernels run asynchronously
    out: dict[str, dict] = {name: {} for name in methods}
    times: dict[str, list[float]] = {name: [] for name in methods}
    try:
        for round_ in range(2):
            for name, fn in methods.items():
                if round_ == 0:
                    fn()  # warm-up
                    wait()
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                measured = round_ == 0 and device.type != "cuda"  # the second round: no trim nor collection first
                with _host_memory(out[name]) if measured else contextlib.nullcontext():
                    start = time.perf_counter()
                    for _ in range(repeats):
                        fn()
                    wait()
                    times[name].append((time.perf_counter() - start) / repeats)
                if round_ == 0 and device.type == "cuda":
                    out[name]["peak_bytes"] = torch.cuda.max_memory_allocated(device)
    except torch.cuda.OutOfMemoryError as error:
        out[name] = {"oom": str(error).splitlines()[0]}
    for name, measured in times.items():
        if measured and "oom" not in out[name]:
            out[name]["s"] = min(measured)
    return out


def _time_learner(model_dir: str, cli: Any, loss_module: Any, groups: list, advantages: Any, args: argparse.Namespace,
                  device: Any, world: int) -> dict:
    """train.py's learner step, packed and padded, on one learner (the flag only changes how its rows are built:
    the same weights, the same optimizer, so neither is favoured by what it holds). Returns the timings, its
    parameters, the memory its weights hold, the host time per micro-batch, and each layout's micro-batch rows
    (for the LM head's time); nothing that keeps the model alive."""
    import dataclasses

    import torch

    from harness import flags, packing
    import train

    clis = {"packed": cli, "padded": dataclasses.replace(cli, packing=False)}
    loss = train.Loss(file=loss_module, hyperparameters=train.loss_hyperparameters(cli), advantage_options={})
    model, n_params = train.build_learner(model_dir, cli, device)
    weights_bytes = _allocated(device)  # before the first step: no gradients, no AdamW state yet
    fused = flags.adamw_fused(cli, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused or None)
    learner = train.Learner(model=model, optimizer=optimizer, loss=loss,
                            scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), pad_id=0,
                            n_params=n_params)
    rows = {name: [packing.to_rows(packing.micro_batch_groups(groups, idx)[0], None, args.group_size, 0, device,
                                   packing.row_packing(c, model))
                   for idx in packing.micro_batches(groups, c.micro_batch_tokens, c.packing)]
            for name, c in clis.items()}

    def learner_step(c: flags.Args) -> Callable[[], None]:
        def step() -> None:  # the loop's learner step: backward, clipping and AdamW, then the metrics gathered
            optimizer.zero_grad(set_to_none=True)
            totals = train.loss_and_backward(c, learner, groups, advantages, train.Step(version=0, world=world))
            train.optimizer_step(c, learner, totals.get("loss", 0.0), has_groups=True)
            train.reduce_metrics(totals, world)
        return step

    methods = {name: learner_step(c) for name, c in clis.items() if not (args.packed_only and name == "padded")}
    timed = {"padded": {}, **_time_methods(methods, args.repeats, device)}
    if args.profile and "s" in timed["packed"]:
        _profile(methods["packed"], args.profile, device)
    host = {} if args.packed_only else _host_times({name: fn for name, fn in methods.items() if "s" in timed[name]},
                                                   args.repeats, device)
    if args.packed_only:
        rows["padded"] = []  # its micro-batches are counted below, its head not timed
    return {"n_params": n_params, "weights_bytes": weights_bytes, "timed": timed, "host": host, "rows": rows,
            "adamw": "fused" if fused else "default",
            "fsdp_reshard": "always" if flags.reshard_layers(cli, world) else "never",
            "attention": model.config._attn_implementation,
            "n_micro_batches": {name: len(packing.micro_batches(groups, c.micro_batch_tokens, c.packing))
                                for name, c in clis.items()},
            "slots": {name: sum((r.input_ids if r.packed is None else r.packed.input_ids).numel() for r in layout)
                      or None for name, layout in rows.items()},  # token slots the model computes on, padding too
            "scored_tokens": sum(r.scored.numel() for r in rows["packed"])}  # the positions its LM head scores


def _profile(step: Callable[[], None], path: str, device: Any) -> None:
    """Profile one call of `step` (after its warm-up) with torch.profiler, CPU and GPU, and write its operators'
    table to `path`, sorted by their own time on the device (on the CPU off a GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    write_output(path, prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=90) + "\n")
    print(f"[bench] profile of one learner step: {path}", file=sys.stderr, flush=True)


def _host_times(methods: dict[str, Callable[[], None]], repeats: int, device: Any) -> dict[str, tuple[float, float]]:
    """Host time per micro-batch: the wall time of each train.micro_batch_loss call (forward, loss file, metrics,
    backward), in extra learner steps after the timed ones, with the GPU synchronised between steps only. The host
    issues the forward's kernels, its metrics' reads wait for the GPU to finish them, then it issues the backward's
    without waiting: so this is the host's time plus the forward's tail behind the last kernel issued, host time
    where the step is host-bound (the tiny and SmolLM2-sized models on a GPU), and simply the micro-batch's time on
    CPU. The rest of the step (building the rows, clipping, AdamW, the metrics' gather, the wait for the GPU at its
    end, so on a GPU the backward's tail too) is the step's time minus its micro-batches'. Returns {method: (ms per
    micro-batch, ms of the rest of a step)}."""
    import torch

    import train

    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    micro_batch_s: list[float] = []
    micro_batch_loss = train.micro_batch_loss

    def timed_micro_batch(*call_args, **kwargs) -> dict[str, float]:
        start = time.perf_counter()
        totals = micro_batch_loss(*call_args, **kwargs)
        micro_batch_s.append(time.perf_counter() - start)
        return totals

    out = {}
    train.micro_batch_loss = timed_micro_batch  # loss_and_backward looks it up in train's globals at each call
    try:
        for name, fn in methods.items():
            micro_batch_s.clear()
            step_s = 0.0
            for _ in range(repeats):
                wait()
                start = time.perf_counter()
                fn()
                wait()
                step_s += time.perf_counter() - start
            out[name] = (1e3 * statistics.mean(micro_batch_s), 1e3 * (step_s - sum(micro_batch_s)) / repeats)
    finally:
        train.micro_batch_loss = micro_batch_loss
    return out


def _seconds(fn: Callable[[], None], repeats: int, device: Any) -> float:
    """Mean wall time of `fn` over `repeats` calls after one warm-up, the GPU's work included."""
    import torch

    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    wait()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    wait()
    return (time.perf_counter() - start) / repeats


def _learner_head_seconds(config: Any, cli: Any, rows: dict[str, list], repeats: int, device: Any) -> dict[str, float]:
    """The learner's LM head alone, forward and backward, per layout over its micro-batches: train.py's own head
    (install_head_logprobs: logits in chunks, each recomputed in backward, only at the scored positions) on a
    stand-in weight of the learner's head's shape and compute dtype, fed random hidden states of each micro-batch's
    rows' shape. A stand-in, because the learner's head is an FSDP2 unit whose weight is a shard outside the model's
    forward; the math and the kernels are the head's."""
    import torch

    from harness import flags, head_gemm

    dtype = torch.float32 if cli.dtype == "float32" or cli.fp32_lm_head else torch.bfloat16
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype)
    gemm = flags.lm_head_gemm(cli, device)  # --lm-head-gemm as the learner runs it
    head_gemm.install_head_logprobs(head, cli.logits_chunk_tokens, gemm)
    if gemm == "split-bf16":  # its hidden states are the bf16 trunk's, as they are
        dtype = torch.bfloat16
    seconds = {}
    for name, micro_batches in rows.items():
        if not micro_batches:  # a layout not timed (--packed-only)
            continue
        inputs = []
        for r in micro_batches:
            ids, scored = (r.input_ids, r.scored) if r.packed is None else (r.packed.input_ids, r.packed.scored)
            hidden = torch.randn(*ids.shape, config.hidden_size, device=device, dtype=dtype,
                                 requires_grad=True)                                     # [R, W, H]
            inputs.append((hidden, ids[:, 1:], scored))

        def step() -> None:
            head.weight.grad = None
            for hidden, targets, scored in inputs:
                hidden.grad = None
                request = head_gemm.LogprobRequest(targets, 1.0, scored, entropy=True)  # as a learner's step asks
                head(hidden, request)[0].sum().backward()                                 # [R, W-1] -> scalar

        seconds[name] = _seconds(step, repeats, device)
        del inputs, step
    return seconds


HEAD_GEMM_ROWS = 8192  # the head's GEMMs are timed on at most this many positions and scaled: their [rows, vocab]
                       # gradients of the logits (6 bytes a logit) would not fit the GPU for a 230k-token group


def _head_gemms_seconds(config: Any, cli: Any, tokens: int, repeats: int, device: Any) -> float:
    """The GEMMs alone (forward, hidden's and weight's gradients) of the head --lm-head-gemm chooses, over `tokens`
    scored positions (tools/bench.py head's variants: split-bf16's, or float32's without TF32): the head's term of the
    learner's limit, the bare bf16 step - its bf16 head + these."""
    import torch

    from harness import flags

    rows = min(tokens, HEAD_GEMM_ROWS)
    weight = torch.randn(config.vocab_size, config.hidden_size, device=device) / config.hidden_size ** 0.5  # [V, H]
    hidden = torch.randn(rows, config.hidden_size, device=device).to(torch.bfloat16)                       # [n, H]
    name = "split_bf16_gemms" if flags.lm_head_gemm(cli, device) == "split-bf16" else "fp32_gemms"
    with torch.no_grad():
        torch.set_float32_matmul_precision("highest")  # no TF32 in the float32 GEMMs
        seconds = _seconds(_head_gemm_variants(weight, hidden, 1.0)[name], repeats, device)
    return seconds * tokens / rows


def _bare_model(model_dir: str, cli: Any, device: Any, checkpointing: bool) -> Any:
    """The bare step's model: plain transformers in --dtype, with the learner's attention implementation (so the
    same kernels), its decoder layers recomputed in backward under --activation-checkpointing as the learner's."""
    import torch
    from transformers import AutoModelForCausalLM

    import train

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, cli.dtype),
                                                 attn_implementation=train.attention_implementation(cli, device))
    model = model.to(device)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()  # as the learner (and gradient checkpointing, which only runs in training mode)


def _bare_logprobs(lm_head: Any, hidden: Any, targets: Any) -> Any:
    """The bare step's LM head: log pi(targets) [P] from hidden states [P, H], in chunks of 256 MiB of float32
    logits, each recomputed in backward, so the full [P, vocab] logits never exist (a 49k vocabulary would need GBs);
    plain torch, outside the model's forward."""
    import torch
    import torch.utils.checkpoint

    def chunk_logprobs(h, t):
        logits = lm_head(h).float()                                                       # [chunk, V]
        return torch.log_softmax(logits, -1).gather(-1, t[:, None]).squeeze(-1)           # [chunk]

    chunk = max(1, (1 << 28) // (4 * lm_head.weight.shape[0]))
    return torch.cat([torch.utils.checkpoint.checkpoint(chunk_logprobs, hidden[i: i + chunk], targets[i: i + chunk],
                                                        use_reentrant=False)
                      for i in range(0, len(targets), chunk)])                            # [P]


def _time_bare(model_dir: str, cli: Any, groups: list, advantages: Any, args: argparse.Namespace, device: Any) -> dict:
    """The bare step: a plain transformers model (_bare_model) fed the whole batch in one forward, packed into the
    rows the learner would build for it; a REINFORCE loss on the completions' tokens; AdamW. With --row-widths also
    on the batch packed into rows of each width and in padded rows. Returns the timings, the memory its weights
    hold, its rows' shapes, and its LM head's time alone (_bare_logprobs on the same scored positions). Its AdamW
    is the learner's implementation (--adamw; a plain model's parameters are on the GPU whatever --cpu-offload
    says); where that is fused, the step is also timed with PyTorch's default ("bare default-adamw")."""
    import dataclasses

    import torch

    from harness import flags, packing

    model = _bare_model(model_dir, cli, device, args.activation_checkpointing)
    weights_bytes = _allocated(device)
    fused = flags.adamw_fused(dataclasses.replace(cli, cpu_offload=False), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused or None)
    whole = packing.to_rows(groups, advantages, args.group_size, 0, device, packing.row_packing(cli, model))
    real = whole.attention[:, 1:]                                                         # [N, L-1] a next token
    weight = (whole.advantages[:, None] * whole.loss_mask)[real] / whole.loss_mask.sum()  # [P]

    def bare_step(input_ids: torch.Tensor, where: torch.Tensor, adamw: Any = optimizer,
                  **layout: torch.Tensor) -> Callable[[], None]:
        """The bare step on rows `input_ids` [R, W] (position_ids= packed, or attention_mask= padded), the batch's
        P next-token positions at `where` [P] in the flattened [R * (W-1)] positions that predict one."""
        targets = input_ids[:, 1:].reshape(-1)[where]                                    # [P]

        def step() -> None:
            adamw.zero_grad(set_to_none=True)
            hidden = model.model(input_ids=input_ids, use_cache=False, **layout).last_hidden_state  # [R, W, H]
            hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])[where]                 # [P, H]
            (-(_bare_logprobs(model.lm_head, hidden, targets) * weight).sum()).backward()
            adamw.step()
        return step

    where = whole.packed.index[real]                                                      # [P]
    methods = {"bare": bare_step(whole.packed.input_ids, where, position_ids=whole.packed.position_ids)}
    if fused:
        methods["bare default-adamw"] = bare_step(whole.packed.input_ids, where, torch.optim.AdamW(
            model.parameters(), lr=1e-5), position_ids=whole.packed.position_ids)
    widths: dict[str, tuple[int, ...]] = {}  # --row-widths: method name -> its rows' shape
    if args.row_widths:
        seqs = [grp.prompt_ids + c.token_ids for grp in groups for c in grp.completions]
        longest = max(len(seq) for seq in seqs)
        for width in sorted({max(int(w), longest) for w in args.row_widths.split(",")}):
            ids, positions, at = _packed_batch(seqs, packing.best_fit_decreasing([len(q) for q in seqs], width))
            methods[f"bare W={width}"] = bare_step(ids.to(device), at.to(device), position_ids=positions.to(device))
            widths[f"bare W={width}"] = tuple(ids.shape)
        methods["bare padded"] = bare_step(whole.input_ids, real.flatten().nonzero().squeeze(1),
                                           attention_mask=whole.attention.long())
        widths["bare padded"] = tuple(whole.input_ids.shape)
    timed = _time_methods(methods, args.repeats, device)
    del methods  # the steps' closures hold the model's activations' inputs; the head's timing needs the room
    _free_memory(device)
    targets = whole.packed.input_ids[:, 1:].reshape(-1)[where]                            # [P]
    hidden = torch.randn(len(targets), model.config.hidden_size, device=device, dtype=getattr(torch, cli.dtype),
                         requires_grad=True)                                              # [P, H]

    def head_step() -> None:
        model.lm_head.weight.grad = hidden.grad = None
        (-(_bare_logprobs(model.lm_head, hidden, targets) * weight).sum()).backward()

    head_s = _seconds(head_step, args.repeats, device) if "s" in timed["bare"] else None
    return {"weights_bytes": weights_bytes, "timed": timed, "head_s": head_s, "scored_tokens": len(targets),
            "adamw": "fused" if fused else "default",
            "rows": tuple(whole.packed.input_ids.shape), "widths": widths}


def _planned_learner_bytes(config: Any, cli: Any, groups: list, world: int, device: Any) -> int | None:
    """What the memory plan (harness/memory_plan.py, as the start-up check in harness/flags.py makes it) expects the
    learner to allocate on this GPU for the largest packed micro-batch of `groups`: the bench prints it beside the
    measured peak. None off a GPU."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    return _planned_bytes(config, cli, groups, world, torch.cuda.get_device_properties(device).total_memory)


def _planned_bytes(config: Any, cli: Any, groups: list, world: int, gpu_memory: int) -> int:
    """The memory plan's learner bytes for the packed micro-batches of `groups` (_planned_learner_bytes)."""
    from harness import flags, packing

    lengths = [len(g.prompt_ids) + len(c.token_ids) for g in groups for c in g.completions]
    batches = packing.micro_batches(groups, cli.micro_batch_tokens, True)
    largest = max(sum(lengths[n] for n in b) for b in batches)
    layout = flags.learner_memory_plan(cli, config, world, gpu_memory).layout
    return memory_plan.estimate(config, layout, tokens=largest, micro_batches=len(batches)).learner_bytes


def _train_report(args: argparse.Namespace, cli: Any, groups: list, learner: dict, bare: dict,
                  peak_flops: float | None) -> dict:
    """Print what bench_train measured; the results' JSON object. Fields of a method that ran out of GPU memory are
    None (its "_oom" names the error); GPU memory and MFU fields are left out where not measured (off a GPU) or
    unknown (no peak)."""
    from harness import runtime

    tokens = sum(len(grp.prompt_ids) + len(c.token_ids) for grp in groups for c in grp.completions)  # real ones
    timed = {**learner["timed"], "bare": bare["timed"]["bare"]}
    step_s = {name: timed[name].get("s") for name in ("packed", "padded", "bare")}
    head_s = {**learner["head_s"], "bare": bare["head_s"]}
    slots = learner["slots"]
    weights = {"packed": learner["weights_bytes"], "padded": learner["weights_bytes"], "bare": bare["weights_bytes"]}
    results = {"bench": "train", "model": args.model, "shape": args.shape, "n_params": learner["n_params"],
               "dtype": args.dtype, "fp32_lm_head": args.fp32_lm_head, "attention": learner["attention"],
               "activation_checkpointing": args.activation_checkpointing, "cpu_offload": args.cpu_offload,
               "adamw": learner["adamw"], "fsdp_reshard": learner["fsdp_reshard"], "bare_adamw": bare["adamw"],
               "groups": args.groups, "group_size": args.group_size, "completion_tokens": args.completion_tokens,
               "tokens": tokens, "micro_batch_tokens": cli.micro_batch_tokens,
               "micro_batches_packed": learner["n_micro_batches"]["packed"],
               "micro_batches_padded": learner["n_micro_batches"]["padded"], "bare_rows": list(bare["rows"]),
               "pad_fraction_packed": round(1 - tokens / slots["packed"], 4),
               "pad_fraction_padded": round(1 - tokens / slots["padded"], 4) if slots["padded"] else None,
               "scored_tokens_learner": learner["scored_tokens"], "scored_tokens_bare": bare["scored_tokens"]}
    if peak_flops is not None:
        results["peak_tflops"] = peak_flops / 1e12
    for name, s in step_s.items():
        # 4 significant figures, not 4 decimals: a tiny shape's step takes milliseconds, where 4 decimals of s
        # and of an MFU near 1% each lose up to 1%
        results[f"{name}_s"] = None if s is None else float(f"{s:.4g}")
        results[f"{name}_tokens_per_s"] = None if s is None else round(tokens / s)
        mfu = None if s is None else runtime.model_flops_utilisation(learner["n_params"], tokens, s, 1, peak_flops)
        if peak_flops is not None:
            results[f"{name}_mfu"] = None if mfu is None else float(f"{mfu:.4g}")
        if "peak_bytes" in timed[name]:
            results[f"{name}_peak_gib"] = round(timed[name]["peak_bytes"] / 2**30, 2)
            results[f"{name}_peak_beyond_weights_gib"] = round((timed[name]["peak_bytes"] - weights[name]) / 2**30, 2)
        if "host_peak_bytes" in timed[name]:  # off a GPU: the process's memory, the step's over what it held before
            results[f"{name}_host_peak_gib"] = round(timed[name]["host_peak_bytes"] / 2**30, 2)
            results[f"{name}_host_step_gib"] = round(
                (timed[name]["host_peak_bytes"] - timed[name]["host_start_bytes"]) / 2**30, 2)
        results[f"{name}_head_s"] = None if head_s.get(name) is None else float(f"{head_s[name]:.4g}")
        results[f"{name}_head_share"] = None if s is None or head_s.get(name) is None else round(head_s[name] / s, 3)
        if "oom" in timed[name]:
            results[f"{name}_oom"] = timed[name]["oom"]
    if step_s["packed"] and step_s["bare"] and head_s.get("bare") is not None:
        # the learner's limit: the bare bf16 step with its bf16 head replaced by the chosen head's GEMMs alone
        limit = step_s["bare"] - head_s["bare"] + learner["head_gemms_s"]
        results.update(head_gemms_s=round(learner["head_gemms_s"], 4), limit_s=round(limit, 4),
                       learner_vs_limit=round(step_s["packed"] / limit, 3),
                       head_vs_its_gemms=round(head_s["packed"] / learner["head_gemms_s"], 3))
        default = bare["timed"].get("bare default-adamw", {}).get("s")
        if default:  # the limit as first measured: the bare step with PyTorch's default AdamW
            limit = default - head_s["bare"] + learner["head_gemms_s"]
            results.update(bare_default_adamw_s=round(default, 4), limit_default_adamw_s=round(limit, 4),
                           learner_vs_limit_default_adamw=round(step_s["packed"] / limit, 3))
    if learner.get("planned_bytes") and "peak_bytes" in timed["packed"]:
        results["packed_planned_gib"] = round(learner["planned_bytes"] / 2**30, 2)
        results["packed_plan_vs_peak"] = round(learner["planned_bytes"] / timed["packed"]["peak_bytes"], 3)
    if learner["weights_bytes"] is not None:
        results.update(learner_weights_gib=round(learner["weights_bytes"] / 2**30, 2),
                       bare_weights_gib=round(bare["weights_bytes"] / 2**30, 2),
                       left_after_learner_gib=round(learner["after_free_bytes"] / 2**30, 2))
    for name in ("packed", "padded"):
        if name in learner["host"]:
            results[f"host_ms_per_micro_batch_{name}"] = round(learner["host"][name][0], 2)
            results[f"host_ms_rest_of_step_{name}"] = round(learner["host"][name][1], 2)
    if bare["widths"]:
        results["row_widths"] = {}
        for name, shape in bare["widths"].items():
            if "s" in bare["timed"][name]:
                results["row_widths"][name.split()[-1]] = {"rows": list(shape),
                                                           "tokens_per_s": round(tokens / bare["timed"][name]["s"])}
    ratio = {"learner_vs_bare_packed": ("bare", "packed"), "packed_vs_padded": ("padded", "packed")}
    for key, (num, den) in ratio.items():
        results[key] = None if step_s[num] is None or step_s[den] is None else round(step_s[num] / step_s[den], 3)
    _print_train_report(results)
    return results


def _print_train_report(r: dict) -> None:
    """bench_train's results as lines for a reader (the JSON line follows them)."""
    def fmt(x, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    print(f"batch: {r['groups']} groups x {r['group_size']} completions of {r['completion_tokens']} tokens, "
          f"{r['tokens']:,} real tokens; micro-batches of {r['micro_batch_tokens']} tokens")
    print(f"model: {r['shape'] or r['model'] or 'the embedded tiny model'}, {r['n_params']:,} parameters, "
          f"{r['dtype']}{' (FP32 head)' if r['fp32_lm_head'] and r['dtype'] == 'bfloat16' else ''}, "
          f"{r['attention']}; activation checkpointing {r['activation_checkpointing']}, CPU offload "
          f"{r['cpu_offload']}; AdamW {r['adamw']} (bare step: {r['bare_adamw']}), FSDP2 reshards each layer after "
          f"its forward: {r['fsdp_reshard']}; peak {fmt(r.get('peak_tflops'), '.1f')} TFLOP/s")
    print(f"padding: padded rows {fmt(r['pad_fraction_padded'], '.1%')} ({r['micro_batches_padded']} micro-batches); "
          f"packed rows {r['pad_fraction_packed']:.1%} ({r['micro_batches_packed']}); the bare step's rows "
          f"{tuple(r['bare_rows'])}")
    labels = {"packed": "learner, packed rows", "padded": "learner, padded rows",
              "bare": "bare transformers forward+backward+AdamW, packed"}
    for name, label in labels.items():
        if r.get(f"{name}_oom"):
            print(f"{label}: out of GPU memory ({r[f'{name}_oom']})")
            continue
        if r[f"{name}_s"] is None:
            print(f"{label}: not run (--packed-only, or an earlier method ran out of GPU memory)")
            continue
        memory = (f"; peak {r[f'{name}_peak_gib']} GiB, {r[f'{name}_peak_beyond_weights_gib']} beyond the weights"
                  if f"{name}_peak_gib" in r else
                  f"; host memory (RSS) at most {r[f'{name}_host_peak_gib']} GiB, {r[f'{name}_host_step_gib']} GiB "
                  "over what it held before its steps" if f"{name}_host_peak_gib" in r else "")
        mfu = f", MFU {r[f'{name}_mfu']:.1%}" if r.get(f"{name}_mfu") is not None else ""
        print(f"{label}: {r[f'{name}_s']:.4g} s = {r[f'{name}_tokens_per_s']:,} real tokens/s{mfu}; LM head "
              f"{fmt(r[f'{name}_head_s'], '.3f')} s alone ({fmt(r[f'{name}_head_share'], '.0%')} of the step, "
              f"{r['scored_tokens_bare' if name == 'bare' else 'scored_tokens_learner']:,} positions){memory}")
    if "limit_s" in r:
        print(f"limit (bare step - its bf16 head + the chosen head's GEMMs alone, {r['head_gemms_s']:.3f} s): "
              f"{r['limit_s']:.3f} s; learner packed / limit {r['learner_vs_limit']:.3f}; learner's head / its "
              f"GEMMs {r['head_vs_its_gemms']:.3f}")
    if "limit_default_adamw_s" in r:
        print(f"with the bare step's AdamW PyTorch's default ({r['bare_default_adamw_s']:.3f} s): limit "
              f"{r['limit_default_adamw_s']:.3f} s; learner packed / that limit "
              f"{r['learner_vs_limit_default_adamw']:.3f}")
    if "packed_planned_gib" in r:
        print(f"memory plan (harness/memory_plan.py) of the packed learner's largest micro-batch: "
              f"{r['packed_planned_gib']} GiB, {r['packed_plan_vs_peak']:.2f}x its measured peak of "
              f"{r['packed_peak_gib']} GiB")
    print(f"learner packed / bare packed {fmt(r['learner_vs_bare_packed'], '.3f')}; packed / padded learner "
          f"{fmt(r['packed_vs_padded'], '.3f')}")
    if "host_ms_per_micro_batch_packed" in r and "host_ms_per_micro_batch_padded" in r:
        print(f"host time per micro-batch (its wall time, the GPU synchronised between steps only): packed "
              f"{r['host_ms_per_micro_batch_packed']:.1f} ms x {r['micro_batches_packed']}, padded "
              f"{r['host_ms_per_micro_batch_padded']:.1f} ms x {r['micro_batches_padded']}; the rest of the step "
              f"(rows, clipping, AdamW, the metrics' gather, the wait at its end): packed "
              f"{r['host_ms_rest_of_step_packed']:.1f} ms, "
              f"padded {r['host_ms_rest_of_step_padded']:.1f} ms")
    for width, entry in r.get("row_widths", {}).items():
        rows = entry["rows"]
        fraction = 1 - r["tokens"] / (rows[0] * rows[1])
        print(f"{'bare ' + width:>14}: rows {tuple(rows)}, padding {fraction:.1%}: {entry['tokens_per_s']:,} real "
              "tokens/s")


def _packed_batch(seqs: list[list[int]], rows: list[list[int]]) -> tuple:
    """The sequences `seqs` laid end to end in `rows` (sequence indices per row), for --row-widths: (input_ids
    [R, W], position_ids [R, W] restarting at each sequence and at the tail padding, the next-token positions [P]
    in the flattened [R * (W-1)])."""
    import torch

    width = max(sum(len(seqs[i]) for i in row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    start = {}  # sequence -> its first position in the flattened [R * (W-1)]
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            n = len(seqs[i])
            ids[r, offset: offset + n] = torch.tensor(seqs[i])
            positions[r, offset: offset + n] = torch.arange(n)
            start[i] = r * (width - 1) + offset
            offset += n
        positions[r, offset:] = torch.arange(width - offset)
    where = [start[i] + t for i in range(len(seqs)) for t in range(len(seqs[i]) - 1)]  # in the sequences' order
    return ids, positions, torch.tensor(where, dtype=torch.long)


# ---------------------------------------------------------------------------------------------------------------
# The FP32 LM head: float32, bf16 and split-bf16 GEMMs, and the learner's head against its GEMMs' limit
# ---------------------------------------------------------------------------------------------------------------

def _add_head_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=sorted(memory_plan.SHAPES), default=None,
                        help="the model whose head to time (default: qwen3-1.7b on a GPU; on a CPU a small head, "
                             "vocab 8192 x hidden 256)")
    parser.add_argument("--vocab", type=_count(1), default=None, help="vocabulary size (over --shape's)")
    parser.add_argument("--hidden", type=_count(1), default=None, help="hidden size (over --shape's)")
    parser.add_argument("--tokens", type=_count(1), default=None,
                        help="scored tokens (default: 8117 on a GPU, a micro-batch of train.py's 8192 tokens' "
                             "completion tokens; 256 on a CPU)")
    parser.add_argument("--temperature", type=_number(0.0, above=True), default=1.0,
                        help="the logits are divided by it (default 1)")
    parser.add_argument("--logit-std", type=_number(0.0, above=True), default=5.0,
                        help="standard deviation of the random head's logits (default 5: the largest near 25)")
    parser.add_argument("--chunk-tokens", type=_count(1), default=None,
                        help="the learner's --logits-chunk-tokens (default: train.py's)")
    parser.add_argument("--repeats", type=_count(1), default=5,
                        help="timed runs of each, after a warm-up; the median is reported (default 5; fewer for "
                             "one that has taken a second)")
    parser.add_argument("--seed", type=_count(0), default=0, help="seed of the random head, hidden states and targets")
    parser.add_argument("--json", type=output_file, default=None, help="also write the results to this file")


def _median_seconds(fn: Callable[[], object], repeats: int, cuda: bool) -> float:
    """Median wall time of fn() after one warm-up (kernels chosen or compiled, memory allocated): CUDA events around
    each run on a GPU, whose kernels run asynchronously; at least 3 runs, and no more once a second is spent."""
    import torch

    fn()
    times: list[float] = []
    while len(times) < max(repeats, 1) and (len(times) < 3 or sum(times) < 1.0):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
    return statistics.median(times)


def _head_reference(weight, hidden, grad_logprobs, temperature: float, seed: int, rows: int = 1024) -> tuple:
    """In float64, `rows` at a time: targets [M] sampled from the head's distribution (as a sampler's are),
    log pi(target) [M], the gradients of sum(grad_logprobs * log pi) wrt the hidden states [M, H] and the weight
    [V, H], and the largest logit / T."""
    import torch

    gen = torch.Generator(device=hidden.device).manual_seed(seed)
    weight64 = weight.double()
    targets, logprobs, grad_hidden, max_logit = [], [], [], -math.inf
    grad_weight = torch.zeros_like(weight64)
    for i in range(0, hidden.shape[0], rows):
        h = hidden[i: i + rows].double()                                                  # [n, H]
        logits = h @ weight64.T / temperature                                             # [n, V]
        max_logit = max(max_logit, float(logits.max()))
        log_probs = torch.log_softmax(logits, -1)
        target = torch.multinomial(log_probs.exp(), 1, generator=gen).squeeze(1)          # [n]
        targets.append(target)
        logprobs.append(log_probs.gather(1, target[:, None]).squeeze(1))
        # d log pi(t) / d logits = (onehot(t) - softmax) / T, times the loss's gradient
        grad_logits = -log_probs.exp_()
        grad_logits[torch.arange(len(target), device=h.device), target] += 1
        grad_logits *= (grad_logprobs[i: i + rows].double() / temperature)[:, None]
        grad_hidden.append(grad_logits @ weight64)
        grad_weight += grad_logits.T @ h
    return torch.cat(targets), torch.cat(logprobs), torch.cat(grad_hidden), grad_weight, max_logit


def _learner_head(weight, gemm: str, chunk_tokens: int | None):
    """A head as train.py's learner runs it: an nn.Linear on `weight` with head_gemm.install_head_logprobs."""
    import torch

    from harness import head_gemm

    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
    head.weight = weight
    head_gemm.install_head_logprobs(head, chunk_tokens, gemm)
    return head


def bench_head(args: argparse.Namespace) -> dict:
    """The FP32 LM head over a micro-batch's scored tokens, in one run: (a) its three GEMMs (forward, and the
    gradients of the hidden states and the weight) in float32 without TF32, (b) the same in bf16, (c) split-bf16's
    GEMMs alone (train.py --lm-head-gemm split-bf16: three bf16 products forward, one per gradient backward), the
    limit of (d) the learner's head as train.py installs it (chunks, log-softmax, what backward keeps), forward and
    backward; (e) the learner's float32 head (--lm-head-gemm fp32: chunks recomputed in backward); and (f) (d) with
    the entropy every training step logs, computed inside the same chunks. Each
    variant's max |log pi(target) - float64's|, on a random head whose logits have --logit-std, bf16 hidden states
    (a bf16 trunk's) and targets sampled from the head."""
    import torch

    from harness import head_gemm

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = memory_plan.SHAPES[args.shape or "qwen3-1.7b"]  # the shapes train.py plan and tools/bench.py train use
    vocab, hidden_size = (shape["vocab_size"], shape["hidden_size"]) if args.shape or cuda else (8192, 256)
    vocab, hidden_size = args.vocab or vocab, args.hidden or hidden_size
    tokens = args.tokens or (8117 if cuda else 256)
    temperature = args.temperature
    torch.set_float32_matmul_precision("highest")  # no TF32 in the float32 GEMMs
    gen = torch.Generator(device=device).manual_seed(args.seed)
    weight = torch.nn.Parameter(torch.randn(vocab, hidden_size, device=device, generator=gen)
                                * (args.logit_std / hidden_size ** 0.5))                 # [V, H] float32
    hidden = torch.randn(tokens, hidden_size, device=device, generator=gen).to(torch.bfloat16)  # [M, H]
    grad_logprobs = torch.randn(tokens, device=device, generator=gen)                    # [M]: dloss / dlog pi
    start = time.perf_counter()
    targets, reference, ref_grad_hidden, ref_grad_weight, max_logit = _head_reference(
        weight.detach(), hidden, grad_logprobs, temperature, args.seed)
    print(f"float64 reference: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

    def max_error(logprobs) -> float:
        return float((logprobs.double() - reference).abs().max())

    def relative_error(grad, ref) -> float:
        return float((grad.double() - ref).norm() / ref.norm())

    with torch.no_grad():  # as the learner's head calls head_gemm's compiled pieces: else they would compile again
        gemms = _head_gemm_variants(weight, hidden, temperature)
        results = {name: {"ms": 1e3 * _median_seconds(fn, args.repeats, cuda)} for name, fn in gemms.items()}
        for name, logits_fn in _head_logits_variants(weight, hidden, temperature).items():
            logprobs = torch.cat([head_gemm.logits_logprobs(logits_fn(rows), targets[rows], 1.0)
                                  for rows in torch.arange(tokens, device=device).split(1024)])
            results.setdefault(name, {})["max_logprob_error"] = max_error(logprobs)
    print(f"GEMMs timed: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

    learner_logprobs = {}  # the learner's heads: the bf16 hidden states as split-bf16 takes them, cast for fp32
    for name, gemm, dtype, entropy in [("learner_split_bf16", "split-bf16", torch.bfloat16, False),
                                       ("learner_fp32", "fp32", torch.float32, False),
                                       ("learner_split_bf16_entropy", "split-bf16", torch.bfloat16, True)]:
        head = _learner_head(weight, gemm, args.chunk_tokens)
        leaf = torch.cat([hidden, hidden[-1:]]).to(dtype)[None].requires_grad_()  # [1, M+1, H]: the last predicts none

        def step() -> None:
            weight.grad = leaf.grad = None
            request = head_gemm.LogprobRequest(targets[None], temperature, None, entropy)  # as a learner's step asks
            logprobs, _ = head(leaf, request)                                           # [1, M]
            logprobs.backward(grad_logprobs[None])
            learner_logprobs[name] = logprobs.detach()[0]

        results[name] = {"ms": 1e3 * _median_seconds(step, args.repeats, cuda),
                         "max_logprob_error": max_error(learner_logprobs[name]),
                         "grad_hidden_rel_error": relative_error(leaf.grad[0, :-1], ref_grad_hidden),
                         "grad_weight_rel_error": relative_error(weight.grad, ref_grad_weight)}
        print(f"{name} timed: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    flop = 2 * tokens * vocab * hidden_size  # one product of the head
    for name, products in [("fp32_gemms", 3), ("bf16_gemms", 3), ("split_bf16_gemms", 5),
                           ("learner_split_bf16", 5), ("learner_fp32", 3), ("learner_split_bf16_entropy", 5)]:
        results[name]["tflops"] = products * flop / (results[name]["ms"] / 1e3) / 1e12
    summary = _head_summary(results, learner_logprobs, device, tokens, vocab, hidden_size, temperature,
                            max_logit, args)
    if args.json:
        write_output(args.json, json.dumps(summary, indent=1) + "\n")
    return summary


def _head_gemm_variants(weight, hidden, temperature: float) -> dict:
    """name -> a function running one variant's three GEMMs (forward, hidden's and weight's gradients) over all
    the tokens at once, on random gradients of the logits: the float32 GEMMs (no TF32), bf16's, and split-bf16's
    (three bf16 products forward, summed in float32 as one GEMM of inner size 3H; one per gradient)."""
    import torch

    from harness import head_gemm

    weight_bf16, hidden32 = weight.to(torch.bfloat16), hidden.float()
    grad_logits = torch.randn(hidden.shape[0], weight.shape[0], device=weight.device) * 1e-3  # [M, V]
    grad_bf16 = grad_logits.to(torch.bfloat16)
    parts, hidden3 = head_gemm._split_bf16(weight, temperature), hidden.repeat(1, 3)               # [V, 3H], [M, 3H]
    return {
        "fp32_gemms": lambda: (hidden32 @ weight.T, grad_logits @ weight, grad_logits.T @ hidden32),
        "bf16_gemms": lambda: (hidden @ weight_bf16.T, grad_bf16 @ weight_bf16, grad_bf16.T @ hidden),
        "split_bf16_gemms": lambda: (head_gemm._mm_float32(hidden3, parts.t()),
                                     head_gemm._mm_float32(grad_bf16, weight_bf16),
                                     head_gemm._mm_float32(grad_bf16.t(), hidden)),
    }


def _head_logits_variants(weight, hidden, temperature: float) -> dict:
    """name -> a function from rows [n] to their logits / T [n, V] (float32 or bf16) in that variant's way."""
    import torch

    from harness import head_gemm

    weight_bf16, parts = weight.to(torch.bfloat16), head_gemm._split_bf16(weight, temperature)

    def tf32(rows):
        torch.set_float32_matmul_precision("high")
        try:
            return hidden[rows].float() @ weight.T / temperature
        finally:
            torch.set_float32_matmul_precision("highest")

    variants = {"fp32_gemms": lambda rows: hidden[rows].float() @ weight.T / temperature,
                "bf16_gemms": lambda rows: (hidden[rows] @ weight_bf16.T) / temperature,
                "split_bf16_gemms": lambda rows: head_gemm._mm_float32(hidden[rows].repeat(1, 3), parts.t()),
                "one_bf16_product": lambda rows: head_gemm._mm_float32(hidden[rows], weight_bf16.t()) / temperature}
    if weight.is_cuda:  # TF32 is a GPU's
        variants["tf32_gemms"] = tf32
    return variants


def _head_summary(results: dict, learner_logprobs: dict, device, tokens: int, vocab: int, hidden: int,
                  temperature: float, max_logit: float, args: argparse.Namespace) -> dict:
    """Print the head's measurements; the results as tools/bench.py returns them."""
    import torch

    from harness import head_gemm

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    limit_ratio = results["learner_split_bf16"]["ms"] / results["split_bf16_gemms"]["ms"]
    vs_fp32_head = float((learner_logprobs["learner_split_bf16"] - learner_logprobs["learner_fp32"]).abs().max())
    print(f"LM head: {tokens:,} scored tokens x vocab {vocab:,} x hidden {hidden:,} on {name}, temperature "
          f"{temperature}, logits up to {max_logit:.1f}; TFLOP/s count the products each needs (float32, bf16: 3; "
          f"split-bf16: 3 forward + 2 backward)")
    labels = {"fp32_gemms": "(a) float32 GEMMs (no TF32), fwd+bwd", "bf16_gemms": "(b) bf16 GEMMs, fwd+bwd",
              "split_bf16_gemms": "(c) split-bf16 GEMMs alone, fwd+bwd: the limit",
              "learner_split_bf16": "(d) learner's head, split-bf16, fwd+bwd", "learner_fp32": "(e) learner's head, "
              "fp32, fwd+bwd", "learner_split_bf16_entropy": "(f) (d) with the entropy a training step logs",
              "one_bf16_product": "    one bf16 product summed in float32", "tf32_gemms": "    TF32 GEMMs"}
    for key, label in labels.items():
        if key not in results:
            continue
        r = results[key]
        timing = f"{r['ms']:9.2f} ms {r['tflops']:7.1f} TFLOP/s" if "ms" in r else " " * 28
        grads = (f"; gradient rel. error: hidden {r['grad_hidden_rel_error']:.1e}, weight "
                 f"{r['grad_weight_rel_error']:.1e}" if "grad_hidden_rel_error" in r else "")
        print(f"{label:<48} {timing}  max |logprob - float64's| {r['max_logprob_error']:.1e}{grads}")
    fused = {"split": head_gemm._split_bf16.fused, "log_softmax": head_gemm._logprobs_and_grad.fused}
    speedup = results["learner_fp32"]["ms"] / results["learner_split_bf16"]["ms"]
    entropy_cost = results["learner_split_bf16_entropy"]["ms"] / results["learner_split_bf16"]["ms"] - 1
    print(f"learner's split-bf16 head / its GEMMs: {limit_ratio:.2f}x (compiled by torch.compile: {fused}); "
          f"max |its logprob - the float32 head's| {vs_fp32_head:.1e}; {speedup:.1f}x the float32 head's speed; "
          f"its entropy adds {100 * entropy_cost:.0f}% to the head")
    return {"bench": "head", "device": name, "tokens": tokens, "vocab": vocab, "hidden": hidden,
            "temperature": temperature, "logit_std": args.logit_std, "max_logit": round(max_logit, 2),
            "chunk_tokens": args.chunk_tokens, "fused": fused, "learner_vs_limit": round(limit_ratio, 3),
            "learner_split_vs_fp32_head_max_logprob_diff": vs_fp32_head,
            "split_vs_fp32_learner_speedup": round(speedup, 2), "entropy_cost": round(entropy_cost, 3),
            **{key: {k: round(v, 3) if k == "ms" else float(f"{v:.4g}") for k, v in r.items()}
               for key, r in results.items()}}


# name -> (benchmark function, function adding its flags, one-line help)
def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default=None, help="memory_plan shape with random weights (smollm2-135m ...); "
                        "default: the embedded tiny model")
    parser.add_argument("--ranks", type=_count(1), default=2, help="learner ranks (torchrun processes, gloo)")
    parser.add_argument("--repeats", type=_count(1), default=3, help="saves and loads timed of each format")
    parser.add_argument("--shard-file-mb", type=_count(1), default=None,
                        help="the size of a rank's shard files (default: harness/checkpoints.SHARD_FILE_BYTES, 1 GiB)")


def bench_checkpoint(args: argparse.Namespace) -> dict:
    """A checkpoint of an FSDP2 learner (float32 weights and AdamW's moments) on --ranks gloo ranks: the sharded one
    (harness/checkpoints.py: each rank its shard, through torch's distributed checkpoint) against the format before
    it (every tensor gathered to rank 0 with full_state_dict and cpu_offload, one torch.save; a load reading it on
    every rank). Seconds (median of --repeats) and each rank's peak host memory above its resident size before the
    operation (VmHWM after /proc/self/clear_refs), in MB. Runs itself under torchrun."""
    import subprocess
    import tempfile

    if "LOCAL_RANK" in os.environ:
        return _checkpoint_rank(args)
    with tempfile.TemporaryDirectory() as scratch:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks),
               "-m", "tools.bench", "checkpoint", "--ranks", str(args.ranks), "--repeats", str(args.repeats),
               *(["--shape", args.shape] if args.shape else []),
               *(["--shard-file-mb", str(args.shard_file_mb)] if args.shard_file_mb else [])]
        run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "SCALERL_BENCH_DIR": scratch})
        if run.returncode != 0:
            raise SystemExit(f"bench checkpoint: torchrun failed:\n{run.stderr[-3000:]}")
        result = json.loads((Path(scratch) / "result.json").read_text())  # rank 0's (the ranks' stdout interleave)
    print(f"{result['model']}, {result['parameters']:,} parameters, {args.ranks} ranks (gloo, CPU)")
    for fmt in ("gathered", "sharded"):
        r = result[fmt]
        files = f" (files of {result['shard_file_mb']} MB)" if fmt == "sharded" else ""
        print(f"  {fmt:9} save {r['save_s']:.2f} s, load {r['load_s']:.2f} s; peak host MB per rank: save "
              f"{r['save_peak_mb']}, load {r['load_peak_mb']}; on disk {r['disk_mb']:.1f} MB{files}")
    return result


def _peak_mb(fn: Callable[[], None]) -> tuple[float, float]:
    """(seconds, this process's peak resident MB above its resident size before) of fn() (_host_memory)."""
    held: dict = {}
    with _host_memory(held):
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return seconds, (held["host_peak_bytes"] - held["host_start_bytes"]) / 1e6


def _checkpoint_rank(args: argparse.Namespace) -> dict:
    """One torchrun rank of bench_checkpoint."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from harness import checkpoints

    dist.init_process_group("gloo")
    rank, scratch = dist.get_rank(), Path(os.environ["SCALERL_BENCH_DIR"])
    if args.shard_file_mb:
        checkpoints.SHARD_FILE_BYTES = args.shard_file_mb << 20
    if args.shape:
        if rank == 0:
            write_random_model(args.shape, scratch / "model", "cpu")
        dist.barrier()
        model_dir = str(scratch / "model")
    else:
        model_dir = _bench_model_dir(argparse.Namespace(model=None, shape=None), scratch, "cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model(input_ids=torch.arange(16)[None] % model.config.vocab_size).logits.float().mean().backward()
    optimizer.step()
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    old = scratch / "old"

    def save_gathered() -> None:  # the format before: everything gathered to rank 0, one torch.save
        model_sd, optim_sd = get_state_dict(model, optimizer, options=full)
        if rank == 0:
            old.mkdir(exist_ok=True)
            torch.save({"model": model_sd, "optimizer": optim_sd}, old / "weights.pt")
        dist.barrier()

    def load_gathered() -> None:  # every rank read weights.pt (memory-mapped) and set its shards from it
        weights = torch.load(old / "weights.pt", map_location="cpu", weights_only=True, mmap=True)
        set_state_dict(model, optimizer, model_state_dict=weights["model"], optim_state_dict=weights["optimizer"],
                       options=full)

    new = scratch / "new"
    new.mkdir(exist_ok=True)
    ops = {"gathered": (save_gathered, load_gathered, lambda: old),
           "sharded": (lambda: checkpoints.save_checkpoint(new, model, optimizer, {"step": 1}, rank),
                       lambda: checkpoints.load_checkpoint(new, model, optimizer, rank), lambda: new / "checkpoint")}
    result: dict[str, Any] = {"model": args.shape or "tiny (embedded)", "ranks": dist.get_world_size(),
                              "shard_file_mb": checkpoints.SHARD_FILE_BYTES >> 20,
                              "parameters": sum(p.numel() for p in model.parameters())}
    for fmt, (save, load, where) in ops.items():
        saves = [_peak_mb(save) for _ in range(args.repeats)]
        loads = [_peak_mb(load) for _ in range(args.repeats)]
        peaks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, (max(p for _, p in saves), max(p for _, p in loads)))
        result[fmt] = {"save_s": statistics.median(s for s, _ in saves),
                       "load_s": statistics.median(s for s, _ in loads),
                       "save_peak_mb": [round(p[0]) for p in peaks], "load_peak_mb": [round(p[1]) for p in peaks],
                       "disk_mb": sum(f.stat().st_size for f in where().iterdir() if f.is_file()) / 1e6}
    if rank == 0:
        (scratch / "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return result


# ---------------------------------------------------------------------------------------------------------------
# make run's generator: the seconds and CPU-seconds one learner step's groups cost it
# ---------------------------------------------------------------------------------------------------------------

def _add_generator_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train-args", default="",
                        help="train.py flags of the run whose generator to time, as one string (default: none, make "
                             "run's recipe: train.py --loss cispo)")
    parser.add_argument("--batches", type=_count(1), default=6,
                        help="timed learner steps' worth of groups, each after a weight push (default 6)")
    parser.add_argument("--gen-threads", type=_count(1), default=1,
                        help="torch threads of the replica (default 1: what train.py's generator inherits from "
                             "torchrun)")
    parser.add_argument("--json", type=output_file, default=None, help="also write the results to this file")


def _tree_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by process `pid` ("scheduler") and by its children ("replicas")."""
    import psutil

    def used(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system

    root = psutil.Process(pid)
    replicas = 0.0
    for child in root.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            replicas += used(child)
    return {"scheduler": used(root), "replicas": replicas}


def bench_generator(args: argparse.Namespace) -> dict:
    """One learner step's groups of make run's recipe (or of --train-args'), generated by the real generator (its
    scheduler process, a replica process with vLLM inside, the wire between them, rewards) in sync mode with the run's
    sampler settings and one replica thread, each batch after a weight push of the base model as the next version,
    then one evaluation: wall seconds, and the CPU-seconds of the replica and of the scheduler, which other jobs on
    the machine move less than the wall time. The completions' digests (of their token ids, logprobs, versions, texts
    and rewards) tell whether a change of the generator left what it samples as it was: sync mode seeds every completion."""
    import dataclasses
    import hashlib
    import shlex

    from harness import base_model, flags, runtime

    import pipeline_rl as pl
    import torch
    import train
    from transformers import AutoModelForCausalLM

    cli = flags.parse_args(["--loss", "cispo", *shlex.split(args.train_args)])
    flags.resolve_defaults(cli, embedded=cli.model is None, on_gpu=False)
    model_dir = cli.model or str(base_model.embedded_base_model())
    task, _ = runtime.load_tasks(cli)
    config = train.generator_config(cli, model_dir)
    one_thread = dataclasses.replace(config.fleet, num_threads=args.gen_threads)
    config = dataclasses.replace(config, mode="sync", fleet=one_thread)
    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    B = cli.prompts_per_step
    parts = ("token_ids", "sampler_logprobs", "versions", "text", "reward")
    digests = {part: hashlib.sha256() for part in parts}

    def fold(groups: list) -> int:  # into the digests, one per field; returns the groups' sampled tokens
        tokens = 0
        for g in sorted(groups, key=lambda g: (g.data_index, g.problem.id)):  # a batch comes in order of finishing
            for c in g.completions:
                for part in parts:
                    digests[part].update(repr(getattr(c, part)).encode())
                tokens += len(c.token_ids)
        return tokens

    rows = []
    with pl.Generator(config, task) as gen:
        gen.update_weights(state, 1)
        fold(gen.get_batch(B, 1)[0])  # warm-up: the first steps of an engine are slower
        for v in range(2, args.batches + 2):
            time.sleep(QUIET_S)
            cpu0, t0 = _tree_cpu_seconds(gen.pid), time.perf_counter()
            push_s = gen.update_weights(state, v)
            groups, _ = gen.get_batch(B, v)
            wall = time.perf_counter() - t0
            cpu1 = _tree_cpu_seconds(gen.pid)
            rows.append({"wall_s": wall, "push_s": push_s, "tokens": fold(groups),
                         **{f"{k}_cpu_s": cpu1[k] - cpu0[k] for k in cpu0}})
        time.sleep(QUIET_S)
        problems = task.validation(cli.eval_prompts)
        cpu0, t0 = _tree_cpu_seconds(gen.pid), time.perf_counter()
        eval_tokens = fold(gen.evaluate(problems, cli.eval_samples, cli.temperature))
        eval_wall = time.perf_counter() - t0
        cpu1 = _tree_cpu_seconds(gen.pid)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    per_step = med["wall_s"] + eval_wall / cli.eval_every
    print(f"{B} groups x {cli.group_size} a batch, median of {len(rows)}: {med['wall_s']:.3f} s (weight push "
          f"{med['push_s']:.3f} s), {med['tokens']:.0f} tokens, replica {med['replicas_cpu_s']:.3f} CPU-s, scheduler "
          f"{med['scheduler_cpu_s']:.3f} CPU-s; evaluation of {len(problems)} x {cli.eval_samples}: {eval_wall:.3f} s, "
          f"replica {cpu1['replicas'] - cpu0['replicas']:.3f} CPU-s; per learner step (a batch and 1/{cli.eval_every} "
          f"of an evaluation): {per_step:.3f} s", flush=True)
    result = {
        "bench": "generator", "train_args": args.train_args, "gen_threads": args.gen_threads, "batches": len(rows),
        "groups": B, "group_size": cli.group_size, "batch_s": round(med["wall_s"], 4),
        "batch_s_all": [round(r["wall_s"], 3) for r in rows], "weight_push_s": round(med["push_s"], 4),
        "batch_tokens": med["tokens"], "batch_replica_cpu_s": round(med["replicas_cpu_s"], 4),
        "batch_scheduler_cpu_s": round(med["scheduler_cpu_s"], 4),
        "eval_s": round(eval_wall, 4), "eval_tokens": eval_tokens,
        "eval_replica_cpu_s": round(cpu1["replicas"] - cpu0["replicas"], 4),
        "eval_scheduler_cpu_s": round(cpu1["scheduler"] - cpu0["scheduler"], 4),
        "per_learner_step_s": round(per_step, 4), "completions_sha256": {part: d.hexdigest()[:16] for part, d in digests.items()},
        "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"), "load_avg_1m": os.getloadavg()[0],
    }
    if args.json:
        write_output(args.json, json.dumps(result) + "\n")
    return result


BENCHMARKS: dict[str, tuple[Callable[[argparse.Namespace], dict], Callable[[argparse.ArgumentParser], None], str]] = {
    "fit": (bench_fit, _add_fit_args, "full-grid sigmoid fit on 75 points vs exhaustive per-grid-point curve_fit"),
    "pipeline": (bench_pipeline, _add_pipeline_args,
                 "vLLM generator vs LLM.generate, weight-sync latency, pipeline vs sync samples/s (tiny model)"),
    "train": (bench_train, _add_train_args,
              "train.py's FSDP2 learner step, packed and padded, vs a bare transformers forward+backward+AdamW on "
              "the same tokens packed: real tokens/s and padding (tiny model)"),
    "head": (bench_head, _add_head_args,
             "the FP32 LM head: float32, bf16 and split-bf16 GEMMs, the learner's head against its GEMMs' limit, "
             "logprob errors against float64 (qwen3-1.7b's head on a GPU, a small one on a CPU)"),
    "generator": (bench_generator, _add_generator_args,
                  "make run's generator: seconds and CPU-seconds of one learner step's groups and of an evaluation, "
                  "and a digest of what it sampled (sync mode, every completion seeded)"),
    "checkpoint": (bench_checkpoint, _add_checkpoint_args,
                   "a checkpoint's save and load: seconds and each rank's peak host memory, sharded (each rank its "
                   "shard) vs gathered to rank 0 (the format before)"),
}


def build_parser() -> argparse.ArgumentParser:
    """tools/bench.py's command line: one subcommand per benchmark, each with its own flags."""
    return subcommand_parser(__doc__.split("\n\n")[0], BENCHMARKS, "BENCHMARK")


def main(argv: list[str] | None = None) -> int:
    return run_subcommand(build_parser(), BENCHMARKS, "BENCHMARK", argv)


if __name__ == "__main__":
    exit_with(main)
