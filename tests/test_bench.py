"""tools/bench.py's benchmarks, as smoke tests on the tiny model or a tiny shape (the timings are the docs'): the
learner step against a bare step, with its memory flags and plan, and the FP32 LM head's GEMMs; each --help."""

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools import bench
from helpers import U_BF16, fp32_sum_error, why_failed

REPO = Path(__file__).resolve().parent.parent


def test_train_bench_reports_the_learner_packed_and_padded_against_a_bare_packed_step(tmp_path, base_model_dir):
    """`python -m tools.bench train` on a small batch of the tiny model (a smoke test; the timings are
    docs/benchmarks.md's): its last line is JSON with the ratios, the padding fractions and the host time per
    micro-batch, and packed rows hold less padding than padded ones; --profile writes the operators of one learner step, AdamW's among them. (The fixture
    builds the base model first, so that its build is not timed by this subprocess's limit.)"""
    run = subprocess.run([sys.executable, "-m", "tools.bench", "train", "--groups", "4", "--repeats", "1",
                          "--profile", "profile.txt"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, why_failed(run)
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["tokens"] > 0 and result["learner_vs_bare_packed"] > 0 and result["packed_vs_padded"] > 0
    assert 0 <= result["pad_fraction_packed"] < result["pad_fraction_padded"] < 1
    for layout in ("packed", "padded"):  # the host time of one micro-batch, and how many a step runs
        assert result[f"host_ms_per_micro_batch_{layout}"] > 0 and result[f"micro_batches_{layout}"] > 0
    assert "real tokens/s" in run.stdout
    assert "packed_mfu" not in result and "peak_tflops" not in result  # a CPU's peak is unknown: no MFU
    for name in ("packed", "padded", "bare"):  # off a GPU: the process's memory at its highest, and the steps' part
        assert 0 <= result[f"{name}_host_step_gib"] <= result[f"{name}_host_peak_gib"], result
        assert f"{name}_peak_gib" not in result  # the GPU's figure
    assert run.stdout.count("host memory (RSS) at most") == 3
    profile = (tmp_path / "profile.txt").read_text()
    assert "Self CPU" in profile and "aten::mm" in profile and "AdamW.step" in profile


def test_host_memory_sees_a_buffer_that_lives_a_moment():
    """_host_memory, what the train bench reports off a GPU: a 256 MiB buffer written and held for 0.1 s inside the
    block shows in its peak over its start (the kernel's high-water mark), and no thread is left behind. Memory freed
    before the block, which glibc's allocator keeps in the process (small blocks, as a step's many tensors), is
    handed back before the start is read (malloc_trim): a warm-up step's activations are not counted in it."""
    import threading

    import psutil
    import torch

    kept = [torch.ones(16_000) for _ in range(6_000)]  # 64 KB each, 384 MB: from the heap, not mmap
    pin = torch.ones(16_000)  # above them on the heap: freeing them cannot shrink its top, as glibc's free() would
    del kept
    rss_before = psutil.Process().memory_info().rss
    before = threading.active_count()
    held: dict = {}
    with bench._host_memory(held):
        buffer = torch.ones(64 << 20)  # 256 MiB of float32, every page written
        time.sleep(0.1)
        del buffer
    assert held["host_peak_bytes"] - held["host_start_bytes"] >= 200 << 20, held
    assert rss_before - held["host_start_bytes"] >= 200 << 20, (rss_before, held)  # the freed heap handed back
    del pin
    assert threading.active_count() == before


def _one_rank_env(monkeypatch) -> None:
    """runtime.init_distributed's environment for one rank in this process, undone after the test."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)


def test_train_bench_times_a_shape_with_the_learner_and_the_bare_model_never_alive_at_once(tmp_path, monkeypatch,
                                                                                            capsys):
    """`python -m tools.bench train --shape NAME` writes a random-weight model from memory_plan.shape_config (here a
    tiny Qwen3 standing in for it), builds the learner, times it and frees it before it builds the bare model (weak
    references to both: the learner is dead when the bare model is built, the bare model when the bench ends), and
    reports per method its tokens/s, its MFU from --peak-tflops and its LM head's share, in the last line and in --json.
    On a CPU there is no GPU memory to measure: those fields are absent."""
    import types
    import weakref

    import transformers

    import train

    config = transformers.Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    monkeypatch.setattr(bench, "memory_plan", types.SimpleNamespace(
        SHAPES={"tiny-qwen3": config}, shape_config=lambda name: {"tiny-qwen3": config}[name]))
    _one_rank_env(monkeypatch)
    alive: dict[str, weakref.ref] = {}
    build_learner, bare_model = train.build_learner, bench._bare_model

    def learner_watched(*args, **kwargs):
        model, n_params = build_learner(*args, **kwargs)
        alive["learner"] = weakref.ref(model)
        return model, n_params

    def bare_after_the_learner(*args, **kwargs):
        assert alive["learner"]() is None, "the learner is still alive when the bare model is built"
        model = bare_model(*args, **kwargs)
        alive["bare"] = weakref.ref(model)
        return model

    monkeypatch.setattr(train, "build_learner", learner_watched)
    monkeypatch.setattr(bench, "_bare_model", bare_after_the_learner)
    out = tmp_path / "train.json"
    assert bench.main(["train", "--shape", "tiny-qwen3", "--groups", "2", "--group-size", "4", "--repeats", "1",
                       "--completion-tokens", "5,30", "--micro-batch-tokens", "64", "--peak-tflops", "0.5",
                       "--json", str(out)]) == 0
    assert alive["bare"]() is None
    result = json.loads(out.read_text())
    assert result == json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["shape"] == "tiny-qwen3" and result["peak_tflops"] == 0.5 and result["micro_batches_packed"] > 1
    assert result["n_params"] == sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config)
                                     .parameters())
    for name in ("packed", "padded", "bare"):
        s = result[f"{name}_s"]
        assert result[f"{name}_tokens_per_s"] == pytest.approx(result["tokens"] / s, rel=1e-2)
        assert result[f"{name}_mfu"] == pytest.approx(6 * result["n_params"] * result["tokens"] / (s * 0.5e12),
                                                      rel=1e-2, abs=1e-4)
        # two separate timings: on a loaded machine the head alone may take longer than the step that holds it
        assert 0 < result[f"{name}_head_s"] and result[f"{name}_head_share"] == pytest.approx(
            result[f"{name}_head_s"] / s, rel=1e-2, abs=1e-3)
        assert f"{name}_peak_gib" not in result and f"{name}_oom" not in result
    assert 0 < result["scored_tokens_learner"] < result["scored_tokens_bare"] < result["tokens"]
    assert result["learner_vs_bare_packed"] > 0 and "learner_weights_gib" not in result
    # the limit: the bare step with its head replaced by the learner's head's GEMMs alone
    assert result["limit_s"] == pytest.approx(result["bare_s"] - result["bare_head_s"] + result["head_gemms_s"],
                                              abs=2e-4)
    assert result["learner_vs_limit"] == pytest.approx(result["packed_s"] / result["limit_s"], rel=1e-2)
    assert "packed_planned_gib" not in result  # the memory plan is for a GPU
    assert bench.main(["train", "--shape", "tiny-qwen3", "--groups", "1", "--group-size", "2", "--repeats", "1",
                       "--completion-tokens", "40,40", "--micro-batch-tokens", "16", "--packed-only",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["packed_s"] > 0 and result["padded_s"] is None and result["packed_vs_padded"] is None
    assert result["micro_batches_packed"] == 2 and "host_ms_per_micro_batch_packed" not in result


def test_train_bench_passes_the_learner_s_memory_flags_on():
    """--activation-checkpointing, --cpu-offload and --micro-batch-tokens reach the learner's flags.Args."""
    parser = argparse.ArgumentParser()
    bench._add_train_args(parser)
    args = parser.parse_args(["--activation-checkpointing", "--cpu-offload", "--micro-batch-tokens", "4096"])
    cli = bench._learner_cli(args)
    assert cli.activation_checkpointing and cli.cpu_offload and cli.micro_batch_tokens == 4096 and cli.packing


def test_weights_bench_keeps_its_context_within_the_model_s_positions(base_model_dir, tmp_path):
    """`pipeline --only-weights` on the default tiny model (256 positions) asks vLLM for no longer a context than the
    model has (vLLM refuses one beyond max_position_embeddings, and the bench failed on its default model); a model
    with more positions gets the bench's 1,024."""
    from transformers import AutoConfig

    parser = argparse.ArgumentParser()
    bench._add_pipeline_args(parser)
    args = parser.parse_args(["--only-weights"])
    tiny = bench._weights_config(args, str(base_model_dir))
    assert tiny.fleet.max_model_len == AutoConfig.from_pretrained(base_model_dir).max_position_embeddings == 256
    long_config = AutoConfig.from_pretrained(base_model_dir)
    long_config.max_position_embeddings = 8192
    long_config.save_pretrained(tmp_path)
    assert bench._weights_config(args, str(tmp_path)).fleet.max_model_len == bench.WEIGHTS_CONTEXT == 1024


def test_the_generator_bench_refuses_a_context_beyond_the_models_positions_in_one_line(base_model_dir, capsys):
    """`generator --train-args` takes train.py's flags: a context beyond the model's positions is train.py's one line
    before anything starts, not vLLM's validation traceback once its engine starts. (`pipeline` asks for the tiny
    model's own 256 positions, and `pipeline --only-weights` for at most its model's, above.)"""
    with pytest.raises(SystemExit) as stop:
        bench.main(["generator", "--train-args", f"--model {base_model_dir} --max-model-len 300"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert (f"--max-model-len 300 exceeds the 256 positions of {base_model_dir} (max_position_embeddings in its "
            "config.json)") in err


def test_a_method_out_of_gpu_memory_is_reported_and_the_methods_after_it_are_not_run():
    """_time_methods: a step that runs out of GPU memory is named with the error, the methods already timed keep
    their times, and the ones after it are not run (an FSDP2 step cut short may leave its model half gathered)."""
    import torch

    calls = collections.Counter()

    def fine(name: str):
        return lambda: calls.update([name])

    def out_of_memory() -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    timed = bench._time_methods({"a": fine("a"), "b": out_of_memory, "c": fine("c")}, 2, torch.device("cpu"))
    assert timed["a"]["s"] >= 0 and timed["b"] == {"oom": "CUDA out of memory. Tried to allocate 2.00 GiB"}
    assert timed["c"] == {} and calls == {"a": 3}


def test_head_bench_times_each_head_and_measures_its_logprobs_against_float64(tmp_path, capsys):
    """`python -m tools.bench head` at a tiny shape on the CPU (a smoke test; the GPU's timings are the point): the
    float32, bf16 and split-bf16 GEMMs, the learner's heads (with and without the entropy) and their ratio, in the last
    line and in --json; split-bf16's logprobs, GEMMs alone or as the learner runs them, within 1e-5 of float64 and of
    the float32 head, bf16's and one bf16 product's off by over 1e-3; the learner's gradients float32's (fp32) or
    bf16-grade (split-bf16)."""
    path = tmp_path / "head.json"
    assert bench.main(["head", "--vocab", "1024", "--hidden", "64", "--tokens", "100", "--chunk-tokens", "32",
                       "--temperature", "0.7", "--logit-std", "3", "--repeats", "1", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert (result["tokens"], result["vocab"], result["hidden"]) == (100, 1024, 64)
    for name in ("fp32_gemms", "bf16_gemms", "split_bf16_gemms", "learner_split_bf16", "learner_fp32",
                 "learner_split_bf16_entropy"):
        assert result[name]["ms"] > 0 and result[name]["tflops"] > 0, name
    assert result["learner_vs_limit"] > 0 and result["split_vs_fp32_learner_speedup"] > 0
    assert result["entropy_cost"] > -1  # a ratio of two timings less one: measured, whatever its sign on a CPU
    # against float64, a side: a logit of 3H exact products (split-bf16; float32's H are fewer), then V exps: 2
    # fp32_sum_error of that chain at the largest logit (the sampled targets' are near it); two heads within twice that
    delta = fp32_sum_error([3 * 64, 1024], result["max_logit"])
    for name in ("fp32_gemms", "split_bf16_gemms", "learner_split_bf16", "learner_fp32", "learner_split_bf16_entropy"):
        assert result[name]["max_logprob_error"] <= 2 * delta, (name, result[name], 2 * delta)
    assert result["learner_split_vs_fp32_head_max_logprob_diff"] <= 2 * 2 * delta
    assert min(result["bf16_gemms"]["max_logprob_error"], result["one_bf16_product"]["max_logprob_error"]) > 2 * delta
    # gradients: D = softmax - onehot off by 2 delta, then sums of V (hidden) or M (weight) terms; split-bf16 rounds
    # D and the other factor of each product to bf16 (2 u_bf16)
    grad_bound = 2 * delta + fp32_sum_error([1024, 100], 1.0)
    for grad in ("grad_hidden_rel_error", "grad_weight_rel_error"):
        assert result["learner_fp32"][grad] <= grad_bound
        assert result["learner_split_bf16"][grad] <= 2 * U_BF16 + grad_bound


def test_help_lists_every_benchmark_and_each_has_its_own():
    """`python -m tools.bench --help` and each benchmark's --help print (a bare % in a help text once made --help
    crash)."""
    top = subprocess.run([sys.executable, "-m", "tools.bench", "--help"], cwd=REPO, capture_output=True, text=True)
    assert top.returncode == 0, top.stderr
    for name in bench.BENCHMARKS:
        assert name in top.stdout
        own = subprocess.run([sys.executable, "-m", "tools.bench", name, "--help"], cwd=REPO, capture_output=True,
                             text=True)
        assert own.returncode == 0 and f"python -m tools.bench {name}" in own.stdout, own.stderr
