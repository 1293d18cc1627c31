"""`make gpu-smoke`: the GPU path a practitioner runs first, checked in one command on a machine with 1 or 2 GPUs and
the CUDA build of vLLM, in under 10 minutes, with SmolLM2-135M-Instruct (harness/base_model.py build-real-model):

1. vLLM starts with interruptions (its V2 model runner where Triton is installed), and every forced token of the
   interruption phrase has sampler logprob 0;
2. weights pushed from a learner reach the replica through vLLM's weight-transfer API (its ipc engine on one shared
   GPU; its nccl engine from GPU 0 with two), twice (the second push reuses the engine), and each replica's sampler
   logprobs then match the learner's (bf16 body, FP32 head); the push's time split into gather, cast and send;
3. the README's one-GPU command, for 2 steps, whose start names vLLM's ipc engine.

Where the GPU path cannot run it says why in one line and exits 2 (nothing was checked): no NVIDIA GPU (nvidia-smi
finds none), a torch without CUDA (a CPU build), or an NVIDIA driver older than this torch's CUDA needs
(`what_is_wrong`). Each check prints one line, `ok` or `FAIL`; the exit status is 1 if any failed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]


# The oldest Linux NVIDIA driver each CUDA major version runs on (NVIDIA's CUDA release notes, "minor version
# compatibility": a torch wheel carries its CUDA runtime, so the driver only needs to reach its major's floor).
DRIVER_FOR_CUDA = {11: 450, 12: 525, 13: 580}


def driver_needed(cuda: str) -> int | None:
    """The oldest NVIDIA driver (major number) that runs a torch built for CUDA `cuda` ("13.0"); None: not known."""
    return DRIVER_FOR_CUDA.get(int(cuda.split(".")[0]))


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version as nvidia-smi reports it ("580.65.06"), None where nvidia-smi finds no GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    versions = query.stdout.split()
    return versions[0] if query.returncode == 0 and versions and versions[0][:1].isdigit() else None


def what_is_wrong() -> str | None:
    """Why the GPU path cannot run here, in one line, or None where torch sees a CUDA GPU. The causes are told apart
    because each has its own remedy: torch.cuda.is_available() alone says False to all of them."""
    driver = nvidia_driver()
    if driver is None:
        return "gpu-smoke: no NVIDIA GPU here (nvidia-smi finds none): it checks the GPU path and needs one (or two)"
    if torch.version.cuda is None:
        return (f"gpu-smoke: this torch ({torch.__version__}) has no CUDA: it is a CPU build; `make gpu-smoke` "
                "installs the CUDA one into .venv-gpu (DEVICE=gpu), never over the CPU build's .venv")
    needed = driver_needed(torch.version.cuda)
    if needed is not None and int(driver.split(".")[0]) < needed:
        return (f"gpu-smoke: the NVIDIA driver ({driver}) is older than this torch's CUDA {torch.version.cuda} needs "
                f"(it needs {needed} or newer): update the driver, or install a torch built for an older CUDA")
    if not torch.cuda.is_available():
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (f"gpu-smoke: no CUDA GPU visible to torch {torch.__version__} (driver {driver}, CUDA "
                f"{torch.version.cuda})" + (f": CUDA_VISIBLE_DEVICES={hidden!r} hides them" if hidden is not None
                                            else ""))
    return None


def check_generator(model: str, gen_devices: str, learner_gpu: int) -> str:
    """Checks 1 and 2 on one generator: interruptions, a push, per-replica logprobs against the learner's."""
    import pipeline_rl as pl
    from harness import runtime, tasks, vllm_replica
    from transformers import AutoModelForCausalLM

    shared = str(learner_gpu) in gen_devices.split(",")
    config = pl.GeneratorConfig(model=model, group_size=4, temperature=0.7, max_tokens=64, think_budget=(2, 4),
                                answer_budget=16, groups_per_batch=2,
                                fleet=pl.FleetConfig(dtype="bfloat16", fp32_lm_head=True, gen_devices=gen_devices,
                                                     gpu_memory_utilization=0.3 if shared else 0.6, max_model_len=512))
    torch.cuda.set_device(learner_gpu)
    learner = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(f"cuda:{learner_gpu}").eval()
    with pl.Generator(config, tasks.ArithmeticTask()) as gen:
        engine = "ipc" if shared else "nccl"  # vLLM's weight-transfer engine for this layout
        assert gen.config.fleet.weight_transport == engine and f"vLLM's {engine} engine" in gen.transport_line
        groups, _ = gen.get_batch(2, 0)
        forced = [lp for g in groups for c in g.completions for lp, m in zip(c.sampler_logprobs, c.loss_mask) if not m]
        assert forced and max(abs(lp) for lp in forced) == 0.0, f"forced tokens' logprobs {forced[:8]}"
        t0 = time.perf_counter()
        state = runtime.push_state_dict(learner, gen)  # as train.py pushes: one rank, no all-gather to wait for
        gather = time.perf_counter() - t0
        total = gen.update_weights(state, 1)
        again = gen.update_weights(state, 2)  # the engine made at the first push, used again
        groups, _ = gen.get_batch(2, 2)
        worst = _logprob_gap(groups, learner.to(torch.bfloat16), learner_gpu)
    runner = "V2" if vllm_replica.model_runner_v2(True) else "V1"
    return (f"{len(forced)} forced tokens at logprob 0 (model runner {runner}); {gen.transport_line}; push: gather "
            f"and cast {gather:.2f} s, cast left to update_weights {gen.last_cast_s:.3f} s, send "
            f"{total - gen.last_cast_s:.2f} s, a second push {again:.2f} s; replica |sampler - learner| mean {worst:.3f}")


def _logprob_gap(groups: list, model: torch.nn.Module, gpu: int) -> float:
    """The largest over replicas of the mean |sampler - learner| logprob of the loss-masked tokens (< 0.05)."""
    by_replica: dict[int, list[torch.Tensor]] = {}
    for g in groups:
        for c in g.completions:
            ids = torch.tensor([g.prompt_ids + c.token_ids], device=f"cuda:{gpu}")
            with torch.no_grad():
                hidden = model.model(input_ids=ids).last_hidden_state[0, len(g.prompt_ids) - 1: -1]
                logits = torch.nn.functional.linear(hidden.float(), model.lm_head.weight.float()) / 0.7
            ours = torch.log_softmax(logits, -1).gather(-1, ids[0, len(g.prompt_ids):, None])[:, 0].cpu()
            mask = torch.tensor(c.loss_mask)
            by_replica.setdefault(c.replica, []).append((ours - torch.tensor(c.sampler_logprobs))[mask].abs())
    gaps = {r: float(torch.cat(d).mean()) for r, d in by_replica.items()}
    assert gaps and max(gaps.values()) < 0.05, f"per replica {gaps}"
    return max(gaps.values())


def check_readme_command(model: str) -> str:
    """Check 4: the README's one-GPU command, 2 steps (torchrun, one learner rank sharing GPU 0 with vLLM)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "train.py",
               "--loss", "cispo", "--model", model, "--dataset", "tests/data/gsm8k_small.jsonl", "--gen-devices", "0",
               "--max-steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--max-tokens", "256",
               "--think-budget", "160,192", "--answer-budget", "48", "--zero-variance", "keep", "--eval-prompts", "8",
               "--eval-samples", "1", "--output-dir", f"{tmp}/run"]
        first_gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]  # one GPU, as the README's machine
        run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=420,
                             env={**os.environ, "CUDA_VISIBLE_DEVICES": first_gpu})
    assert run.returncode == 0, run.stderr[-1500:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("weight transfer:")]
    assert lines and "vLLM's ipc engine" in lines[0], f"no 'weight transfer: vLLM's ipc engine' line at the start"
    return lines[0]


def main() -> int:
    problem = what_is_wrong()
    if problem is not None:
        print(problem)
        return 2
    from harness import base_model

    model = str(base_model.build_real_model())
    gpus = torch.cuda.device_count()
    checks: list[tuple[str, Callable[[], str]]] = [
        ("vLLM with interruptions, a push, logprobs (one shared GPU)", lambda: check_generator(model, "0", 0))]
    if gpus >= 2:
        checks += [("vLLM's nccl engine GPU 0 -> GPU 1, per-replica logprobs", lambda: check_generator(model, "1", 0))]
    checks.append(("the README's one-GPU command, 2 steps", lambda: check_readme_command(model)))
    failed = 0
    for name, check in checks:
        t0 = time.perf_counter()
        try:
            said = check()
            print(f"ok    {name} ({time.perf_counter() - t0:.0f} s): {said}", flush=True)
        except Exception as e:  # every check runs; the status counts the failures
            failed += 1
            print(f"FAIL  {name} ({time.perf_counter() - t0:.0f} s): {type(e).__name__}: {e}", flush=True)
    if gpus < 2:
        print("skipped: vLLM's nccl engine needs two GPUs (this machine has one)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
