"""GPU smoke test of pipeline_rl.py: the generator on its own CUDA device(s), bf16 weights with an FP32 LM head,
weights pushed from a learner model on another device (or the same one on a 1-GPU machine).

Skipped without CUDA (and so in CI, which has no GPU). On a GPU machine with the CUDA build of vLLM:

    pytest tests/test_pipeline_gpu.py -s
    SCALERL_GEN_DEVICES=6,7 SCALERL_GPU_MODEL=Qwen/Qwen3-0.6B pytest tests/test_pipeline_gpu.py -s

SCALERL_GEN_DEVICES: the generator's devices (default: the last GPU), tensor parallel over all of them.
SCALERL_GPU_MODEL: a HF model (default: the tiny embedded model). On one GPU the learner shares the generator's
device, so vLLM gets only 30% of its memory.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import pipeline_rl as pl
import tasks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and the CUDA build of vLLM"),
]


@pytest.fixture(scope="module")
def setup():
    n = torch.cuda.device_count()
    gen_devices = os.environ.get("SCALERL_GEN_DEVICES", str(n - 1))
    learner_ids, gen_ids = pl.split_devices(gen_devices, n)
    model = os.environ.get("SCALERL_GPU_MODEL") or str(tasks.build_base_model(progress=False))
    shared = bool(set(learner_ids) & set(gen_ids)) or n == 1
    config = pl.GeneratorConfig(model=model, group_size=4, temperature=0.7, dtype="bfloat16", fp32_lm_head=True,
                                gen_devices=gen_devices, tensor_parallel_size=len(gen_ids),
                                gpu_memory_utilization=0.3 if shared else 0.85, max_off_policy=2,
                                groups_per_batch=2, max_model_len=512, max_tokens=64)
    device = torch.device("cuda", learner_ids[0])
    from transformers import AutoModelForCausalLM

    learner = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(device).eval()
    with pl.Generator(config, tasks.ArithmeticTask()) as gen:
        yield gen, learner, device


def learner_logprobs(model, prompt_ids, token_ids, temperature, device):
    """The learner side of the FP32 LM head: bf16 body, lm_head computed in float32, then / temperature."""
    ids = torch.tensor([prompt_ids + token_ids], device=device)
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0, len(prompt_ids) - 1 : -1]
        logits = torch.nn.functional.linear(hidden.float(), model.lm_head.weight.float()) / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids, device=device)[:, None])[:, 0].cpu()


def test_gpu_generator_fp32_head_and_logprobs(setup):
    gen, learner, device = setup
    assert gen.info["head"]["head_dtype"] == "torch.float32"
    groups, stats = gen.get_batch(2, 0)
    assert len(groups) == 2 and stats["lag_max"] == 0
    diffs = []
    for g in groups:
        for c in g.completions:
            ours = learner_logprobs(learner, g.prompt_ids, c.token_ids, 0.7, device)
            mask = torch.tensor(c.loss_mask)
            diffs.append((ours - torch.tensor(c.sampler_logprobs))[mask].abs())
    diffs = torch.cat(diffs)
    print(f"bf16 body + fp32 head: |sampler - learner| mean {diffs.mean():.2e} max {diffs.max():.2e}")
    assert diffs.mean() < 0.05


def test_gpu_weight_update_in_flight(setup):
    gen, learner, device = setup
    state = {k: v for k, v in learner.state_dict().items()}
    times = []
    V = gen.version
    for _ in range(4):
        groups, stats = gen.get_batch(2, V)
        assert stats["lag_max"] <= 2 and stats["stale_dropped"] == 0
        V += 1
        times.append(gen.update_weights(state, V))
    print(f"weight update (bf16, file in /dev/shm): median {sorted(times)[len(times) // 2] * 1000:.1f} ms")
    t0 = time.perf_counter()
    groups = gen.evaluate(tasks.ArithmeticTask().validation(4), samples=2)
    assert {v for g in groups for c in g.completions for v in c.versions} == {V}
    print(f"evaluate 4x2: {time.perf_counter() - t0:.2f} s")


def test_train_py_runs_on_gpu(tmp_path):
    """train.py end to end on CUDA: the learner's micro-batches, its collectives (NCCL reduces on the GPU only) and
    its idle forwards must all be on the rank's GPU. One learner rank; the generator on SCALERL_GEN_DEVICES (the
    last GPU; on a 1-GPU machine the two share it)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    gen_devices = os.environ.get("SCALERL_GEN_DEVICES", str(torch.cuda.device_count() - 1))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "train.py",
           "--output-dir", str(out), "--gen-devices", gen_devices, "--max-steps", "3", "--eval-every", "3",
           "--prompts-per-step", "4", "--eval-prompts", "8", "--eval-samples", "2", "--log-every", "1"]
    run = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and "val_pass_rate" in rows[-1]
