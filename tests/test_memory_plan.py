"""harness/memory_plan.py: parameter counts equal to the built models', hand-checked parts on a tiny config, the flags
that make a layout fit, and train.py refusing a layout that cannot fit before anything starts."""

import dataclasses
import re
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

import train
from harness import base_model, flags, tasks
from harness import memory_plan as mp

GIB = mp.GIB


def built_parameters(config) -> int:
    with torch.device("meta"):  # no memory: the 8B shape builds in a second
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def tiny_embedded_model_config() -> LlamaConfig:
    """The embedded tiny model's config, as base_model._train_base_model writes it."""
    base, tokenizer = base_model.BaseModelConfig(), base_model.build_tokenizer(tasks.ArithmeticTask())
    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=base.hidden_size,
                       intermediate_size=base.intermediate_size, num_hidden_layers=base.num_layers,
                       num_attention_heads=base.num_heads, num_key_value_heads=base.num_heads,
                       head_dim=base.hidden_size // base.num_heads, tie_word_embeddings=False)


SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=100)


@pytest.mark.parametrize("config", [
    *[pytest.param(name, id=name) for name in mp.SHAPES],
    pytest.param(tiny_embedded_model_config(), id="embedded-tiny"),
    pytest.param(Qwen3Config(**SMALL, tie_word_embeddings=True), id="qwen3-tied"),
    pytest.param(Qwen3Config(**SMALL, tie_word_embeddings=False), id="qwen3-untied"),
    pytest.param(LlamaConfig(**SMALL, tie_word_embeddings=True), id="llama-tied"),
    pytest.param(LlamaConfig(**SMALL, tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
                 id="llama-biases"),
    pytest.param(Qwen2Config(**SMALL, tie_word_embeddings=False), id="qwen2-qkv-bias"),
])
def test_parameter_counts_equal_the_built_models(config):
    config = mp.shape_config(config) if isinstance(config, str) else config
    assert mp.parameter_counts(config).total == built_parameters(config)


def test_the_shapes_are_the_real_models():
    assert round(mp.parameter_counts(mp.shape_config("qwen3-8b")).total / 1e9, 2) == 8.19
    assert round(mp.parameter_counts(mp.shape_config("smollm2-135m")).total / 1e6, 1) == 134.5
    assert isinstance(mp.shape_config("qwen3-4b"), Qwen3Config)
    with pytest.raises(ValueError, match="unknown shape"):
        mp.shape_config("qwen3-80b")


# A config small enough to check every part by hand: hidden 8, 2 layers, 2 query heads and 1 key/value head of 4.
TINY = Qwen3Config(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=4, vocab_size=32, tie_word_embeddings=False)
TINY_LAYOUT = mp.Layout(learner_ranks=2, gpu_memory=4 * GIB, micro_batch_tokens=100, sequence_tokens=10, group_size=2,
                        prompts_per_step=8, dtype_bytes=2, logits_chunk_tokens=5)


def test_hand_checked_parts_of_a_tiny_config():
    counts = mp.parameter_counts(TINY)
    # q 8x8, k and v 8x4 each, o 8x8, q/k norms 4 each; MLP 3 x 8x16; two norms of 8
    assert counts.layer == (64 + 32 + 32 + 64 + 8) + 384 + 16 == 600
    assert counts.total == 32 * 8 + 2 * 600 + 8 + 32 * 8 == 1720
    # per token per layer, bf16: norms 2 x (4+2) x 8, q/k norms (4+2) x (8+4), q,k,v,out 2 x (8+4+4+8) and a
    # float32 log-sum-exp per head, MLP 4 x 2 x 16
    assert mp.activation_bytes_per_token_layer(TINY, 2) == 96 + 72 + (48 + 8) + 128 == 352
    plan = mp.estimate(TINY, TINY_LAYOUT)
    # whole groups of 2 x 10 tokens within the budget of 100, but a rank has only 8 / 2 = 4 groups: 80 tokens
    assert plan.layout.tokens == min(max(100, 20), 4 * 20) == 80
    shard = 1720 // 2
    assert plan.gpu["weights"] == 4 * shard and plan.gpu["gradients"] == 0  # one micro-batch: it peaks before them
    assert mp.estimate(TINY, dataclasses.replace(TINY_LAYOUT, micro_batch_tokens=40)).gpu["gradients"] == 4 * shard
    assert plan.gpu["optimizer"] == 8 * shard
    root = 32 * 8 + 8  # the untied embedding and the final norm; the head is the FP32 head's unit
    assert plan.gpu["gathered"] == 2 * (root + 2 * 600) + (2 + 4) * 600
    assert plan.gpu["lm_head"] == 3 * 5 * 32 * 4 + 8 * 32 * 8
    assert plan.gpu["activations"] == 80 * (2 * 352 + (4 + 2) * 8 + 8 * 8)
    checkpointed = mp.estimate(TINY, dataclasses.replace(TINY_LAYOUT, activation_checkpointing=True))
    assert checkpointed.gpu["activations"] == 80 * (2 * 2 * 8 + 352 + (4 + 2) * 8 + 8 * 8)
    offloaded = mp.estimate(TINY, dataclasses.replace(TINY_LAYOUT, cpu_offload=True, reference_model=True))
    assert set(offloaded.host) == {"weights", "gradients", "optimizer", "reference"}
    assert set(offloaded.gpu) == {"gathered", "lm_head", "activations"}
    assert plan.margin == mp.MARGIN_BYTES + int(mp.MARGIN_FRACTION * 4 * GIB)
    assert plan.total == sum(plan.gpu.values()) + plan.margin and plan.fits() and plan.problems() == []


def test_the_kv_cache_of_a_token_is_a_key_and_a_value_per_kv_head_of_every_layer():
    """Hand-computed; tests/test_pipeline_rl.py checks the same count against vLLM's own KV cache specs."""
    assert mp.kv_cache_bytes_per_token(mp.shape_config("qwen3-8b"), 2) == 36 * 8 * 128 * 2 * 2 == 147456  # bf16
    assert mp.kv_cache_bytes_per_token(mp.shape_config("smollm2-135m"), 4) == 30 * 3 * 64 * 2 * 4 == 46080
    # over 4 GPUs, 2 of the 8 KV heads each; over 16, one each (vLLM replicates a head rather than split it)
    assert mp.kv_cache_bytes_per_token(mp.shape_config("qwen3-8b"), 2, 4) == 147456 // 4
    assert mp.kv_cache_bytes_per_token(mp.shape_config("qwen3-8b"), 2, 16) == 147456 // 8
    assert mp.sequence_kv_cache_bytes(mp.shape_config("qwen3-8b"), 2, 14848) == 147456 * (14848 + 512)
    # no head_dim in the config: hidden_size / heads; no num_key_value_heads: one KV head per query head
    assert mp.kv_cache_bytes_per_token(LlamaConfig(hidden_size=128, num_attention_heads=2, num_hidden_layers=4,
                                                   head_dim=None, num_key_value_heads=None), 4) == 4 * 2 * 64 * 2 * 4


@pytest.mark.parametrize("version, own", [("v2", "0::/"), ("v1", "4:memory:/"), ("v2", "0::/slurm/job_7"),
                                          ("v1", "9:cpu:/\n4:memory:/slurm/job_7")])
def test_the_host_memory_available_is_a_control_groups_where_it_limits_the_process(tmp_path, monkeypatch, version,
                                                                                 own):
    """A container's --memory or a job scheduler's limit (a control group's) is what the kernel's out-of-memory
    killer enforces, whatever the machine has free: the host check counts the limit less the group's use, its
    inactive page cache free (the kernel reclaims it). Both cgroup versions' files as the kernel writes them, at the
    root (inside a container) or in the process's own group (/proc/self/cgroup); none, or no limit: the system's."""
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=20 * GIB, total=24 * GIB))
    (tmp_path / "self").write_text(own + "\n")
    root = tmp_path / "cgroup"
    group = (root / ("memory" if version == "v1" else "") / own.split(":")[-1].lstrip("/"))
    limit_name, usage_name, cache_key = {"v2": ("memory.max", "memory.current", "inactive_file"),
                                         "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                "total_inactive_file")}[version]
    assert mp.host_memory_available(root, tmp_path / "self") == 20 * GIB  # no control group files
    group.mkdir(parents=True, exist_ok=True)
    (group / limit_name).write_text(f"{8 * GIB}\n")
    (group / usage_name).write_text(f"{6 * GIB}\n")
    (group / "memory.stat").write_text(f"anon {4 * GIB}\n{cache_key} {GIB}\nactive_file 0\n")
    assert mp.host_memory_available(root, tmp_path / "self") == 3 * GIB  # 8 - (6 - 1)
    (group / limit_name).write_text("max\n" if version == "v2" else "9223372036854771712\n")  # no limit
    assert mp.host_memory_available(root, tmp_path / "self") == 20 * GIB


def test_a_shared_gpu_counts_vllm_outside_its_share_and_a_push_counts_rank_0s_host_memory():
    """vLLM's gpu_memory_utilization budget leaves out its worker's CUDA context and the layer a weight reload
    builds before copying it in; a push casts the gathered weights on the GPU and keeps them there for NCCL, in the
    place of the step's activations and gathered units, or copies them to the host."""
    alone = mp.estimate(TINY, TINY_LAYOUT)
    assert "vllm" not in alone.gpu and "vllm_outside" not in alone.gpu and "push" not in alone.gpu
    assert alone.push_host == 1720 * 2
    broadcast = mp.estimate(TINY, dataclasses.replace(TINY_LAYOUT, push_gpu=True, micro_batch_tokens=20))
    assert broadcast.push_host == 0 and broadcast.gpu["push"] == max(
        0, 1720 * 2 - broadcast.gpu["activations"] - broadcast.gpu["gathered"])
    shared = mp.estimate(TINY, dataclasses.replace(TINY_LAYOUT, generator_share=0.3))
    assert shared.gpu["vllm"] == int(0.3 * 4 * GIB)
    assert shared.gpu["vllm_outside"] == mp.VLLM_CONTEXT_BYTES + 2 * 600  # a decoder layer, the largest unit here
    assert shared.total == alone.total + shared.gpu["vllm"] + shared.gpu["vllm_outside"]
    assert shared.learner_bytes == alone.learner_bytes and shared.push_host == 1720 * 2
    text = shared.describe()
    assert "vLLM outside its share" in text and "rank 0's host memory during a weight push" in text
    lines = flags.plan(["--gpus", "1", "--gen-devices", "0", "--shape", "qwen3-8b", "--dtype", "bfloat16"])
    # Qwen3-8B's embedding (151,936 x 4,096 in bf16) is the largest tensor a reload materialises; a shared GPU's
    # replica takes the weights through vLLM's ipc engine, from the GPU, so the push holds no host memory
    assert "2.2 GiB  vLLM outside its share" in lines and "host memory during a weight push" not in lines
    assert "rank 0's weight push: the gathered weights in the generator's dtype on the GPU" in lines
    lines = flags.plan(["--gpus", "8", "--gen-devices", "0,1,2,3,4,5", "--learner-ranks", "2", "--shape", "qwen3-8b",
                        "--dtype", "bfloat16", "--activation-checkpointing", "--cpu-offload"])
    assert "5.7 GiB  rank 0's weight push" in lines and "host memory during a weight push" not in lines


def test_fsdp_reshard_never_keeps_every_layer_gathered_and_auto_chooses_it_on_one_rank_only():
    """--fsdp-reshard never keeps every decoder layer's bf16 copy from forward to backward (all layers count, not
    two); auto chooses it on a single learner rank without --cpu-offload, and FSDP2's default everywhere else."""
    root = 32 * 8 + 8  # as in the hand-checked test above
    four_layers = Qwen3Config(**{**TINY.to_dict(), "num_hidden_layers": 4, "layer_types": None})
    for reshard, layers in (("always", 2), ("never", 4)):
        plan = mp.estimate(four_layers, dataclasses.replace(TINY_LAYOUT, fsdp_reshard=reshard))
        assert plan.gpu["gathered"] == 2 * (root + layers * 600) + (2 + 4) * 600, reshard
    assert mp.reshard_layers("auto", 1, cpu_offload=False) is False
    assert mp.reshard_layers("auto", 2, cpu_offload=False) is True
    assert mp.reshard_layers("auto", 1, cpu_offload=True) is True
    assert mp.reshard_layers("always", 1, cpu_offload=False) is True
    assert mp.reshard_layers("never", 8, cpu_offload=True) is False
    args = flags.Args(group_size=2, prompts_per_step=8, micro_batch_tokens=100)
    one_rank = flags.learner_memory_plan(args, four_layers, 1, 4 * GIB).layout
    assert one_rank.fsdp_reshard == "auto" and not one_rank.reshard_layers
    assert flags.learner_memory_plan(args, four_layers, 2, 4 * GIB).layout.reshard_layers


def test_a_tied_head_joins_the_fp32_units_and_float32_gathers_once():
    tied = Qwen3Config(**{**TINY.to_dict(), "tie_word_embeddings": True})
    layout = dataclasses.replace(TINY_LAYOUT, dtype_bytes=4)
    assert mp.estimate(tied, layout).gpu["gathered"] == 4 * (8 + 2 * 600) + 4 * 600  # the root: the final norm
    assert mp.estimate(tied, dataclasses.replace(layout, fp32_lm_head=False)).gpu["gathered"] == \
        4 * (8 + 256 + 2 * 600) + 4 * 600


QWEN3_8B = mp.shape_config("qwen3-8b")
SCALERL_BATCH = mp.Layout(learner_ranks=2, gpu_memory=80 * GIB, micro_batch_tokens=16384, sequence_tokens=14848,
                          group_size=16, prompts_per_step=48, dtype_bytes=2, logits_chunk_tokens=441)


def test_a_layout_that_cannot_fit_is_refused_with_the_flags_that_would_make_it_fit():
    plan = mp.estimate(QWEN3_8B, SCALERL_BATCH)
    [message] = plan.problems()
    assert "does not fit its GPU" in message and "activations 110.1" in message  # the parts in GiB
    assert message.endswith("It would fit with, in order of cost: --activation-checkpointing --cpu-offload; or 3 "
                            "learner ranks (GPUs) with --activation-checkpointing")
    assert mp.estimate(QWEN3_8B, dataclasses.replace(SCALERL_BATCH, activation_checkpointing=True,
                                                     cpu_offload=True)).fits()
    assert mp.estimate(QWEN3_8B, dataclasses.replace(SCALERL_BATCH, activation_checkpointing=True,
                                                     learner_ranks=3)).fits()
    assert not mp.estimate(QWEN3_8B, dataclasses.replace(SCALERL_BATCH, activation_checkpointing=True)).fits()


def test_a_single_rank_that_fits_only_when_each_layer_is_freed_is_told_so_first():
    """Keeping every layer gathered (auto, one rank) costs 2 bytes a parameter of 34 of Qwen3-8B's 36 layers: on a
    GPU where only that breaks the fit, the cheapest remedy, --fsdp-reshard always, comes first."""
    layout = dataclasses.replace(SCALERL_BATCH, learner_ranks=1, fsdp_reshard="auto", activation_checkpointing=True,
                                 sequence_tokens=1024, micro_batch_tokens=1024)
    always = dataclasses.replace(layout, fsdp_reshard="always")
    parts = sum(mp.estimate(QWEN3_8B, always).gpu.values())
    gap = sum(mp.estimate(QWEN3_8B, layout).gpu.values()) - parts
    assert gap == 2 * 34 * mp.parameter_counts(QWEN3_8B).layer
    gpu_memory = int((parts + gap // 2 + mp.MARGIN_BYTES) / (1 - mp.MARGIN_FRACTION))  # between the two
    assert mp.estimate(QWEN3_8B, dataclasses.replace(always, gpu_memory=gpu_memory)).fits()
    [message] = mp.estimate(QWEN3_8B, dataclasses.replace(layout, gpu_memory=gpu_memory)).problems()
    assert message.split("in order of cost: ")[1].startswith("--fsdp-reshard always; or ")


def test_a_smaller_micro_batch_or_more_ranks_are_named_when_they_fit():
    layout = dataclasses.replace(SCALERL_BATCH, sequence_tokens=1024, micro_batch_tokens=65536,
                                 activation_checkpointing=True, learner_ranks=4)
    [message] = mp.estimate(QWEN3_8B, layout).problems()
    fixes = message.split("in order of cost: ")[1].split("; or ")
    budget = int(fixes[0].removeprefix("--micro-batch-tokens "))
    assert budget % 1024 == 0 and mp.estimate(QWEN3_8B, dataclasses.replace(layout, micro_batch_tokens=budget)).fits()
    assert not mp.estimate(QWEN3_8B, dataclasses.replace(layout, micro_batch_tokens=budget + 1024)).fits()
    assert fixes[1:] == ["--cpu-offload", "5 learner ranks (GPUs)"]


def test_a_sequence_no_flag_can_fit_is_refused_saying_so():
    """A completion over the budget is a micro-batch of its own: 200k-token sequences of Qwen3-8B need more than an
    80 GB GPU's memory in activations alone, whatever the flags."""
    plan = mp.estimate(QWEN3_8B, dataclasses.replace(SCALERL_BATCH, sequence_tokens=200_000))
    assert plan.layout.tokens == 200_000
    [message] = plan.problems()
    assert "No smaller --micro-batch-tokens, --activation-checkpointing, --cpu-offload or more learner ranks" in message
    assert "only fewer tokens per sequence (--max-tokens) or a larger GPU" in message


def scalerl_args(*extra: str) -> list[str]:
    return ["--prompts-per-step", "48", "--group-size", "16", "--max-tokens", "14336", "--think-budget",
            "10240,12288", "--answer-budget", "2048", *extra]


def test_train_plan_prints_the_plan_without_a_gpu():
    text = flags.plan(["--shape", "qwen3-8b", "--learner-ranks", "2", *scalerl_args("--micro-batch-tokens", "16384"),
                       "--activation-checkpointing", "--cpu-offload"])
    assert text.splitlines()[0] == ("2 learner rank(s), micro-batch 16,384 tokens, --activation-checkpointing "
                                    "--cpu-offload: 32.2 of 80.0 GiB per GPU: fits")
    assert "(host memory, --cpu-offload)" in text
    shared = flags.plan(["--shape", "smollm2-135m", "--gpus", "1", "--gen-devices", "0"])
    assert "24.0 GiB  vLLM's share" in shared  # 0.3 of a GPU the learner shares with vLLM
    assert ("vLLM, each generator GPU: 0.3 GiB of weights and 0.0 GiB of one sequence's KV cache at the least, of its "
            "share 24.0 GiB (--gen-memory-fraction 0.3)") in shared.splitlines()
    small = flags.plan(["--shape", "qwen3-4b", "--gpus", "1", "--gen-devices", "0", "--gpu-memory-gib", "24",
                        *scalerl_args("--activation-checkpointing", "--cpu-offload")])  # a 24 GiB GPU, shared
    assert small.splitlines()[-1].startswith(
        "vLLM's share of each generator GPU (0.3 of 24.0 GiB: 7.2 GiB, --gen-memory-fraction) cannot hold qwen3-4b's "
        "weights in bfloat16 (7.5 GiB")
    with pytest.raises(SystemExit, match="give --shape NAME or --model DIR"):
        flags.plan([])


@pytest.mark.parametrize("where, said", [
    ("missing", "no such directory (a hub model is named ORG/NAME)"),
    ("empty", "has no config.json: not a Hugging Face model directory (the plan reads only that file)"),
    ("a-file", "is a file; expected a Hugging Face model directory (the plan reads its config.json)"),
])
def test_train_plan_says_in_one_line_why_a_local_model_has_no_config_to_read(tmp_path, capsys, where, said):
    """`train.py plan --model PATH` reads only PATH's config.json: a path where nothing is, a directory without it,
    or a file is one error line naming the flag (before, each was transformers' traceback), and a directory with
    only a config.json is planned."""
    path = tmp_path / where
    if where == "empty":
        path.mkdir()
    elif where == "a-file":
        path.write_text("{}")
    with pytest.raises(SystemExit) as stopped:
        flags.plan(["--model", str(path)])
    assert stopped.value.code == 2
    named = f"--model {path}:" if where == "missing" else f"--model {path}"
    assert capsys.readouterr().err == f"train.py plan: error: {named} {said} (see --help)\n"
    only_config = tmp_path / "only-config"
    mp.shape_config("smollm2-135m").save_pretrained(only_config)
    assert "per GPU: fits" in flags.plan(["--model", str(only_config)])


def model_dir(tmp_path, shape: str):
    """A directory that passes train.py's model checks: the shape's config.json, a safetensors file of no tensors
    (its header is checked) and the tiny model's tokenizer with its chat template (the check loads it); nothing
    reads the weights before the memory plan refuses or passes."""
    import shutil

    from safetensors.torch import save_file

    path = tmp_path / shape
    mp.shape_config(shape).save_pretrained(path)
    save_file({}, str(path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(base_model.BASE_MODEL_DIR / name, path)
    return str(path)


@pytest.fixture
def eight_gpus(monkeypatch):
    """An 8-GPU node of 80 GiB GPUs, two learner ranks on it."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(flags, "learner_gpu_memory", lambda device_id: 80 * GIB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")


def test_train_refuses_a_layout_that_cannot_fit_before_anything_starts(tmp_path, eight_gpus, monkeypatch, capsys):
    monkeypatch.setattr(train, "set_up", lambda *args: pytest.fail("set_up must not run"))
    argv = ["--model", model_dir(tmp_path, "qwen3-8b"), "--gen-devices", "0,1,2,3,4,5",
            "--output-dir", str(tmp_path / "run"), *scalerl_args()]
    with pytest.raises(SystemExit):
        train.main(argv)
    error = capsys.readouterr().err
    assert "the learner does not fit its GPU" in error and "--activation-checkpointing --cpu-offload" in error
    assert not (tmp_path / "run").exists()
    assert flags.memory_problems(flags.parse_args(argv + ["--activation-checkpointing", "--cpu-offload"]), 8, 2, 2) \
        == []  # docs/real-models.md's 8-GPU example, with the flags the refusal names
    small = ["--model", model_dir(tmp_path, "smollm2-135m"), "--gen-devices", "0,1,2,3,4,5",
             "--output-dir", str(tmp_path / "run")]
    assert flags.parse_args(small).model.endswith("smollm2-135m")  # fits: nothing to refuse
    assert flags.memory_problems(flags.parse_args(small), num_gpus=0, learner_ranks=2, world=2) == []  # CPU


def test_a_generator_share_that_cannot_hold_the_weights_and_one_sequence_is_refused(tmp_path, eight_gpus, capsys):
    """vLLM refuses an engine whose share of its GPU (--gen-memory-fraction) cannot hold its weights and one
    sequence's KV cache, advising its own gpu_memory_utilization, once the learner has loaded. Qwen3-8B in bf16 is
    15.3 GiB of weights, and one sequence of ScaleRL's 14,848 tokens (and two blocks of 256) 2.1 GiB of KV cache (8
    KV heads of 128 in 36 layers: 144 KiB a token): a tenth of an 80 GiB GPU holds neither, a quarter of the four
    GPUs of --tensor-parallel-size 4 holds both (3.8 + 0.5 GiB). The learner fits here with the flags the docs give it."""
    argv = ["--model", model_dir(tmp_path, "qwen3-8b"), "--gen-devices", "0,1,2,3", "--output-dir",
            str(tmp_path / "run"), *scalerl_args(), "--activation-checkpointing", "--cpu-offload",
            "--gen-memory-fraction", "0.1"]
    with pytest.raises(SystemExit):
        train.main(argv)
    err = capsys.readouterr().err
    assert (f"vLLM's share of each generator GPU (0.1 of 80.0 GiB: 8.0 GiB, --gen-memory-fraction) cannot hold "
            f"{argv[1]}'s weights in bfloat16 (15.3 GiB a GPU at --tensor-parallel-size 1) and one sequence's KV cache "
            "(14848 tokens: 2.1 GiB): a larger --gen-memory-fraction, or a larger --tensor-parallel-size") in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "run").exists()
    assert flags.memory_problems(flags.parse_args(argv + ["--tensor-parallel-size", "4"]), 8, 2, 2) == []
    assert flags.memory_problems(flags.parse_args(argv[:-2]), 8, 2, 2) == []  # its own GPUs' default share, 0.85


def test_docs_memory_table_is_what_the_plan_prints():
    """docs/memory.md's Qwen3-8B table, cell by cell, from the command beside it."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "memory.md").read_text()
    rows = [line.split("|")[1:-1] for line in page.splitlines() if re.match(r"\| [1248] \|", line)]
    assert [int(row[0]) for row in rows] == [1, 2, 4, 8]
    flag_sets = ([], ["--activation-checkpointing"], ["--cpu-offload"], ["--activation-checkpointing", "--cpu-offload"])
    for row in rows:
        for cell, (budget, flag_set) in zip(row[1:], [(b, f) for b in ("16384", "32768") for f in flag_sets]):
            first = flags.plan(["--shape", "qwen3-8b", "--learner-ranks", row[0].strip(), "--micro-batch-tokens",
                                budget, *flag_set, *scalerl_args()]).splitlines()[0]
            fits = first.endswith(": fits")
            assert cell.strip() == (f"**{first.split(': ')[1].split()[0]}**" if fits
                                    else first.split(": ")[1].split()[0]), (row[0], budget, flag_set)


def test_the_split_bf16_head_keeps_its_logits_gradient_and_weight_parts_until_backward():
    """--lm-head-gemm split-bf16 keeps [tokens, vocab] bf16 from forward to backward, and the weight's three bf16
    parts: 2 bytes per logit and 6 per head weight more than the float32 head's chunks."""
    plain = mp.estimate(QWEN3_8B, SCALERL_BATCH)
    split = mp.estimate(QWEN3_8B, dataclasses.replace(SCALERL_BATCH, split_bf16_head=True))
    head_weight = 151936 * 4096  # Qwen3-8B's untied head
    chunk = 441 * 151936 * 4  # one [chunk, vocab] float32 buffer fewer; the parts in the weight gradient's place
    assert split.gpu["lm_head"] - plain.gpu["lm_head"] == 2 * 16384 * 151936 + 6 * head_weight - chunk - 4 * head_weight
    assert flags.learner_memory_plan(flags.Args(dtype="bfloat16"), QWEN3_8B, 8, 80 * GIB).layout.split_bf16_head
    assert not flags.learner_memory_plan(flags.Args(dtype="bfloat16", lm_head_gemm="fp32"), QWEN3_8B, 8,
                                         80 * GIB).layout.split_bf16_head


def test_a_checkpoint_save_holds_twice_a_file_of_a_ranks_shard_in_host_memory():
    """Each rank saves its own shard (harness/checkpoints.py): its float32 weights and AdamW's two moments, 12 bytes
    a parameter over the ranks, in files of about 1 GiB, each copied to the host and serialised there once more.
    TINY has 1,720 parameters; Qwen3-8B 8,190,735,360: 11.4 GiB a rank on 8 ranks, 12 files of 0.95 GiB."""
    import harness.checkpoints

    assert mp.SHARD_FILE_BYTES == harness.checkpoints.SHARD_FILE_BYTES
    assert mp.estimate(TINY, TINY_LAYOUT).checkpoint_host == 2 * 12 * 860
    three = mp.estimate(TINY, dataclasses.replace(TINY_LAYOUT, learner_ranks=3))
    assert three.checkpoint_host == 2 * 12 * 574  # ceil(1720 / 3)
    assert mp.parameter_counts(mp.shape_config("qwen3-8b")).total == 8_190_735_360
    lines = flags.plan(["--shape", "qwen3-8b", "--learner-ranks", "8", "--dtype", "bfloat16"])
    per_file = -(-12 * 8_190_735_360 // 8 // 12)  # 12,286,103,040 bytes a rank in 12 files
    assert f"{2 * per_file / GIB:.1f} GiB  each rank's host memory during a checkpoint's save" in lines
