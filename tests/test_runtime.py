"""harness/runtime.py: the generator's start from the flags, the metrics log and its reporters, the output
directory's lock and links, a full disk, Ctrl-C and the other ranks."""

import dataclasses
import importlib
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import pipeline_rl as pl
import train
from harness import checkpoints, flags, runtime, tasks, vllm_replica
from harness.tasks import Problem
from helpers import file_tree, make_group, metrics_rows, saved_run


def test_mfu_is_six_n_tokens_over_the_ranks_peak_and_absent_without_a_peak(monkeypatch):
    """MFU = 6 x parameters x trained tokens / (step seconds x ranks x peak): 1M parameters, 5,000 tokens, 2 s on
    2 ranks of 1 TFLOP/s -> 3e10 / 4e12 = 0.0075. The peak comes from --peak-tflops, else from the table by the
    GPU's name (a variant before its family); a CPU or an unlisted GPU has none, and then there is no mfu."""
    assert runtime.model_flops_utilisation(1_000_000, 5_000, 2.0, 2, 1e12) == pytest.approx(0.0075)
    assert runtime.model_flops_utilisation(1_000_000, 5_000, 2.0, 2, None) is None
    assert runtime.known_peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4
    assert runtime.known_peak_tflops("NVIDIA H100 PCIe", "float32") == 51.0
    assert runtime.known_peak_tflops("NVIDIA A100-SXM4-80GB", "bfloat16") == 312.0
    assert runtime.known_peak_tflops("NVIDIA L40S", "bfloat16") == 362.05 and runtime.known_peak_tflops(
        "NVIDIA L4", "bfloat16") == 121.0 and runtime.known_peak_tflops("NVIDIA A10", "float32") == 31.2
    assert runtime.known_peak_tflops("NVIDIA GeForce GTX 1080", "bfloat16") is None
    monkeypatch.setattr(runtime.torch.cuda, "is_available", lambda: False)
    assert runtime.peak_flops_per_s("float32") is None
    assert runtime.peak_flops_per_s("float32", given_tflops=2.5) == 2.5e12


@pytest.mark.parametrize("argv, max_model_len", [
    ([], 256),  # the embedded tiny model: its context length, as before the flag
    (["--model", "m", "--max-tokens", "64", "--think-budget", "40,48"], 64 + 512),  # a real model: + 512 of prompt
    (["--model", "m", "--max-tokens", "14336", "--think-budget", "10240,12288"], 14336 + 512),  # ScaleRL's budget
    (["--model", "m", "--max-tokens", "64", "--think-budget", "40,48", "--max-model-len", "200"], 200),
    (["--max-model-len", "128"], 128),
])
def test_generator_context_follows_the_flags(argv, max_model_len, monkeypatch):
    # "m": a hub model whose config the hub gives (its check, which would fetch it: test_flags.py)
    monkeypatch.setattr(flags.base_model, "hub_config_problems", lambda model: [])
    args = flags.parse_args(argv)
    flags.resolve_defaults(args, embedded=args.model is None, on_gpu=False)
    config = train.generator_config(args, "model-dir")  # builds the config only: nothing starts
    assert config.fleet.max_model_len == max_model_len
    assert config.max_tokens == args.max_tokens and config.think_budget == flags.int_range(args.think_budget)
    assert config.model == "model-dir" and config.seed == args.seed and config.data_seed == args.seed


@pytest.mark.parametrize("argv, config", [(["--dataset-config", "main"], "main"), ([], None)])
def test_dataset_config_reaches_load_dataset(monkeypatch, argv, config):
    """--dataset-config NAME becomes datasets.load_dataset(DATASET, NAME) (openai/gsm8k has no default config)."""
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, **kwargs):  # the plumbing is under test, not the hub
        calls.append((path, name, kwargs.get("split")))
        return [{"question": f"What is {i} + 2?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"} for i in range(10)]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    task, test_task = runtime.load_tasks(flags.parse_args(["--dataset", "openai/gsm8k", *argv]))
    assert calls == [("openai/gsm8k", config, "train")]
    assert test_task is None and len(task.problems) + len(task.validation()) == 10


def test_a_test_set_is_evaluated_whole(tmp_path, monkeypatch):
    """--test-dataset FILE: every row is a test problem. It was read as a training set, and only its held-out slice
    (a fifth, at most 500) was evaluated: 6 of these 30 rows. A hub name gives its test split (it gave its train
    split), in --dataset-config's configuration when it is --dataset's set; a set without one is one line, as is a
    configuration missing or unknown (datasets' ValueError, a traceback before)."""
    import datasets

    rows = [{"question": f"What is {i} + 2?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"} for i in range(30)]
    test_file = tmp_path / "test.jsonl"
    test_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    _, test_task = runtime.load_tasks(flags.parse_args(["--test-dataset", str(test_file)]))
    assert sorted(p.answer for p in test_task.validation()) == sorted(str(i + 2) for i in range(30))

    calls, splits = [], ["train", "test"]

    def fake_load_dataset(path, name=None, split=None, **kwargs):  # the plumbing is under test, not the hub
        calls.append((path, name, split))
        if split not in splits:  # datasets' words
            raise ValueError(f'Unknown split "{split}". Should be one of {splits}.')
        return rows[:20] if split == "train" else rows[20:]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    hub = ["--dataset", "openai/gsm8k", "--dataset-config", "main", "--test-dataset", "openai/gsm8k"]
    _, test_task = runtime.load_tasks(flags.parse_args(hub))
    assert calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    assert [p.answer for p in test_task.validation()] == [str(i + 2) for i in range(20, 30)]
    splits.remove("test")
    with pytest.raises(runtime.tasks.DataNotFoundError) as error:
        runtime.load_tasks(flags.parse_args(hub))
    assert str(error.value) == "--test-dataset openai/gsm8k (main):test: Unknown split \"test\". Should be one of " \
                               "['train']."
    for words in ("Config name is missing.\nPlease pick one among the available configs: ['main', 'socratic']\n"
                  "Example of usage:\n\t`load_dataset('openai/gsm8k', 'main')`",
                  "BuilderConfig 'mian' not found. Available: ['main', 'socratic']"):
        def no_such_config(path, name=None, split=None, words=words, **kwargs):  # datasets' words, without the hub
            raise ValueError(words)

        monkeypatch.setattr(datasets, "load_dataset", no_such_config)
        with pytest.raises(runtime.tasks.DataNotFoundError) as error:
            runtime.load_tasks(flags.parse_args(["--dataset", "openai/gsm8k"]))
        assert str(error.value) == f"--dataset openai/gsm8k:train: {' '.join(words.splitlines()[:2])} " \
                                   "(--dataset-config NAME)"
        with pytest.raises(runtime.tasks.DataNotFoundError) as error:
            runtime.load_tasks(flags.parse_args(["--test-dataset", "EleutherAI/hendrycks_math"]))
        assert str(error.value) == f"--test-dataset EleutherAI/hendrycks_math:test: " \
                                   f"{' '.join(words.splitlines()[:2])} (--test-dataset-config NAME)"


def test_a_test_set_of_another_hub_set_takes_its_own_configuration(monkeypatch, tmp_path, capsys):
    """--test-dataset of a hub set other than --dataset's could be given no configuration (--dataset-config is
    --dataset's), so a set that needs one could not be a test set; --test-dataset-config gives it one. On a data
    file it is one line, as --dataset-config's is (a directory may clone a hub set: test_tasks reads one)."""
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):  # the plumbing is under test, not the hub
        calls.append((path, name, split))
        return [{"question": f"What is {i} + 2?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"} for i in range(10)]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    runtime.load_tasks(flags.parse_args(["--dataset", "openai/gsm8k", "--dataset-config", "main", "--test-dataset",
                                         "EleutherAI/hendrycks_math", "--test-dataset-config", "algebra"]))
    assert calls == [("openai/gsm8k", "main", "train"), ("EleutherAI/hendrycks_math", "algebra", "test")]
    test_file = tmp_path / "test.jsonl"
    test_file.write_text("")
    with pytest.raises(SystemExit) as stop:
        flags.parse_args(["--test-dataset", str(test_file), "--test-dataset-config", "algebra",
                          "--output-dir", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert "--test-dataset-config names a configuration of a hub data set (or of a directory that clones one): give " \
           "--test-dataset NAME too, not a data file" in capsys.readouterr().err


def test_evaluate_names_a_bad_data_set_in_one_line_before_it_exports_the_run(tmp_path, monkeypatch, one_rank_group):
    """`train.py evaluate --resume RUN --dataset FILE` with bad rows in FILE (or an empty directory) ended in a
    DataFileError traceback, after the run's checkpoint had been exported; now one line, before any export."""
    from harness import commands

    run = tmp_path / "run"
    saved_run(run)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "What is 1 + 1?", "answer": "2"}\nnot json\n')
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(commands, "export", lambda *a, **k: pytest.fail("exported before the data set was read"))
    for data, why in ((bad, f"{bad} line 2: not JSON"), (empty, f"{empty}: a directory with no data files")):
        with pytest.raises(SystemExit) as stop:
            train.main(["evaluate", "--resume", str(run), "--dataset", str(data)])
        assert str(stop.value).startswith("train.py evaluate: error: ") and why in str(stop.value), stop.value


def test_an_evaluation_prompt_longer_than_the_context_is_one_line_before_the_generator_starts(monkeypatch):
    import transformers

    class Chars:  # one token per character of the prompt
        def apply_chat_template(self, messages, **kwargs):
            return list(range(len(messages[0]["content"])))

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: Chars())
    fits, too_long = Problem("val.jsonl-0", "x" * 24, "1"), Problem("val.jsonl-1", "x" * 25, "1")
    runtime.check_eval_prompts("m", 8, 32, [fits])  # max_tokens 8, max_model_len 32
    with pytest.raises(SystemExit, match=r"^train.py: error: evaluation prompt val.jsonl-1 has 25 tokens: with "
                                         r"max_tokens 8 it exceeds the context, max_model_len 32; raise"):
        runtime.check_eval_prompts("m", 8, 32, [fits, too_long])


def test_a_data_set_the_models_tokenizer_cannot_read_is_named_before_the_generator_starts(base_model_dir, capsys):
    """`train.py --dataset gsm8k.jsonl` without --model: the embedded tiny model's word-level tokenizer knows only
    its task's symbols, so GSM8K's prompts were 40% <|unk|>, and the run trained on them and scored 0 without a word.
    Now a warning naming the share, the tokenizer and a prompt, from a run's start and from train.py evaluate (before
    its vLLM starts); the embedded task's own prompts pass without one."""
    gsm8k = tasks.load_task(str(Path(__file__).parent / "data" / "gsm8k_small.jsonl")).validation(None)
    runtime.check_eval_prompts(str(base_model_dir), 48, 256, gsm8k, "train.py evaluate")
    warning = capsys.readouterr().err
    assert re.fullmatch(rf"train.py evaluate: warning: (\d+)% of the evaluation prompts' tokens are unknown to the "
                        rf"tokenizer of {re.escape(str(base_model_dir))} \(<\|unk\|>; prompt .*gsm8k_small.jsonl-\d+: "
                        r"'.+'\): the model cannot read this data set, and its pass rate will stay near 0; give "
                        r"--model one whose tokenizer covers it \(docs/real-models.md\)\n", warning), warning
    assert int(warning.split("warning: ")[1].split("%")[0]) > 100 * runtime.UNKNOWN_TOKENS_NOTED
    runtime.check_eval_prompts(str(base_model_dir), 48, 256, tasks.ArithmeticTask().validation(64))
    assert capsys.readouterr().err == ""


def test_evaluate_refuses_a_prompt_too_long_for_the_context_before_its_vllm_starts(tmp_path, monkeypatch):
    """`train.py evaluate` did not check its prompts against the context, as a run's start does: vLLM refused the
    first one as the evaluation began. Now the same line, before the generator starts."""
    long = tmp_path / "long.jsonl"
    long.write_text("".join(json.dumps({"question": " ".join(["add 12 34"] * 30), "answer": "46"}) + "\n"
                            for _ in range(10)))
    monkeypatch.setattr(pl.Generator, "start", lambda self: pytest.fail("the generator started"))
    with pytest.raises(SystemExit) as stop:
        train.main(["evaluate", "--dataset", str(long), "--max-model-len", "128"])
    assert re.fullmatch(r"train.py evaluate: error: evaluation prompt .*long.jsonl-\d+ has \d+ tokens: with max_tokens "
                        r"48 it exceeds the context, max_model_len 128; raise --max-model-len or lower --max-tokens",
                        str(stop.value)), stop.value


def test_the_generator_gets_a_smaller_share_of_a_gpu_it_shares(monkeypatch):
    args = flags.Args(gen_devices="0")
    flags.resolve_defaults(args, embedded=True, on_gpu=True)
    for gen_devices, gpus, fraction in (("0", 1, 0.3), ("0", 8, 0.85), ("0,1", 2, 0.3)):  # shared when it has all
        args.gen_devices = gen_devices
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        assert runtime.fleet_config(args).gpu_memory_utilization == fraction
    args.gen_memory_fraction = 0.6
    assert runtime.fleet_config(args).gpu_memory_utilization == 0.6


def test_completion_lengths_of_a_batch_by_hand():
    """Ten completions of 1..10 tokens: mean 5.5, p90 the 9th shortest, longest 10; the correct ones are the even
    lengths (mean 6), the incorrect the odd (mean 5); one interrupted, two cut off."""
    groups = [make_group(0, [1, 2, 3, 4, 5], [0, 1, 0, 1, 0]), make_group(1, [6, 7, 8, 9, 10], [1, 0, 1, 0, 1])]
    groups[0].completions[4].interrupted = True
    groups[1].completions[3].truncated = groups[1].completions[4].truncated = True
    assert runtime.completion_lengths(groups) == {
        "length_mean": 5.5, "length_p90": 9.0, "length_max": 10.0, "length_mean_correct": 6.0,
        "length_mean_incorrect": 5.0, "frac_interrupted": 0.1, "frac_truncated": 0.2}
    solved = [make_group(0, [4, 6], [1, 1])]
    assert runtime.completion_lengths(solved)["length_mean_incorrect"] is None  # none wrong: no mean, not 0
    assert runtime.completion_lengths([]) == {}


def test_metrics_log_is_cut_back_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = runtime.MetricsLog(path, None)
    for step in range(5):
        log.write({"step": step})
    log = runtime.MetricsLog(path, keep_lines=3)  # a resume from a checkpoint taken after 3 rows
    log.write({"step": 3})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]


def test_a_runs_own_metrics_are_read_back_as_written_and_a_broken_line_is_named(tmp_path):
    """The harness reads its own metrics.jsonl back (the rows a resume's running fit starts from) without
    scaling_fit.py, which is above it: the rows MetricsLog wrote, and a line that is not a JSON object named."""
    path = tmp_path / "metrics.jsonl"
    log = runtime.MetricsLog(path, None)
    log.write({"step": 0, "val_pass_rate": 0.25})
    log.write({"step": 1, "loss": float("nan")})
    assert runtime.read_run_metrics(path) == [{"step": 0, "val_pass_rate": 0.25},
                                              {"step": 1, "loss": None, "non_finite": ["loss"]}]
    for text, message in (('{"step": 0}\n{"step": 1,\n', ":2: malformed JSON"),
                          ('{"step": 0}\n\n{"step": 2}\n', ":2: malformed JSON"),
                          ('{"step": 0}\n[1, 2]\n', ":2: expected a JSON object, got list")):
        path.write_text(text)
        with pytest.raises(ValueError, match=f"{path}{message}"):
            runtime.read_run_metrics(path)


def test_non_finite_metrics_are_written_as_null_and_named(tmp_path):
    import scaling_fit

    log = runtime.MetricsLog(tmp_path / "metrics.jsonl", None)
    log.write({"step": 0, "compute_hours": 0.1, "val_pass_rate": 0.5, "loss": float("nan")})
    log.write({"step": 1, "compute_hours": 0.2, "val_pass_rate": 0.6, "lag_hist": {"0": float("inf")}})
    text = (tmp_path / "metrics.jsonl").read_text()
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl")) for line in
            text.splitlines()]
    assert rows[0]["loss"] is None and rows[0]["non_finite"] == ["loss"]
    assert rows[1]["lag_hist"] == {"0": None} and rows[1]["non_finite"] == ["lag_hist.0"]
    x, y = scaling_fit.load_curve(tmp_path)  # the fitter reads such a file
    assert list(y) == [0.5, 0.6]


def test_a_row_is_reported_as_trl_keys_its_logs():
    row = {"step": 5, "reward": 0.5, "entropy": 0.25, "groups": 30, "val_pass_rate": 0.75, "val_samples": 4,
           "fit_asymptote": 0.9, "lag_hist": {"0": 3, "1": 5}, "replica_deaths": [], "loss": None,
           "non_finite": ["loss"], "grad_clipped": 0.0, "flag": True, "note": "text"}
    assert runtime.report_scalars(row) == {
        "train/reward": 0.5, "train/entropy": 0.25, "train/groups": 30.0, "eval/val_pass_rate": 0.75,
        "eval/val_samples": 4.0, "eval/fit_asymptote": 0.9, "train/lag_hist/0": 3.0, "train/lag_hist/1": 5.0,
        "train/grad_clipped": 0.0}  # step is the x axis; lists, nulls, booleans and strings are left out


def _metrics_rows_reported(out: Path, kind: str, steps: range, offset: float = 0.0, **resumed) -> None:
    """Write rows of `steps` through a MetricsLog whose reporter is `kind`, as a run (or, with `resumed`, the resume
    of a run: MetricsLog's keep_lines and covers_step) does."""
    log = runtime.MetricsLog(out / "metrics.jsonl", resumed.get("keep_lines"), resumed.get("covers_step"))
    log.reporter = runtime.Reporter(kind, out, {"loss": "cispo"}, first_step=steps[0],
                                    reported_through=log.cut_through)
    for step in steps:
        log.write({"step": step, "reward": offset + step / 10, "lag_hist": {"0": step},
                   **({"val_pass_rate": offset + step / 20} if step % 2 == 0 else {})})
    log.reporter.close()


def test_tensorboard_holds_each_step_once_after_a_resume_redoes_steps(tmp_path):
    """A crash after step 4 and a resume from the checkpoint of step 2 redo steps 3 and 4: TensorBoard's reader sees
    every step once, the values metrics.jsonl has."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _metrics_rows_reported(tmp_path, "tensorboard", range(0, 5))
    _metrics_rows_reported(tmp_path, "tensorboard", range(3, 7), offset=1.0, keep_lines=3, covers_step=2)
    rows = metrics_rows(tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"train/reward", "train/lag_hist/0", "eval/val_pass_rate"} <= set(events.Tags()["scalars"])
    for tag, field in (("train/reward", "reward"), ("eval/val_pass_rate", "val_pass_rate")):
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [
            (r["step"], pytest.approx(r[field])) for r in rows if field in r]


def _wandb_history(out: Path) -> list[tuple[int, dict]]:
    """(step, {key: value}) of every history record in OUTPUT_DIR's W&B offline runs, read as W&B writes its .wandb
    files: a 7-byte header, then records of (crc32, length, type) in 32 KiB blocks, each record a protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    found = []
    for path in sorted(out.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, chunks = path.read_bytes(), 7, b""
        while pos + 7 <= len(data):
            if pos % 32768 > 32768 - 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
            chunks += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a whole record, or the last part of one
                record = wandb_internal_pb2.Record.FromString(chunks)
                chunks = b""
                if record.HasField("history"):
                    items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item}
                    found.append((record.history.step.num, items))
    return found


def _wandb_logs(out: Path) -> str:
    """What a failed check shows: each offline run's files and the end of W&B's own log of it."""
    parts = []
    for run_dir in sorted(out.glob("wandb/offline-run-*")):
        log = run_dir / "logs" / "debug-internal.log"
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.is_file() else ["(no debug-internal.log)"]
        parts.append(f"{run_dir.name}: {sorted(p.name for p in run_dir.iterdir())}\n" + "\n".join(tail))
    return "\n".join(parts) or "no offline run directory"


def test_wandb_offline_gets_every_step_once_across_a_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed: pip install wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: the run stays in OUTPUT_DIR/wandb
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    # Each attempt is a process of its own in a real run, so each gets W&B's service of its own: the attempts here
    # tear the in-process one down as a process's exit would (wandb.teardown waits for the service to stop).
    _metrics_rows_reported(tmp_path, "wandb", range(0, 5))
    wandb.teardown()
    _metrics_rows_reported(tmp_path, "wandb", range(3, 7), offset=1.0, keep_lines=3, covers_step=2)
    wandb.teardown()
    history = _wandb_history(tmp_path)
    assert [step for step, _ in history] == list(range(7)), _wandb_logs(tmp_path)  # 3 and 4: their first values
    assert [items["train/reward"] for _, items in history] == pytest.approx([0, .1, .2, .3, .4, 1.5, 1.6])
    assert history[2][1]["eval/val_pass_rate"] == pytest.approx(0.1) and "eval/val_pass_rate" not in history[1][1]
    run_id = (tmp_path / "wandb" / "run_id").read_text().strip()  # both attempts are one W&B run
    assert [run_id in p.name for p in (tmp_path / "wandb").glob("offline-run-*")] == [True, True]


def test_trackio_local_gets_every_step_once_across_a_resume(tmp_path, monkeypatch):
    if importlib.util.find_spec("trackio") is None:  # found, not imported: trackio reads TRACKIO_DIR as it is
        pytest.skip("trackio is not installed: pip install trackio")
    if "trackio" in sys.modules:
        pytest.skip("trackio was imported earlier in this process, with the TRACKIO_DIR of then")
    monkeypatch.setenv("TRACKIO_DIR", "unset")
    monkeypatch.delenv("TRACKIO_DIR")  # the reporter's default, OUTPUT_DIR/trackio (restored after the test)
    _metrics_rows_reported(tmp_path, "trackio", range(0, 5))
    _metrics_rows_reported(tmp_path, "trackio", range(3, 7), offset=1.0, keep_lines=3, covers_step=2)
    from trackio.sqlite_storage import SQLiteStorage

    assert (tmp_path / "trackio" / "scalerl.db").is_file()
    logs = SQLiteStorage.get_logs("scalerl", str(tmp_path.absolute()))  # the run is named for the whole path
    assert [r["step"] for r in logs] == list(range(7))
    assert [r["train/reward"] for r in logs] == pytest.approx([0, .1, .2, .3, .4, 1.5, 1.6])


def test_a_reporter_that_fails_is_said_once_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    calls = []

    def start(self):
        def log(scalars, step):
            calls.append(step)
            if step >= 2:
                raise OSError(28, "No space left on device")
        return log, lambda: None

    monkeypatch.setattr(runtime.Reporter, "_start_tensorboard", start)
    _metrics_rows_reported(tmp_path, "tensorboard", range(0, 5))
    assert [r["step"] for r in metrics_rows(tmp_path)] == list(range(5)) and calls == list(range(5))
    err = capsys.readouterr().err
    assert err.count("[report-to] tensorboard: step 2 not reported: OSError") == 1
    assert "[report-to] tensorboard: 3 rows not reported; metrics.jsonl has them all" in err

    def broken(self):
        raise RuntimeError("cannot start")
    monkeypatch.setattr(runtime.Reporter, "_start_tensorboard", broken)
    _metrics_rows_reported(tmp_path, "tensorboard", range(5, 7))
    err = capsys.readouterr().err
    assert "step 5 not reported: RuntimeError: cannot start" in err and "2 rows not reported" in err


def test_a_real_full_disk_leaves_whole_rows_and_a_whole_args_json(tiny_tmpfs):
    """On a full tmpfs: metrics.jsonl ends at its last complete row, the message names the file, the file system and
    the free space, and args.json (rewritten at a resume) stays whole, with one line instead of a traceback."""
    out = tiny_tmpfs
    args = flags.parse_args(["--output-dir", str(out)])
    (out / "args.json").write_text("{}")
    log = runtime.MetricsLog(out / "metrics.jsonl", None)
    with pytest.raises(runtime.RunFileError) as raised:
        for step in range(1000):
            log.write({"step": step, "padding": "x" * 3000})
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == log.lines > 0 and all(line.endswith("\n") and json.loads(line) for line in lines)
    assert re.fullmatch(rf"could not write {re.escape(str(out))}/metrics.jsonl: no space left on tmpfs \(mounted at "
                        rf"{re.escape(str(out))}\) for a row of \d+ bytes \(free [\d.]+ MB\)", str(raised.value))
    with pytest.raises(SystemExit) as stop:
        runtime._record_start(args, out, checkpoints.TrainerState(), log)
    assert re.fullmatch(rf"train.py: error: could not write {re.escape(str(out))}/args.json: no space left on "
                        r"tmpfs .+ for args.json of \d+ bytes \(free [\d.]+ MB\)", str(stop.value.code))
    assert (out / "args.json").read_text() == "{}" and sorted(p.name for p in out.iterdir()) == ["args.json",
                                                                                                  "metrics.jsonl"]


def test_an_idle_forward_runs_under_split_bf16(one_rank_group, base_model_dir):
    """A rank with no micro-batch left joins the others' collectives with a plain forward of a dummy row
    (runtime.idle_forward). Under --lm-head-gemm split-bf16 the head multiplied that forward's bf16 hidden states
    by its float32 weight as they were, and 'expected m1 and m2 to have the same dtype' killed the rank (found on
    two gloo ranks with uneven micro-batches). Its logits are float32's now, and its backward adds nothing."""
    args = flags.Args(dtype="bfloat16", lm_head_gemm="split-bf16")
    model, _ = train.build_learner(str(base_model_dir), args, torch.device("cpu"))
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.dtype == torch.float32 and logits.shape[-1] == model.config.vocab_size
    model.zero_grad(set_to_none=True)
    runtime.idle_forward(model, 0, backward=True)
    assert all(not p.grad.full_tensor().any() for p in model.parameters() if p.grad is not None)


def test_one_live_run_per_output_dir(tmp_path):
    held = runtime.lock_output_dir(tmp_path)
    with pytest.raises(runtime.OutputDirBusyError, match=f"pid {os.getpid()}"):
        runtime.lock_output_dir(tmp_path)  # flock conflicts between two open files, even in one process
    held.close()  # what the kernel does when the holder dies, whatever kills it
    runtime.lock_output_dir(tmp_path).close()


def test_a_planted_lock_link_or_fifo_is_refused_by_name(tmp_path, victim):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").symlink_to(victim)
    with pytest.raises(checkpoints.LinkRefusedError, match=f"{out / '.lock'} is a symbolic link"):
        runtime.lock_output_dir(out)
    assert victim.read_text() == "precious\n"
    (out / ".lock").unlink()
    os.mkfifo(out / ".lock")  # would block an open for writing: refused at once instead
    with pytest.raises(checkpoints.LinkRefusedError, match=f"{out / '.lock'} is not a regular file"):
        runtime.lock_output_dir(out)


def test_metrics_jsonl_is_never_read_or_written_through_a_planted_link(tmp_path, victim):
    path = tmp_path / "metrics.jsonl"
    path.symlink_to(victim)  # read, its target's text would be copied into the run directory
    with pytest.raises(checkpoints.LinkRefusedError, match=f"{path} is a symbolic link"):
        runtime.MetricsLog(path, keep_lines=0)
    path.unlink()
    log = runtime.MetricsLog(path, None)
    path.unlink()
    path.symlink_to(victim)  # swapped in while the run is going
    with pytest.raises(checkpoints.LinkRefusedError, match=f"{path} is a symbolic link"):
        log.write({"step": 0})
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("name", ["args.json", "metrics.jsonl", "scaling.png", "dashboard.png", "checkpoint",
                                  "checkpoint.old", "checkpoint.tmp"])
def test_claiming_a_run_directory_refuses_a_planted_link_by_name(tmp_path, victim, name):
    """Checked on rank 0 as the run takes its lock, so every rank stops with that one line before anything starts."""
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(victim)
    with pytest.raises(checkpoints.LinkRefusedError, match=f"{out / name} is a symbolic link"):
        runtime.refuse_planted_links(out)
    (out / name).unlink()
    runtime.refuse_planted_links(out)


def test_overwrite_with_bad_data_leaves_the_old_run_intact(tmp_path, one_rank_group, monkeypatch):
    """--overwrite checks first and deletes last: the data set is loaded (and fails) before anything is removed."""
    out = tmp_path / "run"
    saved_run(out)
    (out / "scaling.png").write_bytes(b"png")
    before = file_tree(out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?"}\n')
    args = flags.parse_args(["--output-dir", str(out), "--overwrite", "--dataset", str(bad)])
    monkeypatch.setattr(runtime, "init_distributed", lambda *_: (0, 1, torch.device("cpu")))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit), runtime.set_up(args):
            pass
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    after = file_tree(out)
    after.pop(".lock", None)
    assert after == before


def test_a_failed_start_removes_only_what_it_wrote(tmp_path, one_rank_group, monkeypatch):
    """A start that fails before its first metrics row removes the files it wrote, never one that was there before
    it: an args.json another run wrote after the checks passed, the empty metrics.jsonl and the .lock a killed start
    left. A directory the start made goes with them."""
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text("4242")
    (out / "metrics.jsonl").write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?"}\n')
    args = flags.parse_args(["--output-dir", str(out), "--dataset", str(bad)])
    assert set(runtime.REPORT_DIRS) < set(flags.RUN_FILES)  # the checks refuse every file of a run
    (out / "args.json").write_text('{"loss": "gspo"}')  # after the checks: not this start's
    monkeypatch.setattr(runtime, "init_distributed", lambda *_: (0, 1, torch.device("cpu")))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit), runtime.set_up(args):
            pass
        assert sorted(p.name for p in out.iterdir()) == [".lock", "args.json", "metrics.jsonl"]
        assert (out / "args.json").read_text() == '{"loss": "gspo"}' and (out / "metrics.jsonl").read_text() == ""
        fresh = tmp_path / "fresh"  # made by the start: removed with what it wrote
        with pytest.raises(SystemExit), runtime.set_up(flags.parse_args(["--output-dir", str(fresh), "--dataset",
                                                                          str(bad)])):
            pass
        assert not fresh.exists()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_metrics_and_args_are_rewritten_through_a_rename_and_gaps_are_named(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)))
    inode = path.stat().st_ino
    log = runtime.MetricsLog(path, keep_lines=3, covers_step=2)  # cut back to the checkpoint: a new file, renamed
    assert path.stat().st_ino != inode and log.lines == 3 and log.missing_steps == []
    monkeypatch.setattr(checkpoints.os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):  # killed while cutting: the file is as it was, no temporary is left
        runtime.MetricsLog(path, keep_lines=1, covers_step=0)
    assert len(path.read_text().splitlines()) == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    with pytest.raises(KeyboardInterrupt):
        flags.write_args_json(tmp_path, flags.Args(output_dir=str(tmp_path)), 0, [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    monkeypatch.undo()
    log = runtime.MetricsLog(path, keep_lines=7, covers_step=6)  # a file cut short behind the run's back
    assert log.lines == 3 and log.missing_steps == [3, 4, 5, 6]
    assert flags.step_ranges([3, 4, 5, 6, 9]) == [[3, 6], [9, 9]]


def test_a_second_ctrl_c_under_torchrun_is_named_as_such():
    """torchrun passes a first Ctrl-C on to the ranks as SIGINT and a second as SIGTERM: the second stops at once,
    in one line, named as the user's second Ctrl-C."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for first, second, label in ((signal.SIGINT, signal.SIGTERM, "second SIGINT"),
                                     (signal.SIGINT, signal.SIGINT, "second SIGINT"),
                                     (signal.SIGTERM, signal.SIGTERM, "second SIGTERM")):
            stopper = runtime.GracefulStop(announce=False)
            stopper._handle(first, None)
            with pytest.raises(SystemExit, match=f"^{label}: stopping at once"):
                stopper._handle(second, None)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_ctrl_c_while_waiting_for_a_remote_replica_stops_at_once(base_model_dir):
    """During the start a first Ctrl-C or SIGTERM was only noted, and the wait for remote replicas went on
    for up to --gen-join-timeout (600 s). Now the start's GracefulStop stops at once (a scheduler waiting for a
    remote replica that never comes: no vLLM starts)."""
    import threading

    from harness import tasks

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    config = pl.GeneratorConfig(model=str(base_model_dir),
                                fleet=pl.FleetConfig(replicas=0, remote_replicas=1, secret=b"x" * 32,
                                                     listen="127.0.0.2:0", join_timeout=600))
    gen = pl.Generator(config, tasks.ArithmeticTask())
    try:
        runtime.GracefulStop(announce=False, at_once=True)
        sent = []
        threading.Timer(2.0, lambda: (sent.append(time.monotonic()), os.kill(os.getpid(), signal.SIGINT))).start()
        with pytest.raises(SystemExit, match="^SIGINT during the start: stopped before the first step"):
            gen.start()
        # From the signal, not from the start (the generator process's own start may take seconds on a loaded
        # machine): well inside the join timeout that the wait ran to before, 600 s. On an idle 2-core machine the
        # stop (the generator process killed and reaped) took under a second; other tests' vLLM starts on the same
        # cores (make test's workers) stretch it, never to a tenth of that timeout.
        assert time.monotonic() - sent[0] < config.fleet.join_timeout / 10
        assert gen.pid is not None and not psutil_alive(gen.pid)  # the generator process is gone with it
    finally:
        gen.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def psutil_alive(pid: int) -> bool:
    import psutil

    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def test_other_ranks_leave_what_rank_0_reports_to_rank_0(monkeypatch, capsys):
    """A failed start printed its line on every rank, then rank 1's gloo traceback ("Connection closed by
    peer") once rank 0 had left. Off rank 0 both are a quiet exit with status 1; anything else still surfaces. An
    exit that rank 0 reports waits first for torchrun's SIGTERM (seen on CI: rank 1 left at once on a bad data row,
    and torchrun ended rank 0 before it had named the rows); a stop by a signal, or rank 0 gone, does not wait."""
    from harness import cli

    waits = []
    # rank 0 ended first
    monkeypatch.setattr(cli, "wait_for_a_signal", lambda seconds, until=None: waits.append(seconds) or True)
    monkeypatch.setattr(runtime.GracefulStop, "first_signal", None)
    monkeypatch.setenv("RANK", "1")
    for raised, code, waited in ((SystemExit("out is in use by another train.py"), 1, 1),
                                 (SystemExit(2), 2, 1),  # a status of its own is kept
                                 (RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:3254. This is"), 1, 0)):
        waits.clear()
        with pytest.raises(SystemExit) as exit_info, runtime.rank0_speaks():
            raise raised
        assert (exit_info.value.code, len(waits)) == (code, waited), raised
    assert waits == [] and cli.QUIET_RANK_GRACE_S >= 10
    monkeypatch.setattr(runtime.GracefulStop, "first_signal", "SIGINT")
    with pytest.raises(SystemExit) as exit_info, runtime.rank0_speaks():
        raise SystemExit("SIGINT during the start: stopped before the first step, nothing was trained")
    assert exit_info.value.code == 1 and waits == []
    with pytest.raises(SystemExit) as exit_info, runtime.rank0_speaks():
        raise SystemExit(0)
    assert exit_info.value.code == 0 and waits == []
    with pytest.raises(RuntimeError, match="a bug"), runtime.rank0_speaks():
        raise RuntimeError("a bug")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit, match="in use"), runtime.rank0_speaks():  # rank 0 says it
        raise SystemExit("out is in use by another train.py")
    assert capsys.readouterr().err == "" and waits == []


def test_a_rank_whose_error_rank_0_did_not_stop_on_says_it_with_its_rank_and_host(monkeypatch, capsys, tmp_path):
    """On two nodes, a --dataset that is on rank 0's node only: rank 1 stopped quietly, leaving the line to rank 0,
    and rank 0, which had read its file, waited in its first collective for the process group's timeout (over an
    hour) with nothing said anywhere. A node's first rank whose wait for torchrun's SIGTERM runs out (torchrun ends
    only rank 0's node's ranks) prints the line itself, with its rank and host; one whose wait a signal ended, and
    the node's other ranks, stay quiet. The same for an argument error, which every rank meets in parse_args."""
    from harness import cli

    signalled = []
    monkeypatch.setattr(cli, "wait_for_a_signal", lambda seconds, until=None: bool(signalled))
    monkeypatch.setattr(runtime.GracefulStop, "first_signal", None)
    monkeypatch.setenv("RANK", "1")
    for signalled[:] in ([], [True]):
        with pytest.raises(SystemExit) as exit_info, runtime.rank0_speaks():
            runtime._data(flags.Args(dataset=str(tmp_path / "missing.jsonl")), is_main=False)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2
        if signalled:
            assert err == ""
        else:
            assert err.startswith("train.py: error: ") and "missing.jsonl" in err, err
            assert f"[rank 1 on {socket.gethostname()}, 20 s on: where rank 0 has not stopped on the same" in err, err
        with pytest.raises(SystemExit) as exit_info:
            flags.parse_args(["--lr", "-1"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and ("--lr must be > 0" in err) == (not signalled), err
    monkeypatch.setenv("LOCAL_RANK", "1")  # the node's first rank says it, not each of its ranks
    with pytest.raises(SystemExit):
        flags.parse_args(["--lr", "-1"])
    assert capsys.readouterr().err == ""


@pytest.fixture
def agent_store(monkeypatch):
    """torchrun's agent store, the one the ranks join through, as a rank reaches it (MASTER_ADDR, MASTER_PORT; the
    test sets the rest of torchrun's environment), in a list: a test that empties it ends the store's server, as node
    0's torchrun gone."""
    from datetime import timedelta

    import torch.distributed as dist

    # port 0: a free one. The list is the store's only holder, so that emptying it ends the server
    held = [dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(held[0].port))
    yield held
    held.clear()


def test_ranks_waiting_to_join_read_the_line_of_one_that_stopped_before_it_joined(monkeypatch, tmp_path, agent_store):
    """Before the process group, through a real store as torchrun's agent keeps it: a rank that stops with an error
    line leaves it (cli.torchrun_error_file), and a rank waiting for the others to join stops on it at once (rank 0
    with that rank's line, host and rank, without the "[rank N on HOST ...]" its node adds; another quietly), where
    torch's set-up waited out its timeout. All ranks in: no stop. None coming: rank 0's line at the timeout. Outside
    torchrun, and once the process group is up, nothing is written or read."""
    from datetime import timedelta

    import torch.distributed as dist

    from harness import cli

    monkeypatch.setattr(runtime, "JOIN_POLL_S", 0.01)
    minute = timedelta(minutes=1)
    runtime.wait_for_every_rank(0, 2, minute)  # outside torchrun: no store asked, no wait
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    runtime.wait_for_every_rank(0, 1, minute)  # a world of one waits for nobody
    with pytest.raises(SystemExit) as exit_info:
        runtime.wait_for_every_rank(0, 3, timedelta(seconds=0.3))  # rank 0 in, the two others never come
    assert exit_info.value.code == ("train.py: error: 1 of 3 learner ranks joined within 0.3 s; the others never "
                                    "came: their nodes' torchrun output says why")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun's next attempt: a count of its own
    cli.start_store().add("joined", 1)  # rank 1 in
    runtime.wait_for_every_rank(0, 2, minute)  # rank 0 in: both, no stop

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setenv("RANK", "1")
    line = f"train.py: error: --model /m: no such directory (see --help) [rank 1 on {socket.gethostname()}, 20 s on: x]"
    cli.torchrun_error_file(SystemExit(line), 1)  # rank 1 stops in its flag checks, before the process group
    cli.torchrun_error_file(SystemExit("train.py: error: a later line"), 1)  # the first line stays
    assert json.loads((tmp_path / "error.json").read_text())["message"] == "train.py: error: a later line"
    with pytest.raises(SystemExit) as exit_info:
        runtime.wait_for_every_rank(0, 2, minute)
    assert exit_info.value.code == (f"train.py: error: learner rank 1 on {socket.gethostname()} stopped before the "
                                    "ranks could join (its torchrun's summary there says so too): --model /m: no such "
                                    "directory (see --help)")
    with pytest.raises(SystemExit) as exit_info:
        runtime.wait_for_every_rank(2, 3, minute)  # another rank waiting: quiet, rank 0 says it
    assert exit_info.value.code == 1

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # after the process group: the store is not written
    cli.torchrun_error_file(SystemExit(line), 1)
    assert not cli.start_store().check(["stopped"])


def test_ranks_that_find_node_0s_torchrun_gone_say_so_at_once(monkeypatch, tmp_path, capsys, agent_store):
    """Node 0's torchrun, which holds the store the ranks join through, gone (its node lost): a rank waiting for
    the others to join says so in one line (its node's first rank; the others quietly), where torch's traceback said
    "Failed to recv", and exits without waiting for the signal rank 0's exit would have brought; and a rank that then
    stops with an error finds no store at once, where torch's client retried its connect for a minute, printing C++
    frames at each try."""
    from datetime import timedelta

    from harness import cli

    port = agent_store[0].port
    for name, value in (("TORCHELASTIC_RESTART_COUNT", "0"), ("TORCHELASTIC_USE_AGENT_STORE", "True"), ("RANK", "2"),
                        ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    store = cli.start_store()
    monkeypatch.setattr(cli, "start_store", lambda: store)  # the waiting rank's connection, made while it was up
    monkeypatch.setattr(runtime, "JOIN_POLL_S", 0.01)
    # node 0's torchrun gone while this rank waits: its store's server stops, and the connection to it closes
    threading.Timer(0.3, agent_store.clear).start()
    waits = []  # no rank 0 left whose exit would bring torchrun's signal: no wait for it
    monkeypatch.setattr(cli, "wait_for_a_signal", lambda seconds, until=None: waits.append(seconds) or False)
    with pytest.raises(SystemExit) as exit_info, runtime.rank0_speaks():  # as train.py's ranks run it
        runtime.wait_for_every_rank(2, 3, timedelta(minutes=1))
    assert waits == []
    err = capsys.readouterr().err  # said here: rank 0, which speaks for the others, is gone
    assert exit_info.value.code == 1 and err.startswith(f"train.py: error: torchrun's store at 127.0.0.1:{port} went "
                                                        "away while the learner ranks were joining ("), err
    assert err.endswith("): the torchrun of node 0 there stopped, and its output says why\n"), err
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit) as exit_info:
        runtime.wait_for_every_rank(3, 3, timedelta(minutes=1))
    assert exit_info.value.code == 1 and capsys.readouterr().err == ""  # its node's first rank says it
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as exit_info:  # rank 0 (its node's torchrun gone, itself not yet): its own line
        runtime.wait_for_every_rank(0, 3, timedelta(minutes=1))
    assert exit_info.value.code.startswith("train.py: error: torchrun's store at ") and capsys.readouterr().err == ""

    monkeypatch.undo()
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                        ("TORCHELASTIC_USE_AGENT_STORE", "True"), ("TORCHELASTIC_ERROR_FILE", str(tmp_path / "e"))):
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    assert cli.start_store() is None
    cli.torchrun_error_file(SystemExit("train.py: error: a line"), 1)  # rank 0 stopping marks the store: none there
    assert time.monotonic() - started < 2 * cli.STORE_CONNECT_S  # refused at once: no minute of torch's retries


def test_a_rank_that_stops_before_joining_speaks_once_rank_0_has_joined(monkeypatch, capsys, agent_store):
    """A rank that stops on its own error before the ranks join (a --dataset that is not on this node) waited
    cli.QUIET_RANK_GRACE_S for a signal before it said so, and rank 0, waiting for the ranks to join, waited as long
    for its line. Through a real store as torchrun's agent keeps it: rank 0 counted in (it went past the check) ends
    the wait at once, with the line; rank 0 stopped with its own line, and neither, the wait runs out and the line
    says which. Another rank of the node waits for torchrun's signal as before, quietly."""
    from harness import cli

    for name, value in (("RANK", "1"), ("LOCAL_RANK", "0"), ("TORCHELASTIC_USE_AGENT_STORE", "True")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli, "QUIET_RANK_GRACE_S", 0.5)
    line = "train.py: error: --dataset /d.jsonl: no such file (see --help)"

    def stop(restart: int) -> tuple[float, str]:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))  # each case an attempt of its own
        started = time.monotonic()
        with pytest.raises(SystemExit) as exit_info:
            cli.quiet_rank_exit(2, message=line)
        assert exit_info.value.code == 2
        return time.monotonic() - started, capsys.readouterr().err

    waited, err = stop(0)  # rank 0 in no state yet: the wait runs out
    assert waited >= 0.5 and err == (f"{line} [rank 1 on {socket.gethostname()}, 0.5 s on: where rank 0 has not "
                                     "stopped on the same error, this node sees another file or setting than "
                                     "rank 0's]\n")
    monkeypatch.setattr(cli, "QUIET_RANK_GRACE_S", 60.0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    threading.Timer(0.2, cli.start_store().set, ("process/0", "[]")).start()  # rank 0 joins while this rank waits
    waited, err = stop(1)
    assert waited < 30.0 and err == (f"{line} [rank 1 on {socket.gethostname()}: rank 0 went past this check, so "
                                     "this node sees another file or setting than rank 0's]\n")
    monkeypatch.setattr(cli, "QUIET_RANK_GRACE_S", 0.5)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    cli.start_store().set("rank0-stopped", "1")  # rank 0 stopped and said why, on its node
    waited, err = stop(2)  # the wait for torchrun's signal is kept; this node's output still names the error
    assert waited >= 0.5 and err == (f"{line} [rank 1 on {socket.gethostname()}, 0.5 s on: rank 0 stopped too, its "
                                     "own line on its node]\n")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # rank 0 joined, but this node's first rank says it
    waited, err = stop(1)
    assert waited >= 0.5 and err == ""


def test_two_nodes_count_every_gpu_they_hold_and_a_second_nodes_ranks_take_its_every_gpu(monkeypatch):
    """An 8-GPU node of six replicas and two learner ranks, and a second 8-GPU node of eight learner ranks (ranks
    2..9): the run holds 16 GPUs, where only rank 0's node's were counted (8), and with them compute_hours, the
    scaling fit's x axis. The second node's ranks take its GPUs 0..7 (they took 6 and 7 of them, a rank on
    each, then 6 and 7 again). One node, and one GPU that a learner rank shares with a replica, count as before."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    fleet = pl.FleetConfig(replicas=6, remote_replicas=0)
    args = flags.Args(gen_devices="0,1,2,3,4,5")
    assert runtime._devices_in_use(args, 10, fleet, local_ranks=2) == 16
    assert runtime._devices_in_use(args, 2, fleet, local_ranks=2) == 8
    assert runtime._devices_in_use(dataclasses.replace(args, tensor_parallel_size=2), 2,
                                   pl.FleetConfig(replicas=3, remote_replicas=2, secret=b"x" * 32), local_ranks=2) == 12
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert runtime._devices_in_use(flags.Args(gen_devices="0"), 1, pl.FleetConfig(replicas=1), local_ranks=1) == 1

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(runtime.dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setenv("WORLD_SIZE", "10")
    placed = {}
    for rank, local_rank in (("0", "0"), ("1", "1"), ("2", "0"), ("8", "6"), ("9", "7")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        placed[int(rank)] = runtime.init_distributed("0,1,2,3,4,5")[2].index
    assert placed == {0: 6, 1: 7, 2: 0, 8: 6, 9: 7}


def test_a_cpu_ranks_threads_share_the_cores_it_may_use_with_its_nodes_ranks_alone(monkeypatch):
    """On CPU each rank's torch threads are the cores this process may use (its affinity, which a job scheduler
    narrows) over this node's learner ranks, plus the generator on rank 0's node. Every node's ranks were counted,
    and the machine's cores: two 16-core nodes of 4 ranks each got 1 thread a rank, where rank 0's node's ranks have
    3 and the other's 4; a job given 4 of a machine's 64 cores gave 21 threads to each of its 2 ranks."""
    monkeypatch.setattr(runtime.dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    threads = torch.get_num_threads()
    try:
        for cores, world, local, rank, local_rank, expected in ((16, 8, 4, 0, 0, 3), (16, 8, 4, 5, 1, 4),
                                                                (4, 2, 2, 1, 1, 1), (2, 2, 2, 0, 0, 1)):
            monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
            monkeypatch.setattr(runtime.os, "cpu_count", lambda: 64)
            for name, value in (("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", local), ("RANK", rank),
                                ("LOCAL_RANK", local_rank)):
                monkeypatch.setenv(name, str(value))
            runtime.init_distributed()
            assert torch.get_num_threads() == expected, (cores, world, local, rank)
    finally:
        torch.set_num_threads(threads)


def test_rank_0_names_a_dead_rank_and_where_to_resume_in_one_line(tmp_path, monkeypatch, one_rank_group):
    """A learner rank killed mid-step (the out-of-memory killer's SIGKILL prints nothing) left rank 0 with gloo's
    traceback, "Connection reset by peer" under forty lines of FSDP's frames. On rank 0 of several it is one line:
    another rank ended, where torchrun says how, what a SIGKILL most often is, and where --resume starts. A world of
    one has no peer rank, so the error stays the error; so does any other."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    gone = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:38611: Connection reset by peer. This is typically")
    with pytest.raises(SystemExit) as exit_info, runtime.rank0_speaks(tmp_path / "run"):
        raise gone
    line = str(exit_info.value.code)
    assert "another learner rank" in line and "(gloo: Connection reset by peer)" in line and "SIGKILL" in line
    assert line.endswith("no checkpoint was written yet: nothing to resume") and "\n" not in line
    saved_run(tmp_path / "run", steps=(4, 8))
    with pytest.raises(SystemExit) as exit_info, runtime.rank0_speaks(tmp_path / "run"):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:3254")
    resume = f"the newest checkpoint is step 8: continue with --resume {tmp_path / 'run'}"
    assert str(exit_info.value.code).endswith(resume)
    assert "its own output above, or torchrun's summary below, says how" in str(exit_info.value.code)
    with pytest.raises(SystemExit) as exit_info, runtime.rank0_speaks(tmp_path / "run"):  # a rank on another node
        raise RuntimeError("[pair.cc:537] Read error [10.0.3.7]:38611: Connection reset by peer. This is typically")
    assert "its own output and its torchrun's summary on that node (10.0.3.7) say how" in str(exit_info.value.code)
    with pytest.raises(RuntimeError, match="a bug"), runtime.rank0_speaks(tmp_path / "run"):
        raise RuntimeError("a bug")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match="reset by peer"), runtime.rank0_speaks(tmp_path / "run"):
        raise gone


RANK_DIES = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
from harness import runtime
from harness.vllm_replica import exit_at_once, report_exit

try:  # as train.py's ranks: in rank0_speaks, and out through report_exit
    with runtime.rank0_speaks(Path(sys.argv[1])):
        rank, _, _ = runtime.init_distributed()  # the process group, after the ranks have joined
        runtime.GracefulStop(announce=False)  # as mid-run: torchrun's SIGTERM to the others is noted, not fatal
        dist.all_reduce(torch.ones(4))
        if rank == int(sys.argv[2]) and sys.argv[3] == "line":
            raise SystemExit("train.py: error: rank 0 stops with a line of its own")
        if rank == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer ends a rank: nothing printed
        dist.all_reduce(torch.ones(4))
except (SystemExit, Exception) as stop:
    exit_at_once(report_exit(stop))
"""


@pytest.mark.parametrize("killed, who", [(1, "another learner rank's"), (0, "learner rank 0's"), (0, None)])
def test_a_rank_killed_under_torchrun_leaves_one_line_and_torchruns_summary(tmp_path, killed, who):
    """The real thing: two gloo ranks under torchrun, one SIGKILLed between two collectives, and gloo's error on the
    other is one of PEER_GONE. Rank 1 killed: rank 0 prints its one line and no traceback. Rank 0 killed (the likeliest
    victim of the out-of-memory killer: it loads the model and feeds the generator): no rank said anything, and now
    rank 1, on rank 0's node, says it. Rank 0 that stops with a line of its own (who None) is not killed: rank 1 stays
    quiet. torchrun's summary names the rank and the signal. (train.py's main runs in
    runtime.rank0_speaks(OUTPUT_DIR).)"""
    import subprocess

    from helpers import REPO, TORCHRUN

    script = tmp_path / "rank_dies.py"
    script.write_text(RANK_DIES.format(repo=str(REPO)))
    run = subprocess.run([*TORCHRUN, "--nproc_per_node", "2", str(script), str(tmp_path / "run"), str(killed),
                          "kill" if who else "line"], capture_output=True, text=True, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode != 0
    lines = [line for line in output.splitlines() if line.startswith("stopping: ")]
    if who is None:
        assert lines == [] and output.count("\ntrain.py: error: rank 0 stops with a line of its own") == 1, output
        return
    assert len(lines) == 1 and lines[0].startswith(f"stopping: {who} process ended in the middle of a collective "
                                                   "(gloo:"), output
    assert "nothing to resume" in lines[0] and "Signal 9 (SIGKILL)" in output, output
    assert f"rank      : {killed} (local_rank: {killed})" in output, output  # torchrun's summary: the rank it lost
    assert "work.wait()" not in output and f"[rank{1 - killed}]: Traceback" not in output, output


UNSHARED_DIR = """
import os, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
import torch.distributed as dist
from harness import runtime
from harness.vllm_replica import exit_at_once

dist.init_process_group("gloo")
rank, base = dist.get_rank(), Path(sys.argv[1])
runtime.refuse_unshared_output_dir(base / "shared", rank, 2, wait_s=1.0)
print(f"rank {{rank}} shared: passed", flush=True)
try:  # rank 1's own directory at the same path on its node: here, another directory
    runtime.refuse_unshared_output_dir(base / ("shared" if rank == 0 else "own"), rank, 2, wait_s=1.0)
except SystemExit as e:
    print(f"rank {{rank}} refused: {{e}}", flush=True)
dist.destroy_process_group()
exit_at_once()  # as train.py's ranks: a gloo thread can crash the interpreter's teardown (docs/runtime.md)
"""


def test_an_output_dir_that_is_not_one_directory_for_every_rank_is_refused_at_the_start(tmp_path):
    """Two gloo ranks under torchrun. Where both name one directory, the check passes and leaves nothing there.
    Where rank 1's --output-dir is a directory of its own (a node's local disk at the same path: here, another
    directory), every rank stops with the line naming rank 1, where training went on to the first checkpoint and
    failed there on rank 0's "shard-00002-... is missing"."""
    import subprocess

    from helpers import REPO, TORCHRUN

    script = tmp_path / "unshared_dir.py"
    script.write_text(UNSHARED_DIR.format(repo=str(REPO)))
    for name in ("shared", "own"):
        (tmp_path / name).mkdir()
    run = subprocess.run([*TORCHRUN, "--nproc_per_node", "2", str(script), str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "rank 0 shared: passed" in output and "rank 1 shared: passed" in output, output
    for rank, name in ((0, "shared"), (1, "own")):  # (rank 0's line is the one train.py prints)
        assert (f"rank {rank} refused: train.py: error: --output-dir {tmp_path / name} is not one directory for "
                f"every rank: rank 1 (on {socket.gethostname()}) did not see the file rank 0") in output, output
    assert os.listdir(tmp_path / "shared") == [] and os.listdir(tmp_path / "own") == []  # rank 0 removed its file


def test_an_output_dir_check_on_one_rank_writes_nothing(tmp_path):
    runtime.refuse_unshared_output_dir(tmp_path, 0, 1)
    assert os.listdir(tmp_path) == []


def test_a_quiet_ranks_wait_ends_on_torchruns_signal_and_puts_the_handlers_back():
    """The wait of cli.quiet_rank_exit: a SIGTERM (torchrun's, once rank 0 has exited) ends it at once, even when
    another thread receives the signal; without one it lasts its time; the handlers in place before are restored."""
    from harness import cli

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        started = time.monotonic()
        assert cli.wait_for_a_signal(60.0) is True
        assert time.monotonic() - started < 30.0  # ended by the signal, not by its 60 s
        started = time.monotonic()
        assert cli.wait_for_a_signal(0.3) is False and time.monotonic() - started >= 0.3
        os.kill(os.getpid(), signal.SIGTERM)  # the handler in place before is back
        deadline = time.monotonic() + 10.0
        while not seen and time.monotonic() < deadline:  # Python runs a handler between bytecodes, on the main thread
            time.sleep(0.01)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_resume_on_data_that_changed_since_the_run_started_is_one_line(tmp_path, one_rank_group, capsys,
                                                                         monkeypatch):
    """A run resumed after its data file was edited (a row changed, rows added) trained on: its checkpoint's data
    position and prompt history then pointed at other problems, and its validation set changed mid-run, without a
    word. The checkpoint keeps the digest of the problems the run started with; a resume on others is one line, exit
    2, said as the data is read (set_up), before the learner is built and the checkpoint loaded, and again after
    the load for the checkpoint the ranks agreed on. The same data resumes; a checkpoint from before the digest
    takes today's; generated tasks have none."""
    import types

    from harness import checkpoints

    data = tmp_path / "data.jsonl"
    rows = [{"question": f"What is {i} + 2?", "answer": str(i + 2)} for i in range(30)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    started = tasks.data_digest(tasks.load_task(str(data)))
    assert len(started) == 64 and tasks.data_digest(tasks.load_task(None), None) == ""
    out = tmp_path / "run"
    model, optimizer = saved_run(out, steps=(1,))
    checkpoints.save_checkpoint(out, model, optimizer, {"step": 2, "metrics_lines": 3, "data_digest": started},
                                rank=0)
    scheduler = types.SimpleNamespace(step=lambda: None)
    learner = types.SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler)
    args = flags.Args(output_dir=str(out), resume=str(out), dataset=str(data))
    assert runtime._resumed_state(args, out, learner, 0, started).data_digest == started
    rows[7]["answer"] = "10"  # a reference fixed in place
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    changed = tasks.data_digest(tasks.load_task(str(data)))
    assert changed != started
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        runtime._resumed_state(args, out, learner, 0, changed)
    assert stop.value.code == 2
    assert capsys.readouterr().err == (f"train.py: error: --resume {out}: the run's data changed since it started "
                                       f"(--dataset {data}): its checkpoint's data position and its validation would "
                                       "point at other problems; restore the data as it was, or start a new run "
                                       "(another --output-dir)\n")
    monkeypatch.setattr(runtime, "init_distributed", lambda *_: (0, 1, torch.device("cpu")))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as stop, runtime.set_up(args):
            pytest.fail("set_up yielded: the learner is built and the checkpoint read before the refusal")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert stop.value.code == 2 and "the run's data changed since it started" in capsys.readouterr().err
    checkpoints.save_checkpoint(out, model, optimizer, {"step": 3, "metrics_lines": 4}, rank=0)  # an older format
    assert runtime._resumed_state(args, out, learner, 0, changed).data_digest == changed
    assert runtime._resumed_state(flags.Args(output_dir=str(out)), out, learner, 0, changed).step == 0  # a new run


def test_a_test_set_that_shares_problems_with_the_training_set_is_named_in_a_warning(tmp_path, capsys):
    """--test-dataset naming --dataset's own file (or a file sharing its rows): its test_* metrics measured the
    problems the run trains on, without a word. Now a warning with the count; a test set held out gets none. A
    data file that repeats rows gets one for its validation, which holds some of its training problems then."""
    rows = [{"question": f"What is {i} + 2?", "answer": str(i + 2)} for i in range(40)]
    train_file, test_file = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows[:30]))
    test_file.write_text("".join(json.dumps(r) + "\n" for r in rows[30:]))
    runtime._data(flags.Args(dataset=str(train_file), test_dataset=str(train_file)), is_main=True)
    assert capsys.readouterr().err == ("train.py: warning: 24 of the 30 --test-dataset problems are also training "
                                       "problems of --dataset: the test_* metrics measure problems the run trains on, "
                                       "not held out ones\n")  # 24: the 6 of the 30 held out for validation are not
    runtime._data(flags.Args(dataset=str(train_file), test_dataset=str(test_file)), is_main=True)
    assert capsys.readouterr().err == ""
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows[:30] * 2))  # each row twice
    runtime._data(flags.Args(dataset=str(train_file)), is_main=True)
    warning = capsys.readouterr().err
    assert re.fullmatch(r"train.py: warning: (\d+) of the 12 validation problems are also training problems of "
                        r"--dataset: the val_\* metrics measure problems the run trains on, not held out ones\n",
                        warning) and int(warning.split()[2]) > 0, warning


def test_a_data_set_too_small_to_hold_out_a_validation_is_one_line(tmp_path, monkeypatch):
    """A data file of 4 rows: a fifth held out for validation is none, and the run's first evaluation, after vLLM's
    start, ended in a ZeroDivisionError traceback. Now one line as the data set is read (run and evaluate)."""
    data = tmp_path / "four.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 2?", "answer": str(i + 2)}) + "\n"
                            for i in range(4)))
    with pytest.raises(tasks.DataFileError) as error:
        runtime.load_tasks(flags.Args(dataset=str(data)))
    assert str(error.value) == (f"--dataset {data}: its 4 problems leave none to hold out for validation (a fifth "
                                "is): give at least 5")
    monkeypatch.setattr(pl.Generator, "start", lambda self: pytest.fail("the generator started"))
    with pytest.raises(SystemExit) as stop:
        train.main(["evaluate", "--dataset", str(data)])
    assert str(stop.value) == f"train.py evaluate: error: {error.value}"
    data.write_text(data.read_text() + json.dumps({"question": "What is 9 + 2?", "answer": "11"}) + "\n")
    task, _ = runtime.load_tasks(flags.Args(dataset=str(data)))
    assert len(task.validation(None)) == 1 and len(task.problems) == 4


def test_a_checkpoint_or_a_file_given_as_the_run_is_named_with_the_run_to_give(tmp_path, capsys,
                                                                                one_rank_group):
    """--resume RUN/checkpoint (or export's RUN_DIR so) said "no complete checkpoint there" and advised starting it
    afresh with --output-dir RUN/checkpoint --overwrite, a run inside the old one's checkpoint; a file said "holds no
    run". Each now names what it is and the run's directory to give."""
    from harness import commands

    run = tmp_path / "run"
    saved_run(run)
    for given in (run / "checkpoint", run / "checkpoint.old"):
        with pytest.raises(SystemExit) as stop:
            flags.parse_args(["--resume", str(given)])
        assert stop.value.code == 2
        assert capsys.readouterr().err.endswith(f"error: --resume {given} is a checkpoint of the run {run}: give the "
                                                "run's directory (see --help)\n")
        with pytest.raises(SystemExit) as stop:
            commands.export(given, tmp_path / "out")
        assert str(stop.value) == f"export: {given} is a checkpoint of the run {run}: give the run's directory"
    with pytest.raises(SystemExit) as stop:
        commands.export(run / "args.json", tmp_path / "out")
    assert str(stop.value) == f"export: {run / 'args.json'} is a file: give the run's directory"
    with pytest.raises(SystemExit):
        flags.parse_args(["--resume", str(run / "metrics.jsonl")])
    assert f"--resume {run / 'metrics.jsonl'} is a file: give the run's directory" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
