"""harness/flags.py: every flag explained and checked before anything starts, the flags the generator shares,
the GPU layouts refused, and the resume rules with args.json."""

import dataclasses
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import types

import pytest

import pipeline_rl as pl
import train
from harness import base_model, checkpoints, flags, fleet, runtime, vllm_replica
from helpers import REPO, wide_kv_model


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        flags.parse_args(["--help"], losses=train.LOSSES)
    text = capsys.readouterr().out
    assert "--loss {grpo,dapo,drgrpo,gspo,cispo}" in text and "the loss file: grpo, dapo, drgrpo, gspo or cispo" in text
    for flag in ("--loss", "--mode", "--max-off-policy", "--max-steps", "--prompts-per-step", "--group-size",
                 "--eval-every", "--eval-samples", "--output-dir", "--resume", "--seed", "--model", "--dataset",
                 "--tis", "--tis-cap", "--zero-variance", "--aggregation", "--adv-norm", "--fp32-lm-head",
                 "--length-control", "--retire-pass-rate", "--loss-arg"):
        assert flag in text
    # every flag gives its default but those with none (None: not given, as --resume) and one ...
    assert text.count("(default:") >= sum(f.default is not None for f in dataclasses.fields(flags.Args)) - 1
    assert "(default: None)" not in text  # ... which argparse's formatter wrote as "None", next to the help's own


def test_unknown_loss_lists_the_valid_ones(capsys):
    """--loss chooses from the loss table train.py hands the parser (flags.py imports no loss file)."""
    with pytest.raises(SystemExit):
        flags.parse_args(["--loss", "ppo"], losses=train.LOSSES)
    err = capsys.readouterr().err
    assert "invalid choice: 'ppo'" in err and all(name in err for name in train.LOSSES)


def test_the_flags_page_is_what_args_gives():
    """docs/flags.md is generated from Args (`python train.py --help-markdown > docs/flags.md`), so it cannot drift
    from --help again: every flag, its default and its help, in --help's groups."""
    page = (REPO / "docs" / "flags.md").read_text()
    stale = "docs/flags.md is stale: python train.py --help-markdown > docs/flags.md"
    assert page == flags.flags_markdown(train.LOSSES), stale
    for f in dataclasses.fields(flags.Args):
        assert f"`--{f.name.replace('_', '-')}" in page


@pytest.mark.parametrize("argv, message", [
    (["--loss", "grpo", "--aggregation", "token"], "--aggregation: grpo.compute_loss takes no aggregation"),
    (["--loss", "dapo", "--adv-norm", "group"], "--adv-norm: dapo.compute_advantages takes no normalization"),
    (["--tis-cap", "3"], "no effect without --tis"),
    (["--think-budget", "40,60", "--max-tokens", "48"], "--think-budget must end below --max-tokens"),
    (["--resume", "/nonexistent/run"], "no complete checkpoint there"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--lr", "-1"], "--lr must be > 0 (got -1.0)"),
    (["--think-budget", "40"], "--think-budget '40': expected MIN,MAX"),
    (["--think-budget", "30,20"], "--think-budget '30,20': expected MIN,MAX"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such directory"),
    (["--model", "/proc/self"], "--model /proc/self has no config.json"),
    (["--dataset", "/nonexistent/data.jsonl"], "--dataset /nonexistent/data.jsonl: no such file"),
    (["--output-dir", "/proc/version"], "--output-dir /proc/version is a file"),
    (["--output-dir", "/proc/version/run"], "/proc/version is a file, not a directory"),
    (["--output-dir", "/proc/scalerl-run"], "/proc is not writable"),
    (["--eval-samples", "0"], "--eval-samples must be >= 1"),
    (["--max-steps", "0"], "error: --max-steps must be >= 1 (got 0) (see --help)"),  # that flag alone, and its value
    (["--final-eval-samples", "0"], "--final-eval-samples must be >= 1"),
    (["--group-size", "1"], "no group variance"),
    (["--loss-arg", "eps_max"], "expected KEY=VALUE"),
    (["--buffer-steps", "-1"], "--buffer-steps must be >= 0"),
    (["--peak-tflops", "0"], "--peak-tflops must be > 0 (got 0.0)"),
    (["--debug-gen-slowdown", "0.5"],
     "--debug-gen-slowdown 0.5: X or X,Y,... (one per replica), each must be >= 1"),
    (["--debug-gen-slowdown", "1,x"], "--debug-gen-slowdown 1,x: X or X,Y,..."),
    (["--gen-listen", "0.0.0.0:29600"], "--gen-listen 0.0.0.0:29600: name the address the replicas reach this node"),
    (["--gen-listen", "localhost"], "--gen-listen: expected HOST:PORT"),
    (["--gen-remote-replicas", "1", "--gen-listen", "127.0.0.2:29600"],
     "--gen-remote-replicas needs --gen-secret-file"),
    (["--gen-remote-replicas", "1"], "remote replicas need a fixed port"),
    (["--gen-replicas", "0"], "--gen-replicas 0 needs --gen-remote-replicas 1 or more"),
    (["--gen-secret-file", "/nonexistent/secret"], "--gen-secret-file: secret file /nonexistent/secret: no such file"),
    (["--weight-transport", "file"], "--weight-transport file: the weight file is gone; weights travel through vLLM's "
     "weight-transfer engines"),
    (["--weight-dir", "/dev/shm"], "--weight-dir: the weight file is gone"),
    (["--weight-transport", "ipc", "--gen-remote-replicas", "1", "--gen-listen", "127.0.0.2:29600"],
     "--weight-transport ipc reaches a replica on learner rank 0's GPU only"),
    (["--debug-learner-slowdown", "nan"], "argument --debug-learner-slowdown: expected a finite number"),
    (["--debug-learner-slowdown", "0.5"], "--debug-learner-slowdown must be >= 1"),
    (["--lm-head-gemm", "split-bf16", "--dtype", "float32"], "--lm-head-gemm split-bf16 multiplies bf16 hidden"),
    (["--max-model-len", "48"], "--max-model-len (48) must exceed --max-tokens (48)"),
    (["--max-tokens", "300", "--think-budget", "200,250"], "--max-model-len (256) must exceed --max-tokens (300)"),
    (["--dataset-config", "main"], "--dataset-config names a configuration of a hub data set"),
    (["--dataset", "tests/data/gsm8k_small.jsonl", "--dataset-config", "main"], "not a data file"),
    (["--dataset", "arithmetic-verified", "--dataset-config", "main"], "or an embedded task"),
])
def test_incompatible_flags_are_explained_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit):
        flags.parse_args(argv, generator_checks=pl.config_problems, losses=train.LOSSES)  # as train.py hands them
    err = capsys.readouterr().err
    assert message in err
    assert "usage:" not in err and len(err.splitlines()) == 1  # one line, no usage block


def test_a_context_beyond_the_models_positions_is_one_line_before_anything_starts(base_model_dir, capsys, monkeypatch):
    """vLLM refuses a max_model_len beyond the model's max_position_embeddings only as its engine starts, in a
    pydantic validation traceback. With --model (the real tiny model's config: 256 positions) it is one line naming
    the flag, its value and the model's limit, from train.py, `train.py evaluate` and `train.py plan`: --max-model-len
    given, or a --max-tokens that leaves no room for a prompt without it (else the model's whole context is taken)."""
    model = str(base_model_dir)
    assert base_model.model_positions(model) == (256, "max_position_embeddings in its config.json")
    beyond = f"the 256 positions of {model} (max_position_embeddings in its config.json)"
    for argv, message in [
        (["--model", model, "--max-model-len", "300"], f"--max-model-len 300 exceeds {beyond}"),
        (["--model", model, "--max-tokens", "256"], f"--max-tokens 256 leaves no room for a prompt within {beyond} "
                                                    f"(--max-model-len unset, vLLM's context would be 768): give a "
                                                    f"--max-tokens below 256"),
        (["evaluate", "--model", model, "--max-model-len", "257"], f"--max-model-len 257 exceeds {beyond}"),
        (["plan", "--model", model, "--max-model-len", "300"], f"--max-model-len 300 exceeds {beyond}"),
    ]:
        with pytest.raises(SystemExit) as stop:
            train.main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    assert flags.context_problems(flags.Args(model=model, max_model_len=256)) == []  # its whole context
    # Unset, the context is the model's own 256 where --max-tokens 48 and the 512-token allowance would make 560
    assert flags.model_context(flags.Args(model=model)) == 256 and flags.context_problems(flags.Args(model=model)) == []
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own way past the limit passes here too
    assert flags.context_problems(flags.Args(model=model, max_model_len=300)) == []


def test_a_hub_names_context_is_read_from_the_hugging_face_cache(base_model_dir, tmp_path, capsys, monkeypatch):
    """A hub name (--model ORG/NAME) already downloaded is checked as a local directory is: its config.json is read
    from the Hugging Face cache (huggingface_hub's lookup, no network), so a context beyond its positions or a head
    size vLLM's CPU attention lacks is one line, and an unset --max-model-len shrinks to the model's own context as
    it does for a directory. Not downloaded yet, it cannot be told here, and vLLM checks it as its engine starts."""
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--ORG--NAME" / "snapshots" / ("0" * 40)  # huggingface_hub's cache layout
    shutil.copytree(base_model_dir, snapshot)  # its config.json: 256 positions
    (tmp_path / "hub" / "models--ORG--NAME" / "refs").mkdir()
    (tmp_path / "hub" / "models--ORG--NAME" / "refs" / "main").write_text("0" * 40)
    assert base_model.model_positions("ORG/NAME") is None  # not in this machine's cache
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # as HF_HUB_CACHE sets it
    source = "max_position_embeddings in its config.json, from the Hugging Face cache"
    assert base_model.model_positions("ORG/NAME") == (256, source)
    assert base_model.model_positions("ORG/OTHER") is None and base_model.model_file("ORG/NAME", "x.json") is None
    with pytest.raises(SystemExit) as stop:
        train.main(["--model", "ORG/NAME", "--max-model-len", "300"])
    err = capsys.readouterr().err
    message = f"--max-model-len 300 exceeds the 256 positions of ORG/NAME ({source})"
    assert stop.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    assert flags.model_context(flags.Args(model="ORG/NAME")) == 256  # 48 + the 512-token allowance would be 560
    # Read at the flags' check, the cache's huggingface_hub is imported after the run's environment is set: on a
    # machine without CUDA the rank's transformers stays offline, as it was before these checks read the cache
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    script = ("from harness import flags; flags.parse_args(['--model', 'ORG/NAME', '--output-dir', 'out']); "
              "import huggingface_hub.constants as c; print(c.HF_HUB_OFFLINE)")
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**env, "HF_HUB_CACHE": str(tmp_path / "hub"), "PYTHONPATH": str(REPO)})
    assert run.returncode == 0 and run.stdout.split() == ["True"], run.stderr
    # Offline, the cache's copy is all a run will have: its snapshot is checked as a directory is (a download cut
    # short was every rank's traceback); online, the hub gives what is missing
    (snapshot / "model.safetensors").rename(tmp_path / "weights")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert base_model.model_dir_problems("ORG/NAME") == []
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert base_model.model_dir_problems("ORG/NAME") == [
        f"ORG/NAME (offline: the Hugging Face cache's copy, {snapshot}) has no weights (*.safetensors or *.bin)"]
    (tmp_path / "weights").rename(snapshot / "model.safetensors")
    assert base_model.model_dir_problems("ORG/NAME") == []
    # vLLM's CPU attention has no kernel for a head size of 40: said before anything starts, as for a directory
    config = json.loads((snapshot / "config.json").read_text())
    (snapshot / "config.json").write_text(json.dumps({**config, "head_dim": 40}))
    sizes = ", ".join(map(str, base_model.VLLM_CPU_HEAD_SIZES))
    assert base_model.model_dir_problems("ORG/NAME") == [
        f"ORG/NAME: attention head size 40; vLLM's CPU attention supports {sizes}"]
    assert base_model.model_dir_problems("ORG/NAME", on_gpu=True) == []


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """The Hugging Face hub's answers for a file, as huggingface_hub reads them (its X-Error-Code header): ORG/GATED
    is gated, ORG/MISSING is no repository, ORG/NOCONFIG has no config.json, any other name serves CONFIG."""
    CONFIG = json.dumps({"model_type": "llama", "hidden_size": 80, "num_attention_heads": 2,  # head size 40
                         "max_position_embeddings": 256}).encode()
    ERRORS = {"GATED": (401, "GatedRepo"), "MISSING": (404, "RepoNotFound"), "NOCONFIG": (404, "EntryNotFound")}

    def answer(self, body: bool) -> None:
        status, error = self.ERRORS.get(self.path.split("/")[2] if self.path.count("/") > 2 else "", (200, None))
        self.send_response(status)
        if error:
            self.send_header("X-Error-Code", error)
        else:
            self.send_header("X-Repo-Commit", "1" * 40)
            self.send_header("ETag", '"config"')
        self.send_header("Content-Length", str(len(self.CONFIG) if status == 200 else 0))
        self.end_headers()
        if body and status == 200:
            self.wfile.write(self.CONFIG)

    def do_HEAD(self) -> None:
        self.answer(body=False)

    def do_GET(self) -> None:
        self.answer(body=True)

    def log_message(self, *args) -> None:
        pass


def test_a_hub_name_the_hub_cannot_give_is_one_line_before_anything_starts(tmp_path):
    """--model ORG/NAME not in the cache was fetched only by transformers in each rank, after the processes had
    started: no such model, a gated one or an unreachable hub was a traceback per rank. Now its config.json is
    fetched at the flags' check (huggingface_hub's own download, from a local server that answers as the hub does,
    through HF_ENDPOINT), and what the hub says is one line; once fetched, the head-size and context checks read it."""
    hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{hub.server_port}", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1"}
    script = ("import json; from harness import base_model as b; print(json.dumps({n: [b.model_dir_problems(n), "
              "b.model_positions(n)] for n in ('ORG/GATED', 'ORG/MISSING', 'ORG/NOCONFIG', 'ORG/GOOD')}))")
    try:
        checked = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=120)
        run = subprocess.run([sys.executable, "train.py", "plan", "--model", "ORG/MISSING"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
    finally:
        hub.shutdown()
    answers = json.loads(checked.stdout)
    assert answers["ORG/GATED"] == [["ORG/GATED is gated on the Hugging Face hub: accept its terms on its page, then "
                                     "log in (hf auth login, or HF_TOKEN)"], None]
    assert answers["ORG/MISSING"] == [["ORG/MISSING: no such local directory, and no such model on the Hugging Face "
                                       "hub (a private one needs hf auth login, or HF_TOKEN)"], None]
    assert answers["ORG/NOCONFIG"] == [["ORG/NOCONFIG has no config.json on the Hugging Face hub: not a "
                                        "transformers model"], None]
    sizes = ", ".join(map(str, base_model.VLLM_CPU_HEAD_SIZES))  # fetched on its first check, then read as a dir's
    assert answers["ORG/GOOD"] == [[f"ORG/GOOD: attention head size 40; vLLM's CPU attention supports {sizes}"],
                                   [256, "max_position_embeddings in its config.json, from the Hugging Face cache"]]
    assert (run.returncode, run.stderr) == (2, "train.py plan: error: --model ORG/MISSING: no such local directory, "
                                               "and no such model on the Hugging Face hub (a private one needs hf "
                                               "auth login, or HF_TOKEN) (see --help)\n"), run.stderr


def test_a_hub_name_with_no_hub_to_reach_is_one_line(monkeypatch):
    """With no hub (HF_HUB_OFFLINE, or no network) and nothing in the cache, the line says so and how to get it."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 sets it
    cache = huggingface_hub.constants.HF_HUB_CACHE
    assert base_model.model_dir_problems("ORG/NOWHERE") == [
        f"ORG/NOWHERE: no such local directory, not in the Hugging Face cache ({cache}), and the hub could not be "
        "reached (HF_HUB_OFFLINE=1, which train.py sets on a machine without CUDA unless HF_HUB_OFFLINE is given): "
        "download it where it can be (hf download ORG/NOWHERE), or give the model's directory"]
    assert base_model.hub_config_problems(str(REPO / "models" / "tiny-arith")) == []  # a directory: nothing to fetch


def test_the_models_positions_are_read_as_vllm_derives_them(tmp_path):
    """base_model.model_positions follows vLLM's reading of config.json: the smallest of its position keys, then the
    tokenizer's model_max_length, times a RoPE scaling factor (not for the types whose positions are scaled already);
    None where it cannot tell, so that nothing is refused by a guess."""
    def positions(config: dict, tokenizer: dict | None = None):
        (tmp_path / "config.json").write_text(json.dumps(config))
        (tmp_path / "tokenizer_config.json").unlink(missing_ok=True)
        if tokenizer is not None:
            (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer))
        return base_model.model_positions(str(tmp_path))

    assert positions({"max_position_embeddings": 8192, "seq_length": 4096}) == (4096, "seq_length in its config.json")
    assert positions({"max_position_embeddings": 8192}, {"model_max_length": 2048}) == (
        2048, "model_max_length in its tokenizer_config.json")
    assert positions({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}) == (
        8192, "max_position_embeddings in its config.json, times its RoPE factor 2")
    assert positions({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) == (
        131072, "max_position_embeddings in its config.json")
    assert positions({"text_config": {"max_position_embeddings": 512}}) == (512, "max_position_embeddings in its "
                                                                                "config.json")
    assert positions({"hidden_size": 64}) is None and base_model.model_positions("ORG/NAME") is None
    (tmp_path / "config.json").write_text("{not json")
    assert base_model.model_positions(str(tmp_path)) is None


# The generator's fields whose flag starts unset and is resolved at start-up (the model directory, dtype by device,
# the context by model, the replicas by --gen-devices), so its default differs from GeneratorConfig's on purpose.
RESOLVED_AT_START = {"model", "dtype", "max_model_len", "replicas"}


def test_a_layout_that_cannot_fit_the_hosts_memory_is_one_line_before_anything_starts(base_model_dir, tmp_path,
                                                                                      capsys, monkeypatch):
    """On CPU the learner's ranks and the replicas share the host's memory, and each replica takes its KV cache whole
    as its engine starts (vllm_replica.cpu_kv_cache_bytes), vLLM checking it against the memory free at that moment
    only: replicas that start together each pass, then take more than there is between them, and a model too large
    for the host met the kernel's out-of-memory killer. The least they hold at once (the learner's float32 weights,
    gradients and AdamW moments at its step; each replica's weights and cache) is refused against what is available,
    in one line with its parts and what would shrink them; a VLLM_CPU_KVCACHE_SPACE vLLM would not read is one line
    too."""
    from harness import memory_plan

    monkeypatch.setattr(memory_plan, "host_memory_available", lambda: 3 << 30)  # 3 GiB free
    assert flags.host_memory_problems(flags.Args(gen_replicas=2), 0, 1, 1) == []
    assert flags.host_memory_problems(flags.Args(gen_replicas=4), 8, 1, 1) == []  # a GPU's plan is memory_problems
    with pytest.raises(SystemExit):
        train.main(["--gen-replicas", "4", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert ("this node's processes need at least 4.0 GiB of host memory, and this machine has 3.0 GiB "
            "available (GiB: the learner's float32 weights, gradients and AdamW moments 0.0 over 1 rank(s) here; 4 "
            "replica(s) of 0.0 of weights and 1.0 of KV cache each, holding VLLM_CPU_KVCACHE_SPACE's 1 GiB): fewer "
            "--gen-replicas") in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "run").exists(), err
    with pytest.raises(SystemExit):  # `evaluate` starts the replicas alone
        train.main(["evaluate", "--gen-replicas", "4"])
    assert ("need at least 4.0 GiB of host memory, and this machine has 3.0 GiB available (GiB: 4 replica(s) of 0.0 "
            "of weights and 1.0 of KV cache each") in capsys.readouterr().err
    model = wide_kv_model(base_model_dir, tmp_path / "wide-kv")  # 256 KiB of KV cache a token, no weight files
    assert flags.host_memory_problems(flags.Args(model=str(model), max_tokens=6000, gen_replicas=2), 0, 1, 1) == [
        "this node's processes need at least 3.4 GiB of host memory, and this machine has 3.0 GiB "
        "available (GiB: the learner's float32 weights, gradients and AdamW moments 0.0 over 1 rank(s) here; 2 "
        f"replica(s) of 0.0 of weights and 1.7 of KV cache each, holding one sequence of 6512 tokens of {model}): "
        "fewer --gen-replicas or a lower --max-tokens or --max-model-len"]
    # 150M parameters: 2.4 GB of learner state over 4 ranks, 2 of them here or all 4; 0.6 GB of float32 weights
    monkeypatch.setattr(base_model, "count_parameters", lambda path: 150_000_000)
    args = flags.Args(model=str(model))
    assert flags.host_memory_problems(args, 0, 2, 4) == []  # 1.2 + 0.6 + 1.07 GB: 2.9 GB, 2.7 GiB
    assert flags.host_memory_problems(args, 0, 4, 4) == [
        "this node's processes need at least 3.8 GiB of host memory, and this machine has 3.0 GiB "
        "available (GiB: the learner's float32 weights, gradients and AdamW moments 2.2 over 4 rank(s) here; 1 "
        "replica(s) of 0.6 of weights and 1.0 of KV cache each, holding VLLM_CPU_KVCACHE_SPACE's 1 GiB): a smaller "
        "model"]
    assert "moments 2.8 over 4 rank(s)" in flags.host_memory_problems(dataclasses.replace(args, kl_coef=0.1),
                                                                       0, 4, 4)[0]  # + the reference's weights
    monkeypatch.setenv("RANK", "4")  # a second node of learner ranks (torchrun --nnodes 2): the replicas are not here
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert flags.host_memory_problems(args, 0, 3, 4) == []  # 1.8 GB here, where the replica's 1.7 GB refused it
    monkeypatch.setattr(memory_plan, "host_memory_available", lambda: 1 << 30)
    assert flags.host_memory_problems(args, 0, 3, 4) == [
        "this node's processes need at least 1.7 GiB of host memory, and this machine has 1.0 GiB "
        "available (GiB: the learner's float32 weights, gradients and AdamW moments 1.7 over 3 rank(s) here): a "
        "smaller model"]
    monkeypatch.setattr(memory_plan, "host_memory_available", lambda: 3 << 30)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert flags.host_memory_problems(flags.Args(gen_replicas=2), 0, 1, 1)[0].endswith(
        ": fewer --gen-replicas or a smaller VLLM_CPU_KVCACHE_SPACE")
    for setting in ("1.5", "0", "one"):
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", setting)
        assert flags.host_memory_problems(flags.Args(), 0, 1, 1) == [
            f"VLLM_CPU_KVCACHE_SPACE={setting}: vLLM reads a whole number of GiB, at least 1"]


def test_the_flags_the_generator_shares_take_its_defaults():
    """Every flag that sets a GeneratorConfig or FleetConfig field defaults to that field's default: the fleet's
    written only there, the rule's in GeneratorConfig and in flags.RULE_DEFAULTS (flags never imports the recipe),
    which must agree."""
    rule_fields = dataclasses.fields(pl.GeneratorConfig)
    assert {f.name: f.default for f in rule_fields if f.name in flags.RULE_DEFAULTS} == flags.RULE_DEFAULTS
    assert flags.MODES == pl.MODES
    args, shared = flags.Args(), 0
    for field in [*rule_fields, *dataclasses.fields(fleet.FleetConfig)]:
        flag = flags.GENERATOR_FLAGS.get(field.name, field.name)
        if not hasattr(args, flag) or field.name in RESOLVED_AT_START:
            continue
        shared += 1
        given = getattr(args, flag)
        if field.name == "think_budget":
            given = flags.int_range(given)
        elif field.name == "debug_slowdown":
            given = float(given)
        assert given == field.default, f"--{flag.replace('_', '-')} defaults to {given!r}, the generator's " \
                                       f"{field.name} to {field.default!r}"
    assert shared >= 14  # group_size, temperature, think_budget, ..., weight_transport


@pytest.mark.parametrize("argv, config", [
    (["--mode", "sync", "--max-off-policy", "0"], {"mode": "sync", "max_off_policy": 0}),
    (["--max-off-policy", "-1"], {"max_off_policy": -1}),
    (["--temperature", "0"], {"temperature": 0.0}),
    (["--gen-listen", "0.0.0.0:29600"], {"listen": "0.0.0.0:29600"}),
    (["--group-size", "0", "--zero-variance", "keep"], {"group_size": 0}),
])
def test_the_flags_the_generator_shares_get_its_checks(argv, config, capsys):
    """A bad value gives the same message from the command line as from GeneratorConfig (or its FleetConfig), each
    spelling the setting its own way: both come from pipeline_rl.config_problems (or fleet.fleet_problems)."""
    with pytest.raises(SystemExit):
        flags.parse_args(argv, generator_checks=pl.config_problems)
    from_flags = capsys.readouterr().err
    fleet_fields = {f.name for f in dataclasses.fields(fleet.FleetConfig)}
    with pytest.raises(ValueError) as raised:
        pl.GeneratorConfig(model="m", **{k: v for k, v in config.items() if k not in fleet_fields},
                           fleet=fleet.FleetConfig(**{k: v for k, v in config.items() if k in fleet_fields}))
    field = next(iter(config)) if len(config) == 1 else "max_off_policy"
    from_config = str(raised.value)
    assert from_config.startswith(field)
    assert from_config.replace(field, flags.generator_flag(field), 1).split(" (got")[0].rstrip(".") in from_flags


def test_argument_errors_are_printed_by_rank_0_only(monkeypatch, capsys):
    """Another rank says nothing, and waits before it exits: had it exited first, torchrun would have ended rank 0
    before rank 0 printed why (seen on CI: a run ended with torchrun's traceback only); rank 0's exit ends the wait."""
    from harness import cli

    waits = []
    # rank 0 ended first
    monkeypatch.setattr(cli, "wait_for_a_signal", lambda seconds, until=None: waits.append(seconds) or True)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit_info:
        flags.parse_args(["--lr", "-1"])
    assert exit_info.value.code == 2 and capsys.readouterr().err == "" and waits == [cli.QUIET_RANK_GRACE_S]
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        flags.parse_args(["--lr", "-1"])
    assert "--lr must be > 0" in capsys.readouterr().err and waits == [cli.QUIET_RANK_GRACE_S]  # rank 0: no wait


@pytest.mark.parametrize("argv, message", [
    (["--tis-mode", "mask"], "no effect without --tis"),
    (["--tis", "token", "--tis-cap-min", "3"], "--tis-cap-min must lie in [0, --tis-cap]"),
    (["--loss", "grpo", "--kl-coef", "-1"], "--kl-coef must be >= 0"),
    (["--overlong-filter"], "use it with --length-control overlong"),
])
def test_algorithm_options_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit):
        flags.parse_args(argv, losses=train.LOSSES)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("gen_devices, gpus, ranks, tp, message", [
    (None, 0, 2, 1, None),  # CPU: vLLM beside the learner
    ("0", 0, 1, 1, "--gen-devices 0: no CUDA GPU here"),
    (None, 8, 2, 1, "--gen-devices is needed on a GPU machine"),
    ("0,1,2,3,4,5", 8, 2, 1, None),
    ("0,1,2,3,4,5", 8, 8, 1, "--nproc_per_node 8: each learner rank needs a GPU of its own, and 2 of the 8 are left"),
    ("0", 1, 1, 1, None),  # one GPU, shared by the generator and one learner rank
    ("0", 1, 2, 1, "--nproc_per_node 2: each learner rank needs a GPU of its own, and 1 of the 1"),
    ("8", 8, 1, 1, "--gen-devices 8: gen_devices [8] out of range for 8 devices"),
    ("6,7", 8, 6, 4, "--tensor-parallel-size 4 needs as many --gen-devices"),
    ("0,1,2", 8, 2, 2, "--gen-devices 0,1,2: 3 devices do not split into replicas of --tensor-parallel-size 2"),
])
def test_gpu_layouts_that_cannot_work_are_refused_before_anything_starts(gen_devices, gpus, ranks, tp, message):
    args = flags.Args(gen_devices=gen_devices, tensor_parallel_size=tp)  # parse_args would check this machine's GPUs
    problems = flags.gpu_layout_problems(args, num_gpus=gpus, learner_ranks=ranks)
    assert (problems == []) if message is None else any(p.startswith(message) for p in problems), problems


def test_a_second_node_gives_its_learner_ranks_every_gpu(monkeypatch):
    """--gen-devices names GPUs of rank 0's node, where the generator runs. A second node of learner ranks (torchrun
    --nnodes 2, its ranks 2..9) kept those GPUs free all the same: of its 8 GPUs, 2 could hold a learner rank, and 8
    ranks there were refused. There every GPU is the learner's; on rank 0's node nothing changes."""
    args = flags.Args(gen_devices="0,1,2,3,4,5")
    for rank, local_rank, gpus in (("0", "0", [6, 7]), ("1", "1", [6, 7]), ("2", "0", list(range(8))),
                                   ("9", "7", list(range(8)))):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert flags.learner_gpus(args.gen_devices, 8) == gpus, rank
    assert flags.gpu_layout_problems(args, num_gpus=8, learner_ranks=8) == []
    assert flags.gpu_layout_problems(args, num_gpus=8, learner_ranks=9) == [
        "--nproc_per_node 9: each learner rank needs a GPU of its own, and this node has 8 (the generator's "
        "--gen-devices are on rank 0's node)"]
    assert flags.gpu_layout_problems(flags.Args(gen_devices="0"), num_gpus=1, learner_ranks=2)[0] == (  # a GPU a node
        "--nproc_per_node 2: each learner rank needs a GPU of its own, and this node has 1 (the generator's "
        "--gen-devices are on rank 0's node)")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert flags.gpu_layout_problems(args, num_gpus=8, learner_ranks=8)[0].startswith(
        "--nproc_per_node 8: each learner rank needs a GPU of its own, and 2 of the 8 are left")


def test_a_node_of_learner_ranks_needs_no_copy_of_the_replicas_secret(monkeypatch):
    """Only rank 0 proves the secret to remote replicas. A second node of learner ranks (torchrun --nnodes 2, the same
    command line) was refused for lacking a copy of the file, and begin() read it there again; on rank 0's node a
    missing file is still one line before anything starts."""
    args = flags.Args(gen_secret_file="/nonexistent/secret")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert flags.replica_problems(args) == [] and runtime.fleet_config(args).secret is None
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert flags.replica_problems(args) == ["--gen-secret-file: secret file /nonexistent/secret: no such file"]


def test_the_readme_s_eight_gpu_node_is_six_replicas_and_two_learner_ranks():
    """--gen-devices 0,1,2,3,4,5 on an 8-GPU node: six vLLM replicas of one GPU each (three with
    --tensor-parallel-size 2), and GPUs 6 and 7 for two learner ranks."""
    args = flags.Args(gen_devices="0,1,2,3,4,5")
    assert flags.gpu_layout_problems(args, num_gpus=8, learner_ranks=2) == []
    assert flags.local_replicas(args, num_gpus=8) == 6
    assert vllm_replica.split_devices(args.gen_devices, 8)[0] == [6, 7]
    args.tensor_parallel_size = 2
    assert flags.local_replicas(args, num_gpus=8) == 3
    args.gen_replicas = 2
    assert flags.gpu_layout_problems(args, 8, 2)[0].startswith("--gen-replicas 2: --gen-devices 0,1,2,3,4,5 with "
                                                               "--tensor-parallel-size 2 makes 3 replica(s)")
    assert flags.local_replicas(flags.Args(), num_gpus=0) == 1  # CPU: one, unless asked for more


@pytest.mark.parametrize("report_to, module", [(name, entry[0]) for name, entry in flags.REPORT_TO.items() if entry])
def test_report_to_without_its_package_is_one_line_naming_it_before_anything_starts(report_to, module, monkeypatch,
                                                                                      capsys):
    monkeypatch.setitem(sys.modules, module, None)  # what an import of a package that is not installed meets
    package = flags.REPORT_TO[report_to][1]
    with pytest.raises(SystemExit):
        flags.parse_args(["--report-to", report_to])
    err = capsys.readouterr().err
    assert f"--report-to {report_to} needs the {package} package: pip install {package}" in err
    assert "usage:" not in err and len(err.splitlines()) == 1
    assert flags.report_to_problems("none") == []


def test_the_lm_head_gemm_is_split_bf16_only_for_a_bf16_learner_on_a_gpu():
    assert flags.lm_head_gemm(flags.Args(dtype="bfloat16"), "cuda") == "split-bf16"
    for args, device in [(flags.Args(dtype="bfloat16"), "cpu"), (flags.Args(dtype="float32"), "cuda"),
                         (flags.Args(dtype="bfloat16", fp32_lm_head=False), "cuda"),
                         (flags.Args(dtype="bfloat16", lm_head_gemm="fp32"), "cuda")]:
        assert flags.lm_head_gemm(args, device) == "fp32"


def test_an_output_dir_that_holds_a_run_is_not_overwritten_by_accident(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(SystemExit):
        flags.parse_args(["--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert "already holds a run" in err and f"--resume {tmp_path}" in err and "--overwrite" in err
    assert flags.parse_args(["--output-dir", str(tmp_path), "--overwrite"]).overwrite
    with pytest.raises(SystemExit):
        flags.parse_args(["--resume", str(tmp_path), "--overwrite"])


@pytest.mark.parametrize("name", ["args.json", "scaling.png", "dashboard.png", "checkpoint.tmp", "wandb"])
def test_an_output_dir_that_holds_a_run_file_is_refused_in_one_line(tmp_path, capsys, name):
    """Not only metrics and checkpoints: a new run would take a foreign args.json for its own (and a failed start
    removed it), draw over another run's plots, or go on with another run's W&B id."""
    if "." in name:
        (tmp_path / name).write_text(json.dumps({"loss": "gspo", "lr": 1.0}) if name == "args.json" else "theirs")
    else:
        (tmp_path / name).mkdir()
    with pytest.raises(SystemExit):
        flags.parse_args(["--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--output-dir {tmp_path} already holds a run ({name})" in err, err
    assert flags.parse_args(["--output-dir", str(tmp_path), "--overwrite"]).overwrite
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_a_resumed_run_keeps_its_flags_unless_overridden(tmp_path):
    started = flags.parse_args(["--output-dir", str(tmp_path), "--loss", "grpo", "--max-steps", "8",
                                "--no-fp32-lm-head", "--loss-arg", "clip_eps=0.3"])
    (tmp_path / "args.json").write_text(json.dumps(dataclasses.asdict(started)))
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "trainer_state.json").write_text("{}")
    resumed = flags.parse_args(["--resume", str(tmp_path), "--output-dir", "elsewhere"])
    assert resumed == dataclasses.replace(started, resume=str(tmp_path))
    extended = flags.parse_args(["--resume", str(tmp_path), "--max-steps", "200", "--eval-every", "7"])
    assert (extended.max_steps, extended.eval_every, extended.loss) == (200, 7, "grpo")
    assert extended.loss_arg == ["clip_eps=0.3"]


def test_args_json_is_never_written_through_a_planted_link(tmp_path, victim, monkeypatch):
    """A planted .args.json.tmp is not the temporary a write uses (O_EXCL under a random name), even when it is
    given that very name; a link at args.json itself is refused, not renamed over."""
    (tmp_path / ".args.json.tmp").symlink_to(victim)
    names = iter(["planted", "fresh"])
    monkeypatch.setattr(checkpoints.secrets, "token_hex", lambda n: next(names))
    (tmp_path / ".args.json.planted.tmp").symlink_to(victim)
    flags.write_args_json(tmp_path, flags.Args(output_dir=str(tmp_path)), 0, [])
    assert json.loads((tmp_path / "args.json").read_text())["output_dir"] == str(tmp_path)
    assert not (tmp_path / "args.json").is_symlink() and victim.read_text() == "precious\n"
    (tmp_path / "args.json").unlink()
    (tmp_path / "args.json").symlink_to(victim)
    with pytest.raises(checkpoints.LinkRefusedError, match=f"{tmp_path / 'args.json'} is a symbolic link"):
        checkpoints.write_atomically(tmp_path / "args.json", "{}")
    assert victim.read_text() == "precious\n" and (tmp_path / "args.json").is_symlink()


def test_an_args_json_of_an_earlier_version_reads_as_the_run_it_was(tmp_path):
    """--debug-gen-slowdown was one number, written as a JSON float; it is text now (one factor per replica). An
    args.json written before (the 250-step study's runs, docs/study-runs) was refused as "not a str", so such a run
    could neither be resumed nor reused by a study; it reads now as the run it was, with "1" where it held 1.0."""
    started = flags.parse_args(["--output-dir", str(tmp_path), "--debug-gen-slowdown", "1.5"])
    flags.write_args_json(tmp_path, started, 0, [])
    older = json.loads((tmp_path / "args.json").read_text())
    for number, text in ((1.0, "1"), (1.5, "1.5"), (3, "3")):
        (tmp_path / "args.json").write_text(json.dumps({**older, "debug_gen_slowdown": number}))
        assert flags.read_args_json(tmp_path)["debug_gen_slowdown"] == text
    (tmp_path / "args.json").write_text(json.dumps({**older, "debug_gen_slowdown": True}))
    with pytest.raises(ValueError, match="debug_gen_slowdown is True, not a str"):  # still checked, as before
        flags.read_args_json(tmp_path)


def test_a_resume_refuses_a_changed_recipe_and_keeps_args_json(tmp_path, capsys):
    started = flags.parse_args(["--output-dir", str(tmp_path), "--loss", "cispo", "--max-steps", "20"])
    flags.write_args_json(tmp_path, started, 0, [])
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "trainer_state.json").write_text(json.dumps({"step": 10}))
    saved = (tmp_path / "args.json").read_bytes()
    for argv, message in [
        (["--loss", "grpo", "--seed", "1"], "--loss (the run's cispo, now grpo), --seed (the run's 0, now 1): these "
                                            "flags define the run and cannot change when it resumes"),
        (["--group-size", "4"], "--group-size (the run's 8, now 4): this flag defines the run"),
        (["--model", str(tmp_path)], f"--model (the run's None, now {tmp_path})"),
        (["--loss-arg", "eps_max=8"], "--loss-arg (the run's None, now eps_max=8)"),
        (["--max-steps", "5"], f"--max-steps 5 is below step 10, where the run {tmp_path} is"),
        (["--max-steps", "15"], "--max-steps 15 is below the run's 20: on --resume --max-steps only goes upwards"),
    ]:
        with pytest.raises(SystemExit) as stop:
            flags.parse_args(["--resume", str(tmp_path), *argv])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err and len(err.splitlines()) == 1, err
        assert (tmp_path / "args.json").read_bytes() == saved
    (tmp_path / "checkpoint" / "trainer_state.json").write_text(json.dumps({"step": 20}))
    with pytest.raises(SystemExit) as stop:  # at its --max-steps already: nothing to do, and nothing starts
        flags.parse_args(["--resume", str(tmp_path), "--max-steps", "20"])
    assert stop.value.code == 0 and "is at step 20, its --max-steps: nothing to do" in capsys.readouterr().err
    (tmp_path / "checkpoint" / "trainer_state.json").write_text(json.dumps({"step": 10}))
    # the same value again, and the flags that may change, are accepted
    args = flags.parse_args(["--resume", str(tmp_path), "--loss", "cispo", "--max-steps", "30", "--eval-every", "2",
                             "--eval-samples", "8", "--checkpoint-every", "3", "--log-every", "1"])
    assert (args.loss, args.max_steps, args.eval_every, args.eval_samples) == ("cispo", 30, 2, 8)
    # evaluate --resume trains nothing: it may use another data set or more samples
    assert flags.parse_args(["--resume", str(tmp_path), "--seed", "3"], evaluating=True).seed == 3


def test_changes_on_resume_are_recorded_with_their_step_and_listed_in_help(tmp_path, capsys):
    started = flags.parse_args(["--output-dir", str(tmp_path), "--max-steps", "20"])
    flags.write_args_json(tmp_path, started, 0, [])
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "trainer_state.json").write_text(json.dumps({"step": 10}))
    flags.write_args_json(tmp_path, flags.parse_args(["--resume", str(tmp_path), "--max-steps", "40",
                                                      "--eval-every", "2"]), 10, [])
    (tmp_path / "checkpoint" / "trainer_state.json").write_text(json.dumps({"step": 40}))
    flags.write_args_json(tmp_path, flags.parse_args(["--resume", str(tmp_path), "--max-steps", "50"]), 40, [7, 8])
    record = json.loads((tmp_path / "args.json").read_text())
    assert record["max_steps"] == 50 and record["eval_every"] == 2 and record["loss"] == "cispo"
    assert record["resumes"] == [{"step": 10, "changed": {"eval_every": [10, 2], "max_steps": [20, 40]}},
                                 {"step": 40, "changed": {"max_steps": [40, 50]}, "metrics_missing_steps": [[7, 8]]}]
    assert flags.CHANGEABLE_ON_RESUME <= {f.name for f in dataclasses.fields(flags.Args)}
    with pytest.raises(SystemExit):
        flags.parse_args(["--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines at hyphens too: compare without spaces
    listed = text.split("Onlythesemaychange")[1].split("refused")[0]
    assert all(f"--{name.replace('_', '-')}," in listed or f"--{name.replace('_', '-')}(" in listed
               for name in flags.CHANGEABLE_ON_RESUME - {"output_dir", "resume", "overwrite"}), listed
