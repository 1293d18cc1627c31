"""The command lines, fuzzed: every flag of train.py, `pipeline_rl.py replica`, scaling_fit.py, tools/bench.py,
tools/experiments.py and tools/teach.py, given out-of-range, wrong-type and empty values, is either accepted or
refused with exit status 2 and one error line that names it: no usage block above it, never a traceback. Parse and
check only, in-process: nothing trains, connects, fits or writes. And a closed stdout (`| head`) ends a command
quietly, while a broken pipe of another kind keeps its traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline_rl
import scaling_fit
from harness import base_model, flags, tasks, vllm_replica
from tools import bench, experiments, teach

REPO = Path(__file__).resolve().parent.parent
# wrong types, empty and blank values, out-of-range and non-finite numbers, malformed lists, a NUL byte
FUZZ = ["", " ", "abc", "-1", "0", "-5", "1.5", "nan", "inf", "-inf", "1e309", "99999999999999999999", "1,x", "0,0",
        "5,1", "\x00"]


def value_flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options of `parser` that take a value (not --help, not the switches)."""
    return [a for a in parser._actions if a.option_strings and a.nargs != 0 and a.dest != "help"]


def outcome(parse, argv: list[str], capsys) -> str | None:
    """None when `parse(argv)` accepts the command line; else its one error line, after checking that the refusal is
    exit status 2 and that the error line is all it printed: no usage block, no traceback."""
    try:
        parse(argv)
    except SystemExit as stop:
        err = capsys.readouterr().err
        assert stop.code == 2 and one_error_line(err), (argv, stop.code, err)
        return err.strip()
    capsys.readouterr()
    return None


def one_error_line(err: str) -> bool:
    """`err` is one line, "PROG: error: ...": what cli.OneLineParser prints, without argparse's usage block."""
    lines = err.strip().splitlines()
    return len(lines) == 1 and ": error: " in lines[0] and "usage:" not in err and "Traceback" not in err


def fuzz(parse, parser: argparse.ArgumentParser, capsys, before: list[str] = (), after: list[str] = ()) -> dict:
    """Every value of FUZZ given to every flag of `parser` (as --flag=VALUE, so that '-5' is a value): each is
    accepted or refused in one line naming the flag. Returns {(flag, value): error line or None}."""
    seen = {}
    for action in value_flags(parser):
        flag = max(action.option_strings, key=len)
        for value in FUZZ:
            values = [value] * action.nargs if isinstance(action.nargs, int) else [value]
            argv = [*before, f"{flag}={values[0]}", *values[1:], *after] if len(values) == 1 else \
                [*before, flag, *values, *after]
            line = outcome(parse, argv, capsys)
            assert line is None or flag in line, (argv, line)
            seen[flag, value] = line
    return seen


def train_flags(argv: list[str]) -> flags.Args:
    """train.py's flags as its main parses them: the rule's settings checked by pipeline_rl.config_problems, --loss
    and --loss-arg against its loss table."""
    from train import LOSSES

    return flags.parse_args(argv, generator_checks=pipeline_rl.config_problems, losses=LOSSES)


def train_plan(argv: list[str]) -> str:
    """`train.py plan`, as its main calls it: the rule's settings checked by pipeline_rl.config_problems."""
    from train import LOSSES

    return flags.plan(argv, generator_checks=pipeline_rl.config_problems, losses=LOSSES)


def test_every_train_flag_is_accepted_or_refused_in_one_line_naming_it(tmp_path, monkeypatch, capsys):
    from train import LOSSES  # the parser as train.py builds it, checking --loss and --loss-arg against its table

    monkeypatch.chdir(tmp_path)  # --output-dir's default, runs/default, is made here if ever
    assert outcome(train_flags, [], capsys) is None  # the defaults pass
    seen = fuzz(train_flags, flags.build_parser(LOSSES), capsys)
    refused = {key for key, line in seen.items() if line is not None}
    # flags with a documented range refuse what lies outside it
    for flag in ("--max-steps", "--prompts-per-step", "--group-size", "--answer-budget", "--max-tokens",
                 "--eval-every", "--eval-samples", "--eval-prompts", "--log-every", "--checkpoint-every",
                 "--micro-batch-tokens", "--max-bad-steps", "--tensor-parallel-size", "--overlong-cache",
                 "--final-eval-samples", "--logits-chunk-tokens", "--gen-threads"):
        assert {(flag, v) for v in ("0", "-5", "abc", "1.5", "")} <= refused, flag
    for flag in ("--temperature", "--lr", "--adam-eps", "--grad-clip", "--gen-join-timeout", "--peak-tflops",
                 "--gen-memory-fraction"):
        assert {(flag, v) for v in ("0", "-5", "nan", "inf", "1e309", "abc", "")} <= refused, flag
    for flag in ("--kl-coef", "--weight-decay", "--retire-pass-rate", "--tis-cap-min", "--buffer-steps",
                 "--warmup-steps", "--seed", "--max-off-policy", "--gen-remote-replicas"):
        assert {(flag, v) for v in ("-5", "abc", "")} <= refused, flag
    for flag in ("--retire-pass-rate", "--gen-memory-fraction"):
        assert (flag, "1.5") in refused
    for flag in ("--model", "--dataset", "--test-dataset", "--output-dir", "--resume", "--gen-secret-file",
                 "--gen-devices", "--think-budget", "--gen-listen", "--loss-arg", "--question-field", "--weight-dir"):
        assert {(flag, v) for v in ("", " ", "\x00")} <= refused, flag
    assert ("--seed", "99999999999999999999") in refused and ("--debug-gen-slowdown", "1e309") in refused
    assert seen["--group-size", "0"] == "train.py: error: --group-size must be >= 1 (got 0) (see --help)"


@pytest.mark.parametrize("listen", ["0:29655", "[::0]:29655", "000.0.0.0:29655", ":29655", "0.0.0.0:29655",
                                    "[::]:29655"])
def test_every_spelling_of_a_wildcard_listen_address_is_one_line(listen, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = outcome(flags.parse_args, ["--gen-listen", listen], capsys)
    assert line == f"train.py: error: --gen-listen {listen}: name the address the replicas reach this node at, not " \
                   "a wildcard (only that address is bound) (see --help)"


def test_every_replica_flag_is_checked_before_it_connects(tmp_path, monkeypatch, capsys):
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    monkeypatch.setattr(vllm_replica, "connect_to_generator", lambda *a, **k: pytest.fail("connected"))
    required = ["--connect", "127.0.0.1:29655", "--secret-file", str(secret)]
    assert outcome(vllm_replica.replica_args, required, capsys) is None
    seen = fuzz(vllm_replica.replica_args, vllm_replica.replica_parser(), capsys, after=required)
    for flag in ("--replicas", "--tensor-parallel-size"):
        assert {(flag, v) for v in ("0", "-5", "abc", "1.5")} <= {k for k, line in seen.items() if line}
    for value in ("0", "-5", "nan", "inf", "abc"):
        assert seen["--connect-timeout", value]
    for argv, message in ((["--connect", "nohost"], "--connect: expected HOST:PORT"),
                          (["--connect", "h:70000"], "--connect: port 70000"),
                          (["--connect", ":5000"], "--connect: no host in ':5000': give the address of the run's "
                                                   "generator node, as train.py --gen-listen names it"),
                          (["--secret-file", str(tmp_path / "none")], "--secret-file: secret file"),
                          (["--gen-devices", "0,1,2", "--tensor-parallel-size", "2"], "--gen-devices 0,1,2: 3")):
        line = outcome(vllm_replica.replica_args, [*required, *argv], capsys)
        assert line and message in line, (argv, line)


def test_every_scaling_fit_flag_is_accepted_or_refused_in_one_line(tmp_path, capsys):
    parser = scaling_fit.build_parser()
    seen = fuzz(parser.parse_args, parser, capsys, before=[str(tmp_path)])
    for flag, values in (("--bootstrap", ("-5", "abc", "1.5")), ("--record-bins", ("-1", "abc")),
                         ("--seed", ("-1", "abc")), ("--min-compute", ("-5", "nan", "inf", "abc")),
                         ("--fit-until", ("-5", "nan", "inf")), ("--out", ("", " ")), ("--x", ("abc",))):
        assert all(seen[flag, v] for v in values), flag


@pytest.mark.parametrize("module", [bench, experiments], ids=["bench", "experiments"])
def test_every_bench_and_experiment_flag_is_accepted_or_refused_in_one_line(module, capsys):
    parser = module.build_parser()
    [subparsers] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sub in subparsers.choices.items():
        positional = ["runs/x"] if name == "report" else []
        seen = fuzz(parser.parse_args, sub, capsys, before=[name, *positional])
        for flag in ("--repeats", "--steps", "--prompts", "--groups", "--group-size", "--points"):
            if any(key[0] == flag for key in seen):
                assert all(seen[flag, v] for v in ("0", "-5", "abc", "1.5")), (name, flag)
        for flag in ("--seeds", "--ks", "--at-steps", "--completion-tokens"):
            if any(key[0] == flag for key in seen):
                assert all(seen[flag, v] for v in ("-5", "abc", "1,x", "")), (name, flag)
        for flag in ("--seeds", "--ks", "--at-steps"):  # a seed, k or cut given twice would count one run twice
            if any(key[0] == flag for key in seen):
                assert seen[flag, "0,0"] and "0 given twice (got '0,0')" in seen[flag, "0,0"], (name, flag)
        if name == "study":
            line = outcome(parser.parse_args, ["study", "--variants", "scalerl,dapo,scalerl"], capsys)
            assert line and "--variants: scalerl given twice" in line, line


def test_every_teach_flag_is_accepted_or_refused_in_one_line(tmp_path, capsys):
    parser = teach.build_parser()
    for argv in (["exercise", "nosuch", str(tmp_path)], ["exercise", "grpo", ""], ["grade", "grpo", " "],
                 ["pictures", "--out="], ["pictures", "--out", "\x00"], ["nosuch"]):
        assert outcome(parser.parse_args, argv, capsys), argv
    assert outcome(parser.parse_args, ["exercise", "grpo", str(tmp_path)], capsys) is None


@pytest.mark.parametrize("module", [tasks, base_model], ids=["tasks", "base_model"])
def test_every_task_and_base_model_flag_is_accepted_or_refused_in_one_line(module, capsys):
    """`python -m harness.tasks` and `python -m harness.base_model`: --samples 0 or --val-prompts 0 was taken, and
    build-base failed on it after its seven-minute build; counts and the temperature now refuse in one line."""
    parser = module.build_parser()
    [subparsers] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sub in subparsers.choices.items():
        required = ["--model", "m", "--dataset", "d", "--out", "o"] if name == "sample" else []  # a fuzzed one wins
        seen = fuzz(parser.parse_args, sub, capsys, before=[name, *required])
        for flag in ("--samples", "--max-tokens", "--val-prompts", "--max-new-tokens"):
            if any(key[0] == flag for key in seen):
                assert all(seen[flag, v] for v in ("0", "-5", "abc", "1.5")), (name, flag)
        if name == "sample":
            assert all(seen["--temperature", v] for v in ("-5", "nan", "inf", "abc"))


def test_a_figure_flag_takes_only_a_kind_of_file_matplotlib_writes(capsys):
    """`scaling_fit.py RUN --out fit.txt` fitted, then ended in matplotlib's ValueError traceback; a study's --figure
    would have done so after its runs. Each figure flag now refuses such a name in one line, before any work."""
    parser = scaling_fit.build_parser()
    for value in ("fit.txt", "fit", "fit.png.bak"):
        line = outcome(parser.parse_args, ["run", "--out", value], capsys)
        assert line and "--out: expected a figure file ending in .png, .pdf, .svg" in line, line
    assert outcome(parser.parse_args, ["run", "--out", "fit.PDF", "--dashboard", "d.svg"], capsys) is None
    line = outcome(parser.parse_args, ["run", "--dashboard", "d.html"], capsys)
    assert line and "--dashboard: expected a figure file" in line, line
    parser = experiments.build_parser()
    for name in ("study", "staleness"):
        line = outcome(parser.parse_args, [name, "--figure", "f.doc"], capsys)
        assert line and "--figure: expected a figure file" in line, line
        assert outcome(parser.parse_args, [name, "--figure", "docs/f.png"], capsys) is None


def test_a_file_written_after_the_work_is_checked_before_it(tmp_path, capsys):
    """`tools/bench.py ... --json runs/bench/x.json` wrote its results once the benchmark had run, and a directory
    not there yet (or a directory given as the file) ended in a traceback then, the measurement lost. Each such flag
    now refuses a directory or a path under a file in one line, and the write makes the file's directory."""
    from harness.cli import write_output

    (tmp_path / "a_file").write_text("")
    checked = 0
    for prog, parser in entry_point_parsers():
        for action in parser._actions:
            if action.dest not in ("json", "profile", "summary") and not (prog.endswith("sample")
                                                                         and action.dest == "out"):
                continue
            for value, why in ((str(tmp_path), "is a directory; expected a file to write"),
                               (str(tmp_path / "a_file" / "x.json"), f"lies under {tmp_path / 'a_file'}, a file")):
                with pytest.raises(argparse.ArgumentTypeError, match=why):
                    action.type(value)
            assert action.type(str(tmp_path / "new" / "x.json")) == str(tmp_path / "new" / "x.json")
            checked += 1
    assert checked == 6, checked  # bench's three --json and --profile, tasks sample's --out, a study's --summary
    write_output(tmp_path / "new" / "deeper" / "x.json", "{}\n")
    assert (tmp_path / "new" / "deeper" / "x.json").read_text() == "{}\n"


def test_a_directory_written_into_is_refused_where_a_file_is(tmp_path):
    """`python -m tools.teach pictures --out FILE` ended in mkdir's FileExistsError traceback, `exercise grpo FILE`
    in "[Errno 17] File exists"; a study's --out-dir would have failed so after its first run. Each directory flag
    now refuses a file in its place, or on its way, in one line."""
    (tmp_path / "a_file").write_text("")
    checked = []
    for prog, parser in entry_point_parsers():
        for action in parser._actions:
            if action.dest in ("dir", "out_dir", "records", "save_records") or (prog.endswith("pictures")
                                                                               and action.dest == "out"):
                for value in (tmp_path / "a_file", tmp_path / "a_file" / "below"):
                    with pytest.raises(argparse.ArgumentTypeError, match=f"{tmp_path / 'a_file'} is a file; "
                                                                         "expected a directory"):
                        action.type(str(value))
                assert action.type(str(tmp_path / "new" / "dir")) == tmp_path / "new" / "dir"
                checked.append((prog, action.dest))
    assert len(checked) == 7, checked  # exercise's and grade's DIR, pictures' --out, report's --save-records,
    # staleness's --out-dir, the study's --out-dir and --records (train.py's --output-dir: check_args says it)


def entry_point_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every parser and subparser of every entry point: train.py (run and plan), `pipeline_rl.py replica`,
    scaling_fit.py, tools/bench.py, tools/experiments.py, tools/teach.py, harness/tasks.py, harness/base_model.py."""
    from train import LOSSES

    found = [("train.py", flags.build_parser(LOSSES)), ("replica", vllm_replica.replica_parser()),
             ("scaling_fit.py", scaling_fit.build_parser())]
    for module in (bench, experiments, teach, tasks, base_model):
        parser = module.build_parser()
        [subparsers] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        found += [(f"{module.__name__} {name}", sub) for name, sub in subparsers.choices.items()]
    return found


def test_every_flags_help_gives_its_default_once_and_never_none():
    """train.py --help read "--model ... (default: the embedded tiny model ...) (default: None)": argparse's formatter
    added a second default, None, to 28 flags whose help gave their own or had none to give (a required flag too).
    Every help line of every entry point now gives a default at most once, and never None."""
    import re

    for prog, parser in entry_point_parsers():
        text = re.sub(r"\s+", " ", parser.format_help())
        assert "(default: None)" not in text, prog
        for action in parser._actions:
            if action.help:
                shown = parser._get_formatter()._expand_help(action)  # its help, a default added or not
                assert shown.count("(default") <= max(1, action.help.count("(default")), (prog, action.dest, shown)


# The last word of a flag's name that makes it a path (--output-dir, --gen-secret-file, --save-records, ...)
PATH_WORDS = {"dir", "out", "file", "path", "paths", "model", "dataset", "records", "json", "profile", "figure",
              "resume", "pairs", "dashboard", "runs"}


def test_every_path_flag_reads_a_tilde_as_the_home_directory(tmp_path, monkeypatch, capsys):
    """`--output-dir=~/runs/a`: the shell leaves ~ as it is after `=` (it expands `--output-dir ~/runs/a`), and the
    run was made in a directory named ~ under the current one. Every path flag of every entry point now reads a
    leading ~ as the home directory (harness/cli.path_text); a flag named as a path without that type fails here."""
    from harness.cli import directory_path, figure_path, output_file, path_text, path_value

    path_types = (path_text, path_value, directory_path, figure_path, output_file)

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    checked = []
    for prog, parser in entry_point_parsers():
        for action in parser._actions:
            if action.nargs == 0 or action.dest == "help" or isinstance(action, argparse._SubParsersAction):
                continue
            if action.dest.split("_")[-1] in PATH_WORDS:
                assert action.type in path_types, (prog, action.dest, action.type)
            if action.type in path_types:
                assert str(action.type("~/x.png")) == str(tmp_path / "home" / "x.png"), (prog, action.dest)
                checked.append((prog, action.dest))
    assert len(checked) >= 25, checked
    monkeypatch.chdir(tmp_path)
    args = train_flags(["--output-dir=~/runs/a", "--max-steps", "3"])
    assert args.output_dir == str(tmp_path / "home" / "runs" / "a") and not (tmp_path / "~").exists()


@pytest.mark.parametrize("argv, message", [
    (["train.py", "--gen-join-timeout", "-5"], "train.py: error: --gen-join-timeout must be a number of seconds > 0"),
    (["pipeline_rl.py", "replica", "--connect", "h:1", "--secret-file", "x", "--replicas", "0"],
     "error: argument --replicas: must be >= 1 (got 0)"),
    (["scaling_fit.py", "x", "--bootstrap", "-1"], "error: argument --bootstrap: must be >= 0 (got -1)"),
    (["-m", "tools.experiments", "staleness", "--ks", "1,x"],
     "error: argument --ks: expected comma-separated integers"),
    (["-m", "tools.teach", "exercise", "grpo", ""], "error: argument DIR: expected a value, got ''"),
    (["-m", "tools.teach", "nosuch"], "python -m tools.teach: error: argument command: invalid choice: 'nosuch'"),
    (["-m", "tools.bench"], "python -m tools.bench: error: the following arguments are required: BENCHMARK"),
    (["pipeline_rl.py", "nosuch"], "pipeline_rl.py: error: its one command is `pipeline_rl.py replica"),
    (["-m", "harness.base_model", "build-base", "--nosuch"],
     "python -m harness.base_model: error: unrecognized arguments: --nosuch"),
    (["-m", "harness.base_model", "build-base", "--cpu-kernels", "native"],
     "python -m harness.base_model: error: --cpu-kernels native builds another base than the cached one"),
    (["train.py", "--loss", "ppo"], "train.py: error: argument --loss: invalid choice: 'ppo' (choose from 'grpo', "
                                    "'dapo', 'drgrpo', 'gspo', 'cispo')"),
    (["train.py", "--loss", "gspo", "--aggregation", "token"], "--aggregation: gspo.compute_loss takes no aggregation"),
    (["train.py", "plan", "--shape", "qwen3-8b", "--loss-arg", "eps=1"], "--loss-arg eps: cispo.compute_loss has no "
                                                                       "such hyper-parameter"),
    (["train.py", "export"], "train.py export: error: the following arguments are required: RUN_DIR, OUT_DIR"),
    (["train.py", "export", "a", "b", "c"], "train.py export: error: unrecognized arguments: c"),
    (["train.py", "migrate-checkpoint", "--nosuch"], "train.py migrate-checkpoint: error: the following arguments "
                                                     "are required: RUN_DIR"),
])
def test_the_real_entry_points_refuse_in_one_line(argv, message, tmp_path):
    """The same refusals through each script's own entry point, as a user meets them: status 2, and the one error line
    is all it prints (no usage block)."""
    command = argv if argv[0] == "-m" else [str(REPO / argv[0]), *argv[1:]]  # -m harness.X: the package's entry points
    # Without the caller's SCALERL_CACHE: `build-base --cpu-kernels native` refuses only where the cache is the default.
    env = {**{k: v for k, v in os.environ.items() if k != "SCALERL_CACHE"}, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, *command], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and one_error_line(run.stderr) and message in run.stderr, run.stderr[-2000:]


def test_train_plan_checks_what_the_plan_divides_by(capsys):
    """train.py plan checks no machine, but the flags' own ranges hold everywhere: --learner-ranks 0 or --group-size 0
    divided by zero, --gpu-memory-gib nan failed to convert; each is now one line naming its flag."""
    from harness import memory_plan

    shape = ["--shape", sorted(memory_plan.SHAPES)[0]]
    for argv, flag in ((["--learner-ranks", "0"], "--learner-ranks"), (["--gpu-memory-gib=nan"], "--gpu-memory-gib"),
                       (["--gpu-memory-gib", "-5"], "--gpu-memory-gib"), (["--gpus", "0"], "--gpus"),
                       (["--group-size", "0"], "--group-size"), (["--micro-batch-tokens", "0"], "--micro-batch-tokens"),
                       (["--gen-devices", "3", "--gpus", "1"], "--gen-devices"), (["--max-steps", "x"], "--max-steps")):
        line = outcome(train_plan, [*shape, *argv], capsys)
        assert line and flag in line, (argv, line)
    assert outcome(train_plan, [*shape, "--max-tokens", "14336", "--think-budget", "10240,12288"], capsys) is None


# ------------------------------------------------------------------------------------------------ a closed stdout


def _closed_reader(command: list[str], cwd: Path) -> tuple[int, str]:
    """Run `command` with its stdout's reader gone before the first line (`| head -0`): its status and stderr."""
    proc = subprocess.Popen([sys.executable, *command], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    proc.stdout.close()
    stderr = proc.stderr.read()
    return proc.wait(timeout=120), stderr


def test_a_reader_that_stops_reading_ends_train_py_quietly():
    """`train.py --help-markdown | head -0`: status 1 and nothing on stderr (harness/vllm_replica.report_exit, through
    harness/cli.quiet_if_reader_gone), where it ended in a BrokenPipeError traceback. Its 15 kB overflow print's buffer,
    so a print meets the closed pipe, not only the exit's flush."""
    status, stderr = _closed_reader([str(REPO / "train.py"), "--help-markdown"], REPO)
    assert status == 1 and stderr == "", stderr


def test_a_broken_pipe_that_is_not_stdouts_keeps_its_traceback(tmp_path):
    """harness/cli.exit_with is quiet only when stdout's reader is gone: a BrokenPipeError of another pipe (a child
    process that died) is an error to show, with its traceback, whether stdout is open or a file."""
    script = tmp_path / "child_died.py"
    script.write_text("import subprocess, sys\nfrom harness.cli import exit_with\n\n\ndef main():\n"
                      "    child = subprocess.Popen([sys.executable, '-c', ''], stdin=subprocess.PIPE)\n"
                      "    child.wait()\n    print('reading')\n    child.stdin.write(b'x' * 1_000_000)\n\n\n"
                      "exit_with(main)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stdout == "reading\n", run
    assert run.stderr.rstrip().endswith("BrokenPipeError: [Errno 32] Broken pipe"), run.stderr


def test_torchruns_failure_summary_names_the_error_a_rank_stopped_on(tmp_path, monkeypatch, capsys):
    """Under torchrun a rank's one error line was followed by torchrun's failure summary, the last thing a user
    reads, whose root cause said only "To enable traceback see: https://pytorch.org/...". Each torchrun worker now
    hands what ended it to the error file torchrun gives it: read back by torch's own ProcessFailure (what the
    summary prints), it is the error line, SystemExit's message, or the exception with its traceback. A real
    torchrun of train.py with a bad flag ends with the line."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from harness import cli

    def summary_message(stop: BaseException, code: int) -> str:
        error_file = tmp_path / f"error-{code}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        monkeypatch.setattr(sys, "stderr", cli.ErrorLineNoter(sys.stderr))
        print("train.py: error: --lr must be > 0 (got -1.0) (see --help)", file=sys.stderr)
        print("a later line\r[progress bar]", file=sys.stderr, end="")
        assert vllm_replica.report_exit(stop) == code
        failure = ProcessFailure(local_rank=0, pid=1, exitcode=code, error_file=str(error_file))
        return failure.message if isinstance(failure.message, str) else failure.message["extraInfo"]["py_callstack"]

    assert summary_message(SystemExit(2), 2) == "train.py: error: --lr must be > 0 (got -1.0) (see --help)"
    assert summary_message(SystemExit("resume runs/a: no checkpoint could be read"), 1) == \
        "resume runs/a: no checkpoint could be read"
    try:
        raise ValueError("a malformed row")
    except ValueError as error:
        trace = summary_message(error, 1)
    assert trace.startswith("Traceback") and trace.rstrip().endswith("ValueError: a malformed row")
    assert not (tmp_path / "error-0.json").exists() and vllm_replica.report_exit(SystemExit(0)) == 0
    capsys.readouterr()
    monkeypatch.undo()
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "train.py", "--lr", "-1", "--output-dir", str(tmp_path / "run")], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and run.stderr.count("train.py: error: --lr must be > 0 (got -1.0)") == 2, run.stderr
    assert run.stderr.rstrip().splitlines()[-2] == "  traceback : train.py: error: --lr must be > 0 (got -1.0) " \
                                                   "(see --help)", run.stderr
